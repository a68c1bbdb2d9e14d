"""sparrow.sync.roundtrip.round_trip and sparrow.sync.codecs.codec_bytes on small CPU tensors."""

from __future__ import annotations

import pytest
import torch

from sparrow.sync.codecs import codec_bytes, position_entropy_bits
from sparrow.sync.roundtrip import round_trip
from sparrow.sync.synthetic import perturb_bits


def _pair(density: float, n: int = 4096, tensors: int = 2):
    gen = torch.Generator().manual_seed(0)
    base = {f"w{k}": (torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16) for k in range(tensors)}
    return base, {k: perturb_bits(v, density, gen) for k, v in base.items()}


def _changed(base, new) -> int:
    return sum(int((base[k].view(torch.int16) != new[k].view(torch.int16)).sum()) for k in base)


def test_round_trip_counts_and_timings():
    base, new = _pair(0.02)
    kept = {k: v.clone() for k, v in base.items()}
    r = round_trip(base, new, verifies=(False, "incremental", "full"), iters=1, warmup=0, stage_reps=1)
    assert r["params"] == 2 * 4096
    assert r["changed"] == _changed(base, new) > 0  # the sender's count, against a count of the bit patterns
    assert 0 < r["wire_bytes"] < 2 * r["params"]  # sparse: smaller than the dense bf16 bytes
    assert r["buckets"] >= 1
    assert set(r["apply"]) == {False, "incremental", "full"} == set(r["apply_stages"])
    assert r["encode"]["n"] == 1
    assert all(set(v) == {"gpu_ms", "cpu_ms"} for v in r["encode_stages"].values())
    assert all(torch.equal(kept[k], base[k]) for k in base)  # the inputs are left as they were


def test_round_trip_without_hashes_and_errors():
    base, new = _pair(0.01, tensors=1)
    r = round_trip(base, new, with_hash=False, verifies=(False,), iters=1, warmup=0)
    assert "encode_stages" not in r and list(r["apply"]) == [False]
    with pytest.raises(ValueError, match="with_hash"):
        round_trip(base, new, with_hash=False, verifies=("incremental",))
    with pytest.raises(ValueError, match="verify"):
        round_trip(base, new, verifies=("sometimes",))
    with pytest.raises(ValueError, match="names"):
        round_trip(base, {"other": new["w0"]})
    with pytest.raises(TypeError, match="dtype"):
        round_trip(base, {"w0": new["w0"].half()})


def test_codec_bytes_against_counts():
    base, new = _pair(0.01, n=5000, tensors=2)
    old, cur = list(base.values()), list(new.values())
    b = codec_bytes(old, cur, slice_elems=2048)  # slices of 2048, 2048, 904 per tensor
    m = _changed(base, new)
    assert (b["n"], b["m"]) == (10_000, m)
    assert b["dense"] == 2 * 10_000
    assert b["coo"] == m * (4 + 2)  # a position and a bf16 pattern per change
    assert b["auto"] <= min(b["dense"], b["coo"], b["compact"])
    # per slice: a nearly all-changed tensor next to a sparse one is cheaper mixed than under any single codec
    gen = torch.Generator().manual_seed(5)
    mixed = codec_bytes(old, [perturb_bits(old[0], 0.95, gen), perturb_bits(old[1], 0.002, gen)], slice_elems=2048)
    assert mixed["auto"] < min(mixed["dense"], mixed["coo"], mixed["compact"])
    bound = sum(position_entropy_bits(5000, _changed({"x": o}, {"x": x})) for o, x in zip(old, cur)) / 8
    assert b["bound_positions"] == pytest.approx(bound)
    assert b["bound_positions"] < b["bound_positions_values"] < b["compact"]
    assert 0.8 < b["pm1_fraction"] <= 1.0  # +-1 ULP is 90 % of perturb_bits' moves
    assert "pm1_fraction" not in codec_bytes(old, cur, entropy=False)
    same = codec_bytes(old, old)
    assert same["m"] == 0 and same["bound_positions"] == 0.0
    with pytest.raises(ValueError):
        codec_bytes(old, cur[:1])
    with pytest.raises(TypeError):
        codec_bytes(old, [t.half() for t in cur])

"""Triton kernels (interpreter on CPU) against the PyTorch reference: identical records and bytes."""

from __future__ import annotations

import pytest
import torch

from sparrow.kernels.sync import api
from sparrow.kernels.sync.common import SyncFormatError, bits_view

from .conftest import FLOAT_DTYPES, TRITON_DEVICE, make_pair

pytestmark = pytest.mark.skipif(not api.triton_available(), reason="triton not installed")

CASES = [(1, 1.0), (63, 0.3), (100, 0.05), (4097, 0.02), (4097, 0.6), (6000, 0.45)]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("n,density", CASES)
def test_pipeline_matches_reference(dtype, n, density):
    base, new = make_pair(dtype, n, density, seed=n)
    ob, nb = bits_view(base.to(TRITON_DEVICE)), bits_view(new.to(TRITON_DEVICE))
    ebits = 8 * ob.element_size()
    assert torch.equal(api.hash_bits(nb, 7, impl="reference"), api.hash_bits(nb, 7, impl="triton"))
    sr = api.diff_scan(ob, nb, hash_start=3, impl="reference")
    st = api.diff_scan(ob, nb, hash_start=3, impl="triton")
    m = int(sr.count)
    assert m == int(st.count) and m > 0
    assert torch.equal(sr.hash, st.hash)
    for values in ("delta", "new"):
        pr, vr = api.diff_collect(ob, nb, sr, m, values=values)
        pt, vt = api.diff_collect(ob, nb, st, m, values=values)
        assert torch.equal(pr, pt) and torch.equal(vr, vt)
    pr, cr = api.diff_collect(ob, nb, sr, m)
    wr, nwr = api.pack_compact(pr, cr, ebits, impl="reference")
    wt, nwt = api.pack_compact(pr, cr, ebits, impl="triton")
    assert int(nwr) == int(nwt)
    assert torch.equal(wr, wt[: int(nwt)]), "compact bodies differ"
    for impl in ("reference", "triton"):
        p2, c2 = api.unpack_compact(wr, n, ebits, m, impl=impl)
        assert torch.equal(p2, pr) and torch.equal(c2, cr)
    out_r, out_t = ob.clone(), ob.clone()
    api.apply_records(out_r, pr, cr, impl="reference")
    api.apply_records(out_t, pr, cr, impl="triton")
    assert torch.equal(out_r, nb) and torch.equal(out_t, nb)
    api.apply_records(out_t, pr, cr, negate=True, impl="triton")
    assert torch.equal(out_t, ob)
    # snapshot update during collection writes only the changed elements
    snap = ob.clone()
    st2 = api.diff_scan(snap, nb, impl="triton")
    api.diff_collect(snap, nb, st2, m, update_old=True)
    assert torch.equal(snap, nb)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_decode_rejects_corruption(dtype):
    base, new = make_pair(dtype, 3000, 0.4, seed=1)
    ob, nb = bits_view(base.to(TRITON_DEVICE)), bits_view(new.to(TRITON_DEVICE))
    ebits = 8 * ob.element_size()
    pos, codes = api.diff_records(ob, nb, impl="reference")
    words, _ = api.pack_compact(pos, codes, ebits, impl="reference")
    m, n = pos.numel(), ob.numel()
    bad_cases = []
    w = words.clone(); w[0] = n + 5; bad_cases.append(w)                       # p_first out of range
    w = words.clone(); w[2] = w[2] | 0xFF; bad_cases.append(w)                  # L > 31
    w = words.clone(); w[1] = w[1] + 1; bad_cases.append(w)                     # body offset
    w = words.clone(); w[4 * 2 + 4] ^= 0x10; bad_cases.append(w)                # a bit in block 0's body
    bad_cases.append(words[:-1].clone())                                       # truncated
    for impl in ("reference", "triton"):
        for w in bad_cases:
            with pytest.raises(SyncFormatError):
                p2, c2 = api.unpack_compact(w, n, ebits, m, impl=impl)
                # a flipped bit inside a valid region can still decode: it must then differ
                if torch.equal(p2, pos) and not torch.equal(c2, codes):
                    raise SyncFormatError("payload changed")
                if not torch.equal(p2, pos):
                    raise SyncFormatError("positions changed")


def test_dispatch_and_validation():
    x = torch.zeros(10, dtype=torch.int16)
    assert api.resolve_impl("auto", x) == "reference"
    with pytest.raises(ValueError):
        api.resolve_impl("cuda", x)
    with pytest.raises(TypeError):
        api.hash_bits(torch.zeros(3))
    with pytest.raises(ValueError):
        api.diff_scan(x, torch.zeros(11, dtype=torch.int16))
    with pytest.raises(ValueError):
        api.diff_scan(x, torch.zeros(10, dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_group_kernels_match_reference(dtype):
    """One launch per stage over several slices (empty, unchanged, single, multi-block) == reference."""
    sizes = [(0, 0.0), (1, 1.0), (5000, 0.5), (63, 0.0), (2500, 0.05), (3000, 0.9)]
    pairs = [make_pair(dtype, n, d, seed=k + 7) for k, (n, d) in enumerate(sizes)]
    olds = [bits_view(b.to(TRITON_DEVICE)) for b, _ in pairs]
    news = [bits_view(x.to(TRITON_DEVICE)) for _, x in pairs]
    ebits = 8 * olds[0].element_size()
    starts = [k * 11 for k in range(len(sizes))]
    scans = {impl: api.group_diff_scan(olds, news, hash_starts=starts, impl=impl) for impl in ("reference", "triton")}
    counts = scans["reference"].counts.tolist()
    assert counts == scans["triton"].counts.tolist()
    assert counts[0] == 0 and counts[3] == 0 and counts[2] > 2 * 1024
    assert torch.equal(scans["reference"].hashes, scans["triton"].hashes)
    assert torch.equal(api.group_hash_bits(news, starts, impl="triton"), scans["reference"].hashes)
    rec = {}
    for impl, sc in scans.items():
        snaps = [o.clone() for o in olds]
        rec[impl] = api.group_diff_collect(snaps, news, sc, counts, update_old=True)
        assert all(torch.equal(s, x) for s, x in zip(snaps, news))
    (pr, vr, offr), (pt, vt, offt) = rec["reference"], rec["triton"]
    assert torch.equal(pr, pt) and torch.equal(vr, vt) and offr == offt
    bodies = {}
    for impl in ("reference", "triton"):
        out, base, nw = api.group_pack_compact(pr, vr, counts, ebits, impl=impl)
        bodies[impl] = [out[b:b + w] for b, w in zip(base.tolist(), nw.tolist())]
    for br, bt in zip(bodies["reference"], bodies["triton"]):
        assert torch.equal(br, bt)
    # bodies at 4-word aligned offsets in one buffer, decoded together
    buf, spec, at = [], [], 0
    for body, (n, _), m in zip(bodies["reference"], sizes, counts):
        pad = (-body.numel()) % 4
        buf += [body, torch.zeros(pad, dtype=torch.int32, device=body.device)]
        spec.append((at, body.numel(), n, m))
        at += body.numel() + pad
    words = torch.cat(buf)
    for impl in ("reference", "triton"):
        p2, v2, off2, bad = api.group_unpack_compact(words, spec, ebits, impl=impl)
        assert bad is None or not bool(bad)
        assert torch.equal(p2, pr) and torch.equal(v2, vr) and off2 == offr
        outs = [o.clone() for o in olds]
        api.group_apply_records(outs, p2, v2, counts, impl=impl)
        assert all(torch.equal(o, x) for o, x in zip(outs, news))
        api.group_apply_records(outs, p2, v2, counts, negate=True, impl=impl)
        assert all(torch.equal(o, x) for o, x in zip(outs, olds))


def test_binary_search_steps_cover_every_slice_count_and_rarely_change():
    """The group kernels' search depth is a compile-time constant: it must cover the slice count (enough
    steps to find any slice) and take few values, since a sync's slice count follows the data (a new value
    is a new compilation in the middle of a run)."""
    from sparrow.kernels.sync.api import _steps

    for n in range(1, 1 << 14):
        assert 1 << (_steps(n) - 1) > n  # halving n + 1 candidates down to one takes bit_length(n) + 1 steps
    assert {_steps(n) for n in range(1, 128)} == {8}
    assert len({_steps(n) for n in range(1, 1 << 15)}) == 2

"""Incremental target hashes: the hash change fused into collect / apply equals the full recomputation,
the sender's running hashes track its snapshot, and the receiver's verification modes catch a diverged
base (``full``: anywhere; ``incremental``: from its running hashes, changed elements and audits)."""

from __future__ import annotations

import pytest
import torch

from sparrow.kernels.sync import api
from sparrow.kernels.sync.common import combine_hash
from sparrow.sync import HashMismatchError, InProcessTransport, SyncReceiver, SyncSender

from .conftest import TRITON_DEVICE, bits, make_pair

IMPLS = ["reference"] + (["triton"] if api.triton_available() else [])


def _lanes_add(base: torch.Tensor, delta32: torch.Tensor) -> torch.Tensor:
    return (base + (delta32.to(torch.int64) & 0xFFFFFFFF)) & 0xFFFFFFFF


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_write_hash_change_equals_full_recompute(impl, dtype):
    """The hash change the encode writer adds per slice, in two runs of slices as the sender's change-bounded
    launches do, equals the full recomputation; the old bits end equal to the new."""
    dev = TRITON_DEVICE if impl == "triton" else torch.device("cpu")
    sizes, starts = [1, 100, 1500, 2049], [0, 5, 1 << 20, 77]
    olds, news = [], []
    for k, n in enumerate(sizes):
        o, x = make_pair(dtype, n, 0.05 + 0.2 * k, seed=k)
        olds.append(bits(o).to(dev).clone())
        news.append(bits(x).to(dev))
    base = api.group_hash_bits(olds, starts, impl=impl)
    want = api.group_hash_bits(news, starts, impl=impl)
    scan = api.scan_blocks(olds, news, span_log2=10, impl=impl)
    counts, words = scan.counts.tolist(), scan.words.tolist()
    out = torch.zeros(16 + sum(-(-4 * w // 16) * 16 for w in words), dtype=torch.uint8, device=dev)
    offs = [0]
    for w in words:
        offs.append(offs[-1] + -(-4 * w // 16) * 16)
    acc = api.hash_zeros(len(olds), dev)
    for sub in ((0, 2), (2, len(olds))):
        api.write_bodies(olds, news, scan, counts, words, ["compact"] * len(olds), out, offs[:-1], sub=sub,
                         update_old=True, hash_starts=starts, hash_out=acc, hash_rows=list(range(len(olds))))
    assert torch.equal(_lanes_add(base, acc), want)
    assert all(torch.equal(o, x) for o, x in zip(olds, news))  # snapshot updated


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_apply_hash_change_triton_vs_reference(dtype):
    """The hash change fused into the receiver's decode + apply (compact) and into the records writer (COO)."""
    if "triton" not in IMPLS:
        pytest.skip("triton not installed")
    res = {}
    for impl in IMPLS:
        dev = TRITON_DEVICE if impl == "triton" else torch.device("cpu")
        outs, news, pos, val, counts = [], [], [], [], []
        for k, n in enumerate([63, 2100, 1]):
            o, x = make_pair(dtype, n, 0.3, seed=10 + k)
            ob, xb = bits(o).to(dev), bits(x).to(dev)
            p, v = api.diff_records(ob, xb, values="new", impl="reference")
            outs.append(ob.clone())
            news.append(xb)
            pos.append(p)
            val.append(v)
            counts.append(p.numel())
        starts = [3, 0, 1 << 31]
        base = api.group_hash_bits(outs, starts, impl=impl)
        acc = api.hash_zeros(len(outs), dev)
        api.group_apply_records(outs, torch.cat(pos), torch.cat(val), counts, values="new", impl=impl,
                                hash_starts=starts, hash_out=acc)
        assert all(torch.equal(o, x) for o, x in zip(outs, news))
        assert torch.equal(_lanes_add(base, acc), api.group_hash_bits(news, starts, impl=impl))
        res[impl] = acc.cpu()
    assert torch.equal(res["reference"], res["triton"])


def test_scan_hash_and_hash_bits_aligned_and_unaligned():
    if "triton" not in IMPLS:
        pytest.skip("triton not installed")
    x = bits(make_pair(torch.bfloat16, 8 * 1000 + 8, 0.1)[1]).to(TRITON_DEVICE)
    for v, st in ((x, 0), (x[1:], 9), (x[8:], 1 << 32 | 5)):  # 16-byte aligned and not
        want = api.hash_bits(v.cpu(), st, impl="reference")
        assert torch.equal(api.hash_bits(v, st, impl="triton").cpu(), want)


def _model_state(seed: int, n: int = 3000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16),
            "b": (torch.randn(37, generator=g) * 0.02).to(torch.bfloat16),
            "f": torch.randn(257, generator=g)}


def _step(state: dict, seed: int, density: float = 0.05) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state.items():
        bd = torch.int16 if v.dtype == torch.bfloat16 else torch.int32
        b = v.view(bd).cpu().clone()  # the change is drawn on the CPU (seeded), then moved to the state's device
        ch = torch.rand(b.numel(), generator=g) < density
        b[ch] += torch.randint(-2, 3, (int(ch.sum()),), generator=g).to(bd)
        out[k] = b.view(v.dtype).to(v.device)
    return out


@pytest.mark.parametrize("impl", IMPLS)
def test_sender_running_hash_matches_full_hash(impl):
    dev = TRITON_DEVICE if impl == "triton" else torch.device("cpu")
    state = {k: v.to(dev) for k, v in _model_state(0).items()}
    sender = SyncSender(state, bucket_bytes=2048, impl=impl)
    for step in range(4):
        state = _step(state, 100 + step)
        list(sender.encode(state))
        running = sender.slice_hashes()
        for i, (name, s, n) in enumerate(sender._slices):
            full = combine_hash(api.hash_bits(bits(sender.snapshot[name]).reshape(-1)[s:s + n], s, impl=impl))
            assert running[i] == full


def _pair(verify, **kw):
    state = _model_state(1)
    sender = SyncSender(state, bucket_bytes=4096, run_id="inc")
    rx = SyncReceiver({k: v.clone() for k, v in state.items()}, verify=verify, **kw)
    return state, sender, rx


@pytest.mark.parametrize("verify", ["incremental", "full", True])
def test_receiver_modes_random_updates_bit_exact(verify):
    state, sender, rx = _pair(verify)
    tr = InProcessTransport()
    for step in range(5):
        state = _step(state, 200 + step, density=0.02 * (step + 1))
        sender.send(state, tr)
        rx.receive(tr)
        assert all(torch.equal(bits(rx.tensors[k]), bits(v)) for k, v in state.items())
    if verify == "incremental":  # running hashes equal the full recomputation
        for name, d in rx._hashes.items():
            for (s, n), h in d.items():
                assert h == combine_hash(api.hash_bits(bits(rx.tensors[name]).reshape(-1)[s:s + n], s))


@pytest.mark.parametrize("verify", ["incremental", "full"])
def test_initial_divergence_detected_before_writing(verify):
    state, sender, rx = _pair(verify)
    bits(rx.tensors["w"]).view(-1)[5] ^= 0x10  # diverged before the first sync
    snap = {k: bits(v).clone() for k, v in rx.tensors.items()}
    tr = InProcessTransport()
    sender.send(_step(state, 1), tr)
    # caught by the base-hash check before anything is written (not by the after-apply check + undo)
    with pytest.raises(HashMismatchError, match="Nothing was written"):
        rx.receive(tr)
    assert all(torch.equal(bits(rx.tensors[k]), v) for k, v in snap.items())


def test_flip_after_tracking_full_vs_incremental_vs_audit():
    """A bit flipped behind the receiver's back at an unchanged position: ``full`` catches it at the next
    sync, ``incremental`` only at its next audit (the documented trade-off); a flip at a changed
    position is caught by both."""
    tr = InProcessTransport()
    results = {}
    for verify, audit in (("full", 0), ("incremental", 0), ("incremental", 3)):
        state, sender, rx = _pair(verify, audit_every=audit)
        state = _step(state, 1)
        sender.send(state, tr)
        rx.receive(tr)  # version 1: running hashes known
        # flip the sign bit of an element that the next sync does not change
        nxt = _step(state, 2, density=0.0)
        nxt["w"] = nxt["w"].clone()
        nxt["w"].view(torch.int16)[100:110] += 1  # change elements 100..109 only
        bits(rx.tensors["w"]).view(-1)[2000] ^= -0x8000
        errors = []
        for version, new in ((2, nxt), (3, _step(nxt, 3))):
            sender.send(new, tr)
            try:
                rx.receive(tr)
            except HashMismatchError:
                errors.append(version)
        results[(verify, audit)] = errors
    assert results[("full", 0)] == [2]
    assert results[("incremental", 0)] == []
    assert results[("incremental", 3)] == [3]


def test_incremental_catches_flip_at_changed_element():
    state, sender, rx = _pair("incremental")
    tr = InProcessTransport()
    state = _step(state, 1)
    sender.send(state, tr)
    rx.receive(tr)
    nxt = {k: v.clone() for k, v in state.items()}
    nxt["w"].view(torch.int16)[50] += 1
    bits(rx.tensors["w"]).view(-1)[50] ^= 0x4  # flipped where the next sync writes
    snap = {k: bits(v).clone() for k, v in rx.tensors.items()}
    sender.send(nxt, tr)
    with pytest.raises(HashMismatchError, match="undone"):
        rx.receive(tr)
    assert all(torch.equal(bits(rx.tensors[k]), v) for k, v in snap.items())

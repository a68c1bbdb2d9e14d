"""Triton kernels (interpreter on CPU, compiled on a GPU) against the PyTorch reference: identical counts, body
bytes and hash changes, identical decode, identical verdicts on corrupted bodies."""

from __future__ import annotations

import pytest
import torch

from sparrow.kernels.sync import api, reference
from sparrow.kernels.sync.common import HEADER_WORDS, SyncFormatError, bits_view, block_words, num_blocks

from .conftest import FLOAT_DTYPES, TRITON_DEVICE, make_pair, specials

pytestmark = pytest.mark.skipif(not api.triton_available(), reason="triton not installed")

IMPLS = ("reference", "triton")


def _dev(impl: str) -> torch.device:
    return TRITON_DEVICE if impl == "triton" else torch.device("cpu")


def encode_group(olds, news, modes, span, impl, *, update_old=True):
    """Scan + write of a group into one buffer: (counts, words, buffer, offsets, hash changes, olds after)."""
    dev = _dev(impl)
    olds = [o.to(dev).clone() for o in olds]
    news = [x.to(dev) for x in news]
    ebits = 8 * olds[0].element_size()
    scan = api.scan_blocks(olds, news, span_log2=span, impl=impl)
    counts, words = scan.counts.tolist(), scan.words.tolist()
    sizes = [api.body_nbytes(m, o.numel(), c, w, ebits) for m, o, c, w in zip(modes, olds, counts, words)]
    offs = [0]
    for sz in sizes:
        offs.append(offs[-1] + -(-sz // 16) * 16)
    out = torch.zeros(offs[-1] + 16, dtype=torch.uint8, device=dev)
    hout = api.hash_zeros(len(olds), dev)
    starts = [7 * k + 3 for k in range(len(olds))]
    api.write_bodies(olds, news, scan, counts, words, modes, out, offs[:-1], update_old=update_old,
                     hash_starts=starts, hash_out=hout, hash_rows=list(range(len(olds))))
    return counts, words, out.cpu(), offs, hout.cpu(), [o.cpu() for o in olds]


AWKWARD = [(0, 0.0), (1, 1.0), (2500, 0.5), (63, 0.0), (1500, 0.05), (1100, 0.9)]
CASES = [  # empty, single, unchanged, all changed, odd sizes, several blocks; a block of several change chunks
    pytest.param(torch.bfloat16, AWKWARD, 10, id="bf16-awkward-span1k"),
    pytest.param(torch.float32, AWKWARD, 10, id="fp32-awkward-span1k"),
    pytest.param(torch.float16, [(3000, 0.7), (100, 1.0)], 11, id="fp16-multichunk-span2k"),
    pytest.param(torch.bfloat16, [(9000, 0.003)], 17, id="bf16-sparse-default-span"),
]


@pytest.mark.parametrize("dtype,sizes,span", CASES)
def test_encode_bytes_and_decode_match_reference(dtype, sizes, span):
    pairs = [make_pair(dtype, n, d, seed=k + 7) for k, (n, d) in enumerate(sizes)]
    olds = [bits_view(b) for b, _ in pairs]
    news = [bits_view(x) for _, x in pairs]
    ebits = 8 * olds[0].element_size()
    modes = ["compact"] * len(sizes)
    res = {impl: encode_group(olds, news, modes, span, impl) for impl in IMPLS}
    (cr, wr, outr, offs, hr, snr), (ct, wt, outt, _, ht, snt) = res["reference"], res["triton"]
    assert cr == ct and wr == wt
    assert cr == [int((o != x).sum()) for o, x in zip(olds, news)]
    for o, x, w, (n, _) in zip(olds, news, wr, sizes):  # sizes: the block formula on the reference's counts
        cnt, kbits = reference.compact_block_stats(o, x, span)
        spans = [min(1 << span, n - (j << span)) for j in range(num_blocks(n, span))]
        want = HEADER_WORDS * len(spans) + sum(block_words(int(c), int(k), sp) for c, k, sp in zip(cnt, kbits, spans))
        assert w == (want if int(cnt.sum()) else 0)
    assert torch.equal(outr, outt), "compact bodies differ"
    assert torch.equal(hr, ht), "hash changes differ"
    assert all(torch.equal(s, x) for s, x in zip(snr, news)) and all(torch.equal(s, x) for s, x in zip(snt, news))
    # the hash change equals the full recomputation
    starts = [7 * k + 3 for k in range(len(olds))]
    full_new = api.group_hash_bits(news, starts, impl="reference")
    full_old = api.group_hash_bits(olds, starts, impl="reference")
    assert torch.equal((full_old + (hr.to(torch.int64) & 0xFFFFFFFF)) & 0xFFFFFFFF, full_new)
    # decode + apply, and the undo, on either implementation
    words = outr.view(torch.int32)
    entries = [(offs[k] // 4, wr[k], olds[k].numel(), cr[k]) for k in range(len(olds))]
    for impl in IMPLS:
        dev = _dev(impl)
        tg = [o.to(dev).clone() for o in olds]
        gate = torch.zeros(2, dtype=torch.int32, device=dev)
        err = torch.zeros(1, dtype=torch.int32, device=dev)
        h = api.hash_zeros(len(olds), dev)
        api.apply_compact(tg, words.to(dev), entries, span_log2=span, gate=gate, err=err, hash_starts=starts,
                          hash_out=h, impl=impl)
        assert gate.tolist() == [0, 0] and err.tolist() == [0]
        assert all(torch.equal(a.cpu(), b) for a, b in zip(tg, news)), impl
        assert torch.equal(h.cpu(), hr), impl
        api.apply_compact(tg, words.to(dev), entries, span_log2=span, gate=gate, err=err, negate=True, impl=impl)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(tg, olds)), impl
    for k, (o, x) in enumerate(zip(olds, news)):
        pos, v = api.decode_compact(words[offs[k] // 4:offs[k] // 4 + wr[k]], o.numel(), ebits, cr[k], span)
        assert torch.equal(pos, torch.nonzero(o != x).reshape(-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_coo_and_dense_bodies_match_reference(dtype):
    sizes = [(1000, 0.1), (3, 1.0), (0, 0.0), (2049, 0.0)]
    pairs = [make_pair(dtype, n, d, seed=k) for k, (n, d) in enumerate(sizes)]
    olds, news = [bits_view(b) for b, _ in pairs], [bits_view(x) for _, x in pairs]
    for modes in (["coo"] * 4, ["dense"] * 4, ["coo", "dense", "compact", "dense"]):
        res = {impl: encode_group(olds, news, modes, 10, impl) for impl in IMPLS}
        assert torch.equal(res["reference"][2], res["triton"][2]), modes
        assert torch.equal(res["reference"][4], res["triton"][4]), modes
    out, offs = res["triton"][2], res["triton"][3]
    m = int((olds[0] != news[0]).sum())
    pos = out[:4 * m].view(torch.int32)  # slice 0 is COO in the last layout
    assert torch.equal(pos.long(), torch.nonzero(olds[0] != news[0]).reshape(-1))
    assert torch.equal(out[offs[1]:offs[1] + 3 * olds[1].element_size()].view(olds[1].dtype), news[1])


def test_special_values_every_transition_and_signed_zero():
    """+0.0 <-> -0.0, NaN payloads to other NaN payloads, infinities and subnormals: all are changes, all exact."""
    for dtype in FLOAT_DTYPES:
        sp = specials(dtype)
        old = sp.repeat_interleave(sp.numel())
        new = sp.repeat(sp.numel())
        res = {impl: encode_group([old], [new], ["compact"], 10, impl) for impl in IMPLS}
        assert torch.equal(res["reference"][2], res["triton"][2])
        assert res["triton"][0] == [int((old != new).sum())]
        assert torch.equal(res["triton"][5][0], new)


def _corruptions(words: torch.Tensor, n: int, span: int) -> list[tuple[str, torch.Tensor]]:
    nb = num_blocks(n, span)
    cases = []

    def case(what: str, at: int, value: int | None = None, xor: int = 0) -> None:
        w = words.clone()
        w[at] = value if value is not None else w[at] ^ xor
        cases.append((what, w))

    case("first rank offset", 0, 5)
    case("value bits", 1, int(words[1]) + 1)
    case("body offset", 2, int(words[2]) + 1)
    if nb > 1:
        case("second rank offset", HEADER_WORDS, int(words[HEADER_WORDS]) + 40)
    body0 = HEADER_WORDS * nb
    for k in (0, 9, words.numel() - body0 - 1):  # bits inside block bodies (positions, codes, padding)
        for bit in (0, 31):
            case(f"word {k} bit {bit}", body0 + k, xor=1 << bit if bit < 31 else -(1 << 31))
    case("last word all ones", words.numel() - 1, -1)
    return cases


@pytest.mark.parametrize("dtype,span", [(torch.bfloat16, 10), (torch.float32, 11)], ids=["bf16", "fp32"])
def test_corrupted_bodies_same_verdict_and_nothing_out_of_range(dtype, span):
    """Every corruption either decodes to another valid change set (then the hashes catch it) or is refused; both
    implementations agree, and a refused body changes no element (the gated / per-block writes plus undo)."""
    n = 2100
    base, new = make_pair(dtype, n, 0.3, seed=1)
    ob, nb = bits_view(base), bits_view(new)
    ebits = 8 * ob.element_size()
    counts, wds, out, offs, _, _ = encode_group([ob], [nb], ["compact"], span, "reference", update_old=False)
    words = out[:4 * wds[0]].view(torch.int32)
    m = counts[0]
    for what, w in _corruptions(words, n, span):
        verdict = {}
        for impl in IMPLS:
            dev = _dev(impl)
            tg = ob.to(dev).clone()
            gate = torch.zeros(1, dtype=torch.int32, device=dev)
            err = torch.zeros(1, dtype=torch.int32, device=dev)
            api.apply_compact([tg], w.to(dev), [(0, w.numel(), n, m)], span_log2=span, gate=gate, err=err,
                              impl=impl)
            closed, failed = int(gate), int(err)
            if failed:
                api.apply_compact([tg], w.to(dev), [(0, w.numel(), n, m)], span_log2=span, gate=gate,
                                  err=torch.zeros_like(err), negate=True, impl=impl)
            if closed or failed:
                assert torch.equal(tg.cpu(), ob), (impl, what)
            verdict[impl] = (bool(closed), bool(closed or failed), tg.cpu())
        assert verdict["reference"][:2] == verdict["triton"][:2], what  # header problems close the gate in both
        if not verdict["reference"][1]:  # accepted: a canonical body of another change set, decoded identically
            assert torch.equal(verdict["reference"][2], verdict["triton"][2]), what
            pos, _ = api.decode_compact(w, n, ebits, m, span)
            assert pos.numel() == m
        else:
            with pytest.raises(SyncFormatError):
                api.decode_compact(w, n, ebits, m, span)


def test_gate_stops_every_write():
    base, new = make_pair(torch.bfloat16, 2000, 0.2, seed=4)
    ob, nb = bits_view(base), bits_view(new)
    counts, wds, out, _, _, _ = encode_group([ob], [nb], ["compact"], 10, "reference", update_old=False)
    words = out[:4 * wds[0]].view(torch.int32)
    for impl in IMPLS:
        dev = _dev(impl)
        tg = ob.to(dev).clone()
        gate = torch.tensor([0, 1], dtype=torch.int32, device=dev)  # the caller's own check failed
        api.apply_compact([tg], words.to(dev), [(0, words.numel(), 2000, counts[0])], span_log2=10, gate=gate,
                          err=torch.zeros(1, dtype=torch.int32, device=dev), impl=impl)
        assert torch.equal(tg.cpu(), ob), impl
        pos, vals = api.diff_records(ob, nb, values="new", impl="reference")
        api.group_apply_records([tg], pos.to(dev), vals.to(dev), [pos.numel()], values="new", gate=gate, impl=impl)
        assert torch.equal(tg.cpu(), ob), impl


def test_diff_records_and_undo_capture_match_reference():
    for dtype in FLOAT_DTYPES:
        base, new = make_pair(dtype, 4097, 0.2, seed=9)
        ob, nb = bits_view(base), bits_view(new)
        for values in ("delta", "new"):
            pr, vr = api.diff_records(ob, nb, values=values, impl="reference")
            pt, vt = api.diff_records(ob.to(TRITON_DEVICE), nb.to(TRITON_DEVICE), values=values, impl="triton")
            assert torch.equal(pr, pt.cpu()) and torch.equal(vr, vt.cpu())
        pos, vals = api.diff_records(ob, nb, values="new", impl="reference")
        for impl in IMPLS:
            dev = _dev(impl)
            tg = ob.to(dev).clone()
            undo = torch.empty_like(pos).to(dev)
            api.group_apply_records([tg], pos.to(dev), vals.to(dev), [pos.numel()], values="new", impl=impl,
                                    undo_out=undo)
            assert torch.equal(tg.cpu(), nb)
            api.group_apply_records([tg], pos.to(dev), undo, [pos.numel()], values="new", impl=impl)
            assert torch.equal(tg.cpu(), ob)


def test_dispatch_and_validation():
    x = torch.zeros(10, dtype=torch.int16)
    assert api.resolve_impl("auto", x) == "reference"
    with pytest.raises(ValueError):
        api.resolve_impl("cuda", x)
    with pytest.raises(TypeError):
        api.hash_bits(torch.zeros(3))
    with pytest.raises(ValueError):
        api.scan_blocks([x], [torch.zeros(11, dtype=torch.int16)])
    with pytest.raises(ValueError):
        api.scan_blocks([x], [torch.zeros(10, dtype=torch.int32)])
    with pytest.raises(ValueError, match="span_log2"):
        api.scan_blocks([x], [x], span_log2=9)
    scan = api.scan_blocks([x], [x + 1])
    with pytest.raises(ValueError, match="does not fit"):  # a body would not fit the buffer
        api.write_bodies([x], [x + 1], scan, [10], [0], ["dense"], torch.zeros(8, dtype=torch.uint8), [0])
    with pytest.raises(ValueError, match="unknown body kind"):
        api.write_bodies([x], [x + 1], scan, [10], [0], ["zip"], torch.zeros(64, dtype=torch.uint8), [0])
    with pytest.raises(SyncFormatError, match="0 changes"):
        api.apply_compact([x], torch.zeros(4, dtype=torch.int32), [(0, 4, 10, 0)], span_log2=10,
                          gate=torch.zeros(1, dtype=torch.int32), err=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(SyncFormatError, match="truncated"):
        api.apply_compact([x], torch.zeros(2, dtype=torch.int32), [(0, 2, 10, 3)], span_log2=10,
                          gate=torch.zeros(1, dtype=torch.int32), err=torch.zeros(1, dtype=torch.int32))


def test_binary_search_steps_cover_every_slice_count_and_rarely_change():
    """The group kernels' search depth is a compile-time constant: it must cover the slice count (enough
    steps to find any slice) and take few values, since a sync's slice count follows the data (a new value
    is a new compilation in the middle of a run)."""
    from sparrow.kernels.sync.api import _steps

    for n in range(1, 1 << 14):
        assert 1 << (_steps(n) - 1) > n  # halving n + 1 candidates down to one takes bit_length(n) + 1 steps
    assert {_steps(n) for n in range(1, 128)} == {8}
    assert len({_steps(n) for n in range(1, 1 << 15)}) == 2

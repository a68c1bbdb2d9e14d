import math

import pytest
import torch

from sparrow.kernels.decode_attention import decode_attention
from sparrow.kernels.decode_attention.triton_decode import (
    DECODE_PROGRAMS_PER_SM, LONGEST_CUT, PROGRAMS_PER_SM, decode_attention_triton, splits_for_batch,
)
from tests.helpers import DEVICE, rel_err


def _naive(q, pk, pv, gk, gv, rs, ps, pl, cl, window=None, sink=0):
    """Per-row, per-head loop in float64: the plainest statement of decode attention (``window``: only the
    first ``sink`` positions and the last ``window`` up to the row's last new token)."""
    q, pk, pv, gk, gv, rs, ps, pl, cl = (t.cpu() for t in (q, pk, pv, gk, gv, rs, ps, pl, cl))
    A, Hq, T, D = q.shape
    qpk = Hq // pk.shape[1]
    out = torch.empty(A, Hq, T, D, dtype=torch.float64)
    for a in range(A):
        for h in range(Hq):
            kv = h // qpk
            for t in range(T):
                n_gen = int(cl[a]) + t + 1
                k = torch.cat([pk[ps[a], kv, : pl[a]], gk[rs[a], kv, :n_gen]]).double()
                v = torch.cat([pv[ps[a], kv, : pl[a]], gv[rs[a], kv, :n_gen]]).double()
                if window is not None:
                    lo = max(0, int(pl[a] + cl[a]) + T - window)
                    keep = [p for p in range(len(k)) if p < min(sink, lo) or p >= lo]
                    k, v = k[keep], v[keep]
                w = torch.softmax(k @ q[a, h, t].double() / math.sqrt(D), dim=0)
                out[a, h, t] = w @ v
    return out


def _inputs(A, Hq, Hkv, T, D, P, Lp, R, Lg, dtype=torch.float32):
    q = torch.randn(A, Hq, T, D, dtype=dtype)
    pk, pv = torch.randn(P, Hkv, Lp, D, dtype=dtype), torch.randn(P, Hkv, Lp, D, dtype=dtype)
    gk, gv = torch.randn(R, Hkv, Lg, D, dtype=dtype), torch.randn(R, Hkv, Lg, D, dtype=dtype)
    ps = torch.randint(0, P, (A,))
    rs = torch.randperm(R)[:A]
    pl = torch.randint(1, Lp + 1, (A,))
    cl = torch.randint(0, Lg - T + 1, (A,))
    return tuple(t.to(DEVICE) for t in (q, pk, pv, gk, gv, rs, ps, pl, cl))


SHAPES = [
    pytest.param((1, 2, 1, 1, 16, 1, 5, 1, 3), id="one-row-mha"),
    pytest.param((3, 4, 2, 1, 16, 2, 37, 4, 20), id="gqa2-odd-lengths"),
    pytest.param((2, 6, 2, 3, 32, 3, 70, 3, 9), id="verify-T3"),
    pytest.param((4, 7, 1, 2, 16, 2, 63, 5, 100), id="qpk7-T2"),
    pytest.param((2, 8, 2, 1, 64, 2, 130, 2, 17), id="d64"),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_matches_naive(shape):
    args = _inputs(*shape)
    out = decode_attention(*args, impl="reference")
    assert rel_err(out, _naive(*args)) < 1e-6


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("splits", [1, 3], ids=["1split", "3splits"])
def test_triton_matches_reference(shape, splits):
    args = _inputs(*shape)
    ref = decode_attention(*args, impl="reference")
    out = decode_attention_triton(*args, num_splits=splits, min_chunk=16)
    assert rel_err(out, ref) < 1e-5


def test_splits_for_batch_fills_the_gpu_and_no_more():
    """Small batches keep the cache-length bound; large ones drop to what fills the multiprocessors (more
    programs for one decode token than for verify tokens), never below the bound / LONGEST_CUT; without a
    multiprocessor count nothing is cut."""
    sizes = (1, 4, 16, 64, 256, 4096)
    for tokens, per_sm in ((1, DECODE_PROGRAMS_PER_SM), (5, PROGRAMS_PER_SM)):
        for max_splits in (1, 3, 8, 64):
            got = [splits_for_batch(max_splits, rows, 2, 132, tokens) for rows in sizes]
            assert got == sorted(got, reverse=True) and got[0] == max_splits  # more rows, fewer splits
            assert all(max(1, -(-max_splits // LONGEST_CUT)) <= g <= max_splits for g in got)
            for rows, g in zip(sizes, got):  # enough programs unless the floor or bound binds
                assert rows * 2 * g >= min(per_sm * 132, rows * 2 * max_splits)
            assert splits_for_batch(max_splits, 4096, 2, None, tokens) == max_splits
    assert [splits_for_batch(64, a, 2, 132, 5) for a in (16, 64, 256)] == [17, 5, 4]
    assert [splits_for_batch(64, a, 2, 132, 1) for a in (16, 64, 256)] == [64, 17, 5]


@pytest.mark.parametrize("shape", [(3, 4, 2, 1, 16, 2, 700, 3, 300), (2, 6, 2, 5, 32, 2, 900, 2, 40)],
                         ids=["T1", "verify-T5"])
def test_batch_fitted_splits_match_reference(shape, monkeypatch):
    """The default launch (splits cut down to the batch) on pretend 1-, 2- and 64-multiprocessor devices:
    rows long enough for several length splits, which the small devices cut to one or two; the same
    attention as the reference each time."""
    from sparrow.kernels.decode_attention import triton_decode

    args = _inputs(*shape)
    ref = decode_attention(*args, impl="reference")
    longest = args[1].shape[2] + args[3].shape[2]
    A, Hkv = args[0].shape[0], args[1].shape[1]
    assert triton_decode.num_splits_for(longest) >= 3
    chosen = set()
    for sms in (1, 2, 64):
        monkeypatch.setattr(triton_decode, "INTERPRETER_SM_COUNT", sms)
        chosen.add(splits_for_batch(triton_decode.num_splits_for(longest), A, Hkv, sms, args[0].shape[2]))
        assert rel_err(decode_attention_triton(*args, min_chunk=16), ref) < 1e-5
    assert len(chosen) >= 2


WINDOWS = [(1, 0), (5, 2), (24, 4), (40, 3), (1000, 4)]  # (window, sink); 1000 covers every row


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("window,sink", WINDOWS)
def test_windowed_reference_and_triton_match_naive(shape, window, sink):
    args = _inputs(*shape)
    T = args[0].shape[2]
    if window < T:
        pytest.skip("the window must cover the new tokens")
    want = _naive(*args, window=window, sink=sink)
    assert rel_err(decode_attention(*args, window=window, sink=sink, impl="reference"), want) < 1e-6
    for splits in (1, 3):
        out = decode_attention_triton(*args, num_splits=splits, min_chunk=16, window=window, sink=sink)
        assert rel_err(out, want) < 1e-5
    if window == 1000:
        assert rel_err(decode_attention(*args, window=window, sink=sink), _naive(*args)) < 1e-5


def test_window_changes_the_output():
    """Negative control for the windowed test: a window that cuts the sequence gives other outputs."""
    args = _inputs(3, 4, 2, 1, 16, 2, 37, 4, 20)
    assert rel_err(decode_attention(*args, window=5, sink=2, impl="reference"), _naive(*args)) > 1e-2


LOW_PRECISION = [
    torch.float16,
    # the Triton interpreter mishandles bf16 loads on the CPU; bf16 is checked on CUDA
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_triton_low_precision_error_no_worse_than_eager(dtype):
    args = _inputs(3, 4, 2, 1, 32, 2, 90, 3, 40)
    f64 = _naive(*args)
    bf = [a.to(dtype) if a.is_floating_point() else a for a in args]
    eager = decode_attention(*bf, impl="reference")
    tri = decode_attention_triton(*bf, num_splits=2)
    assert rel_err(tri, f64) <= 1.5 * rel_err(eager, f64) + 1e-3


@pytest.mark.parametrize("impl,poison", [("reference", 1e4), ("triton", 1e4), ("triton", float("nan"))],
                         ids=["reference-big", "triton-big", "triton-nan"])
def test_poisoned_cache_beyond_lengths_is_ignored(impl, poison):
    q, pk, pv, gk, gv, rs, ps, pl, cl = _inputs(3, 4, 2, 2, 16, 2, 50, 3, 30)
    out = decode_attention(q, pk, pv, gk, gv, rs, ps, pl, cl, impl="reference")
    pk2, pv2, gk2, gv2 = pk.clone(), pv.clone(), gk.clone(), gv.clone()
    for s in range(pk.shape[0]):  # past the longest prompt that reads this prefix slot
        used = max([int(pl[a]) for a in range(3) if int(ps[a]) == s], default=0)
        pk2[s, :, used:] = poison
        pv2[s, :, used:] = poison
    for a in range(3):  # past the row's last new token
        gk2[rs[a], :, cl[a] + 2:] = poison
        gv2[rs[a], :, cl[a] + 2:] = poison
    out2 = decode_attention(q, pk2, pv2, gk2, gv2, rs, ps, pl, cl, impl=impl)
    assert torch.isfinite(out2).all()
    assert rel_err(out2, out) < 1e-5


def test_validation_errors():
    q, pk, pv, gk, gv, rs, ps, pl, cl = _inputs(2, 4, 2, 1, 16, 2, 8, 2, 8)
    with pytest.raises(ValueError, match="row_slot"):
        decode_attention(q, pk, pv, gk, gv, rs[:1], ps, pl, cl)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        decode_attention(q[:, :3], pk, pv, gk, gv, rs, ps, pl, cl)
    with pytest.raises(ValueError, match="impl"):
        decode_attention(q, pk, pv, gk, gv, rs, ps, pl, cl, impl="cuda")
    with pytest.raises(ValueError, match="window"):
        decode_attention(q, pk, pv, gk, gv, rs, ps, pl, cl, window=0)


def test_custom_op_fake_matches_real_on_strided_query():
    """The op's fake (meta) kernel must give the real output's strides, also for a query that arrives as a
    transposed view ((A, T, Hq, D) storage, as the verify step builds it): compiled graphs assert them."""
    from sparrow.kernels.decode_attention.triton_decode import _decode_attention_op

    q, pk, pv, gk, gv, rs, ps, pl, cl = _inputs(2, 6, 2, 3, 32, 3, 70, 3, 9)
    q_view = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, (A, T, Hq, D) memory order
    assert not q_view.is_contiguous()
    args = (q_view, pk, pv, gk, gv, rs, ps, pl, cl, 1.0 / math.sqrt(32), 2, 16, 0, 0)
    torch.library.opcheck(_decode_attention_op, args, test_utils=("test_schema", "test_faketensor"))
    real = _decode_attention_op(*args)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = _decode_attention_op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    assert fake.stride() == real.stride() and fake.shape == real.shape
    assert rel_err(real, decode_attention(q, pk, pv, gk, gv, rs, ps, pl, cl, impl="reference")) < 1e-5

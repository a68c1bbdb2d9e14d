"""Shared-prefix ("cascade") decode attention: each prompt read once for the rows of its group, then merged with
every row's own tokens by log-sum-exp, against the per-row oracle (fp64 loop) and the per-row kernel's reference."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparrow.kernels.decode_attention import (
    cascade_decode_attention, cascade_local_attention, decode_attention, prefix_groups,
)
from sparrow.kernels.decode_attention.reference import cascade_states, local_states, merge_states
from sparrow.kernels.decode_attention.triton_cascade import cascade_attention_triton, cascade_splits, tile_rows
from sparrow.kernels.sparse_decode import SparseDecodeCache
from sparrow.kernels.sparse_decode.reference import sparse_decode_reference
from tests.helpers import DEVICE, rel_err
from tests.kernels.test_decode_attention import _naive


def _grouped_inputs(sizes, Hq, Hkv, T, D, Lp, Lg, *, plens=None, slots=None, cached=None, dtype=torch.float32,
                    seed=0):
    """Rows in groups of ``sizes`` (group ``i`` reads prefix slot ``slots[i]`` with prompt length ``plens[i]``),
    shuffled into one batch with random generation slots and cached lengths (``cached``: all rows)."""
    g = torch.Generator().manual_seed(seed)
    n = len(sizes)
    slots = list(range(n)) if slots is None else slots
    plens = [int(torch.randint(1, Lp + 1, (1,), generator=g)) for _ in sizes] if plens is None else plens
    ps = torch.tensor([slots[i] for i, k in enumerate(sizes) for _ in range(k)])
    pl = torch.tensor([plens[i] for i, k in enumerate(sizes) for _ in range(k)])
    A = len(ps)
    perm = torch.randperm(A, generator=g)
    ps, pl = ps[perm], pl[perm]
    R = A + 2
    rs = torch.randperm(R, generator=g)[:A]
    cl = torch.randint(0, Lg - T + 1, (A,), generator=g) if cached is None else torch.full((A,), cached)
    P = max(slots) + 1
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    q = r(A, Hq, T, D)
    pk, pv, gk, gv = r(P, Hkv, Lp, D), r(P, Hkv, Lp, D), r(R, Hkv, Lg, D), r(R, Hkv, Lg, D)
    return tuple(t.to(DEVICE) for t in (q, pk, pv, gk, gv, rs, ps, pl, cl))


SMALL_TILES = dict(rows_per_tile=2, splits=(3, 2), min_chunk=(16, 16))  # groups span tiles, parts span splits

# (group sizes, Hq, Hkv, T, D, Lp, Lg, inputs, launch)
CASES = [
    pytest.param(([8, 8], 14, 2, 1, 16, 63, 20, {}, {}), id="G8x2-qpk7"),
    pytest.param(([5, 1, 3, 2], 4, 2, 1, 32, 100, 9, {}, SMALL_TILES), id="unequal-groups"),
    pytest.param(([4, 2], 8, 1, 3, 16, 123, 12, {}, SMALL_TILES), id="verify-T3-qpk8"),
    pytest.param(([1, 1, 1], 4, 2, 2, 16, 40, 6, {}, {}), id="groups-of-1-T2"),
    pytest.param(([3, 2], 4, 2, 1, 16, 70, 8, dict(plens=[1, 70], cached=0), SMALL_TILES),
                 id="prompt1-nothing-cached"),
    pytest.param(([3, 4], 8, 2, 1, 64, 50, 5, dict(plens=[50, 1], slots=[0, 0]), {}), id="one-slot-two-lengths-d64"),
]


def _args(case):
    sizes, Hq, Hkv, T, D, Lp, Lg, kw, _ = case
    return _grouped_inputs(sizes, Hq, Hkv, T, D, Lp, Lg, **kw)


@pytest.mark.parametrize("case", CASES)
def test_reference_is_the_per_row_attention(case):
    args = _args(case)
    groups = prefix_groups(args[6], args[7])
    want = _naive(*args)
    assert rel_err(cascade_decode_attention(*args, *groups, impl="reference"), want) < 1e-6
    assert rel_err(decode_attention(*args, impl="reference"), want) < 1e-6


@pytest.mark.parametrize("case", CASES)
def test_triton_matches_the_oracle(case):
    """Default tiles and splits, or tiles of 2 rows (a group spans several tiles) and several splits per part."""
    args = _args(case)
    out = cascade_attention_triton(*args, *prefix_groups(args[6], args[7]), min_rows=0, **case[-1])
    assert rel_err(out, _naive(*args)) < 1e-5


def test_small_batches_take_the_per_row_kernel():
    """Below ``min_rows`` rows the op runs the per-row kernel: its output bit for bit; at ``min_rows`` the cascade
    (a different summation order, so not the same bits: the dispatch is seen, not assumed). On CUDA the default
    threshold applies unless launch parameters are fixed; on the CPU's interpreter the cascade always runs."""
    from sparrow.kernels.decode_attention.triton_cascade import CASCADE_MIN_ROWS
    from sparrow.kernels.decode_attention.triton_decode import decode_attention_triton

    args = _grouped_inputs([5, 3], 8, 2, 1, 16, 200, 9)
    groups = prefix_groups(args[6], args[7])
    per_row = decode_attention_triton(*args)
    small = cascade_attention_triton(*args, *groups, min_rows=9)
    assert torch.equal(small.view(torch.int32), per_row.view(torch.int32))
    cascade = cascade_attention_triton(*args, *groups, min_rows=8)
    assert not torch.equal(cascade.view(torch.int32), per_row.view(torch.int32))
    assert rel_err(cascade, _naive(*args)) < 1e-5
    default = cascade_attention_triton(*args, *groups)
    want = per_row if DEVICE.type == "cuda" and 8 < CASCADE_MIN_ROWS else cascade
    assert torch.equal(default.view(torch.int32), want.view(torch.int32))


def test_verify_steps_take_the_per_row_kernel():
    """Rows of more than ``max_tokens`` query tokens (speculative verification) run the per-row kernel: its bits;
    one token per row, or ``min_rows=0``, keeps the cascade (other bits). On CUDA the default is
    ``CASCADE_MAX_TOKENS``; on the CPU's interpreter no limit, so the cascade runs at every ``T``."""
    from sparrow.kernels.decode_attention import CASCADE_MAX_TOKENS
    from sparrow.kernels.decode_attention.triton_decode import decode_attention_triton

    bits = lambda t: t.view(torch.int32)  # noqa: E731
    for T in (1, 3):
        args = _grouped_inputs([8, 9], 8, 2, T, 16, 150, 12)  # 17 rows: not a size the op hands off by itself
        groups = prefix_groups(args[6], args[7])
        per_row = decode_attention_triton(*args)
        limited = cascade_attention_triton(*args, *groups, max_tokens=1)
        cascade = cascade_attention_triton(*args, *groups, min_rows=0, max_tokens=1)
        assert not torch.equal(bits(cascade), bits(per_row)) and rel_err(cascade, _naive(*args)) < 1e-5
        assert torch.equal(bits(limited), bits(per_row if T > 1 else cascade)), T
        default = cascade_attention_triton(*args, *groups)
        verify_apart = DEVICE.type == "cuda" and T > CASCADE_MAX_TOKENS
        assert torch.equal(bits(default), bits(per_row if verify_apart else cascade)), T


def test_per_row_decode_hands_every_size_off():
    """Inside ``per_row_decode()`` a dense batch of any size runs the per-row kernel (its bits), unless ``min_rows``
    is 0 or the launch is fixed; outside it the cascade (other bits: the dispatch is seen, not assumed); RTPurbo's
    local heads keep the cascade. The context nests and is left on an exception."""
    from sparrow.kernels.decode_attention import per_row_decode
    from sparrow.kernels.decode_attention.dispatch import per_row_forced
    from sparrow.kernels.decode_attention.triton_decode import decode_attention_triton

    bits = lambda t: t.view(torch.int32)  # noqa: E731
    args = _grouped_inputs([5, 3, 9], 8, 2, 1, 16, 200, 9)  # 17 rows: not a size the op hands off by itself
    groups = prefix_groups(args[6], args[7])
    per_row = decode_attention_triton(*args)
    outside = cascade_attention_triton(*args, *groups)
    assert not torch.equal(bits(outside), bits(per_row))
    rings = _ring_inputs([4, 1, 3], 4, 2, 1, 16, 4, 8, 12, 40, 30)
    ring_groups = prefix_groups(rings[6], rings[7])
    local = cascade_attention_triton(*rings, *ring_groups, window=8, sink=4, local=True)
    assert not per_row_forced()
    with per_row_decode():
        with per_row_decode():
            pass
        assert per_row_forced()
        inside = cascade_attention_triton(*args, *groups)
        always = cascade_attention_triton(*args, *groups, min_rows=0)
        fixed = cascade_attention_triton(*args, *groups, splits=(2, 1))
        local_inside = cascade_attention_triton(*rings, *ring_groups, window=8, sink=4, local=True)
    assert torch.equal(bits(inside), bits(per_row)) and rel_err(inside, _naive(*args)) < 1e-5
    assert torch.equal(bits(always), bits(outside))
    assert not torch.equal(bits(fixed), bits(per_row))
    assert torch.equal(bits(local_inside), bits(local))
    with pytest.raises(RuntimeError, match="inside"), per_row_decode():
        raise RuntimeError("inside")
    assert not per_row_forced()


def test_shares_enough_counts_rows_per_prompt():
    from sparrow.kernels.decode_attention import CASCADE_MIN_SHARE, shares_enough

    n = CASCADE_MIN_SHARE
    assert shares_enough([]) and shares_enough([7] * n) and shares_enough([0] * n + [1] * n)
    assert not shares_enough([7] * (n - 1)) and not shares_enough(list(range(2 * n)))
    assert shares_enough([0] * (2 * n - 1) + [1])  # on average: one full group carries a group of one
    assert not shares_enough([0] * n + [1] * (n - 1))


@pytest.mark.parametrize("window,sink", [(5, 2), (24, 4), (1, 0)])
def test_windowed_matches_the_oracle(window, sink):
    """Windows that cut the prompt, sit wholly in the generated tokens (sinks only from the prompt) or keep only
    the new token."""
    args = _grouped_inputs([4, 1, 3], 4, 2, 1, 16, 90, 30, seed=3)
    groups = prefix_groups(args[6], args[7])
    want = _naive(*args, window=window, sink=sink)
    assert rel_err(cascade_decode_attention(*args, *groups, window=window, sink=sink, impl="reference"), want) < 1e-6
    out = cascade_attention_triton(*args, *groups, window=window, sink=sink, **SMALL_TILES)
    assert rel_err(out, want) < 1e-5


@pytest.mark.parametrize("case", [CASES[4], CASES[5]])
def test_partials_of_splits_that_saw_nothing_are_never_read(case, monkeypatch):
    """A 1-token prompt over 3 prefix splits, a suffix of only the new token over 2 (and a 1-token prompt in a slot
    shared with a longer one): those splits write no partial output. With every fresh allocation filled with NaN,
    the output is still the attention (a merge that read them would give NaN)."""
    args = _args(case)
    groups = prefix_groups(args[6], args[7])
    empty = torch.empty

    def poisoned(*shape, **kw):
        t = empty(*shape, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)
    out = cascade_attention_triton(*args, *groups, min_rows=0, **case[-1])
    monkeypatch.undo()
    assert rel_err(out, _naive(*args)) < 1e-5


def test_dropping_the_merge_fails():
    """Negative controls: the prompt's state alone, the row's own tokens alone, or the two states averaged
    without their log-sum-exp weights are far from the attention; the exact merge is not."""
    args = _grouped_inputs([3, 2], 4, 2, 2, 16, 40, 20, seed=1)
    want = _naive(*args).float().view(args[0].shape[0], 2, -1, 16)
    (op, lp), (og, lg) = cascade_states(*args)
    assert rel_err(merge_states(op, lp, og, lg)[0], want) < 1e-6
    for wrong in (op, og, (op + og) / 2, op * lp.exp()[..., None] + og * lg.exp()[..., None]):
        assert rel_err(wrong, want) > 0.05


def test_merge_with_an_empty_side_is_the_other_side():
    o = torch.randn(3, 4)
    lse = torch.randn(3)
    empty = torch.full((3,), float("-inf"))
    for got in (merge_states(o, lse, torch.zeros(3, 4), empty), merge_states(torch.zeros(3, 4), empty, o, lse)):
        assert torch.equal(got[0], o) and torch.equal(got[1], lse)
    both = merge_states(torch.zeros(3, 4), empty, torch.zeros(3, 4), empty)
    assert torch.equal(both[0], torch.zeros(3, 4)) and torch.isneginf(both[1]).all()


def _ring_inputs(sizes, Hq, Hl, T, D, S, Wp, Wg, Lp, Lg, seed=0):
    """Local-head rings: prompts up to ``Lp`` tokens (rings of ``Wp``), generations up to ``Lg`` (rings of ``Wg``)."""
    q, _, _, _, _, rs, ps, pl, cl = _grouped_inputs(sizes, Hq, Hl, T, D, Lp, Lg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    P, R = int(ps.max()) + 1, int(rs.max()) + 1
    r = lambda *s: torch.randn(*s, generator=g).to(DEVICE)  # noqa: E731
    return q, r(P, Hl, S + Wp, D), r(P, Hl, S + Wp, D), r(R, Hl, Wg, D), r(R, Hl, Wg, D), rs, ps, pl, cl


def _sparse_local(q, plk, plv, glk, glv, rs, ps, pl, cl, *, num_sinks, window):
    """RTPurbo's own local-head oracle (a layer with no retrieval heads)."""
    A, _, T, D = q.shape
    P, Hl = plk.shape[:2]
    none = lambda n, L, d: q.new_zeros(n, 0, L, d)  # noqa: E731
    cache = SparseDecodeCache(none(P, 8, D), none(P, 8, D), none(glk.shape[0], 8, D), none(glk.shape[0], 8, D),
                              none(P, 8, 16), none(glk.shape[0], 8, 16), plk, plv, glk, glv)
    return sparse_decode_reference(q, q.new_zeros(A, 0, T, 16), cache, rs, ps, pl, cl,
                                   torch.zeros(0, dtype=torch.int64, device=q.device),
                                   torch.arange(Hl, device=q.device), top_p=1.0, block=16, num_sinks=num_sinks,
                                   window=window, ret_window=16)


# (group sizes, Hq, H_loc, T, D, sinks, Wp, Wg, Lp, Lg, window, launch)
RING_CASES = [
    pytest.param(([4, 1, 3], 4, 2, 1, 16, 4, 8, 12, 40, 30, 8, {}), id="rings-wrap-T1"),
    pytest.param(([3, 2], 8, 1, 3, 16, 2, 8, 12, 30, 20, 8, SMALL_TILES), id="rings-wrap-verify-T3"),
    pytest.param(([2, 2], 4, 2, 2, 32, 4, 24, 16, 24, 16, 64, SMALL_TILES), id="window-covers-all"),
]


@pytest.mark.parametrize("case", RING_CASES)
def test_local_heads_match_rtpurbo_local_attention(case):
    *shape, window, launch = case
    args = _ring_inputs(*shape)
    sinks = shape[5]
    groups = prefix_groups(args[6], args[7])
    want = _sparse_local(*args, num_sinks=sinks, window=window)
    ref = cascade_local_attention(*args, *groups, num_sinks=sinks, window=window, impl="reference")
    assert rel_err(ref, want) < 1e-6
    (op, _), _ = local_states(*args, num_sinks=sinks, window=window)
    assert rel_err(op, want.view(op.shape)) > 0.05  # the prompt's part alone is not the answer
    out = cascade_attention_triton(*args, *groups, window=window, sink=sinks, local=True, **launch)
    assert rel_err(out, want) < 1e-5


def test_poisoned_cache_beyond_the_rows_is_ignored():
    """NaN past every row's prompt and past its last new token changes nothing (the kernel never reads there, and
    a split that saw nothing writes no output the merge could read)."""
    q, pk, pv, gk, gv, rs, ps, pl, cl = _grouped_inputs([3, 2, 1], 4, 2, 2, 16, 50, 30, seed=5)
    groups = prefix_groups(ps, pl)
    want = cascade_attention_triton(q, pk, pv, gk, gv, rs, ps, pl, cl, *groups, splits=(3, 3), min_chunk=(16, 16))
    pk2, pv2, gk2, gv2 = pk.clone(), pv.clone(), gk.clone(), gv.clone()
    for a in range(q.shape[0]):
        for t in (pk2, pv2):
            t[ps[a], :, pl[a]:] = float("nan")
        for t in (gk2, gv2):
            t[rs[a], :, cl[a] + 2:] = float("nan")
    out = cascade_attention_triton(q, pk2, pv2, gk2, gv2, rs, ps, pl, cl, *groups, splits=(3, 3), min_chunk=(16, 16))
    assert torch.isfinite(out).all() and rel_err(out, want) < 1e-6


LOW_PRECISION = [
    torch.float16,
    # the Triton interpreter mishandles bf16 loads on the CPU; bf16 is checked on CUDA
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]


@pytest.mark.parametrize("dtype", LOW_PRECISION)
def test_low_precision_error_no_worse_than_eager(dtype):
    args = _grouped_inputs([8, 3], 14, 2, 1, 64, 150, 40, seed=2)
    f64 = _naive(*args)
    low = [a.to(dtype) if a.is_floating_point() else a for a in args]
    groups = prefix_groups(args[6], args[7])
    eager = decode_attention(*low, impl="reference")
    out = cascade_attention_triton(*low, *groups, splits=(2, 1), min_chunk=(64, 64))
    assert out.dtype == dtype
    assert rel_err(out, f64) <= 1.5 * rel_err(eager, f64) + 1e-3


def _python_groups(slots, lens):
    keys = list(zip(slots, lens))
    order = sorted(range(len(keys)), key=lambda i: (keys[i], i))
    start, first = [], {}
    for pos, i in enumerate(order):
        start.append(first.setdefault(keys[i], pos))
    return order, start


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(1, 3)), min_size=1, max_size=24))
def test_prefix_groups_sort_rows_by_prompt(rows):
    slots, lens = zip(*rows)
    order, start = prefix_groups(torch.tensor(slots), torch.tensor(lens))
    assert (order.tolist(), start.tolist()) == _python_groups(slots, lens)
    by_slot = _python_groups(slots, [1] * len(slots))  # negative control: grouping by the slot alone
    if len({(s, n) for s, n in rows}) != len(set(slots)):
        assert start.tolist() != by_slot[1]


def test_prefix_groups_in_a_compiled_graph():
    fn = torch.compile(prefix_groups, fullgraph=True, backend="eager", dynamic=True)
    slots, lens = torch.tensor([3, 1, 3, 1, 0, 3]), torch.tensor([9, 4, 9, 4, 2, 9])
    assert [t.tolist() for t in fn(slots, lens)] == [[4, 1, 3, 0, 2, 5], [0, 1, 1, 3, 3, 3]]


def test_split_and_tile_choices():
    assert tile_rows(1, 7) == 9 and tile_rows(1, 8) == 8 and tile_rows(6, 7) == 3 and tile_rows(3, 64) == 1
    assert cascade_splits(16, 2, 1, 9, 8192, 256, None) == (16, 1)
    # a big batch cuts the splits down to what fills the multiprocessors, long prompts keep several
    few = cascade_splits(256, 2, 1, 9, 32768, 4096, 132)
    assert 1 < few[0] < 64 and few[1] < 16


def test_validation_errors():
    q, pk, pv, gk, gv, rs, ps, pl, cl = _grouped_inputs([2, 1], 4, 2, 1, 16, 8, 8)
    order, start = prefix_groups(ps, pl)
    with pytest.raises(ValueError, match="prefix_order"):
        cascade_decode_attention(q, pk, pv, gk, gv, rs, ps, pl, cl, order[:1], start)
    with pytest.raises(ValueError, match="group_start"):
        cascade_decode_attention(q, pk, pv, gk, gv, rs, ps, pl, cl, order, start.float())
    with pytest.raises(ValueError, match="multiple of kv heads"):
        cascade_decode_attention(q[:, :3], pk, pv, gk, gv, rs, ps, pl, cl, order, start)
    with pytest.raises(ValueError, match="window"):
        cascade_decode_attention(q, pk, pv, gk, gv, rs, ps, pl, cl, order, start, window=0)
    with pytest.raises(ValueError, match="num_sinks"):
        cascade_local_attention(q, pk, pv, gk, gv, rs, ps, pl, cl, order, start, num_sinks=8, window=4)
    with pytest.raises(ValueError, match="impl"):
        cascade_decode_attention(q, pk, pv, gk, gv, rs, ps, pl, cl, order, start, impl="cuda")


def test_custom_op_fake_matches_real():
    """The op's fake kernel gives the real output's shape and strides (compiled graphs assert them), also for a
    query that arrives as a transposed view, as the verify step builds it."""
    from sparrow.kernels.decode_attention.triton_cascade import _cascade_op

    q, pk, pv, gk, gv, rs, ps, pl, cl = _grouped_inputs([2, 1], 4, 2, 3, 16, 20, 9)
    q_view = q.transpose(1, 2).contiguous().transpose(1, 2)
    args = (q_view, pk, pv, gk, gv, rs, ps, pl, cl, *prefix_groups(ps, pl), 1.0 / math.sqrt(16), 0, 0, False,
            0, 0, 0, 512, 256)
    torch.library.opcheck(_cascade_op, args, test_utils=("test_schema", "test_faketensor"))
    real = _cascade_op(*args)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
        fake = _cascade_op(*(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args))
    assert fake.stride() == real.stride() and fake.shape == real.shape
    assert rel_err(real, _naive(q, pk, pv, gk, gv, rs, ps, pl, cl)) < 1e-5

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from sparrow.kernels.topp import topp_select, topp_select_dense
from sparrow.kernels.topp.api import blocks_to_mask, mask_to_blocks
from sparrow.kernels.topp.reference import topp_mask_reference
from tests.helpers import DEVICE, to_device


def check_minimal_topp(scores: torch.Tensor, valid: torch.Tensor, keep: torch.Tensor, p: float, tol: float = 1e-5):
    """Assert ``keep`` is the smallest set of valid entries whose softmax mass reaches ``p`` (up to ties).

    Three facts: only valid entries are kept; the kept mass is >= p; and the set is a prefix of the
    descending order — every kept score is >= every dropped score — that would fall below p without its
    smallest member (so no smaller set reaches p: any set of that size has at most the kept mass).
    """
    x = torch.where(valid, scores.double(), float("-inf"))
    mass = torch.softmax(x, -1).nan_to_num(0.0)
    for n in range(scores.shape[0]):
        k, v, m, s = keep[n], valid[n], mass[n], x[n]
        assert not (k & ~v).any(), "kept an invalid entry"
        if not v.any():
            continue
        kept_mass = float(m[k].sum())
        assert kept_mass >= p - tol, f"row {n}: kept mass {kept_mass} < {p}"
        if p >= 1.0:
            assert torch.equal(k, v)
            continue
        dropped = v & ~k
        if dropped.any():
            assert float(s[k].min()) >= float(s[dropped].max()) - 1e-6, f"row {n}: not a top set"
        smallest = float(m[k].min())
        assert kept_mass - smallest < p + tol, f"row {n}: removing the smallest kept entry still reaches {p}"


def check_same_selection(scores: torch.Tensor, valid: torch.Tensor, a: torch.Tensor, b: torch.Tensor, p: float,
                         margin: float = 1e-6):
    """Assert two top-p selections are equal, except in a row where they differ only in where the boundary falls
    and that boundary lies within float32 rounding of ``p``: one set is the other plus its highest-scoring
    dropped entries, and the smaller one's exact (float64) mass is within ``margin`` of ``p`` (two float32 sums in
    other orders may put that set on either side of ``p``)."""
    x = torch.where(valid, scores.double(), float("-inf"))
    mass = torch.softmax(x, -1).nan_to_num(0.0)
    for n in range(scores.shape[0]):
        if torch.equal(a[n], b[n]):
            continue
        small, big = (a[n], b[n]) if a[n].sum() < b[n].sum() else (b[n], a[n])
        assert not (small & ~big).any(), f"row {n}: the selections are not nested"
        extra = big & ~small
        rest = x[n][valid[n] & ~big]
        assert not rest.numel() or float(x[n][extra].min()) >= float(rest.max()), \
            f"row {n}: the larger selection adds entries that are not the next by score"
        small_mass = float(mass[n][small].sum())
        assert abs(small_mass - p) < margin, f"row {n}: selections differ away from the boundary " \
                                             f"(smaller set's mass {small_mass}, p {p})"


rows = st.integers(1, 5)
cols = st.integers(1, 40)


@settings(max_examples=150, deadline=None)
@given(n=rows, nb=cols, p=st.floats(0.05, 1.0), scale=st.floats(0.1, 8.0), seed=st.integers(0, 10_000))
def test_reference_selection_is_minimal(n, nb, p, scale, seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(n, nb, generator=g) * scale
    valid = torch.rand(n, nb, generator=g) < 0.8
    check_minimal_topp(s, valid, topp_mask_reference(s, valid, p), p)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=rows, nb=st.integers(1, 130), p=st.floats(0.05, 1.0), scale=st.floats(0.1, 8.0), seed=st.integers(0, 10_000))
@example(n=3, nb=15, p=0.9999999999999999, scale=4.0, seed=0)  # float32 stores p as 1: both keep every block
@example(n=2, nb=116, p=0.99999, scale=7.69140625, seed=355)  # a row's top 8 hold p + 2e-8: float32 sums disagree
def test_triton_selection_is_minimal_and_matches_reference(n, nb, p, scale, seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(n, nb, generator=g) * scale
    block = 4
    q_hi = torch.randint(0, nb * block, (n,), generator=g)
    valid = torch.arange(nb)[None] <= (q_hi // block)[:, None]
    kw = dict(block=block, sink_blocks=0, local_window=0)
    tri = topp_select_dense(*to_device((s, q_hi, q_hi)), p, impl="triton", **kw).cpu()
    check_minimal_topp(s, valid, tri, p)
    ref = topp_select_dense(s, q_hi, q_hi, p, impl="reference", **kw)
    check_same_selection(s, valid, tri, ref, p)  # continuous random scores: no ties, only boundaries at rounding


@pytest.mark.parametrize("nb", [20, 70, 200])
def test_row_in_registers_and_chunked_rows_select_the_same_blocks(nb):
    """A row that fits one chunk is bisected in registers; a longer one is re-read at every step. Forcing
    16-block chunks sends the same rows down the chunked path: the selections are identical, bit for bit."""
    from sparrow.kernels.topp.triton_topp import MODE_EXPLICIT, topp_select_triton

    g = torch.Generator().manual_seed(nb)
    s = torch.randn(6, nb, generator=g) * 3
    s[1] = 0.5  # ties everywhere
    s[2, : nb // 2] = float("-inf")  # blocks with no mass
    s[4] = torch.linspace(0.0, 0.01, nb)[torch.randperm(nb, generator=g)]  # near-equal scores: a fine threshold
    s[4, 0] = -20.0  # ... found in a wide bracket
    q_hi = torch.randint(0, nb * 4, (6,), generator=g)
    q_hi[3] = q_hi[4] = nb * 4 - 1  # every block valid
    args = to_device((s, q_hi // 2, q_hi))
    for p in (0.3, 0.9):
        kw = dict(mode=MODE_EXPLICIT, block=4, sink_blocks=1, local_window=6)
        one = topp_select_triton(args[0], args[1], args[2], p, **kw)
        chunked = topp_select_triton(args[0], args[1], args[2], p, chunk=16, **kw)
        assert torch.equal(one[1], chunked[1])
        for n in range(6):
            c = int(one[1][n])
            assert torch.equal(one[0][n, :c], chunked[0][n, :c])


@pytest.mark.parametrize("broken", ["drop-last", "add-extra", "ascending"])
def test_minimality_check_rejects_broken_selections(broken):
    """Negative control: the property check must fail on selections that are not the minimal top-p set."""
    g = torch.Generator().manual_seed(0)
    s = torch.randn(4, 20, generator=g) * 3
    valid = torch.ones(4, 20, dtype=torch.bool)
    p = 0.7
    keep = topp_mask_reference(s, valid, p)
    check_minimal_topp(s, valid, keep, p)
    bad = keep.clone()
    if broken == "drop-last":  # too small: below p
        for n in range(4):
            kept = torch.nonzero(keep[n]).flatten()
            bad[n, kept[s[n, kept].argmin()]] = False
    elif broken == "add-extra":  # reaches p but is not the smallest
        for n in range(4):
            dropped = torch.nonzero(~keep[n]).flatten()
            bad[n, dropped[s[n, dropped].argmax()]] = True
    else:  # the right size, wrong members
        bad = topp_mask_reference(-s, valid, p)
    with pytest.raises(AssertionError):
        check_minimal_topp(s, valid, bad, p)


@pytest.mark.parametrize("broken", ["boundary-far-from-p", "not-nested", "skips-the-next"])
def test_same_selection_check_rejects_real_differences(broken):
    """Negative control of ``check_same_selection``: selections that differ anywhere but at a boundary within
    rounding of ``p`` fail it, and the rounding case of the Triton test passes it."""
    g = torch.Generator().manual_seed(0)
    s = torch.randn(1, 30, generator=g) * 3
    valid = torch.ones(1, 30, dtype=torch.bool)
    order = s[0].argsort(descending=True)
    mass = torch.softmax(s[0].double(), -1)[order].cumsum(0)
    k = int((mass < 0.9).sum()) + 1  # the top k hold >= 0.9
    top = torch.zeros(1, 30, dtype=torch.bool)
    top[0, order[:k]] = True
    check_same_selection(s, valid, top, top.clone(), 0.9)
    bad = top.clone()
    if broken == "boundary-far-from-p":  # one more entry where the top k are well above p
        bad[0, order[k]] = True
    elif broken == "not-nested":  # the k-th swapped for the (k+1)-th
        bad[0, order[k - 1]], bad[0, order[k]] = False, True
    else:  # the (k+2)-th added instead of the (k+1)-th
        bad[0, order[k + 1]] = True
    p = float(mass[k - 1]) if broken == "skips-the-next" else 0.9  # a boundary exactly at p: only the order is wrong
    with pytest.raises(AssertionError):
        check_same_selection(s, valid, top, bad, p)
    near = top.clone()
    near[0, order[k]] = True
    check_same_selection(s, valid, top, near, float(mass[k - 1]) - 1e-8)  # top k hold p + 1e-8: either side


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_forced_blocks_and_p1(impl):
    s = torch.full((3, 12), -50.0)
    s[:, 5] = 10.0  # all the mass in block 5
    q_hi = torch.tensor([47, 30, 9])  # blocks of 4 tokens: rows see 12, 8, 3 blocks
    q_lo = q_hi - torch.tensor([0, 3, 0])
    dev = DEVICE if impl == "triton" else torch.device("cpu")
    keep = topp_select_dense(*to_device((s, q_lo, q_hi), dev), 0.9, block=4, sink_blocks=1, local_window=6,
                             impl=impl).cpu()
    expect = torch.zeros(3, 12, dtype=torch.bool)
    expect[0, [0, 5, 10, 11]] = True  # sink, top-p, window [42, 47]
    expect[1, [0, 5, 6, 7]] = True  # window [22, 30] -> blocks 5..7
    expect[2, [0, 1, 2]] = True  # block 5 not visible; window [4, 9] -> blocks 1, 2; top-p among 0..2
    assert torch.equal(keep, expect)
    all_ = topp_select_dense(*to_device((s, q_hi, q_hi), dev), 1.0, block=4, impl=impl).cpu()
    assert torch.equal(all_, torch.arange(12)[None] <= (q_hi // 4)[:, None])


def test_block_list_round_trip_and_validation():
    m = torch.rand(5, 17) < 0.4
    idx, cnt = mask_to_blocks(m)
    assert torch.equal(blocks_to_mask(idx, cnt, 17), m)
    for n in range(5):
        assert idx[n, : cnt[n]].tolist() == torch.nonzero(m[n]).flatten().tolist()
    with pytest.raises(ValueError, match="top_p"):
        topp_select(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long), 0.0, block=1)
    with pytest.raises(ValueError, match="expected"):
        topp_select(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), 0.5, block=1)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_a_device_top_p_selects_as_the_same_float_does(impl):
    """top_p as a float32 tensor (0-dim, or one per row; 1 among them) selects exactly what each row's float
    selects; the Triton kernel reads it on the device (a CUDA graph follows in-place updates), in explicit and
    decode modes."""
    from sparrow.kernels.topp.triton_topp import MODE_DECODE, topp_select_triton

    g = torch.Generator().manual_seed(7)
    s = torch.randn(5, 40, generator=g) * 3
    q_hi = torch.randint(40, 160, (5,), generator=g)
    ps = [0.3, 0.9, 1.0, 0.6, 0.75]
    dev = DEVICE if impl == "triton" else torch.device("cpu")
    args = to_device((s, q_hi - 5, q_hi), dev)
    kw = dict(block=4, sink_blocks=1, local_window=6, impl=impl)
    per_row = topp_select_dense(*args, torch.tensor(ps, device=dev), **kw).cpu()
    for n, p in enumerate(ps):
        one = topp_select_dense(*args, p, **kw).cpu()
        assert torch.equal(per_row[n], one[n]), (n, p)
    same = topp_select_dense(*args, torch.tensor(0.75, device=dev), **kw).cpu()
    assert torch.equal(same, topp_select_dense(*args, 0.75, **kw).cpu())
    with pytest.raises(ValueError, match="float32"):
        topp_select(*args, torch.tensor([0.5, 0.5], device=dev), block=4, impl=impl)
    if impl == "triton":  # decode rows (a * H + h) * T + t read the top-p of their cache row a
        A, H, T = 2, 2, 1
        prefix_len, cached_len = to_device((torch.tensor([100, 60]), torch.tensor([3, 9])), dev)
        bs = args[0][: A * H * T].contiguous()
        tp = torch.tensor([0.4, 0.95], device=dev)
        idx, cnt = topp_select_triton(bs, prefix_len, cached_len, tp, mode=MODE_DECODE, block=4, sink_blocks=1,
                                      local_window=6, inner=T, h_inner=H * T)
        for a in range(A):
            ref_idx, ref_cnt = topp_select_triton(bs, prefix_len, cached_len, float(tp[a]), mode=MODE_DECODE,
                                                  block=4, sink_blocks=1, local_window=6, inner=T, h_inner=H * T)
            for n in range(a * H * T, (a + 1) * H * T):
                assert int(cnt[n]) == int(ref_cnt[n])
                assert torch.equal(idx[n, : int(cnt[n])], ref_idx[n, : int(cnt[n])])

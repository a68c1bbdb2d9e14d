import math

import pytest
import torch

from sparrow.kernels.sparse_decode import SparseDecodeCache, SparseDecodeConfig, sparse_decode_attention
from sparrow.kernels.sparse_decode import triton_sparse_decode
from sparrow.kernels.sparse_decode.triton_sparse_decode import ret_splits_for, sparse_decode_triton
from tests.helpers import rel_err, to_device


def _make(A, Hkv, ret, qpk, T, D, P, Lp, R, Lg, *, S=4, W=24, slack=4, r=16, block=8, dtype=torch.float32, seed=0):
    """Logical per-slot KV, and an RTPurbo cache holding it in the documented layout.

    Rows sharing a prefix slot share its prompt length (as in the engine)."""
    g = torch.Generator().manual_seed(seed)
    rn = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    ret = torch.tensor(ret, dtype=torch.long)
    loc = torch.tensor([h for h in range(Hkv) if h not in ret.tolist()], dtype=torch.long)
    pk, pv, pik = rn(P, Hkv, Lp, D), rn(P, Hkv, Lp, D), rn(P, len(ret), Lp, r)
    gk, gv, gik = rn(R, Hkv, Lg, D), rn(R, Hkv, Lg, D), rn(R, len(ret), Lg, r)
    slot_len = torch.randint(1, Lp + 1, (P,), generator=g)
    ps = torch.randint(0, P, (A,), generator=g)
    rs = torch.randperm(R, generator=g)[:A]
    pl = slot_len[ps]
    cl = torch.randint(0, Lg - T + 1, (A,), generator=g)
    Wp, Wg = min(W, Lp), min(W + slack, Lg)
    plk, plv = torch.zeros(P, len(loc), S + Wp, D, dtype=dtype), torch.zeros(P, len(loc), S + Wp, D, dtype=dtype)
    glk, glv = torch.zeros(R, len(loc), Wg, D, dtype=dtype), torch.zeros(R, len(loc), Wg, D, dtype=dtype)
    for p in range(P):
        n = int(slot_len[p])
        plk[p, :, :S], plv[p, :, :S] = pk[p, loc, :S], pv[p, loc, :S]
        for j in range(max(0, n - Wp), n):
            plk[p, :, S + j % Wp], plv[p, :, S + j % Wp] = pk[p, loc, j], pv[p, loc, j]
    for a in range(A):
        end = int(cl[a]) + T
        for j in range(max(0, end - Wg), end):
            glk[rs[a], :, j % Wg], glv[rs[a], :, j % Wg] = gk[rs[a], loc, j], gv[rs[a], loc, j]
    cache = SparseDecodeCache(pk[:, ret].contiguous(), pv[:, ret].contiguous(), gk[:, ret].contiguous(),
                              gv[:, ret].contiguous(), pik, gik, plk, plv, glk, glv)
    q, qi = rn(A, Hkv * qpk, T, D), rn(A, len(ret), T, r) * 0.7
    is_ret = torch.zeros(Hkv, dtype=torch.int32)
    is_ret[ret] = 1
    args = (q, qi, cache, rs, ps, pl, cl, ret, loc, is_ret)
    return args, (pk, pv, pik, gk, gv, gik)


def _naive(args, logical, cfg: SparseDecodeConfig):
    """Per (row, head, token) loops in float64 over the logical sequence."""
    q, qi, _, rs, ps, pl, cl, ret, loc, _ = args
    pk, pv, pik, gk, gv, gik = logical
    A, Hq, T, D = q.shape
    qpk = Hq // (len(ret) + len(loc))
    out = torch.zeros(A, Hq, T, D, dtype=torch.float64)
    B = cfg.block
    for a in range(A):
        n_p = int(pl[a])
        for t in range(T):
            pos = n_p + int(cl[a]) + t
            n_g = int(cl[a]) + t + 1
            for h in range(len(ret) + len(loc)):
                k = torch.cat([pk[ps[a], h, :n_p], gk[rs[a], h, :n_g]]).double()
                v = torch.cat([pv[ps[a], h, :n_p], gv[rs[a], h, :n_g]]).double()
                j = torch.arange(pos + 1)
                if h in ret.tolist():
                    hr = ret.tolist().index(h)
                    ik = torch.cat([pik[ps[a], hr, :n_p], gik[rs[a], hr, :n_g]]).double()
                    s = ik @ qi[a, hr, t].double()
                    nb = pos // B + 1
                    bs = torch.stack([torch.logsumexp(s[b * B:(b + 1) * B], 0) for b in range(nb)])
                    mass = torch.softmax(bs, 0)
                    order = torch.argsort(mass, descending=True)
                    keep, acc = set(), 0.0
                    for b in order.tolist():
                        if acc >= cfg.top_p:
                            break
                        keep.add(b)
                        acc += float(mass[b])
                    keep |= set(range(math.ceil(cfg.num_sinks / B)))
                    keep |= set(range(max(0, pos - cfg.ret_window + 1) // B, nb))
                    vis = torch.tensor([int(x) // B in keep for x in j])
                else:
                    vis = (j < min(cfg.num_sinks, n_p)) | (j > pos - cfg.window)
                for gq in range(qpk):
                    w = torch.softmax(torch.where(vis, k @ q[a, h * qpk + gq, t].double() / math.sqrt(D),
                                                  float("-inf")), 0)
                    out[a, h * qpk + gq, t] = w @ v
    return out


CASES = [
    pytest.param(dict(A=2, Hkv=3, ret=(0, 2), qpk=2, T=1, D=16, P=2, Lp=63, R=3, Lg=20), id="mixed-Lp63"),
    pytest.param(dict(A=3, Hkv=2, ret=(1,), qpk=3, T=3, D=16, P=2, Lp=100, R=4, Lg=9), id="T3-qpk3-Lp100"),
    pytest.param(dict(A=1, Hkv=2, ret=(0, 1), qpk=1, T=1, D=32, P=1, Lp=1, R=2, Lg=130), id="all-ret-Lp1-Lg130"),
    pytest.param(dict(A=2, Hkv=2, ret=(), qpk=4, T=2, D=16, P=2, Lp=130, R=2, Lg=40), id="all-local-Lp130"),
]


@pytest.mark.parametrize("case", CASES)
def test_reference_matches_naive(case):
    cfg = SparseDecodeConfig(top_p=0.6, block=8, num_sinks=4, window=24, ret_window=8)
    args, logical = _make(**case)
    out = sparse_decode_attention(*args, cfg, impl="reference")
    assert rel_err(out, _naive(args, logical, cfg)) < 1e-5


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("top_p", [0.6, 1.0])
def test_triton_matches_reference(case, top_p):
    cfg = SparseDecodeConfig(top_p=top_p, block=8, num_sinks=4, window=24, ret_window=8)
    args, _ = _make(**case)
    ref = sparse_decode_attention(*args, cfg, impl="reference")
    # unequal split counts: the one attention launch has each kind of head skip the splits it does not have
    out = sparse_decode_triton(*to_device(args), top_p=top_p, block=8, num_sinks=4, window=24, ret_window=8,
                               ret_splits=3, local_splits=2, ret_min_blocks=1, local_min_chunk=8)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("case,pipeline", [
    pytest.param(CASES[0].values[0], dict(fused=False), id="staged-4-launches-Lp63"),
    pytest.param(CASES[1].values[0], dict(fused=False), id="staged-4-launches-T3"),
    pytest.param(CASES[1].values[0], dict(fused=True, select_chunk=1), id="fused-with-topp-kernel-list-T3"),
    pytest.param(CASES[0].values[0], dict(fused=True, ret_splits=8), id="fused-more-splits-than-blocks-Lp63"),
])
def test_pipelines_match_reference(case, pipeline):
    """The staged pipeline, the fused one taking the top-p kernel's list (rows too long to select in registers)
    and the fused one with most retrieval splits empty all give the reference's output."""
    cfg = SparseDecodeConfig(top_p=0.6, block=8, num_sinks=4, window=24, ret_window=8)
    args, _ = _make(**case)
    ref = sparse_decode_attention(*args, cfg, impl="reference")
    kw = dict(ret_splits=3, local_splits=2, ret_min_blocks=1, local_min_chunk=8) | pipeline
    out = sparse_decode_triton(*to_device(args), top_p=0.6, block=8, num_sinks=4, window=24, ret_window=8, **kw)
    assert rel_err(out, ref) < 1e-5


def test_retrieval_splits_grow_as_the_batch_shrinks():
    """64 splits for a long row at batch 4 and above; more at batch 1-2, so that the call keeps about 256
    retrieval programs; never fewer than 4 blocks per split; the count is the same for every cache longer than the
    bound, and falls only with the blocks a short cache has."""
    n_1m, n_128k = (1 << 20) // 64, (1 << 17) // 64
    assert [ret_splits_for(n_1m, a) for a in (1, 2, 3, 4, 16, 256)] == [256, 128, 86, 64, 64, 64]
    assert [ret_splits_for(n_128k, a) for a in (1, 4)] == [256, 64]
    assert ret_splits_for(n_1m, 2 * 3) == 64  # 2 rows x 3 tokens (verification): 6 triples
    assert [ret_splits_for(n, 1) for n in (1, 7, 100, 1023, 1024)] == [1, 2, 25, 256, 256]
    assert ret_splits_for(100, 1, min_blocks=1) == 100 and ret_splits_for(0, 1) == 1


def test_kernel_asks_for_the_splits_of_its_retrieval_triples(monkeypatch):
    """Without an override the call counts rows x retrieval heads x tokens (3 x 1 x 3 here) and gets the
    reference's output at the split count that gives; ``ret_splits`` bypasses the rule."""
    asked = []
    monkeypatch.setattr(triton_sparse_decode, "ret_splits_for",
                        lambda n, triples, m: asked.append((n, triples, m)) or ret_splits_for(n, triples, m))
    cfg = SparseDecodeConfig(top_p=0.6, block=8, num_sinks=4, window=24, ret_window=8)
    args, _ = _make(**CASES[1].values[0])
    ref = sparse_decode_attention(*args, cfg, impl="reference")
    out = sparse_decode_triton(*to_device(args), top_p=0.6, block=8, num_sinks=4, window=24, ret_window=8,
                               ret_min_blocks=1)
    assert asked == [(-(-(100 + 9) // 8), 3 * 1 * 3, 1)] and rel_err(out, ref) < 1e-5
    sparse_decode_triton(*to_device(args), top_p=0.6, block=8, num_sinks=4, window=24, ret_window=8, ret_splits=2)
    assert len(asked) == 1


def test_indexer_queries_projected_in_the_score_kernel():
    """q_idx=None: the score kernel projects the pre-RoPE queries (times a per-head scale) itself; the reference
    projects them the same way, which is the backend's grouping (heads ``h * q_per_kv + g``, dims ``g * D + d``)."""
    from sparrow.kernels.sparse_decode.reference import project_indexer_queries

    cfg = SparseDecodeConfig(top_p=0.6, block=8, num_sinks=4, window=24, ret_window=8)
    args, _ = _make(A=2, Hkv=3, ret=(0, 2), qpk=2, T=2, D=16, P=2, Lp=63, R=3, Lg=20)
    q, _, cache, rs, ps, pl, cl, ret, loc, is_ret = args
    g = torch.Generator().manual_seed(5)
    q_pre, wq = torch.randn(q.shape, generator=g), torch.randn(2, 2 * 16, 16, generator=g) * 0.2
    scale = torch.tensor([0.5, 2.0])
    explicit = torch.stack([torch.stack([torch.cat([q_pre[a, h * 2 + gg, t] for gg in range(2)]) @ wq[i] * scale[i]
                                         for t in range(2)]) for a in range(2) for i, h in enumerate((0, 2))])
    proj = project_indexer_queries(q_pre, wq, ret, scale)
    assert torch.allclose(proj, explicit.view(2, 2, 2, 16), atol=1e-5)
    ref = sparse_decode_attention(q, proj, cache, rs, ps, pl, cl, ret, loc, is_ret, cfg, impl="reference")
    wrong = sparse_decode_attention(q, proj.flip(1), cache, rs, ps, pl, cl, ret, loc, is_ret, cfg, impl="reference")
    assert rel_err(wrong, ref) > 1e-3  # the selection depends on the queries: the check below can fail
    dev = to_device((q, cache, rs, ps, pl, cl, ret, loc, is_ret, q_pre, wq, scale))
    out = sparse_decode_attention(dev[0], None, *dev[1:9], cfg, impl="triton", q_pre=dev[9], indexer_q=dev[10],
                                  q_scale=dev[11])
    assert rel_err(out, ref) < 1e-5


def test_per_row_top_p_on_the_device():
    """A [A] top_p tensor read by the fused selection: each row's own mass (1.0 keeps every block)."""
    args, _ = _make(A=2, Hkv=2, ret=(0, 1), qpk=2, T=2, D=16, P=2, Lp=90, R=3, Lg=30)
    cfg = SparseDecodeConfig(top_p=torch.tensor([0.5, 1.0]), block=8, num_sinks=4, window=24, ret_window=8)
    ref, sel_ref = sparse_decode_attention(*args, cfg, impl="reference", return_selection=True)
    dcfg = SparseDecodeConfig(to_device(cfg.top_p), 8, 4, 24, 8)
    out, (idx, cnt) = sparse_decode_attention(*to_device(args), dcfg, impl="triton", return_selection=True)
    from sparrow.kernels.topp.api import blocks_to_mask

    mask = blocks_to_mask(*to_device((idx, cnt), "cpu"), idx.shape[1]).view(sel_ref.shape)
    assert torch.equal(mask, sel_ref) and rel_err(out, ref) < 1e-5
    nb = ((args[5] + args[6])[:, None] + torch.arange(2)) // 8 + 1  # [A, T] causal blocks
    assert (sel_ref[1].sum(-1) == nb[1]).all() and (sel_ref[0].sum(-1) < nb[0]).any()


def test_selection_reported_by_both_impls_agrees():
    cfg = SparseDecodeConfig(top_p=0.5, block=8, num_sinks=4, window=24, ret_window=8)
    args, _ = _make(A=2, Hkv=2, ret=(0, 1), qpk=2, T=2, D=16, P=2, Lp=90, R=3, Lg=30)
    _, sel_ref = sparse_decode_attention(*args, cfg, impl="reference", return_selection=True)
    _, sel = sparse_decode_attention(*to_device(args), cfg, impl="triton", return_selection=True)
    idx, cnt = to_device(sel, "cpu")
    from sparrow.kernels.topp.api import blocks_to_mask

    assert torch.equal(blocks_to_mask(idx, cnt, idx.shape[1]).view(sel_ref.shape), sel_ref)
    assert (sel_ref.sum(-1) < (args[5] + args[6])[:, None, None] // 8 + 1).any()  # something was skipped


def test_low_precision_close_to_fp32():
    cfg = SparseDecodeConfig(top_p=1.0, block=8, num_sinks=4, window=24, ret_window=8)
    args, _ = _make(A=2, Hkv=2, ret=(1,), qpk=2, T=1, D=32, P=2, Lp=70, R=2, Lg=20)
    ref = sparse_decode_attention(*args, cfg, impl="reference")
    half = [a.half() if torch.is_tensor(a) and a.is_floating_point() else a for a in args[:2]]
    cache = type(args[2])(*(t.half() for t in args[2]))
    out = sparse_decode_attention(*to_device((*half, cache, *args[3:])), cfg, impl="triton")
    assert out.dtype == torch.float16 and rel_err(out, ref) < 3e-3


def test_nan_poison_outside_the_visible_region_is_ignored():
    cfg = SparseDecodeConfig(top_p=0.7, block=8, num_sinks=4, window=16, ret_window=8)
    args, _ = _make(A=2, Hkv=2, ret=(0,), qpk=2, T=1, D=16, P=2, Lp=50, R=3, Lg=40, W=16)
    ref = sparse_decode_attention(*args, cfg, impl="reference")
    q, qi, cache, rs, ps, pl, cl = args[:7]
    c = [t.clone() for t in cache]
    for a in range(2):  # past every row's visible tokens (rows sharing a slot share its length)
        c[0][ps[a], :, pl[a]:] = float("nan")
        c[1][ps[a], :, pl[a]:] = float("nan")
        c[4][ps[a], :, pl[a]:] = float("nan")
        c[2][rs[a], :, cl[a] + 1:] = float("nan")
        c[3][rs[a], :, cl[a] + 1:] = float("nan")
        c[5][rs[a], :, cl[a] + 1:] = float("nan")
    out = sparse_decode_attention(*to_device((q, qi, type(cache)(*c), *args[3:])), cfg, impl="triton")
    assert torch.isfinite(out).all().item() and rel_err(out, ref) < 1e-5


def test_validation():
    cfg = SparseDecodeConfig(top_p=0.7, block=8, num_sinks=4, window=24, ret_window=8)
    args, _ = _make(A=2, Hkv=2, ret=(0,), qpk=2, T=1, D=16, P=2, Lp=10, R=3, Lg=10)
    with pytest.raises(ValueError, match="q_idx"):
        sparse_decode_attention(args[0], args[1][:, :, :0], *args[2:], cfg)
    with pytest.raises(ValueError, match="num_sinks"):
        sparse_decode_attention(*args, SparseDecodeConfig(0.7, 2, 4, 24, 8))
    with pytest.raises(ValueError, match="impl"):
        sparse_decode_attention(*args, cfg, impl="cuda")


def test_custom_op_schema_fake_and_compiled_graph():
    """The engine's path is one opaque custom op: its fake kernel gives the real shape, and a fullgraph compiled
    step with a dynamic row count (the engine's buckets) calls it without graph breaks and matches the
    reference. (Traced as a user Triton kernel instead, Inductor re-typed a float argument as float64 and the
    kernel failed to compile on the GPU.)"""
    from sparrow.kernels.sparse_decode.triton_sparse_decode import _sparse_decode_op

    cfg = SparseDecodeConfig(top_p=0.6, block=8, num_sinks=4, window=24, ret_window=8)
    args, _ = _make(A=3, Hkv=3, ret=(0, 2), qpk=2, T=1, D=16, P=2, Lp=63, R=4, Lg=20)
    ref = sparse_decode_attention(*args, cfg, impl="reference")
    dargs = to_device(args)
    q, q_idx, cache, *meta = dargs
    top_p = torch.tensor(0.6, device=q.device)  # the op reads top_p on the device
    torch.library.opcheck(_sparse_decode_op, (q, q_idx, *cache, *meta, top_p, 8, 4, 24, 8, 0.25),
                          test_utils=("test_schema", "test_faketensor"))

    def step(q, q_idx, row_slot, prefix_slot, prefix_len, cached_len):
        out = sparse_decode_attention(q, q_idx, cache, row_slot, prefix_slot, prefix_len, cached_len, *meta[4:],
                                      cfg, impl="triton", validate=False)
        return out * 2

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    for rows in (slice(None), slice(0, 1)):
        got = compiled(q[rows], q_idx[rows], *(m[rows] for m in meta[:4]))
        assert rel_err(got.cpu(), 2 * ref[rows]) < 1e-5

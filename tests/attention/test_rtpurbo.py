import copy

import pytest
import torch
import torch.nn.functional as F

from sparrow.attention import CacheSpec, DecodeMeta, LayerShape, PrefillMeta
from sparrow.attention.rtpurbo import (
    HeadProfile,
    RTPurboAttention,
    RTPurboConfig,
    collect_selection_stats,
    rtpurbo_attention,
)
from sparrow.models import load_model_state, use_attention
from sparrow.rollout import EngineConfig, RolloutEngine, SamplingParams
from sparrow.rollout.forward import decode_hidden, logits_from_hidden, prefill_hidden
from sparrow.rollout.steps import decode_step
from tests.helpers import DEVICE, random_tiny

SMALL = dict(decode_block=16, prefill_block=16, ret_window=16, ring_slack=4)


def _device(impl: str) -> torch.device:
    """Where a backend of ``impl`` runs in these tests: Triton on CUDA when present (else the interpreter)."""
    return DEVICE if impl == "triton" else torch.device("cpu")


def _cfg(**kw):
    return RTPurboConfig(**{**SMALL, "prefill_impl": "reference", **kw})


def _masked_forward(model, seq, plen):
    """Full causal forward where local heads see only sinks + window (retrieval heads: dense)."""
    for layer in model.layers:
        b = layer.attn.backend
        c = b.config

        def ft(q, k, v, *, q_pre=None, k_pre=None, mask=None, b=b, c=c):
            i = torch.arange(q.shape[2], device=q.device)
            causal = i[None, :] <= i[:, None]
            local = causal & ((i[:, None] - i[None, :] < c.window) | (i[None, :] < min(c.num_sinks, plen)))
            is_loc = (b.head_is_ret == 0).repeat_interleave(b.shape.q_per_kv)
            m = torch.where(is_loc[:, None, None], local, causal)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=m[None], enable_gqa=True)

        b.forward_train = ft
    try:
        return model(seq[None])[0]
    finally:
        for layer in model.layers:
            del layer.attn.backend.forward_train


def _cached_vs_full(model, *, T, steps, plens=(37, 6), full=None):
    """Prefill two prompts (shared prefix slots), decode ``steps`` blocks of T tokens for three rows; return
    the largest logit difference from ``full(model, seq, prompt_len)``."""
    full = full or (lambda m, seq, n: m(seq[None])[0])
    dev = next(model.parameters()).device
    spec = CacheSpec(num_prefixes=3, max_prefix_len=40, num_rows=4, max_gen_len=30)
    caches = [layer.attn.backend.init_cache(spec, dtype=torch.float32, device=dev) for layer in model.layers]
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 64, (n,), generator=g).to(dev) for n in plens]
    toks = torch.zeros(2, max(plens), dtype=torch.int64, device=dev)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = p
    slots, plen = torch.tensor([2, 0], device=dev), torch.tensor(plens, device=dev)
    err = 0.0
    with torch.no_grad():
        h = prefill_hidden(model, toks, caches, PrefillMeta(slots, plen))
        for i, p in enumerate(prompts):
            ref = full(model, p, len(p))
            err = max(err, float((logits_from_hidden(model, h[i, : len(p)]) - ref).abs().max()))
        rows, pr = torch.tensor([3, 0, 1], device=dev), torch.tensor([0, 1, 1], device=dev)
        gen = torch.randint(0, 64, (3, steps * T), generator=g).to(dev)
        for blk in range(steps):
            meta = DecodeMeta(rows, slots[pr], plen[pr], torch.full((3,), blk * T, device=dev))
            logits = logits_from_hidden(model, decode_hidden(model, gen[:, blk * T:(blk + 1) * T], caches, meta))
            for r in range(3):
                seq = torch.cat([prompts[int(pr[r])], gen[r, : (blk + 1) * T]])
                ref = full(model, seq, len(prompts[int(pr[r])]))[-T:]
                err = max(err, float((logits[r] - ref).abs().max()))
    return err


@pytest.mark.parametrize("impl,T,steps", [("reference", 1, 6), ("reference", 4, 3), ("triton", 2, 2)])
def test_p1_all_retrieval_equals_dense(impl, T, steps):
    """top_p = 1 with every head a retrieval head: logits through prefill + cached decode equal the dense
    model's full forward."""
    model = random_tiny("qwen2", attention=lambda s: RTPurboAttention(s, _cfg(top_p=1.0, impl=impl, window=8)))
    assert _cached_vs_full(model.to(_device(impl)), T=T, steps=steps) < 1e-4


@pytest.mark.parametrize("impl,T,steps", [("reference", 1, 14), ("reference", 3, 8), ("triton", 2, 4)])
def test_local_heads_ring_buffers_equal_masked_attention(impl, T, steps):
    """Local heads with an 8-token window (rings wrap: prompt ring 8, generation ring 12): cached decode
    equals a full forward whose local heads are masked to sinks + window."""
    model = random_tiny("qwen2", attention=lambda s: RTPurboAttention(s, _cfg(top_p=1.0, impl=impl, window=8), [1]))
    assert _cached_vs_full(model.to(_device(impl)), T=T, steps=steps, full=_masked_forward) < 1e-4


def test_sparse_selection_changes_little_and_records_density():
    cfg = _cfg(top_p=0.5, impl="reference", window=8, decode_block=8, prefill_block=8, ret_window=8)
    model = random_tiny("qwen2", attention=lambda s: RTPurboAttention(s, cfg))
    for layer in model.layers:
        layer.attn.backend.enable_stats()
    err = _cached_vs_full(model, T=1, steps=4)
    assert err > 0  # something was dropped
    st = collect_selection_stats(model)
    assert 0 < st["decode_ret_density"] < 1 and 0 < st["prefill_ret_density"] <= 1
    assert st["decode_queries"] == 2 * 4 * 3  # layers x steps x rows


def _prefill(model, toks, plen):
    spec = CacheSpec(num_prefixes=2, max_prefix_len=40, num_rows=2, max_gen_len=8)
    caches = [layer.attn.backend.init_cache(spec, dtype=torch.float32, device=torch.device("cpu"))
              for layer in model.layers]
    with torch.no_grad():
        h = prefill_hidden(model, toks, caches, PrefillMeta(torch.tensor([1, 0]), plen))
    return logits_from_hidden(model, h), caches


@pytest.mark.parametrize("S", [37, 29])
def test_dense_prefill_below_attends_densely_and_writes_the_same_caches(S):
    """Below ``dense_prefill_below`` (padded length) every head attends densely: the prompts' logits equal a
    dense model's, and a layer's caches hold exactly what the sparse prefill writes from the same input (decode
    reads the same layout); at or above it the prefill is sparse again."""
    dense = random_tiny("qwen2")
    g = torch.Generator().manual_seed(3)
    toks = torch.randint(0, 64, (2, S), generator=g)
    plen = torch.tensor([S, S - 5])
    profile = HeadProfile.from_scores(torch.tensor([[1.0, 0.0], [0.0, 1.0]]), 0.5)
    stats = {}

    def build(below):
        cfg = _cfg(top_p=0.5, window=8, decode_block=8, prefill_block=8, ret_window=8, dense_prefill_below=below)
        m = use_attention(copy.deepcopy(dense), rtpurbo_attention(profile, None, cfg))
        for layer in m.layers:
            layer.attn.backend.enable_stats()
        out = _prefill(m, toks, plen)
        stats[below] = collect_selection_stats(m)
        return out

    ref, _ = _prefill(dense, toks, plen)
    (sparse, c0), (at, _), (below, c1) = build(0), build(S), build(S + 1)
    real = torch.arange(S)[None, :] < plen[:, None]
    assert float((below - ref)[real].abs().max()) < 1e-5
    assert float((sparse - ref)[real].abs().max()) > 1e-3  # the sparse prefill differs (negative control)
    assert torch.equal(at, sparse)
    for x, y in zip(c0[0], c1[0]):  # the first layer's inputs are the same (later layers': their outputs differ)
        assert torch.equal(x.view(torch.int32), y.view(torch.int32))
    assert stats[S + 1]["prefill_ret_density"] == 1.0 and stats[0]["prefill_ret_density"] < 1.0


def test_ring_buffer_memory_is_bounded_by_the_window():
    shape = LayerShape(0, 8, 4, 16)
    b = RTPurboAttention(shape, RTPurboConfig(window=64, ring_slack=8, num_sinks=4), [1])
    sizes = {}
    for lp, lg in [(100, 80), (1000, 1000), (100_000, 50_000)]:
        c = b.init_cache(CacheSpec(2, lp, 3, lg), dtype=torch.bfloat16, device=torch.device("meta"))
        sizes[lp] = sum(t.numel() * t.element_size() for t in c[6:])  # local heads' tensors
        assert c.prefix_lk.shape == (2, 3, 4 + min(64, lp), 16)
        assert c.gen_lk.shape == (4, 3, min(72, lg), 16)
        assert c.prefix_k.shape == (2, 1, lp, 16)  # the retrieval head keeps everything
    assert sizes[1000] == sizes[100_000] == 2 * 16 * 2 * 3 * (2 * (4 + 64) + 4 * 72)


def test_forward_train_is_dense_and_indexer_is_not_in_the_checkpoint():
    dense = random_tiny("qwen2")
    sparse = use_attention(copy.deepcopy(dense), rtpurbo_attention(HeadProfile.from_scores(torch.rand(2, 2), 0.5),
                                                                   None, _cfg(window=8)))
    x = torch.randint(0, 64, (2, 20))
    assert torch.allclose(dense(x), sparse(x), atol=1e-6)
    state = dense.state_dict()
    load_model_state(sparse, state)  # the backend's indexer parameters are tolerated as missing
    extra = set(sparse.state_dict()) - set(state)
    assert extra and all(".backend.indexer_" in k for k in extra)
    b = sparse.layers[0].attn.backend
    assert b.indexer_q.shape == (1, 2 * 16, 16) and b.indexer_k.shape == (1, 16, 16)


def test_the_cache_is_the_sparse_decode_kernels_input():
    """The backend's cache type is the kernel package's input type (the kernel never imports the backend)."""
    from sparrow.attention.rtpurbo import RTPurboCache
    from sparrow.kernels.sparse_decode import SparseDecodeCache

    assert issubclass(RTPurboCache, SparseDecodeCache) and RTPurboCache._fields == SparseDecodeCache._fields
    b = RTPurboAttention(LayerShape(0, 8, 4, 16), RTPurboConfig(window=64), [1])
    c = b.init_cache(CacheSpec(2, 100, 3, 50), dtype=torch.bfloat16, device=torch.device("meta"))
    assert type(c) is RTPurboCache and isinstance(c, SparseDecodeCache)


def test_config_and_profile_validation():
    for bad in (dict(top_p=0.0), dict(top_p=1.5), dict(window=0), dict(indexer_dim=12), dict(num_sinks=100),
                dict(retrieval_ratio=2.0), dict(impl="cuda"), dict(prefill_impl="triton"), dict(decode_block=48),
                dict(dense_prefill_below=-1)):
        with pytest.raises(ValueError):
            RTPurboConfig(**bad)
    assert RTPurboConfig.for_context(1024).window == 128
    assert RTPurboConfig.for_context(1 << 20).window == 8192
    p = HeadProfile.from_scores(torch.tensor([[0.1, 0.9], [0.5, 0.2]]), 0.5)
    assert p.retrieval.tolist() == [[False, True], [True, False]] and p.ratio == 0.5
    assert HeadProfile.from_dict(p.to_dict()).retrieval.tolist() == p.retrieval.tolist()
    with pytest.raises(ValueError, match="cover"):
        RTPurboAttention(LayerShape(3, 4, 2, 16), RTPurboConfig(), p)
    with pytest.raises(ValueError, match="distinct"):
        RTPurboAttention(LayerShape(0, 4, 2, 16), RTPurboConfig(), [0, 0])
    b = RTPurboAttention(LayerShape(0, 4, 2, 16), RTPurboConfig(impl="triton"))
    assert b.validate_configuration(dtype=torch.int8, device=torch.device("cpu"))


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (n,), generator=g).tolist() for n in [5, 17, 3, 30, 9]]


def _engine(model, **kw):
    cfg = dict(max_rows=4, max_prompt_len=64, max_new_tokens=24, compile=False, block_steps=3)
    cfg.update(kw)
    return RolloutEngine(model, EngineConfig(**cfg))


def test_engine_greedy_equals_dense_at_p1_and_compiles_without_graph_breaks():
    dense = random_tiny("qwen2")
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    ref = _engine(dense).generate(_prompts(), 2, params)
    sparse = use_attention(copy.deepcopy(dense), rtpurbo_attention(None, None, _cfg(top_p=1.0, impl="reference",
                                                                                   window=16)))
    eng = _engine(sparse, compile=True, compile_backend="eager", max_rows=8)
    out = eng.generate(_prompts(), 2, params)
    assert [s.tokens.tolist() for s in out] == [s.tokens.tolist() for s in ref]
    explain = torch._dynamo.explain(decode_step)(eng.state, torch.tensor([0, 1, 2, eng.scratch]))
    assert explain.graph_break_count == 0 and explain.graph_count == 1


def test_engine_generates_with_a_sparse_profile():
    dense = random_tiny("qwen2")
    prof = HeadProfile.from_scores(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), 0.5)
    sparse = use_attention(copy.deepcopy(dense), rtpurbo_attention(prof, None, _cfg(top_p=0.8, impl="reference",
                                                                                   window=8)))
    params = SamplingParams(temperature=1.0, max_new_tokens=20, seed=3)
    out = _engine(sparse).generate(_prompts(), 3, params)
    assert len(out) == 15 and all(s.length == 20 for s in out)
    assert all(torch.isfinite(s.logprobs).all() for s in out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_engine_with_triton_kernels_compiled_and_graphed():
    dense = random_tiny("qwen2", num_heads=8, num_kv_heads=4, embed_dim=256).cuda()  # head_dim 32
    prof = HeadProfile.from_scores(torch.rand(2, 4), 0.25)
    cfg = RTPurboConfig(**SMALL, top_p=1.0, window=16)
    sparse = use_attention(copy.deepcopy(dense), rtpurbo_attention(HeadProfile.uniform(2, 4), None, cfg)).cuda()
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    ref = _engine(dense, compile=False, cuda_graphs=False).generate(_prompts(), 2, params)
    eng = _engine(sparse, compile=True, cuda_graphs=True)
    out = eng.generate(_prompts(), 2, params)
    # fp32 tl.dot runs in tf32 on the GPU: allow rare greedy flips at near-ties
    same = sum(a == b for x, y in zip(out, ref) for a, b in zip(x.tokens.tolist(), y.tokens.tolist()))
    assert same >= 0.9 * sum(s.length for s in ref)
    explain = torch._dynamo.explain(decode_step)(eng.state, torch.tensor([0, 1, 2, eng.scratch], device="cuda"))
    assert explain.graph_break_count == 0
    sparse2 = use_attention(copy.deepcopy(dense), rtpurbo_attention(prof, None, RTPurboConfig(**SMALL, top_p=0.9,
                                                                                             window=16))).cuda()
    out2 = _engine(sparse2, compile=True, cuda_graphs=True).generate(_prompts(), 2, params)
    assert len(out2) == 10


@pytest.mark.slow
def test_engine_compiles_the_triton_path_with_inductor_and_a_drafter():
    """The GPU configuration of an all-on rollout, on the CPU: RTPurbo's Triton decode (the interpreter) inside
    decode, draft and verify steps compiled by Inductor, with a speculative drafter; greedy output equals the
    uncompiled reference path's. (Inductor tracing the RTPurbo Triton kernels itself broke this on the GPU.)"""
    from sparrow.speculative import AlwaysOn, DrafterConfig, QuantizedSelfDrafter

    dense = random_tiny("qwen2")
    prof = HeadProfile.from_scores(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), 0.5)
    outs = []
    for impl, compile_ in (("reference", False), ("triton", True)):
        sparse = use_attention(copy.deepcopy(dense), rtpurbo_attention(prof, None, _cfg(top_p=0.8, impl=impl,
                                                                                       window=8))).to(_device(impl))
        eng = RolloutEngine(sparse, EngineConfig(max_rows=4, max_prompt_len=64, max_new_tokens=12, block_steps=3,
                                                 compile=compile_, max_draft=2),
                            drafter=QuantizedSelfDrafter(sparse, DrafterConfig(weight="none")))
        eng.toggle = AlwaysOn(2)
        outs.append(eng.generate(_prompts()[:3], 1, SamplingParams(temperature=0.0, max_new_tokens=12)))
    assert [s.tokens.tolist() for s in outs[1]] == [s.tokens.tolist() for s in outs[0]]

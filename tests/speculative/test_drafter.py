"""The quantized self-drafter: sharing, quantization, in-place refresh, windowed draft attention."""

import pytest
import torch

from sparrow.attention.base import DecodeMeta
from sparrow.attention.dense import DenseAttention
from sparrow.rollout import EngineConfig, RolloutEngine, SamplingParams
from sparrow.rollout.forward import decode_hidden, logits_from_hidden, prefill_hidden
from sparrow.attention.base import CacheSpec, PrefillMeta
from sparrow.kernels.int8_linear import Int8Linear
from sparrow.speculative.drafter import DrafterConfig, QuantizedSelfDrafter
from sparrow.speculative.toggle import AlwaysOn
from sparrow.speculative.window import WindowedDraftAttention
from tests.helpers import random_tiny
from tests.speculative.common import prompts


def _caches_with_prompts(model, ps, gen_len=16):
    """Prefill ``ps`` into fresh caches (prefix slot i, generation slot i); returns caches and metadata."""
    attn = [layer.attn for layer in model.layers]
    spec = CacheSpec(len(ps), max(len(p) for p in ps), len(ps), gen_len)
    caches = [a.backend.init_cache(spec, dtype=torch.float32, device=torch.device("cpu")) for a in attn]
    lens = torch.tensor([len(p) for p in ps])
    toks = torch.zeros(len(ps), int(lens.max()), dtype=torch.int64)
    for i, p in enumerate(ps):
        toks[i, : len(p)] = torch.tensor(p)
    slots = torch.arange(len(ps))
    with torch.no_grad():
        prefill_hidden(model, toks, caches, PrefillMeta(slots, lens))
    last = toks[slots, lens - 1]
    return caches, DecodeMeta(slots, slots, lens - 1, torch.zeros_like(lens)), last


def test_drafter_shares_everything_but_quantized_linears():
    model = random_tiny("qwen2")
    d = QuantizedSelfDrafter(model, DrafterConfig(fuse=False))
    assert d.weight_format == "int8"
    assert d.tok_embeddings is model.tok_embeddings and d.norm is model.norm and d.output is model.output
    for dl, tl in zip(d.layers, model.layers):
        assert dl.sa_norm is tl.sa_norm and dl.mlp_norm is tl.mlp_norm
        assert dl.attn.pos_embeddings is tl.attn.pos_embeddings and dl.attn.backend is tl.attn.backend
        assert dl.attn.q_proj.bias is tl.attn.q_proj.bias  # qwen2 q/k/v biases are shared, not copied
        assert dl.attn.q_proj is not tl.attn.q_proj
        assert isinstance(dl.attn.q_proj, Int8Linear) and dl.attn.q_proj.qweight.dtype == torch.int8
        assert type(tl.attn.q_proj.weight) is torch.nn.Parameter  # the target is untouched
        assert tl.attn.qkv_proj is None
    assert len(d.quantized_weights()) == 7 * len(model.layers)
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    assert d.weight_nbytes() < full


def test_fused_int8_drafter_has_the_separate_codes_in_fewer_linears():
    """The default int8 drafter computes q/k/v with one linear and the MLP's gate/up with another: the codes and
    scales are the separate linears' stacked (per-output-channel quantization), bit for bit, and the draft
    logits match the unfused drafter's; the target keeps its separate projections."""
    model = random_tiny("qwen2", std=0.1)
    ps = prompts()
    fused, sep = QuantizedSelfDrafter(model), QuantizedSelfDrafter(model, DrafterConfig(fuse=False))
    assert len(fused.quantized_weights()) == 4 * len(model.layers)
    for fl, sl, tl in zip(fused.layers, sep.layers, model.layers):
        qkv = fl.attn.qkv_proj
        assert fl.attn.q_proj is None and tl.attn.qkv_proj is None and isinstance(tl.attn.q_proj, torch.nn.Linear)
        assert torch.equal(qkv.qweight, torch.cat([sl.attn.q_proj.qweight, sl.attn.k_proj.qweight,
                                                  sl.attn.v_proj.qweight]))
        assert torch.equal(qkv.scale.view(torch.int32), torch.cat(
            [sl.attn.q_proj.scale, sl.attn.k_proj.scale, sl.attn.v_proj.scale]).view(torch.int32))
        assert torch.equal(qkv.bias, torch.cat([tl.attn.q_proj.bias, tl.attn.k_proj.bias, tl.attn.v_proj.bias]))
        assert torch.equal(fl.mlp.gate_up.qweight, torch.cat([sl.mlp.w1.qweight, sl.mlp.w3.qweight]))
    torch.testing.assert_close(_draft_logits(fused, model, ps), _draft_logits(sep, model, ps), rtol=1e-5, atol=1e-5)
    # a step reads the same bytes: the fused bias copies stand in for the shared q/k/v biases
    assert fused.weight_nbytes() == sep.weight_nbytes()


def _draft_logits(d, model, ps):
    caches, meta, last = _caches_with_prompts(model, ps)
    with torch.no_grad():
        return d.forward_logits(last[:, None], caches, meta)[:, 0]


def _target_logits(model, ps):
    caches, meta, last = _caches_with_prompts(model, ps)
    with torch.no_grad():
        return logits_from_hidden(model, decode_hidden(model, last[:, None], caches, meta))[:, 0]


def test_int8_draft_is_close_to_target():
    model = random_tiny("qwen2", std=0.1)
    ps = prompts()
    d = QuantizedSelfDrafter(model)
    q, p = torch.softmax(_draft_logits(d, model, ps), -1), torch.softmax(_target_logits(model, ps), -1)
    tv = 0.5 * (q - p).abs().sum(-1)
    assert float(tv.max()) < 0.05
    same = QuantizedSelfDrafter(model, DrafterConfig(weight="none"))  # unquantized, full attention: the target
    assert torch.allclose(_draft_logits(same, model, ps), _target_logits(model, ps), atol=1e-5)


def test_refresh_keeps_storage_and_follows_new_weights():
    model = random_tiny("qwen2", std=0.1)
    ps = prompts()
    d = QuantizedSelfDrafter(model)
    ptrs = {n: [t.data_ptr() for t in ts] for n, ts in d.quantized_weights().items()}
    before = _draft_logits(d, model, ps)
    with torch.no_grad():  # a weight sync: the target's tensors change in place
        g = torch.Generator().manual_seed(3)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    stale = _draft_logits(d, model, ps)
    d.refresh()
    assert d.last_refresh_s > 0
    after = _draft_logits(d, model, ps)
    fresh = _draft_logits(QuantizedSelfDrafter(model), model, ps)
    assert {n: [t.data_ptr() for t in ts] for n, ts in d.quantized_weights().items()} == ptrs
    assert torch.equal(after, fresh)  # exactly what a drafter built from the new weights computes
    assert not torch.allclose(after, before, atol=1e-3)
    assert not torch.equal(after, stale)


def test_refresh_inside_an_engine_keeps_it_exact():
    model = random_tiny("qwen2")
    d = QuantizedSelfDrafter(model)
    cfg = dict(max_rows=4, max_prompt_len=64, max_new_tokens=12, compile=True, compile_backend="eager", block_steps=3)
    eng = RolloutEngine(model, EngineConfig(**cfg, max_draft=3), drafter=d, toggle=AlwaysOn(3))
    p = SamplingParams(temperature=0.0, max_new_tokens=12)
    eng.generate(prompts(), 1, p)
    with torch.no_grad():
        g = torch.Generator().manual_seed(4)
        for prm in model.parameters():
            prm.add_(torch.randn(prm.shape, generator=g) * 0.1)
    d.refresh()
    got = eng.generate(prompts(), 1, p)
    ref = RolloutEngine(model, EngineConfig(**{**cfg, "compile": False})).generate(prompts(), 1, p)
    assert [s.tokens.tolist() for s in got] == [s.tokens.tolist() for s in ref]
    assert got.stats.acceptance_rate > 0.5


def test_unavailable_formats_fall_back_or_raise():
    model = random_tiny("qwen2")
    if torch.cuda.is_available():
        pytest.skip("int4 / fp8 may be available on CUDA")
    with pytest.warns(RuntimeWarning, match="using int8"):
        d = QuantizedSelfDrafter(model, DrafterConfig(weight="int4"))
    assert d.weight_format == "int8"
    with pytest.raises(RuntimeError, match="cannot run"):
        QuantizedSelfDrafter(model, DrafterConfig(weight="int4", fallback=False))


def test_drafter_config_validation():
    for kw, field in ((dict(weight="int3"), "weight"), (dict(group_size=100), "group_size"),
                      (dict(window=0), "window"), (dict(sink=-1), "sink")):
        with pytest.raises(ValueError, match=field):
            DrafterConfig(**kw)
    model = random_tiny("qwen2")
    from sparrow.models import use_attention

    class OtherDense(DenseAttention):
        pass

    use_attention(model, lambda shape: WindowedDraftAttention(shape, window=4))
    with pytest.raises(ValueError, match="DenseAttention"):
        QuantizedSelfDrafter(model, DrafterConfig(window=8))
    del OtherDense


# --------------------------------------------------------------------------------- window
def test_window_covering_everything_equals_dense_attention():
    model = random_tiny("qwen2", std=0.1)
    ps = prompts()
    wide = QuantizedSelfDrafter(model, DrafterConfig(weight="none", window=64, sink=0))
    assert torch.allclose(_draft_logits(wide, model, ps), _target_logits(model, ps), atol=1e-4)
    narrow = QuantizedSelfDrafter(model, DrafterConfig(weight="none", window=3, sink=1))
    assert not torch.allclose(_draft_logits(narrow, model, ps), _target_logits(model, ps), atol=1e-3)

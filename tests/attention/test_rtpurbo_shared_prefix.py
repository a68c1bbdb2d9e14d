"""RTPurbo's local heads on the shared-prefix kernel (a group's sinks + prompt window read once), retrieval heads on
their own selection: the same attention as the masked full forward, and the same selection statistics."""

import pytest

from sparrow.attention.rtpurbo import RTPurboAttention, collect_selection_stats
from tests.attention.test_rtpurbo import _cached_vs_full, _cfg, _device, _masked_forward
from tests.helpers import random_tiny


@pytest.mark.parametrize("impl,T,steps,retrieval", [("reference", 3, 4, [1]), ("triton", 2, 2, [1])],
                         ids=["reference-T3", "triton-T2"])
def test_shared_prefix_local_heads_equal_masked_attention(impl, T, steps, retrieval):
    """Rings that wrap (8-token window), rows 1 and 2 sharing a prompt: cached decode through the shared-prefix path
    equals a full forward whose local heads are masked to sinks + window (retrieval heads at top_p = 1: dense)."""
    cfg = _cfg(top_p=1.0, impl=impl, window=8, shared_prefix=True)
    model = random_tiny("qwen2", attention=lambda s: RTPurboAttention(s, cfg, retrieval))
    assert _cached_vs_full(model.to(_device(impl)), T=T, steps=steps, full=_masked_forward) < 1e-4


def test_shared_prefix_path_records_the_same_selection():
    """Selection statistics are recorded on the shared-prefix path too, and equal the one-call path's (the retrieval
    heads' selection does not depend on how local heads decode)."""
    stats = []
    for shared in (False, True):
        model = random_tiny("qwen2", attention=lambda s, shared=shared: RTPurboAttention(
            s, _cfg(top_p=0.3, impl="reference", window=8, shared_prefix=shared), [0]))
        for layer in model.layers:
            layer.attn.backend.enable_stats()
        _cached_vs_full(model, T=1, steps=3, plens=(40, 36))
        stats.append(collect_selection_stats(model))
    assert stats[0] == stats[1] and stats[0]["decode_ret_visible"] > 0


def test_engine_with_shared_prefix_local_heads_compiles_without_graph_breaks():
    """The engine's compiled step (``fullgraph=True``) through the shared-prefix path of a layer with both kinds of
    heads gives the tokens of the eager one-call path."""
    from sparrow.models import use_attention
    from sparrow.rollout import EngineConfig, RolloutEngine, SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=5, seed=4)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [2, 7]]
    outs = []
    for shared, compile in ((False, False), (True, True)):
        model = use_attention(random_tiny("qwen2"), lambda s, shared=shared: RTPurboAttention(
            s, _cfg(top_p=0.7, impl="reference", window=8, shared_prefix=shared), [1]))
        eng = RolloutEngine(model, EngineConfig(max_rows=8, max_prompt_len=16, max_new_tokens=5, block_steps=3,
                                                batch_buckets=(8,), compile=compile, compile_backend="eager"))
        outs.append([s.tokens.tolist() for s in eng.generate(prompts, 3, params)])
    assert outs[0] == outs[1]  # the compiled engine ran: fullgraph=True raises on any graph break

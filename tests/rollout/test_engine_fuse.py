"""The rollout engine with fused projections (``EngineConfig.fuse_projections``): the same samples as with separate
projections, weight sync and drafter refresh through the parameters' names, four matmuls a layer in the decode
step's graph, and Inductor's residual-add + RMSNorm kernels.

Exactness tested (fp32, CPU): identical tokens, log-probs within 1e-5 of the unfused engine's."""

from __future__ import annotations

import collections
import copy
import re

import pytest
import torch

from sparrow.models import fused_projections, policy_parameters
from sparrow.rollout import EngineConfig, RolloutEngine, SamplingParams, generate_reference
from sparrow.rollout.steps import decode_step
from sparrow.speculative import DrafterConfig, QuantizedSelfDrafter
from sparrow.speculative.toggle import AlwaysOn
from sparrow.sync import InProcessTransport, SyncReceiver, SyncSender
from sparrow.kernels.int8_linear import Int8Linear
from sparrow.models.fuse import FusedLinear
from tests.helpers import bits_equal, random_tiny

PARAMS = [
    pytest.param(SamplingParams(temperature=0.0, max_new_tokens=12), id="greedy"),
    pytest.param(SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=12, stop_token_ids=(5,), seed=3),
                 id="sampled"),
]


def _prompts(vocab=64, lens=(5, 17, 3, 9), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _engine(model, fuse=True, drafter=None, **kw):
    cfg = dict(max_rows=4, max_prompt_len=32, max_new_tokens=12, compile=False, block_steps=3,
               fuse_projections=fuse)
    cfg.update(kw)
    if drafter is not None:
        cfg.setdefault("max_draft", 3)
    return RolloutEngine(model, EngineConfig(**cfg), drafter=drafter, toggle=AlwaysOn(3) if drafter else None)


def _assert_same(got, ref, lp_tol=1e-5):
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert a.tokens.tolist() == b.tokens.tolist() and a.finish_reason == b.finish_reason
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=lp_tol)


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("family,compiled", [pytest.param("qwen2", False, id="qwen2"),
                                             pytest.param("llama3", False, id="llama3"),
                                             pytest.param("qwen2", True, id="qwen2-compiled")])
def test_fused_engine_samples_what_the_unfused_one_does(family, compiled, params):
    model = random_tiny(family)
    kw = dict(compile=True, compile_backend="eager") if compiled else {}
    fused = _engine(copy.deepcopy(model), **kw)
    assert len(fused_projections(fused.model)) == 2 * len(model.layers)
    unfused = _engine(model, fuse=False)
    assert fused_projections(model) == {}
    got = fused.generate(_prompts(), 2, params).samples
    _assert_same(got, unfused.generate(_prompts(), 2, params).samples)
    _assert_same(got, generate_reference(model, _prompts(), 2, params))


def test_the_flag_fuses_or_unfuses_and_keys_the_compile():
    model = random_tiny("qwen2")
    fused = _engine(model)
    assert len(fused_projections(model)) == 2 * len(model.layers)
    key = fused.compile_key()
    ptrs = [p.data_ptr() for p in model.parameters()]
    unfused = _engine(model, fuse=False)  # structurally unfused: the storage is kept
    assert fused_projections(model) == {} and [p.data_ptr() for p in model.parameters()] == ptrs
    other = unfused.compile_key()
    assert key["model"] != other["model"] and key["engine"] != other["engine"]
    with pytest.raises(ValueError, match="fuse_projections must be a bool, got 'yes'"):
        EngineConfig(fuse_projections="yes")


def _perturb_(model, seed, frac=0.05):
    """A sparse update of every parameter, as a trainer step followed by a bf16-exact sync would bring."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            mask = torch.rand(p.shape, generator=g) < frac
            p.add_(mask * torch.randn(p.shape, generator=g) * 0.2)


@pytest.mark.parametrize("codec", ["auto", "dense"])
def test_sync_apply_is_bit_exact_and_generation_follows(codec):
    trainer = random_tiny("qwen2")
    rollout = copy.deepcopy(trainer)
    eng = _engine(rollout, compile=True, compile_backend="eager")
    p = SamplingParams(temperature=1.0, max_new_tokens=12, seed=7)
    eng.generate(_prompts(), 2, p)  # compiled before the sync
    receiver = SyncReceiver(policy_parameters(rollout))  # after the engine fused the model
    sender = SyncSender({n: t.detach().clone() for n, t in policy_parameters(trainer).items()}, codec=codec)
    tr = InProcessTransport()
    ptrs = {n: t.data_ptr() for n, t in list(rollout.named_parameters()) + list(rollout.named_buffers())}
    for version in (1, 2):
        _perturb_(trainer, seed=version)
        sender.send({n: t.detach() for n, t in policy_parameters(trainer).items()}, tr)
        receiver.receive(tr)
        mine = policy_parameters(rollout)
        assert all(bits_equal(mine[n], t.detach()) for n, t in policy_parameters(trainer).items())
        # written in place, by name: the fused buffers are the same storage, read by the compiled step
        assert {n: t.data_ptr() for n, t in list(rollout.named_parameters()) + list(rollout.named_buffers())} == ptrs
        assert len(fused_projections(rollout)) == 2 * len(rollout.layers)
        _assert_same(eng.generate(_prompts(), 2, p).samples,
                     _engine(copy.deepcopy(trainer), fuse=False).generate(_prompts(), 2, p).samples)


DRAFTERS = [pytest.param(DrafterConfig(), id="int8-fused"), pytest.param(DrafterConfig(fuse=False), id="int8"),
            pytest.param(DrafterConfig(weight="none", window=8), id="none-window")]


@pytest.mark.parametrize("order", ["drafter-first", "engine-first"])
@pytest.mark.parametrize("dcfg", DRAFTERS)
def test_drafter_and_refresh_with_a_fused_target(dcfg, order):
    model = random_tiny("qwen2", std=0.1)
    ref = copy.deepcopy(model)
    p = SamplingParams(temperature=0.0, max_new_tokens=12)
    if order == "drafter-first":  # as the GRPO recipe builds them
        drafter = QuantizedSelfDrafter(model, dcfg)
        eng = _engine(model, drafter=drafter)
    else:
        _engine(model)  # fuses the model
        drafter = QuantizedSelfDrafter(model, dcfg)
        eng = _engine(model, drafter=drafter)
        for layer in drafter.layers:  # a draft copy is fused only where its linears are the target's
            qkv = layer.attn.qkv_proj
            if dcfg.weight == "none":
                assert isinstance(qkv, FusedLinear)
                assert len(fused_projections(drafter.layers)) == 2 * len(model.layers)
            elif dcfg.fuse:
                assert isinstance(qkv, Int8Linear) and layer.attn.q_proj is None
            else:
                assert qkv is None and isinstance(layer.attn.q_proj, Int8Linear)
                assert fused_projections(drafter.layers) == {}
    assert len(fused_projections(model)) == 2 * len(model.layers)
    out = eng.generate(_prompts(), 1, p)
    _assert_same(out.samples, _engine(ref, fuse=False).generate(_prompts(), 1, p).samples)
    assert out.stats.draft_proposed > 0 and out.stats.acceptance_rate > 0.3
    for m, seed in ((model, 4), (ref, 4)):  # a weight sync: in place, by name
        _perturb_(m, seed, frac=0.5)
    drafter.refresh()
    fresh = QuantizedSelfDrafter(copy.deepcopy(ref), dcfg)  # a drafter built from the new weights, unfused
    for name, tensors in drafter.quantized_weights().items():
        assert all(torch.equal(a, b) for a, b in zip(tensors, fresh.quantized_weights()[name])), name
    # the int8 q / k / v biases (copies when the drafter was built first, views when after) follow the sync too
    biases = [(n, d.bias, f.bias) for (n, _, d), (_, _, f) in zip(drafter._pairs, fresh._pairs)
              if isinstance(d, Int8Linear) and d.bias is not None]
    assert (dcfg.weight == "none" or not dcfg.fuse) or biases
    assert all(torch.equal(a, b) for _, a, b in biases), [n for n, a, b in biases if not torch.equal(a, b)]
    out = eng.generate(_prompts(), 1, p)
    _assert_same(out.samples, _engine(ref, fuse=False).generate(_prompts(), 1, p).samples)
    assert out.stats.acceptance_rate > 0.3


# ------------------------------------------------------------------------------------ graph and kernels
def _decode_graph_counts(family, fuse, num_layers=3):
    """(linear calls per layer in the decode step's Dynamo graph, by layer index; aten mm / addmm nodes in its
    AOT inference graph)."""
    from torch._dynamo.backends.common import aot_autograd

    model = random_tiny(family, num_layers=num_layers)
    eng = _engine(model, fuse=fuse)
    eng.generate(_prompts(lens=(4,)), 2, SamplingParams(temperature=0.0, max_new_tokens=2))  # state allocated
    per_layer, aten = collections.Counter(), collections.Counter()

    def count_aten(gm, inputs):
        aten.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    def backend(gm, inputs):
        for n in gm.graph.nodes:
            if n.op == "call_function" and n.target is torch._C._nn.linear:
                m = re.search(r"layers_modules_(\d+)_", n.args[1].name)  # the weight's source
                per_layer[int(m.group(1)) if m else "head"] += 1
        return aot_autograd(fw_compiler=count_aten)(gm, inputs)

    torch._dynamo.reset()
    step = torch.compile(decode_step, backend=backend, fullgraph=True)  # fullgraph: no graph break
    with torch.no_grad():
        step(eng.state, torch.tensor([0, 1, eng.scratch, eng.scratch]))
    return per_layer, aten["aten.mm.default"] + aten["aten.addmm.default"]


@pytest.mark.parametrize("family", ["qwen2", "llama3"])
@pytest.mark.parametrize("fuse,per_layer", [pytest.param(False, 7, id="unfused"), pytest.param(True, 4, id="fused")])
def test_decode_step_has_four_matmuls_a_layer_when_fused(family, fuse, per_layer):
    """q, k, v, o, gate, up, down: 7 linears a layer unfused; qkv, o, gate_up, down: 4 fused (plus the output
    projection once), counted in the compiled decode step's graph."""
    counts, mms = _decode_graph_counts(family, fuse)
    assert counts == {0: per_layer, 1: per_layer, 2: per_layer, "head": 1}
    assert mms == 3 * per_layer + 1


def test_fused_decode_step_compiles_without_graph_breaks():
    model = random_tiny("qwen2")
    eng = _engine(model, compile=True, compile_backend="eager", max_rows=8)
    eng.generate(_prompts(), 2, SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=4))
    explain = torch._dynamo.explain(decode_step)(eng.state, torch.tensor([0, 1, 2, eng.scratch]))
    assert explain.graph_break_count == 0 and explain.graph_count == 1


@pytest.mark.slow
def test_inductor_fuses_each_residual_add_with_the_next_rms_norm():
    """In Inductor's code for the fused decode step (CPU), between a layer's output projection and its gate / up
    projection, and between its down projection and the next matmul, runs exactly one generated kernel, computing
    the residual add and the next RMSNorm (``add`` ... ``rsqrt`` in its name)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.utils import run_and_get_code

    layers = 2
    model = random_tiny("qwen2", num_layers=layers)
    eng = _engine(model)
    eng.generate(_prompts(lens=(4,)), 2, SamplingParams(temperature=0.0, max_new_tokens=2))
    torch._dynamo.reset()
    with inductor_config.patch({"triton.descriptive_names": "original_aten", "fx_graph_cache": False}):
        step = torch.compile(decode_step, fullgraph=True, backend="inductor")
        with torch.no_grad():
            _, codes = run_and_get_code(step, eng.state, torch.tensor([0, 1, eng.scratch, eng.scratch]))
    call = codes[-1][codes[-1].index("def call("):]
    launches = re.findall(r"^\s+(?:\w+ = )?(extern_kernels\.(?:mm|addmm)|cpp_fused_\w+|torch\.ops\.aten\.\w+)\(",
                          call, re.M)
    mm_at = [i for i, name in enumerate(launches) if name.startswith("extern_kernels.")]
    assert len(mm_at) == 4 * layers + 1, launches  # qkv, o, gate_up, down per layer; the output projection
    for layer in range(layers):
        qkv, o, gate_up, down, nxt = mm_at[4 * layer: 4 * layer + 5]
        for a, b in ((o, gate_up), (down, nxt)):
            between = launches[a + 1:b]
            assert len(between) == 1 and "add" in between[0] and "rsqrt" in between[0], between

"""Fused q / k / v and gate / up projections (``sparrow.models.fuse_projections_``): the same model, every
parameter name and object kept, in-place writes by name reaching the fused matmul.

What is tested for exactness: fp32 on the CPU, the fused model's logits against the unfused model's within 1e-5
(absolute and relative), and the same greedy / sampled tokens (tests/rollout/test_engine_fuse.py). Bit equality
of a matmul over concatenated rows with separate matmuls is not assumed; gradients (the fused module runs its
separate linears when they are needed) are compared bit for bit."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn
from torchtune.modules import FeedForward

from sparrow.kernels.int8_linear import Int8Linear
from sparrow.models import (FusedFeedForward, FusedLinear, fuse_projections_, fused_projections, policy_parameters,
                            unfuse_projections_)
from tests.helpers import random_tiny

# (family, builder kwargs): GQA 2:1, MQA with odd sizes, MHA, Llama-3 without biases
SHAPES = [
    pytest.param("qwen2", {}, id="qwen2-gqa"),
    pytest.param("qwen2", dict(num_heads=5, num_kv_heads=1, embed_dim=60, intermediate_dim=97), id="qwen2-mqa-odd"),
    pytest.param("llama3", {}, id="llama3-gqa"),
    pytest.param("llama3", dict(num_heads=3, num_kv_heads=3, embed_dim=36, intermediate_dim=51, num_layers=3),
                 id="llama3-mha-odd"),
]
FUSED_NAMES = ("attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight", "attn.q_proj.bias",
               "attn.k_proj.bias", "attn.v_proj.bias", "mlp.w1.weight", "mlp.w3.weight")


def _tokens(vocab=64, shape=(3, 11), seed=0):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _logits(model, tokens):
    with torch.no_grad():
        return model(tokens)


def _pair(family="qwen2", **kw):
    model = random_tiny(family, **kw)
    return fuse_projections_(copy.deepcopy(model)), model


@pytest.mark.parametrize("family,kw", SHAPES)
def test_fused_model_computes_the_unfused_logits(family, kw):
    fused, ref = _pair(family, **kw)
    assert len(fused_projections(fused)) == 2 * len(fused.layers)
    for layer in fused.layers:
        assert isinstance(layer.attn.qkv_proj, FusedLinear) and isinstance(layer.mlp, FusedFeedForward)
        a = layer.attn
        assert a.qkv_proj.split_sizes == (a.num_heads * a.head_dim,) + (a.num_kv_heads * a.head_dim,) * 2
        assert (a.qkv_proj.bias is not None) == (family == "qwen2")
    torch.testing.assert_close(_logits(fused, _tokens()), _logits(ref, _tokens()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family,kw", SHAPES)
def test_names_shapes_order_and_parameter_objects_are_kept(family, kw):
    model = random_tiny(family, **kw)
    before_sd = {k: v.clone() for k, v in model.state_dict().items()}
    before = list(model.named_parameters())
    fuse_projections_(model)
    after = list(model.named_parameters())
    assert [n for n, _ in after] == [n for n, _ in before]
    assert all(p is q for (_, p), (_, q) in zip(after, before))  # the same objects: an optimizer's stay valid
    assert len({id(p) for p in model.parameters()}) == len(before)  # no duplicates, no new parameters
    sd = model.state_dict()
    assert list(sd) == list(before_sd)
    assert all(sd[k].shape == v.shape and torch.equal(sd[k], v) for k, v in before_sd.items())
    assert list(policy_parameters(model)) == [n for n, _ in before]
    # the fused tensors are non-persistent buffers: in no state dict, not parameters
    fused_buffers = [n for n, _ in model.named_buffers() if ".qkv_proj." in n or ".gate_up." in n]
    assert len(fused_buffers) == len(model.layers) * (3 if family == "qwen2" else 2)
    for layer in model.layers:  # every fused parameter is contiguous (the sync receiver needs that)
        for name in FUSED_NAMES:
            t = layer.get_parameter(name) if family == "qwen2" or "bias" not in name else None
            assert t is None or (t.is_contiguous() and t._base is None and t.is_leaf)


def _write_by_name(model, seed=5):
    """What a weight sync does: every fused parameter (and one that is not) rewritten in place, by name."""
    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in sorted(params):
            if name.endswith(FUSED_NAMES) or name.endswith("attn.output_proj.weight"):
                params[name].copy_(torch.randn(params[name].shape, generator=g) * 0.3)


def _writes_reach_the_forward(model, ref) -> bool:
    """The core invariant: after in-place writes by name, ``model`` computes what ``ref`` (unfused, same writes)
    computes."""
    _write_by_name(model)
    _write_by_name(ref)
    return torch.allclose(_logits(model, _tokens()), _logits(ref, _tokens()), rtol=1e-5, atol=1e-5)


class _CopyingFusedLinear(nn.Module):
    """Negative control: a fusion that copies the weights instead of viewing them."""

    def __init__(self, parts):
        super().__init__()
        self.register_buffer("weight", torch.cat([p.weight.detach() for p in parts]), persistent=False)
        bias = None if parts[0].bias is None else torch.cat([p.bias.detach() for p in parts])
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight, self.bias)


@pytest.mark.parametrize("family", ["qwen2", "llama3"])
def test_in_place_writes_by_name_reach_the_fused_matmul(family):
    fused, ref = _pair(family)
    assert _writes_reach_the_forward(fused, ref)
    # negative control: the same structure with copied weights computes the old weights after the writes
    copied, ref = random_tiny(family), random_tiny(family)
    for layer in copied.layers:
        layer.attn.qkv_proj = _CopyingFusedLinear([layer.attn.q_proj, layer.attn.k_proj, layer.attn.v_proj])
    assert torch.allclose(_logits(copied, _tokens()), _logits(ref, _tokens()), rtol=1e-5, atol=1e-5)
    assert not _writes_reach_the_forward(copied, ref)
    assert fused_projections(copied) == {}  # and is not taken for a live fusion


def test_idempotent_and_unfuse_round_trip_keep_the_storage():
    model = random_tiny("qwen2")
    fuse_projections_(model)
    mods = dict(fused_projections(model))
    ptrs = {n: m.weight.data_ptr() for n, m in mods.items()}
    fuse_projections_(model)
    assert fused_projections(model) == mods  # the same modules: nothing re-fused
    unfuse_projections_(model)
    assert fused_projections(model) == {} and model.layers[0].attn.qkv_proj is None
    assert type(model.layers[0].mlp) is FeedForward
    assert model.layers[0].attn.q_proj.weight.data_ptr() == ptrs["layers.0.attn.qkv_proj"]  # storage kept
    fuse_projections_(model)  # fused back onto the same storage, no copy
    assert {n: m.weight.data_ptr() for n, m in fused_projections(model).items()} == ptrs
    unfuse_projections_(model)
    ref = random_tiny("qwen2")
    assert _writes_reach_the_forward(model, ref)


def test_a_replaced_parameter_goes_stale_and_is_fused_again():
    fused, ref = _pair("llama3")
    q = fused.layers[1].attn.q_proj
    q.weight = nn.Parameter(q.weight.detach() * 2)  # cut off from the fused storage
    assert "layers.1.attn.qkv_proj" not in fused_projections(fused)
    assert len(fused_projections(fused)) == 2 * len(fused.layers) - 1
    fuse_projections_(fused)  # re-fused from the parameters' current values
    assert len(fused_projections(fused)) == 2 * len(fused.layers)
    with torch.no_grad():
        ref.layers[1].attn.q_proj.weight.mul_(2)
    assert _writes_reach_the_forward(fused, ref)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize("how", ["to-float64", "deepcopy", "pickle"])
def test_conversions_and_copies_keep_the_views(how):
    fused, ref = _pair("qwen2")
    if how == "to-float64":
        fused, ref = fused.to(torch.float64), ref.to(torch.float64)
        assert fused.layers[0].attn.qkv_proj.weight.dtype == torch.float64
    elif how == "deepcopy":
        fused = copy.deepcopy(fused)
    else:
        buf = io.BytesIO()
        torch.save(fused, buf)
        buf.seek(0)
        fused = torch.load(buf, weights_only=False)
    assert len(fused_projections(fused)) == 2 * len(fused.layers)
    g = torch.Generator().manual_seed(5)
    for m in (fused, ref):
        params = dict(m.named_parameters())
        with torch.no_grad():
            for name in sorted(params):
                if name.endswith(FUSED_NAMES):
                    params[name].copy_(torch.randn(params[name].shape, generator=g.manual_seed(5)))
    torch.testing.assert_close(_logits(fused, _tokens()), _logits(ref, _tokens()), rtol=1e-5, atol=1e-5)


def test_state_dict_round_trip():
    fused, _ = _pair("qwen2")
    other = random_tiny("qwen2", seed=7)
    ptrs = [p.data_ptr() for p in fused.parameters()]
    fused.load_state_dict(other.state_dict(), strict=True)  # in place, into the fused storage
    assert [p.data_ptr() for p in fused.parameters()] == ptrs
    assert len(fused_projections(fused)) == 2 * len(fused.layers)
    torch.testing.assert_close(_logits(fused, _tokens()), _logits(other, _tokens()), rtol=1e-5, atol=1e-5)
    back = random_tiny("qwen2", seed=3)
    back.load_state_dict(fused.state_dict(), strict=True)  # and a fused model's state dict loads unfused
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), other.state_dict().values()))


@pytest.mark.parametrize("family", ["qwen2", "llama3"])
def test_gradients_equal_the_unfused_models(family):
    fused, ref = _pair(family)
    tokens, target = _tokens(), _tokens(seed=1)
    for m in (fused, ref):
        m.train().requires_grad_(True)
        loss = nn.functional.cross_entropy(m(tokens).flatten(0, 1), target.flatten())
        loss.backward()
    ref_grads = dict(ref.named_parameters())
    for name, p in fused.named_parameters():
        assert p.grad is not None and torch.equal(p.grad, ref_grads[name].grad), name
    # an optimizer step writes the parameters in place: the fused (inference) matmul sees it
    for m in (fused, ref):
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    assert len(fused_projections(fused)) == 2 * len(fused.layers)
    fused.eval(), ref.eval()
    torch.testing.assert_close(_logits(fused, _tokens()), _logits(ref, _tokens()), rtol=1e-5, atol=1e-5)


class _MyLinear(nn.Linear):
    pass


def _lora(layer):
    from torchtune.modules.peft import LoRALinear

    layer.attn.k_proj = LoRALinear(64, 32, rank=4, alpha=8, use_bias=True)


def _int8_q(layer):
    layer.attn.q_proj = Int8Linear(layer.attn.q_proj.weight.detach(), layer.attn.q_proj.bias)


def _subclass_w3(layer):
    layer.mlp.w3 = _MyLinear(64, 128, bias=False)


def _drafter_qkv(layer):
    a = layer.attn
    a.qkv_proj = Int8Linear(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach())


def _half_v(layer):
    layer.attn.v_proj.to(torch.float16)


def _bias_mismatch(layer):
    layer.attn.v_proj.bias = None


def _no_up(layer):
    layer.mlp.w3 = None


def _other_mlp(layer):
    layer.mlp = nn.Linear(64, 64)


def _wide_q(layer):
    layer.attn.q_proj = nn.Linear(64, 80)


@pytest.mark.parametrize("breaks,match", [
    pytest.param(_lora, r"layers\.1\.attn\.k_proj is LoRALinear, not a plain torch\.nn\.Linear", id="lora"),
    pytest.param(_int8_q, r"layers\.1\.attn\.q_proj is Int8Linear", id="quantized-module"),
    pytest.param(_subclass_w3, r"layers\.1\.mlp\.w3 is _MyLinear", id="linear-subclass"),
    pytest.param(_drafter_qkv, r"layers\.1\.attn\.qkv_proj is already set to Int8Linear", id="qkv-proj-taken"),
    pytest.param(_half_v, r"layers\.1\.attn\.v_proj is torch\.float16", id="dtype"),
    pytest.param(_bias_mismatch, r"layers\.1\.attn\.v_proj has no bias, layers\.1\.attn\.q_proj has one",
                 id="bias"),
    pytest.param(_no_up, r"layers\.1\.mlp is FeedForward without an up projection", id="no-up-projection"),
    pytest.param(_other_mlp, r"layers\.1\.mlp is Linear, not a gated torchtune FeedForward", id="not-feedforward"),
    pytest.param(_wide_q, r"out_features \(80, 32, 32\), its heads need \(64, 32, 32\)", id="head-sizes"),
])
def test_refuses_what_it_cannot_fuse_and_changes_nothing(breaks, match):
    model = random_tiny("qwen2")
    breaks(model.layers[1])
    with pytest.raises(ValueError, match=match):
        fuse_projections_(model)
    assert fused_projections(model) == {} and model.layers[0].attn.qkv_proj is None  # layer 0 untouched


def test_refuses_a_quantized_weight():
    class Wrapped(torch.Tensor):  # stands in for a quantized tensor subclass
        pass

    model = random_tiny("llama3")
    w = model.layers[0].mlp.w1.weight
    model.layers[0].mlp.w1.weight = nn.Parameter(w.detach().as_subclass(Wrapped), requires_grad=False)
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.w1 has a Parameter weight, not a plain tensor|"
                                         r"layers\.0\.mlp\.w1 has a Wrapped weight"):
        fuse_projections_(model)


def test_refuses_torchtune_attention():
    from torchtune.models.qwen2 import qwen2

    tt = qwen2(vocab_size=64, num_layers=1, num_heads=4, num_kv_heads=2, embed_dim=64, intermediate_dim=128,
               max_seq_len=64)
    with pytest.raises(ValueError, match=r"layers\.0\.attn is MultiHeadAttention, not SparrowAttention"):
        fuse_projections_(tt)


def test_fused_linear_checks_its_parts():
    with pytest.raises(ValueError, match="no linears"):
        FusedLinear([])
    with pytest.raises(ValueError, match="part 1 has in_features=8, part 0 4"):
        FusedLinear([nn.Linear(4, 2), nn.Linear(8, 2)])

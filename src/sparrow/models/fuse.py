"""Fused projections: a layer's q / k / v projections as one matmul, its MLP's gate / up projections as another.

At decode-sized batches (1-8 rows) a step reads each weight once and does little arithmetic on it, so it is
bound by the number of launches more than by bytes: seven projections a layer (q, k, v, o, gate, up, down) are
seven launches. :func:`fuse_projections_` makes them four (qkv, o, gate_up, down) **without renaming or
copying any parameter**: each layer gets one fused weight ``[q + k + v, dim]`` (and bias, where Qwen2 has
q / k / v biases; a :class:`FusedLinear` under ``attn.qkv_proj``) and one ``[2 * hidden, dim]`` for the MLP (a
:class:`FusedFeedForward` under ``mlp``, whose ``gate_up`` is a :class:`FusedLinear`), and ``q_proj.weight``,
``k_proj.weight``, ``v_proj.weight``, ``w1.weight``, ``w3.weight`` (and biases) become *row slices* of that
storage. The Parameter objects stay the same (their ``.data`` is re-pointed), so:

* ``state_dict()`` / ``named_parameters()`` keep every name, shape and order (the fused tensors are
  non-persistent buffers: in no state dict, not parameters, nothing an optimizer or the weight sync sees);
* anything that writes a parameter in place by name (the weight-sync receiver, ``load_state_dict``, an
  optimizer step, :meth:`QuantizedSelfDrafter.refresh <sparrow.speculative.QuantizedSelfDrafter.refresh>` which
  reads them) writes the fused storage, which the fused matmul reads: nothing to re-fuse after a sync;
* the storage is allocated once, when fusing, and never again: compiled steps and captured CUDA graphs that
  read it stay valid.

Only inference uses the fused matmul: with gradients enabled and a part's weight requiring them, a
:class:`FusedLinear` runs its separate linears (gradients land on the named parameters, exactly the unfused
ones). ``module.to(...)`` / ``.cuda()`` / ``.half()``, ``copy.deepcopy`` and pickling keep the views (the fused
module re-points its parts after each). Replacing a parameter object (``load_state_dict(assign=True)``,
``linear.weight = nn.Parameter(...)``) cuts it off from the fused storage: :func:`fuse_projections_` again
re-fuses what is stale. Build a :class:`~sparrow.sync.SyncReceiver` over the parameters after fusing (it keeps
views of their storage); the rollout engine fuses its model when it is made (``EngineConfig.fuse_projections``).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torchtune.modules import FeedForward

from sparrow.models.attention import SparrowAttention

QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("w1", "w3")


def row_concat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(tensors)`` along dim 0, without a copy when the tensors already lie end to end, in order, in one
    contiguous storage (the parts of a fused projection): then a view of it.

    tensors: 1-D [n_i] or 2-D [n_i, in] (same trailing shape, dtype, device) -> [sum n_i] / [sum n_i, in]."""
    t0 = tensors[0]
    row = math.prod(t0.shape[1:])
    shape = (sum(t.shape[0] for t in tensors),) + tuple(t0.shape[1:])
    offset, adjacent = t0.storage_offset(), True
    for t in tensors:
        if (not t.is_contiguous() or t.dtype != t0.dtype or t.device != t0.device or t.shape[1:] != t0.shape[1:]
                or t.untyped_storage().data_ptr() != t0.untyped_storage().data_ptr() or t.storage_offset() != offset):
            adjacent = False
            break
        offset += t.shape[0] * row
    if adjacent and not any(is_traceable_wrapper_subclass(t) for t in tensors):
        stride = (row, 1) if t0.dim() > 1 else (1,)
        return t0.detach().as_strided(shape, stride, t0.storage_offset())
    return torch.cat([t.detach() for t in tensors])


def cat_bias(linears: Sequence[nn.Module]) -> torch.Tensor | None:
    """The biases of ``linears`` end to end (zeros for a linear without one), or None if none has one (a view of
    them when they already lie end to end in one storage, see :func:`row_concat`)."""
    if all(getattr(lin, "bias", None) is None for lin in linears):
        return None
    return row_concat([lin.bias if lin.bias is not None else lin.weight.new_zeros(lin.out_features)
                       for lin in linears])


def _gated(gate_up: torch.Tensor, activation: nn.Module) -> torch.Tensor:
    """[..., 2 * hidden] ``[gate | up]`` -> [..., hidden] ``activation(gate) * up`` (torchtune's FeedForward order)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return activation(gate) * up


class FusedGateUpMLP(nn.Module):
    """A gated MLP with its gate and up projections computed as one linear: ``w2(act(gate) * up)``, where
    ``[gate | up] = gate_up(x)`` (a drafter's form of torchtune's ``FeedForward``, whose gate / up weights are a
    quantized copy; ``w2`` keeps its name). x: [..., dim] -> [..., dim]."""

    def __init__(self, gate_up: nn.Module, w2: nn.Module, activation: nn.Module) -> None:
        super().__init__()
        self.gate_up, self.w2, self.activation = gate_up, w2, activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(_gated(self.gate_up(x), self.activation))


class FusedLinear(nn.Module):
    """Plain linears computed as one matmul over their weights end to end, the linears' weights (and biases) being
    row slices of the fused ones (see the module docstring).

    Args:
        parts: plain :class:`torch.nn.Linear` modules with the same ``in_features``, dtype and device, all with a
            bias or none. Their parameter objects are kept; their ``.data`` becomes a view of the fused storage
            (which is a view of their storage already when they lie end to end in one, else a new tensor holding
            their current values).

    Attributes:
        weight: [sum out_i, in] non-persistent buffer. bias: [sum out_i] non-persistent buffer or None.
        split_sizes: each part's ``out_features``, in order.

    ``forward``: x [..., in] -> [..., sum out_i], ``[part_0(x) | part_1(x) | ...]``: the fused matmul, or the
    separate linears when gradients are enabled and a part's parameter requires them.

    Raises:
        ValueError: no parts, a part that is not a plain ``nn.Linear`` with plain tensors, or parts that differ
            in ``in_features``, dtype, device or in having a bias.
    """

    def __init__(self, parts: Sequence[nn.Linear]) -> None:
        super().__init__()
        parts = tuple(parts)
        why = _unfusable(parts)
        if why is not None:
            raise ValueError(f"FusedLinear: {why}")
        with torch.no_grad():
            weight = row_concat([p.weight for p in parts])
            bias = cat_bias(parts)
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.split_sizes = tuple(p.out_features for p in parts)
        self.in_features = parts[0].in_features
        self._parts = parts  # a plain tuple: not registered (their parent module owns them)
        self.rebind_()

    @property
    def parts(self) -> tuple[nn.Linear, ...]:
        """The fused linears, in order (owned and named by the parent module)."""
        return self._parts

    @torch.no_grad()
    def rebind_(self) -> None:
        """Point every part's weight (and bias) at its rows of the fused storage."""
        start = 0
        for part, n in zip(self._parts, self.split_sizes):
            part.weight.data = self.weight[start:start + n]
            if self.bias is not None:
                part.bias.data = self.bias[start:start + n]
            start += n

    def _needs_grad(self) -> bool:
        for part in self._parts:
            if part.weight.requires_grad or (part.bias is not None and part.bias.requires_grad):
                return True
        return False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and self._needs_grad():  # training: gradients on the named parameters
            return torch.cat([F.linear(x, p.weight, p.bias) for p in self._parts], dim=-1)
        return F.linear(x, self.weight, self.bias)

    def _apply(self, fn, recurse: bool = True):
        # .to() / .cuda() / .half() convert the parts' parameters and these buffers separately: the buffers are
        # converted after the parts (this module is registered after them), so re-point the parts at them
        out = super()._apply(fn, recurse)
        self.rebind_()
        return out

    def __setstate__(self, state) -> None:
        # deepcopy / unpickling copy parameters and buffers separately: re-point the copies' parts
        super().__setstate__(state)
        self.rebind_()

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, split_sizes={self.split_sizes}, bias={self.bias is not None}"


class FusedFeedForward(FeedForward):
    """torchtune's gated :class:`~torchtune.modules.FeedForward` with its gate (``w1``) and up (``w3``) projections
    as one :class:`FusedLinear` (``gate_up``); ``w1``, ``w2``, ``w3`` and ``activation`` keep their names and
    order. x: [..., dim] -> [..., dim], ``w2(activation(w1(x)) * w3(x))``."""

    def __init__(self, ff: FeedForward) -> None:
        super().__init__(gate_proj=ff.w1, down_proj=ff.w2, up_proj=ff.w3, activation=ff.activation)
        self.gate_up = FusedLinear([self.w1, self.w3])  # registered last: after w1 / w3 (see FusedLinear._apply)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(_gated(self.gate_up(x), self.activation))

    def unfused(self) -> FeedForward:
        """A torchtune ``FeedForward`` over the same modules (the parameters stay views of the fused storage)."""
        return FeedForward(gate_proj=self.w1, down_proj=self.w2, up_proj=self.w3, activation=self.activation)


# ------------------------------------------------------------------------------------------------ checks
def _plain_tensor(t: torch.Tensor | None) -> bool:
    return t is None or (type(t) in (torch.Tensor, nn.Parameter) and not is_traceable_wrapper_subclass(t))


def _unfusable(parts: Sequence[nn.Module], names: Sequence[str] | None = None) -> str | None:
    """Why ``parts`` cannot be one :class:`FusedLinear` (None: they can); ``names`` name them in the reason."""
    names = list(names) if names is not None else [f"part {i}" for i in range(len(parts))]
    if not parts:
        return "no linears to fuse"
    for n, p in zip(names, parts):
        if type(p) is not nn.Linear:
            return (f"{n} is {type(p).__name__}, not a plain torch.nn.Linear (quantized, LoRA and other linears "
                    "are not fused)")
        if not (_plain_tensor(p.weight) and _plain_tensor(p.bias)):
            return f"{n} has a {type(p.weight).__name__} weight, not a plain tensor (a quantized linear is not fused)"
    p0 = parts[0]
    for n, p in zip(names[1:], parts[1:]):
        if p.in_features != p0.in_features:
            return f"{n} has in_features={p.in_features}, {names[0]} {p0.in_features}"
        if (p.weight.dtype, p.weight.device) != (p0.weight.dtype, p0.weight.device):
            return (f"{n} is {p.weight.dtype} on {p.weight.device}, {names[0]} {p0.weight.dtype} on "
                    f"{p0.weight.device}")
        if (p.bias is None) != (p0.bias is None):
            return (f"{n} has {'no' if p.bias is None else 'a'} bias, {names[0]} "
                    f"{'has one' if p.bias is None else 'has none'}")
        if p.bias is not None and p.bias.dtype != p0.weight.dtype:
            return f"{n} has a {p.bias.dtype} bias, its weights are {p0.weight.dtype}"
    return None


def _views(t: torch.Tensor, fused: torch.Tensor, start: int, n: int) -> bool:
    """Whether ``t`` is rows ``start:start + n`` of ``fused`` (same storage, offset, shape, strides)."""
    want = fused[start:start + n]
    return (_plain_tensor(t) and t.device == fused.device and t.dtype == fused.dtype
            and t.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
            and t.storage_offset() == want.storage_offset() and t.shape == want.shape and t.stride() == want.stride())


def _live(fused: FusedLinear, linears: Sequence[nn.Module]) -> bool:
    """Whether ``linears`` (a parent's current modules) are plain linears whose weights (and biases) are views of
    their rows of ``fused``'s storage: only then does the fused matmul compute what they would."""
    if len(linears) != len(fused.split_sizes):
        return False
    start = 0
    for lin, n in zip(linears, fused.split_sizes):
        if type(lin) is not nn.Linear or not _views(lin.weight, fused.weight, start, n):
            return False
        if (lin.bias is None) != (fused.bias is None):
            return False
        if lin.bias is not None and not _views(lin.bias, fused.bias, start, n):
            return False
        start += n
    return True


def _layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    layers = getattr(model, "layers", model)
    prefix = "layers." if hasattr(model, "layers") else ""
    if not isinstance(layers, (nn.ModuleList, list, tuple)):
        raise ValueError(f"expected a decoder with .layers or a list of layers, got {type(model).__name__}")
    return [(f"{prefix}{i}", layer) for i, layer in enumerate(layers)]


def _attn_linears(attn: SparrowAttention) -> list[nn.Module]:
    return [getattr(attn, n) for n in QKV]


def _mlp_linears(mlp: nn.Module) -> list[nn.Module]:
    return [getattr(mlp, n, None) for n in GATE_UP]


# -------------------------------------------------------------------------------------------------- verbs
def fused_projections(model: nn.Module) -> dict[str, FusedLinear]:
    """The live fused projections of ``model`` (a decoder, or a list of its layers), by module name
    (``layers.<i>.attn.qkv_proj``, ``layers.<i>.mlp.gate_up``): those whose linears are still views of their
    storage. A model fused by :func:`fuse_projections_` has two per layer."""
    out: dict[str, FusedLinear] = {}
    for name, layer in _layers(model):
        attn, mlp = getattr(layer, "attn", None), getattr(layer, "mlp", None)
        if isinstance(attn, SparrowAttention) and isinstance(attn.qkv_proj, FusedLinear) \
                and _live(attn.qkv_proj, _attn_linears(attn)):
            out[f"{name}.attn.qkv_proj"] = attn.qkv_proj
        if isinstance(mlp, FusedFeedForward) and _live(mlp.gate_up, _mlp_linears(mlp)):
            out[f"{name}.mlp.gate_up"] = mlp.gate_up
    return out


def fuse_projections_(model: nn.Module) -> nn.Module:
    """Fuse every layer's q / k / v projections (``attn.qkv_proj``) and its MLP's gate / up projections
    (``mlp``: a :class:`FusedFeedForward`), in place; returns ``model``. See the module docstring for what stays
    the same (every parameter name, object and value; ``state_dict``).

    Idempotent: fused layers whose linears are still views of their storage are left alone; fused layers that
    went stale (a parameter object replaced) are fused again from their parameters' current values. Fusing
    allocates the fused storage unless the parameters already lie end to end in one (a model unfused by
    :func:`unfuse_projections_` is fused back onto its storage), and copies their values into it.

    Args:
        model: a torchtune decoder with :class:`SparrowAttention` layers (see :func:`use_attention`) and gated
            ``FeedForward`` MLPs (Llama-3, Qwen2), or a list of such layers.

    Raises:
        ValueError: naming the module, when a layer cannot be fused: attention that is not a
            :class:`SparrowAttention`, an ``attn.qkv_proj`` set to another module (a drafter's quantized one), an
            MLP that is not a gated torchtune ``FeedForward``, q / k / v or gate / up projections that are not plain
            ``nn.Linear`` with plain tensors (quantized, LoRA), that differ in input size, dtype, device or bias, or
            whose sizes do not match the attention's heads. Nothing is changed when it raises (every layer is
            checked first).
    """
    plan: list[tuple[str, nn.Module, str]] = []
    for name, layer in _layers(model):
        attn, mlp = getattr(layer, "attn", None), getattr(layer, "mlp", None)
        if not isinstance(attn, SparrowAttention):
            raise ValueError(f"{name}.attn is {type(attn).__name__}, not SparrowAttention: call use_attention(model) "
                             "first")
        if attn.qkv_proj is not None and not isinstance(attn.qkv_proj, FusedLinear):
            raise ValueError(f"{name}.attn.qkv_proj is already set to {type(attn.qkv_proj).__name__}: cannot fuse "
                             "its projections again")
        if not (isinstance(attn.qkv_proj, FusedLinear) and _live(attn.qkv_proj, _attn_linears(attn))):
            names = [f"{name}.attn.{n}" for n in QKV]
            why = _unfusable(_attn_linears(attn), names)
            if why is None:
                kv = attn.num_kv_heads * attn.head_dim
                want = (attn.num_heads * attn.head_dim, kv, kv)
                got = tuple(lin.out_features for lin in _attn_linears(attn))
                if got != want:
                    why = (f"{name}.attn's q / k / v projections have out_features {got}, its heads need {want}")
            if why is not None:
                raise ValueError(f"cannot fuse: {why}")
            plan.append((name, attn, "qkv"))
        if type(mlp) not in (FeedForward, FusedFeedForward) or mlp.w3 is None:
            raise ValueError(f"cannot fuse: {name}.mlp is {type(mlp).__name__}"
                             + (" without an up projection (w3)" if isinstance(mlp, FeedForward) else "")
                             + ", not a gated torchtune FeedForward")
        if not (isinstance(mlp, FusedFeedForward) and _live(mlp.gate_up, _mlp_linears(mlp))):
            why = _unfusable(_mlp_linears(mlp), [f"{name}.mlp.{n}" for n in GATE_UP])
            if why is None and mlp.w1.out_features != mlp.w3.out_features:
                why = (f"{name}.mlp.w1 has out_features={mlp.w1.out_features}, {name}.mlp.w3 "
                       f"{mlp.w3.out_features}")
            if why is not None:
                raise ValueError(f"cannot fuse: {why}")
            plan.append((name, layer, "mlp"))
    for _, module, kind in plan:
        if kind == "qkv":
            module.qkv_proj = FusedLinear(_attn_linears(module))
        else:
            mlp = module.mlp
            module.mlp = FusedFeedForward(mlp.unfused() if isinstance(mlp, FusedFeedForward) else mlp)
    return model


def unfuse_projections_(model: nn.Module, *, stale_only: bool = False) -> nn.Module:
    """Give every fused layer of ``model`` (a decoder, or a list of its layers) its separate projections back, in
    place; returns ``model``. Structural only: the parameters keep their values and their storage (still views of
    the former fused one), so compiled code and CUDA graphs that read them stay valid, and
    :func:`fuse_projections_` fuses them back without a copy.

    Args:
        stale_only: only the fused projections whose linears are no longer views of their storage (a drafter's
            copy of the layers whose linears it replaced by quantized ones); live ones stay fused.
    """
    for _, layer in _layers(model):
        attn, mlp = getattr(layer, "attn", None), getattr(layer, "mlp", None)
        if isinstance(attn, SparrowAttention) and isinstance(attn.qkv_proj, FusedLinear):
            if not (stale_only and _live(attn.qkv_proj, _attn_linears(attn))):
                attn.qkv_proj = None
        if isinstance(mlp, FusedFeedForward):
            if not (stale_only and _live(mlp.gate_up, _mlp_linears(mlp))):
                layer.mlp = mlp.unfused()
    return model

"""Depth and width growth: train a decoder first on an evenly spread subset of its layers, or on a narrower slice
of itself, or both, then on the whole model.

A 24-layer model trained from scratch on the retrieval mix sits for hundreds of steps on the plateau of
copying *some* value of the context, and a learning rate high enough to leave it faster keeps the deep model at
the uniform guess (docs/benchmarks.md); a 6-layer model leaves it within a minute. With ``start_layers`` the
trainer runs only ``start_layers`` of the model's layers (:func:`shallow_layers`: evenly spread, in order) until
the curriculum's longest context first reaches ``at_context`` or ``at_progress`` of the run is done, then
:func:`grow_` zeroes the output projections of the layers that sat out (attention ``output_proj`` and MLP
``w2``): each is then the identity on the residual stream, so the grown model computes bit for bit what the
shallow one did, and training goes on with every layer.

The skipped layers are never called before the growth: their parameters get no gradient, so AdamW leaves them
(and their weight decay) alone and their optimizer state starts at the growth, in parameter groups of their own
whose learning rate warms up over ``warmup_steps`` from there. The model object, its parameters
and the optimizer stay the same throughout; only the list of layers the forward pass walks changes
(:func:`active_layers`).

Width growth (``start_embed_dim``, ``start_num_heads``, ``start_intermediate_dim``, ``start_vocab``) also starts
narrower: every
step of a narrow model costs a fraction of the whole one's, so it reaches the plateau's way out in fewer
seconds. :func:`narrow_` shrinks the initialised model in place to a slice of itself (the first ``E0`` residual
dimensions, the first query heads of each key-value group, the first hidden units, the first ids of the
vocabulary; the head size and the key-value heads stay) and returns the full-size initial tensors; at the growth
:func:`widen_` puts the trained slice back into them. The parts that write into the residual stream (the embedding, attention ``output_proj``,
MLP ``w2``) are 0 outside the slice and the norm scales absorb the longer RMS, so the new residual dimensions
start at 0 and the widened model computes what the narrow one did (up to rounding; the narrow model's norms
use ``eps * E / E0`` for that); the new heads and units read the stream through their fresh weights, so they
learn from the first step after. The resized parameters are new objects (autograd keeps a parameter's shape),
put in the optimizer's groups in place of the old ones; its moments are widened with zeros.

A narrow vocabulary (``start_vocab``: the ids the data uses, e.g. the synthetic tasks' 48 in a model of the real
151,936) leaves the rest out of the softmax until the growth: with a large vocabulary the start's first hundreds
of steps otherwise go to pushing down the logits of ids the data never holds (docs/benchmarks.md). At the growth
the other rows come back at their initial values; every logit of the narrow vocabulary is kept, and the new ids
join the softmax with their initial logits, so the loss rises once there and the whole model learns to suppress
them.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from sparrow.attention.base import LayerShape
from sparrow.attention.dense import DenseAttention


@dataclass(frozen=True)
class GrowthConfig:
    """When, and from how many layers and what width, a run grows (off by default).

    Attributes:
        start_layers: layers trained before the growth (0: every layer from the start).
        start_embed_dim, start_num_heads, start_intermediate_dim: the width trained before the growth (0: the
            model's): residual dimensions, query heads (a multiple of the key-value heads), MLP hidden units.
        start_vocab: the ids in the softmax before the growth, the first ``start_vocab`` of the vocabulary (0: all);
            the data must hold no other id.
        at_context: grow when the curriculum's longest context first reaches this many tokens (0: by progress
            only).
        at_progress: grow, at the latest, once this fraction of the run is done.
        warmup_steps: the grown layers' learning rate rises linearly from 0 to the schedule's over this many
            steps after the growth (AdamW's first updates of fresh parameters are full-size in every element).

    Raises:
        ValueError: a negative ``start_*``, ``at_context`` or ``warmup_steps``, ``at_progress`` outside ``(0, 1]``.
    """

    start_layers: int = 0
    start_embed_dim: int = 0
    start_num_heads: int = 0
    start_intermediate_dim: int = 0
    start_vocab: int = 0
    at_context: int = 0
    at_progress: float = 0.3
    warmup_steps: int = 100

    def __post_init__(self) -> None:
        counts = {"start_layers": self.start_layers, "start_embed_dim": self.start_embed_dim,
                  "start_num_heads": self.start_num_heads, "start_intermediate_dim": self.start_intermediate_dim,
                  "start_vocab": self.start_vocab, "at_context": self.at_context, "warmup_steps": self.warmup_steps}
        bad = {k: v for k, v in counts.items() if v < 0}
        if not 0 < self.at_progress <= 1:
            bad["at_progress"] = self.at_progress
        if bad:
            raise ValueError(f"growth: need {', '.join(counts)} >= 0 and 0 < at_progress <= 1, got {bad}")

    @property
    def narrow(self) -> bool:
        """Whether the run starts narrower than the model."""
        return bool(self.start_embed_dim or self.start_num_heads or self.start_intermediate_dim or self.start_vocab)

    @property
    def enabled(self) -> bool:
        return self.start_layers > 0 or self.narrow

    def start_width(self, model: torch.nn.Module) -> "Width":
        """The width the run starts at: the model's where a ``start_*`` is 0."""
        full = model_width(model)
        return Width(self.start_embed_dim or full.embed_dim, self.start_num_heads or full.num_heads,
                     self.start_intermediate_dim or full.intermediate_dim, self.start_vocab or full.vocab)

    def due(self, top_context: int, progress: float) -> bool:
        """Whether a run at longest context ``top_context`` and ``progress`` of its length grows now."""
        return (0 < self.at_context <= top_context) or progress >= self.at_progress


def shallow_layers(num_layers: int, start_layers: int) -> list[int]:
    """The indices of the ``start_layers`` layers of ``num_layers`` trained before the growth: evenly spread,
    the first layer included (``i * num_layers // start_layers``).

    Raises:
        ValueError: ``start_layers`` not in ``[1, num_layers)``.
    """
    if not 1 <= start_layers < num_layers:
        raise ValueError(f"growth: start_layers must be in [1, {num_layers}) for a model of {num_layers} layers, "
                         f"got {start_layers}")
    return [i * num_layers // start_layers for i in range(start_layers)]


def _output_projections(layer: torch.nn.Module) -> list[torch.nn.Module]:
    return [getattr(getattr(layer, "attn", None), "output_proj", None), getattr(getattr(layer, "mlp", None), "w2", None)]


def check_growable(model: torch.nn.Module) -> None:
    """``ValueError`` unless ``model.layers`` holds layers whose residual branches end in ``attn.output_proj``
    and ``mlp.w2`` (torchtune's self-attention layers), the projections :func:`grow_` zeroes."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"growth: the model needs a ModuleList of layers, {type(model).__name__} has none")
    for i, layer in enumerate(layers):
        if any(not isinstance(m, torch.nn.Linear) for m in _output_projections(layer)):
            raise ValueError(f"growth: layer {i} ({type(layer).__name__}) has no attn.output_proj and mlp.w2 "
                             "linear projections to zero")


@contextmanager
def active_layers(model: torch.nn.Module, indices: Sequence[int] | None) -> Iterator[None]:
    """Within the block, ``model.layers`` holds only ``layers[i] for i in indices`` (in that order); the whole
    list is back afterwards, also after an exception. ``None``: every layer (no change)."""
    if indices is None:
        yield
        return
    full = model.layers
    model.layers = torch.nn.ModuleList([full[i] for i in indices])
    try:
        yield
    finally:
        model.layers = full


@torch.no_grad()
def grow_(model: torch.nn.Module, trained: Sequence[int]) -> list[int]:
    """Make the layers not in ``trained`` the identity on the residual stream, in place (their attention
    ``output_proj`` and MLP ``w2`` weights and biases set to 0): the model with every layer then computes bit
    for bit what it computed on ``trained`` alone. Returns the indices of the layers zeroed.

    Raises:
        ValueError: the model's layers are not growable (:func:`check_growable`; nothing changed then).
    """
    check_growable(model)
    kept = set(trained)
    added = [i for i in range(len(model.layers)) if i not in kept]
    for i in added:
        for proj in _output_projections(model.layers[i]):
            proj.weight.zero_()
            if proj.bias is not None:
                proj.bias.zero_()
    return added


# -- width ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Width:
    """A decoder's width: residual dimensions, query heads, MLP hidden units, vocabulary ids."""

    embed_dim: int
    num_heads: int
    intermediate_dim: int
    vocab: int


@dataclass
class Narrowed:
    """What :func:`narrow_` returns and :func:`widen_` takes: the full-size parameters by name (the initialised
    values the new parts start from) and the norms' full-size ``eps`` by module name."""

    params: dict[str, torch.Tensor]
    eps: dict[str, float] = field(default_factory=dict)


# how each parameter's dimensions widen, by the name's last components: "E" the residual stream, "Q" the
# query heads' rows, "I" the MLP's hidden units, "V" the vocabulary, None unchanged; writers (True) put into the
# residual stream and are 0 outside the narrow slice, readers keep their initial values there; rows of ids outside
# the narrow vocabulary take their initial values in both
_RULES: dict[str, tuple[tuple[str | None, ...], bool]] = {
    "tok_embeddings.weight": (("V", "E"), True), "output.weight": (("V", "E"), False),
    "norm.scale": (("E",), False), "sa_norm.scale": (("E",), False), "mlp_norm.scale": (("E",), False),
    "q_norm.scale": ((None,), False), "k_norm.scale": ((None,), False),
    "attn.q_proj.weight": (("Q", "E"), False), "attn.q_proj.bias": (("Q",), False),
    "attn.k_proj.weight": ((None, "E"), False), "attn.k_proj.bias": ((None,), False),
    "attn.v_proj.weight": ((None, "E"), False), "attn.v_proj.bias": ((None,), False),
    "attn.output_proj.weight": (("E", "Q"), True), "attn.output_proj.bias": (("E",), True),
    "mlp.w1.weight": (("I", "E"), False), "mlp.w3.weight": (("I", "E"), False),
    "mlp.w1.bias": (("I",), False), "mlp.w3.bias": (("I",), False),
    "mlp.w2.weight": (("E", "I"), True), "mlp.w2.bias": (("E",), True),
}


def _rule(name: str) -> tuple[tuple[str | None, ...], bool]:
    for suffix, rule in _RULES.items():
        if name == suffix or name.endswith("." + suffix):
            return rule
    raise ValueError(f"growth: no width rule for parameter {name!r}")


def model_width(model: torch.nn.Module) -> Width:
    """The width of a torchtune-style decoder (``tok_embeddings``, ``layers[i].attn`` and ``.mlp.w1``)."""
    layer = model.layers[0]
    emb = model.tok_embeddings.weight
    return Width(emb.shape[1], layer.attn.num_heads, layer.mlp.w1.weight.shape[0], emb.shape[0])


def check_widenable(model: torch.nn.Module, width: Width) -> None:
    """``ValueError`` naming the problem unless ``model`` can run at ``width`` and grow back: Sparrow attention
    with the dense backend in every layer, RMS norms, a width rule for every parameter, and ``width`` no wider
    than the model, its heads a multiple of the key-value heads."""
    check_growable(model)
    full = model_width(model)
    kv = model.layers[0].attn.num_kv_heads
    if not (1 <= width.embed_dim <= full.embed_dim and 1 <= width.intermediate_dim <= full.intermediate_dim
            and kv <= width.num_heads <= full.num_heads and width.num_heads % kv == 0
            and 1 <= width.vocab <= full.vocab):
        raise ValueError(f"growth: cannot start at {width} in a model of {full} with {kv} key-value heads (each at "
                         "most the model's; query heads a multiple of the key-value heads)")
    for i, layer in enumerate(model.layers):
        backend = getattr(layer.attn, "backend", None)
        if type(backend) is not DenseAttention:
            raise ValueError(f"growth: layer {i} attends with {type(backend).__name__}; width growth trains with "
                             "DenseAttention (sparrow.models.use_attention)")
    for name, p in model.named_parameters():
        dims, _ = _rule(name)
        if len(dims) != p.dim():
            raise ValueError(f"growth: parameter {name!r} has {p.dim()} dimensions, its width rule {len(dims)}")
    for name, m in model.named_modules():
        if name.endswith(("sa_norm", "mlp_norm")) or name == "norm":
            if not hasattr(m, "eps") or getattr(m, "normalized_shape", None) != (full.embed_dim,):
                raise ValueError(f"growth: {name} is not an RMS norm over the {full.embed_dim} residual dimensions")


def _kept(kind: str | None, size: int, narrow: Width, full: Width, head_dim: int, kv: int) -> torch.Tensor:
    """The indices, in the full dimension of ``kind``, that the narrow model keeps."""
    if kind == "E":
        return torch.arange(narrow.embed_dim)
    if kind == "I":
        return torch.arange(narrow.intermediate_dim)
    if kind == "V":
        return torch.arange(narrow.vocab)
    if kind == "Q":  # the first heads of each key-value group, so every query head keeps its key-value head
        per, full_per = narrow.num_heads // kv, full.num_heads // kv
        heads = torch.tensor([g * full_per + i for g in range(kv) for i in range(per)])
        return (heads[:, None] * head_dim + torch.arange(head_dim)).flatten()
    return torch.arange(size)


def _index(name: str, shape: torch.Size, narrow: Width, full: Width, head_dim: int, kv: int, device):
    dims, writer = _rule(name)
    kept = [_kept(k, n, narrow, full, head_dim, kv).to(device) for k, n in zip(dims, shape)]
    return torch.meshgrid(*kept, indexing="ij"), writer, dims


def _norms(model: torch.nn.Module):
    return [(n, m) for n, m in model.named_modules() if n.endswith(("sa_norm", "mlp_norm")) or n == "norm"]


def _replace(model: torch.nn.Module, name: str, old: torch.nn.Parameter, value: torch.Tensor,
             optimizer: torch.optim.Optimizer | None) -> None:
    """A new parameter object holding ``value`` in ``old``'s place, in the model and in ``optimizer`` (its group
    and its state): autograd keeps a parameter's shape from its first backward pass, so a resized one must be new."""
    owner, _, attr = name.rpartition(".")
    new = torch.nn.Parameter(value, requires_grad=old.requires_grad)
    setattr(model.get_submodule(owner) if owner else model, attr, new)
    if optimizer is None:
        return
    for group in optimizer.param_groups:
        group["params"] = [new if q is old else q for q in group["params"]]
    if old in optimizer.state:
        optimizer.state[new] = optimizer.state.pop(old)


def _set_width(model: torch.nn.Module, width: Width) -> None:
    """The modules' shape attributes after their parameters changed size (forward passes read some of them)."""
    for i, layer in enumerate(model.layers):
        attn = layer.attn
        attn.num_heads = width.num_heads
        b = attn.backend
        attn.backend = DenseAttention(LayerShape(b.shape.layer_idx, width.num_heads, attn.num_kv_heads, attn.head_dim),
                                      impl=b.impl, shared_prefix=b.shared_prefix)
        for lin in (attn.q_proj, attn.k_proj, attn.v_proj, attn.output_proj, layer.mlp.w1, layer.mlp.w2, layer.mlp.w3):
            lin.out_features, lin.in_features = lin.weight.shape
    for _, m in _norms(model):
        m.normalized_shape = (width.embed_dim,)
    model.tok_embeddings.embedding_dim = width.embed_dim
    model.tok_embeddings.num_embeddings = width.vocab
    output = getattr(model, "output", None)
    if isinstance(output, torch.nn.Linear):
        output.out_features, output.in_features = output.weight.shape
    if hasattr(model, "num_heads"):
        model.num_heads = width.num_heads


@torch.no_grad()
def narrow_(model: torch.nn.Module, width: Width) -> Narrowed:
    """Shrink ``model`` in place to ``width`` (before an optimizer holds its parameters): each parameter becomes
    the slice of itself the narrow model keeps (a new parameter object), the norms' ``eps`` becomes
    ``eps * E / E0``. Returns the full-size tensors for :func:`widen_`. A narrow vocabulary is the first
    ``width.vocab`` ids: the model's logits hold only those, and an id past them fails the embedding lookup.

    Raises:
        ValueError: as :func:`check_widenable` (nothing changed then).
    """
    check_widenable(model, width)
    full = model_width(model)
    head_dim, kv = model.layers[0].attn.head_dim, model.layers[0].attn.num_kv_heads
    out = Narrowed({})
    for name, p in list(model.named_parameters()):
        ix, _, _ = _index(name, p.shape, width, full, head_dim, kv, p.device)
        out.params[name] = p.detach()
        _replace(model, name, p, p.detach()[ix].clone(), None)
    for name, m in _norms(model):
        out.eps[name] = m.eps
        m.eps = m.eps * full.embed_dim / width.embed_dim
    _set_width(model, width)
    return out


@torch.no_grad()
def widen_(model: torch.nn.Module, narrowed: Narrowed, optimizer: torch.optim.Optimizer | None = None) -> Width:
    """Grow ``model`` (made narrow by :func:`narrow_`) back to its full size in place: the trained slices go back
    into the full-size initial tensors, the writers into the residual stream are 0 outside them and the norm
    scales are multiplied by ``sqrt(E0 / E)``, so the model computes what it computed narrow (the logits of the
    narrow vocabulary; the rows of the other ids take their initial values). The parameters are
    new objects, put in ``optimizer``'s groups in place of the old ones; its moments (every state tensor of a
    parameter's shape) are widened with zeros. Returns the narrow width."""
    narrow, full_e = model_width(model), narrowed.params["tok_embeddings.weight"].shape[1]
    layer = model.layers[0]
    head_dim, kv = layer.attn.head_dim, layer.attn.num_kv_heads
    q_rows = narrowed.params["layers.0.attn.q_proj.weight"].shape[0]
    full = Width(full_e, q_rows // head_dim, narrowed.params["layers.0.mlp.w1.weight"].shape[0],
                 narrowed.params["tok_embeddings.weight"].shape[0])
    scale = math.sqrt(narrow.embed_dim / full.embed_dim)
    for name, p in list(model.named_parameters()):
        init = narrowed.params[name]
        ix, writer, dims = _index(name, init.shape, narrow, full, head_dim, kv, p.device)
        grown = torch.zeros_like(init) if writer else init.clone()
        if dims[0] == "V":  # the ids outside the narrow vocabulary: their initial rows
            grown[narrow.vocab:] = init[narrow.vocab:]
        grown[ix] = p.detach() * scale if dims == ("E",) and not writer else p.detach()  # norm scales
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        for key, t in state.items():
            if torch.is_tensor(t) and t.shape == p.shape:
                wide = torch.zeros_like(init, dtype=t.dtype)
                wide[ix] = t
                state[key] = wide
        _replace(model, name, p, grown, optimizer)
    for name, m in _norms(model):
        m.eps = narrowed.eps[name]
    _set_width(model, full)
    return narrow

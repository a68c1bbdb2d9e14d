"""Depth growth: train a deep decoder first on an evenly spread subset of its layers, then on all of them.

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
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch


@dataclass(frozen=True)
class GrowthConfig:
    """When and from how many layers a run grows (off by default).

    Attributes:
        start_layers: layers trained before the growth (0: no growth, every layer from the start).
        at_context: grow when the curriculum's longest context first reaches this many tokens (0: by progress
            only).
        at_progress: grow, at the latest, once this fraction of the run is done.
        warmup_steps: the grown layers' learning rate rises linearly from 0 to the schedule's over this many
            steps after the growth (AdamW's first updates of fresh parameters are full-size in every element).

    Raises:
        ValueError: a negative ``start_layers``, ``at_context`` or ``warmup_steps``, ``at_progress`` outside
            ``(0, 1]``.
    """

    start_layers: int = 0
    at_context: int = 0
    at_progress: float = 0.3
    warmup_steps: int = 100

    def __post_init__(self) -> None:
        if self.start_layers < 0 or self.at_context < 0 or self.warmup_steps < 0 or not 0 < self.at_progress <= 1:
            raise ValueError(f"growth: need start_layers, at_context, warmup_steps >= 0 and 0 < at_progress <= 1, "
                             f"got start_layers={self.start_layers}, at_context={self.at_context}, "
                             f"warmup_steps={self.warmup_steps}, at_progress={self.at_progress}")

    @property
    def enabled(self) -> bool:
        return self.start_layers > 0

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

"""The weight initialisation of every model Sparrow trains from scratch."""

from __future__ import annotations

import math

import torch


@torch.no_grad()
def init_weights(model: torch.nn.Module, std: float = 0.02, *, residual_scaling: bool = False,
                 zero_bias: bool = False) -> None:
    """Initialise ``model`` in place for training from scratch (torchtune's defaults are meant for loading
    checkpoints).

    Every parameter of two or more dimensions (linear weights, embeddings) is drawn from Normal(0, ``std``), in
    ``named_parameters`` order from the global torch generator, so a seed fixes the result. Norm scales and
    biases keep their construction values, unless ``zero_bias``: biases become 0. ``residual_scaling`` draws the
    projections that write into the residual stream (attention ``output_proj``, MLP ``w2``) with
    ``std / sqrt(2 * num_layers)``, so the residual's variance does not grow with depth.

    Raises:
        ValueError: ``std`` not > 0, or ``residual_scaling`` on a model without ``layers``.
    """
    if not std > 0:
        raise ValueError(f"init_weights: std must be > 0, got {std}")
    if residual_scaling and not hasattr(model, "layers"):
        raise ValueError(f"init_weights: residual_scaling needs a model with layers, got {type(model).__name__}")
    residual_std = std / math.sqrt(2 * len(model.layers)) if residual_scaling else std
    for name, p in model.named_parameters():
        if p.dim() >= 2:
            p.normal_(0.0, residual_std if name.endswith(("output_proj.weight", "w2.weight")) else std)
        elif zero_bias and name.endswith("bias"):
            p.zero_()

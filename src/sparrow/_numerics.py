"""How far a tensor is from a reference: what the library's checks of a fast path against the reference report."""

from __future__ import annotations

import torch


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``|x - ref| / |ref|`` (Frobenius norms, in fp32) of two tensors of one shape."""
    ref = ref.float()
    return float((x.float() - ref).norm() / ref.norm())

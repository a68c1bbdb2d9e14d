"""Which implementation a kernel API runs: every ``kernels/<op>/api.py`` takes ``impl: Impl``."""

from __future__ import annotations

from typing import Literal

import torch

Impl = Literal["auto", "reference", "triton"]
IMPLS: tuple[str, ...] = ("auto", "reference", "triton")


def resolve_impl(impl: str, t: torch.Tensor) -> Literal["reference", "triton"]:
    """``impl`` with ``"auto"`` made concrete: Triton for CUDA tensors, the pure-PyTorch reference elsewhere
    (Triton on the CPU is the interpreter: asked for explicitly, in tests).

    Raises:
        ValueError: ``impl`` is not one of :data:`IMPLS`.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(map(repr, IMPLS))}, got {impl!r}")
    if impl == "auto":
        return "triton" if t.is_cuda else "reference"
    return impl  # type: ignore[return-value]

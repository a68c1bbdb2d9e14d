"""Weight-only int8 linear: validation, ``impl`` dispatch, and the module the drafter swaps in."""

from __future__ import annotations

import torch
from torch import nn

from ..common.impl import Impl, resolve_impl
from .reference import int8_linear_reference, quantize_int8


def _check(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
    if qweight.dim() != 2 or qweight.dtype != torch.int8:
        raise ValueError(f"qweight must be a 2-D int8 tensor [N, K], got {qweight.dtype} {tuple(qweight.shape)}")
    N, K = qweight.shape
    if x.shape[-1] != K:
        raise ValueError(f"x's last dimension ({x.shape[-1]}) must equal qweight's K ({K})")
    if not x.is_floating_point():
        raise ValueError(f"x must be floating point, got {x.dtype}")
    if scale.shape != (N,) or scale.dtype != torch.float32:
        raise ValueError(f"scale must be float32 of shape ({N},), got {scale.dtype} {tuple(scale.shape)}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"bias must have shape ({N},), got {tuple(bias.shape)}")
    if qweight.stride(1) != 1:
        raise ValueError("qweight must be contiguous along K")


def int8_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    impl: Impl = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """``x @ (qweight * scale[:, None]).T + bias`` with int8 weights read as int8.

    Args:
        x: [..., K] activations (bf16, fp16 or fp32).
        qweight: [N, K] int8, contiguous along K (from :func:`quantize_int8`).
        scale: [N] float32 per-output-channel scales.
        bias: optional [N].
        impl: ``"reference"`` (eager PyTorch, any device), ``"triton"`` (CUDA, or CPU under
            ``TRITON_INTERPRET=1``), ``"auto"`` (triton on CUDA, reference elsewhere).

    Returns: [..., N] in ``x.dtype`` (accumulated in float32).

    Raises: ValueError on inconsistent shapes or dtypes (only when ``validate``; the check reads no data).
    """
    if validate:
        _check(x, qweight, scale, bias)
    if resolve_impl(impl, x) == "triton":
        from .triton_int8_linear import int8_linear_triton

        return int8_linear_triton(x, qweight, scale, bias)
    return int8_linear_reference(x, qweight, scale, bias)


class Int8Linear(nn.Module):
    """A linear layer with int8 weight-only quantization (per output channel, symmetric, round to nearest).

    Built from a float weight (``Int8Linear(weight, bias)``); :meth:`requantize_` re-quantizes a new float
    weight into the same buffers (storages unchanged, so compiled code and CUDA graphs that read them stay
    valid). ``bias`` is used as given (not copied: a drafter shares the target's).

    Attributes:
        qweight: [out, in] int8 buffer. scale: [out] float32 buffer. bias: the given bias or None.
        impl: kernel choice passed to :func:`int8_linear`.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, impl: Impl = "auto") -> None:
        super().__init__()
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(f"weight must be a 2-D float tensor, got {weight.dtype} {tuple(weight.shape)}")
        q, s = quantize_int8(weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", s)
        self.bias = bias
        self.impl = impl
        self.out_features, self.in_features = weight.shape

    @torch.no_grad()
    def requantize_(self, weight: torch.Tensor) -> None:
        """Quantize ``weight`` (same shape) into the existing buffers."""
        if weight.shape != self.qweight.shape:
            raise ValueError(f"weight shape {tuple(weight.shape)} differs from {tuple(self.qweight.shape)}")
        q, s = quantize_int8(weight)
        self.qweight.copy_(q)
        self.scale.copy_(s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return int8_linear(x, self.qweight, self.scale, self.bias, impl=self.impl, validate=False)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"

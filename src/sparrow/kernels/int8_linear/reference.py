"""Eager PyTorch oracle for the weight-only int8 linear, and the quantizer both paths share."""

from __future__ import annotations

import torch


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest symmetric int8 per output channel: ``weight ≈ qweight * scale[:, None]``.

    weight: [N, K] float. Returns ``(qweight [N, K] int8 in [-127, 127], scale [N] float32)``; a row of zeros
    gets scale 1 (and zeros). Every element is within ``scale / 2`` of its original value.
    """
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def int8_linear_reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (qweight * scale[:, None]).T + bias`` accumulated in float32, returned in ``x.dtype``.

    x: [..., K]; qweight: [N, K] int8; scale: [N] float32; bias: [N] or None.
    """
    y = torch.matmul(x.float(), qweight.float().t()) * scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)

"""The floor under one decode step: bytes it must read and FLOPs it must do, at the machine's copy bandwidth and
matmul throughput (the model ``docs/benchmarks.md`` writes down for ``benchmarks/bench_engine.py``).

A step of ``B`` rows, in groups of rows that share a prompt, must read the weights once, each group's prompt KV once
(shared-prefix decode reads nothing more) and each row's own generated KV; it does ``2 x parameters`` FLOPs per new
token. Its roofline time is the larger of bytes / bandwidth and FLOPs / throughput; a measured step's *roofline
fraction* is roofline time / measured time (1.0: at the hardware limit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from sparrow.models.attention import attention_modules

H200_COPY_BYTES_PER_S = 4.2e12  # device-to-device copy, bytes read + written (measured: docs/benchmarks.md)
H200_BF16_FLOPS = 778e12  # dense bf16 matmul (measured)


@dataclass(frozen=True)
class DecodeFootprint:
    """What a model's decode step reads and computes per row, independent of the batch.

    Attributes:
        params: parameters (shared ones, e.g. tied embeddings, once).
        weight_bytes: bytes of those parameters.
        kv_bytes_per_token: K and V bytes of one token over all layers (dense layout).
    """

    params: int
    weight_bytes: int
    kv_bytes_per_token: int

    @classmethod
    def of(cls, model: nn.Module, dtype: torch.dtype | None = None) -> "DecodeFootprint":
        """The footprint of a Sparrow model (its attention layers' head layouts) in ``dtype`` (default: the
        model's own; a model on the meta device works)."""
        params = list(model.parameters())  # deduplicated: a tied embedding counts once
        size = (dtype or params[0].dtype).itemsize
        n = sum(p.numel() for p in params)
        kv = sum(2 * a.backend.shape.num_kv_heads * a.backend.shape.head_dim for a in attention_modules(model))
        return cls(n, n * size, kv * size)


@dataclass(frozen=True)
class StepRoofline:
    """One step's floor. ``bytes`` / ``flops``: what it must read / compute; ``seconds``: the larger of the two
    times; ``bound``: ``"bytes"`` or ``"flops"``, whichever sets it."""

    bytes: float
    flops: float
    seconds: float
    bound: str

    def fraction(self, measured_s: float) -> float:
        """Roofline time / ``measured_s`` (1.0 at the limit; ValueError unless ``measured_s > 0``)."""
        if not measured_s > 0:
            raise ValueError(f"measured_s must be > 0, got {measured_s}")
        return self.seconds / measured_s


def decode_step_roofline(footprint: DecodeFootprint, group_prompt_lens: Sequence[int],
                         row_cached_lens: Sequence[float], *, tokens_per_row: int = 1,
                         bandwidth: float = H200_COPY_BYTES_PER_S, flops: float = H200_BF16_FLOPS) -> StepRoofline:
    """The roofline of one decode step.

    Args:
        footprint: the model's :class:`DecodeFootprint`.
        group_prompt_lens: prompt length of each group of rows sharing a prompt (read once per group).
        row_cached_lens: generated tokens whose KV each row reads (one entry per row; a mean over a run is fine).
        tokens_per_row: new tokens per row (``k + 1`` for a verify step).
        bandwidth, flops: bytes/s and FLOP/s of the machine (default: the H200's measured copy and bf16 matmul).

    Raises:
        ValueError: no rows, a negative length, or a non-positive rate.
    """
    if not row_cached_lens:
        raise ValueError("a decode step needs at least one row")
    if min(group_prompt_lens, default=0) < 0 or min(row_cached_lens) < 0 or tokens_per_row < 1:
        raise ValueError("lengths must be >= 0 and tokens_per_row >= 1")
    if not (bandwidth > 0 and flops > 0):
        raise ValueError(f"bandwidth and flops must be > 0, got {bandwidth}, {flops}")
    nbytes = footprint.weight_bytes + footprint.kv_bytes_per_token * (sum(group_prompt_lens) + sum(row_cached_lens))
    nflops = 2.0 * footprint.params * len(row_cached_lens) * tokens_per_row
    t_bytes, t_flops = nbytes / bandwidth, nflops / flops
    return StepRoofline(float(nbytes), nflops, max(t_bytes, t_flops), "bytes" if t_bytes >= t_flops else "flops")

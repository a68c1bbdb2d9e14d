"""The GRPO recipe's bit check across ranks: a fingerprint of the weights' bit patterns."""

from __future__ import annotations

import zlib
from typing import Mapping

import torch


def state_fingerprint(named: Mapping[str, torch.Tensor]) -> int:
    """A 64-bit fingerprint of the bit patterns of ``named`` (order-independent in the dict, name-bound)."""
    from sparrow.kernels.sync.api import hash_bits
    from sparrow.kernels.sync.common import bits_view

    acc = 0
    for name in sorted(named):
        t = named[name].detach().contiguous()
        lanes = hash_bits(bits_view(t)).tolist()  # host sync: a verification step, not the hot path
        tag = zlib.crc32(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())  # stable across processes
        for v in (tag, lanes[0], lanes[1]):
            acc = ((acc ^ v) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return acc - (1 << 64) if acc >= 1 << 63 else acc

"""A 64-bit fingerprint of a state's bit patterns: what ranks compare to check that every copy of the weights
holds the same bits (one number per rank instead of the weights)."""

from __future__ import annotations

import zlib
from typing import Mapping

import torch

from sparrow.kernels.sync.api import hash_bits
from sparrow.kernels.sync.common import bits_view


def state_fingerprint(named: Mapping[str, torch.Tensor]) -> int:
    """A signed 64-bit fingerprint of the bit patterns of ``named`` (independent of the dict's order, bound to
    each tensor's name, shape and dtype). One host sync per tensor: a verification step, not a hot path."""
    acc = 0
    for name in sorted(named):
        t = named[name].detach().contiguous()
        lanes = hash_bits(bits_view(t)).tolist()
        tag = zlib.crc32(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())  # stable across processes
        for v in (tag, lanes[0], lanes[1]):
            acc = ((acc ^ v) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return acc - (1 << 64) if acc >= 1 << 63 else acc

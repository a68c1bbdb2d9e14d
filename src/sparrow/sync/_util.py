"""Small shared helpers: dtype names, byte hashing, alignment, runs of bounded size, the ``impl`` argument of the
public API."""

from __future__ import annotations

import warnings
from typing import Sequence

import numpy as np
import torch

from ..kernels.common.impl import IMPLS, Impl
from ..kernels.sync import api as _k
from ..kernels.sync.common import M32, combine_hash, fold_lanes, hash_lanes
from .errors import CorruptPayloadError

DTYPE_NAMES: dict[torch.dtype, str] = {torch.bfloat16: "bfloat16", torch.float16: "float16",
                                       torch.float32: "float32"}
DTYPES_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}


def public_impl(impl: Impl | None) -> Impl:
    """The ``impl`` argument of a public entry point (``SyncSender``, ``SyncReceiver``, ``encode``,
    ``apply_``, ``warmup``, the codec classes), validated. ``None`` is a deprecated spelling of ``"auto"``.

    Raises:
        ValueError: ``impl`` is not one of ``"auto"``, ``"reference"``, ``"triton"`` (or ``None``).
    """
    if impl is None:
        warnings.warn("impl=None is deprecated: pass impl='auto' (Triton on CUDA tensors, the reference "
                      "elsewhere)", DeprecationWarning, stacklevel=3)
        return "auto"
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(map(repr, IMPLS))}, got {impl!r}")
    return impl


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"unsupported dtype {dtype}: expected bfloat16, float16 or float32") from None


def dtype_from_name(name: object) -> torch.dtype:
    if not isinstance(name, str) or name not in DTYPES_BY_NAME:
        raise CorruptPayloadError(f"unknown dtype {name!r} in payload header")
    return DTYPES_BY_NAME[name]


def align(n: int, a: int = 16) -> int:
    return (n + a - 1) // a * a


def cut_runs(sizes: Sequence[int], cap: int) -> list[tuple[int, int]]:
    """The items cut, in order, into consecutive runs ``[a, b)`` whose sizes sum to at most ``cap``; a run holds at
    least one item (an item larger than ``cap`` is a run of its own). No items: no runs.

    What bounds a bucket (body bytes), an encode launch and a decode launch (changes, i.e. scratch)."""
    runs, a = [], 0
    while a < len(sizes):
        b, total = a + 1, sizes[a]
        while b < len(sizes) and total + sizes[b] <= cap:
            total += sizes[b]
            b += 1
        runs.append((a, b))
        a = b
    return runs


def hash_bytes_lanes(data: torch.Tensor, impl: Impl = "auto") -> torch.Tensor:
    """Hash lanes (int64 [2], on ``data.device``, no sync) of a uint8 tensor, zero-padded to 4 bytes."""
    n = data.numel()
    pad = (-n) % 4
    if pad:
        data = torch.cat([data, torch.zeros(pad, dtype=torch.uint8, device=data.device)])
    words = data.view(torch.int32) if data.numel() else torch.zeros(0, dtype=torch.int32, device=data.device)
    return _k.hash_bits(words, 0, impl=impl)


def hash_bytes(data: torch.Tensor | bytes, impl: Impl = "auto") -> int:
    """64-bit hash of a byte string (uint8 tensor or ``bytes``) as a Python int. Host bytes (a bucket's header and
    manifest, read on every apply) are hashed by :func:`_hash_host_bytes`, the same function without torch's
    per-operation cost; tensors by :func:`hash_bytes_lanes` on their device."""
    if not isinstance(data, torch.Tensor):
        return _hash_host_bytes(data)
    return combine_hash(hash_bytes_lanes(data, impl))


def _hash_host_bytes(data: bytes | bytearray | memoryview) -> int:
    """:func:`hash_bytes` of host bytes in numpy: the bytes zero-padded to 4 and read as little-endian uint32
    words at positions 0, 1, ..., through the reference's :func:`~sparrow.kernels.sync.common.hash_lanes` on
    uint64 arrays, the lanes summed modulo 2^32."""
    raw = bytes(data)  # len() of a memoryview counts its items, not its bytes: pad what was read
    raw += b"\0" * (-len(raw) % 4)
    x = np.frombuffer(raw, dtype="<u4").astype(np.uint64)
    a, b = hash_lanes(x, np.arange(x.size, dtype=np.uint64))
    return fold_lanes(int(a.sum(dtype=np.uint64)) & M32, int(b.sum(dtype=np.uint64)) & M32)


def hash_views(views: list[torch.Tensor], starts: list[int], impl: Impl = "auto") -> torch.Tensor:
    """Hash lanes (int64 ``[N, 2]`` on the views' device, no host sync) of flat bit views of any widths,
    view ``i`` hashed at positions ``starts[i] + j``: one :func:`group_hash_bits` launch per bit width."""
    by_bits: dict[int, list[int]] = {}
    for i, v in enumerate(views):
        by_bits.setdefault(v.element_size(), []).append(i)
    if len(by_bits) == 1:
        return _k.group_hash_bits(views, starts, impl=impl)
    rows: list[torch.Tensor] = [None] * len(views)  # type: ignore[list-item]
    for idx in by_bits.values():
        lanes = _k.group_hash_bits([views[i] for i in idx], [starts[i] for i in idx], impl=impl)
        for r, i in enumerate(idx):
            rows[i] = lanes[r]
    return torch.stack(rows)


def as_u8(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a contiguous tensor's bytes."""
    return t.reshape(-1).view(torch.uint8)

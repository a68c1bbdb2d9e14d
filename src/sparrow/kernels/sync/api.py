"""Validated entry points of the sync kernels, dispatching to Triton or to the PyTorch reference.

``impl=None`` picks Triton for CUDA tensors (when Triton is importable) and the reference otherwise;
``impl="triton"`` on CPU tensors needs ``TRITON_INTERPRET=1`` (used by the tests).

All functions take flat bit views (``int16`` for bf16 / fp16, ``int32`` for fp32; see
:func:`~sparrow.kernels.sync.common.bits_view`). Records are ``(pos: int32[m], val: int32[m])`` with
ascending positions; ``val`` is either the delta code ``c = zigzag(new - old) - 1`` (``values="delta"``)
or the new bit pattern zero-extended to 32 bits (``values="new"``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch

from .common import (
    DIFF_TILE,
    MAX_SLICE_ELEMS,
    META_WORDS,
    RANK_BLOCK,
    SyncFormatError,
    compact_num_blocks,
    slot_words,
)

Impl = Literal["reference", "triton"]
Values = Literal["delta", "new"]

_BLOCK = 1024  # elements per program of the hash / apply kernels


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_impl(impl: str | None, t: torch.Tensor) -> Impl:
    """``"triton"`` for CUDA tensors (if Triton is importable), else ``"reference"``; validates ``impl``."""
    if impl is None:
        return "triton" if (t.is_cuda and triton_available()) else "reference"
    if impl not in ("reference", "triton"):
        raise ValueError(f"impl must be 'reference', 'triton' or None, got {impl!r}")
    return impl  # type: ignore[return-value]


def _tk():
    from . import triton_kernels

    return triton_kernels


def _ref():
    from . import reference

    return reference


def _check_bits(name: str, t: torch.Tensor) -> int:
    if t.dtype not in (torch.int16, torch.int32):
        raise TypeError(f"{name}: expected an int16/int32 bit view, got {t.dtype}")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous 1-D bit view, got shape {tuple(t.shape)}")
    if t.numel() > MAX_SLICE_ELEMS:
        raise ValueError(f"{name}: {t.numel()} elements exceed the slice limit {MAX_SLICE_ELEMS}")
    return 8 * t.element_size()


def _check_pair(old: torch.Tensor, new: torch.Tensor) -> int:
    ebits = _check_bits("old", old)
    _check_bits("new", new)
    if old.dtype != new.dtype or old.shape != new.shape or old.device != new.device:
        raise ValueError(f"old/new mismatch: {old.dtype}{tuple(old.shape)}@{old.device} vs "
                         f"{new.dtype}{tuple(new.shape)}@{new.device}")
    return ebits


def hash_bits(bits: torch.Tensor, start: int = 0, *, impl: str | None = None) -> torch.Tensor:
    """Two 32-bit hash lanes (int64 tensor ``[2]`` on ``bits.device``) of the bit patterns at positions
    ``start + i``; fold with :func:`~sparrow.kernels.sync.common.combine_hash`. No host sync."""
    ebits = _check_bits("bits", bits)
    if resolve_impl(impl, bits) == "reference":
        return _ref().hash_bits(bits, start)
    n = bits.numel()
    grid = max(1, _triton().cdiv(n, _BLOCK))
    part = torch.empty(2 * grid, dtype=torch.int64, device=bits.device)
    _tk()._hash_kernel[(grid,)](bits, n, start, part, EBITS=ebits, BLOCK=_BLOCK)
    return part.view(grid, 2).sum(0) & 0xFFFFFFFF


def _triton():
    import triton

    return triton


@dataclass
class DiffScan:
    """First pass of the diff: the change count (0-d int64 device tensor) and, if asked, the hash lanes
    of the new bits. The Triton path also keeps the per-tile counts and the 1-bit change mask."""

    count: torch.Tensor
    hash: torch.Tensor | None
    impl: Impl
    tile_counts: torch.Tensor | None = None
    mask_words: torch.Tensor | None = None


def diff_scan(old: torch.Tensor, new: torch.Tensor, *, hash_start: int | None = None,
              impl: str | None = None) -> DiffScan:
    """Count the positions whose bit patterns differ (device-side; no host sync)."""
    ebits = _check_pair(old, new)
    which = resolve_impl(impl, old)
    if which == "reference":
        h = _ref().hash_bits(new, hash_start) if hash_start is not None else None
        return DiffScan((old != new).sum().to(torch.int64), h, which)
    n = old.numel()
    tiles = max(1, _triton().cdiv(n, DIFF_TILE))
    counts = torch.empty(tiles, dtype=torch.int32, device=old.device)
    maskw = torch.empty(tiles * (DIFF_TILE // 32), dtype=torch.int32, device=old.device)
    hpart = torch.empty(2 * tiles if hash_start is not None else 2, dtype=torch.int64, device=old.device)
    _tk()._diff_count_kernel[(tiles,)](old, new, n, counts, maskw, hash_start or 0, hpart, EBITS=ebits,
                                       TILE=DIFF_TILE, HASH=hash_start is not None)
    h = hpart.view(tiles, 2).sum(0) & 0xFFFFFFFF if hash_start is not None else None
    return DiffScan(counts.sum(dtype=torch.int64), h, which, counts, maskw)


def diff_collect(old: torch.Tensor, new: torch.Tensor, scan: DiffScan, nchanged: int, *,
                 values: Values = "delta", update_old: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Second pass: the ``nchanged`` records (``nchanged`` = ``int(scan.count)``, read by the caller with
    one host sync per batch). ``update_old`` writes the new bits of changed positions into ``old``."""
    ebits = _check_pair(old, new)
    if values not in ("delta", "new"):
        raise ValueError(f"values must be 'delta' or 'new', got {values!r}")
    if scan.impl == "reference":
        pos, val = _ref().diff_records(old, new, values, update_old)
        if pos.numel() != nchanged:
            raise RuntimeError(f"diff_collect: {pos.numel()} changes found, {nchanged} expected")
        return pos, val
    pos = torch.empty(nchanged, dtype=torch.int32, device=old.device)
    val = torch.empty(nchanged, dtype=torch.int32, device=old.device)
    if nchanged == 0:
        return pos, val
    tiles = scan.tile_counts.numel()
    offsets = torch.cumsum(scan.tile_counts, 0, dtype=torch.int64) - scan.tile_counts
    _tk()._diff_collect_kernel[(tiles,)](old, new, old.numel(), offsets, scan.mask_words, pos, val,
                                         EBITS=ebits, TILE=DIFF_TILE, DELTA=values == "delta",
                                         UPDATE_OLD=update_old)
    return pos, val


def diff_records(old: torch.Tensor, new: torch.Tensor, *, values: Values = "delta", update_old: bool = False,
                 impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Both passes with one host sync (the change count)."""
    scan = diff_scan(old, new, impl=impl)
    return diff_collect(old, new, scan, int(scan.count), values=values, update_old=update_old)


def pack_compact(pos: torch.Tensor, codes: torch.Tensor, ebits: int, *,
                 impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Compact body of the records: ``(words, nwords)``. ``words`` is an int32 buffer whose first
    ``nwords`` (0-d int64 device tensor) entries are the body; no host sync on the Triton path."""
    if pos.dtype != torch.int32 or codes.dtype != torch.int32 or pos.shape != codes.shape or pos.dim() != 1:
        raise ValueError("pack_compact: pos and codes must be 1-D int32 tensors of the same length")
    if ebits not in (16, 32):
        raise ValueError(f"ebits must be 16 or 32, got {ebits}")
    which = resolve_impl(impl, pos)
    m = pos.numel()
    dev = pos.device
    if which == "reference" or m == 0:
        words = _ref().pack_compact(pos, codes, ebits)
        return words, torch.tensor(words.numel(), dtype=torch.int64, device=dev)
    nb = compact_num_blocks(m)
    slot = slot_words(ebits)
    slots = torch.empty(nb * slot, dtype=torch.int32, device=dev)
    sizes = torch.empty(nb, dtype=torch.int64, device=dev)
    meta = torch.empty(nb * META_WORDS, dtype=torch.int32, device=dev)
    scratch = torch.empty(nb * 4 * RANK_BLOCK, dtype=torch.int32, device=dev)
    tk = _tk()
    tk._pack_kernel[(nb,)](pos, codes, m, slots, sizes, meta, scratch, EBITS=ebits, R=RANK_BLOCK,
                           SLOT=slot, WT=128, SEARCH_STEPS=(RANK_BLOCK).bit_length() + 1, num_warps=8)
    offsets = torch.cumsum(sizes, 0) - sizes
    out = torch.empty(META_WORDS * nb + nb * slot, dtype=torch.int32, device=dev)
    tk._assemble_kernel[(nb,)](slots, sizes, offsets, meta, out, nb, SLOT=slot, CT=512)
    return out, META_WORDS * nb + sizes.sum()


def unpack_compact(words: torch.Tensor, n: int, ebits: int, nchanged: int, *,
                   impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode and validate a compact body (exactly its words) into records.

    Raises :class:`SyncFormatError` (after one host sync on the Triton path) when the body is not a
    canonical encoding of ``nchanged`` strictly increasing positions in ``[0, n)``; nothing is written
    to any weight here."""
    pos, val, bad = unpack_compact_deferred(words, n, ebits, nchanged, impl=impl)
    if bad is not None and bool(bad):  # the one host sync of the decode
        raise SyncFormatError("compact body failed validation (bad metadata, bit counts, offsets or "
                              "positions out of range / not increasing)")
    return pos, val


def unpack_compact_deferred(words: torch.Tensor, n: int, ebits: int, nchanged: int, *,
                            impl: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Like :func:`unpack_compact` without the host sync: returns ``(pos, val, bad)`` where ``bad`` is a
    0-d bool device tensor (``None`` when the check already ran on the host). Records are only valid
    when ``bad`` is false; the caller must check it before using them. Structural errors found without
    touching the device (lengths) still raise :class:`SyncFormatError` immediately."""
    if words.dtype != torch.int32 or words.dim() != 1:
        raise ValueError("unpack_compact: words must be a 1-D int32 tensor")
    if ebits not in (16, 32):
        raise ValueError(f"ebits must be 16 or 32, got {ebits}")
    which = resolve_impl(impl, words)
    m = int(nchanged)
    if which == "reference" or m <= 0 or m > n:
        pos, val = _ref().unpack_compact(words, n, ebits, m)
        return pos, val, None
    dev = words.device
    nb = compact_num_blocks(m)
    total = words.numel()
    if total < META_WORDS * nb:
        raise SyncFormatError(f"compact body truncated: {total} words < {META_WORDS * nb} metadata words")
    pos = torch.zeros(m, dtype=torch.int32, device=dev)
    val = torch.zeros(m, dtype=torch.int32, device=dev)
    err = torch.empty(nb, dtype=torch.int32, device=dev)
    sizes = torch.empty(nb, dtype=torch.int64, device=dev)
    _tk()._unpack_kernel[(nb,)](words, total, n, m, pos, val, err, sizes, EBITS=ebits, R=RANK_BLOCK,
                                num_warps=8)
    offs = words[1: META_WORDS * nb: META_WORDS].to(torch.int64) & 0xFFFFFFFF
    bad = (err != 0).any() | (sizes < 0).any() | (offs != torch.cumsum(sizes, 0) - sizes).any() \
        | (META_WORDS * nb + sizes.sum() != total)
    if m > 1:
        bad = bad | (pos[1:] <= pos[:-1]).any()
    return pos, val, bad


def positions_bad(pos: torch.Tensor, n: int) -> torch.Tensor:
    """0-d bool device tensor: ``pos`` is not strictly increasing within ``[0, n)`` (no host sync)."""
    if pos.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=pos.device)
    bad = (pos[0] < 0) | (pos[-1] >= n)
    if pos.numel() > 1:
        bad = bad | (pos[1:] <= pos[:-1]).any()
    return bad


def check_positions(pos: torch.Tensor, n: int) -> None:
    """Raise :class:`SyncFormatError` unless ``pos`` is strictly increasing within ``[0, n)`` (one sync)."""
    if bool(positions_bad(pos, n)):
        raise SyncFormatError(f"indices out of range [0, {n}) or not strictly increasing")


def apply_records(bits: torch.Tensor, pos: torch.Tensor, val: torch.Tensor, *, values: Values = "delta",
                  negate: bool = False, impl: str | None = None) -> None:
    """Write records into ``bits`` in place. Positions must already be validated (see
    :func:`check_positions` / :func:`unpack_compact`). ``negate`` undoes a delta application."""
    ebits = _check_bits("bits", bits)
    if values not in ("delta", "new"):
        raise ValueError(f"values must be 'delta' or 'new', got {values!r}")
    if pos.shape != val.shape or pos.dtype != torch.int32 or val.dtype != torch.int32:
        raise ValueError("apply_records: pos and val must be int32 tensors of the same shape")
    if negate and values != "delta":
        raise ValueError("negate is only defined for delta records")
    if resolve_impl(impl, bits) == "reference":
        _ref().apply_records(bits, pos, val, values, negate)
        return
    m = pos.numel()
    if m == 0:
        return
    grid = _triton().cdiv(m, _BLOCK)
    _tk()._apply_kernel[(grid,)](bits, pos, val, m, EBITS=ebits, BLOCK=_BLOCK, DELTA=values == "delta",
                                 NEGATE=negate)

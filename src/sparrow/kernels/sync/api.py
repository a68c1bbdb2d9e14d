"""Validated entry points of the sync kernels, dispatching to Triton or to the PyTorch reference.

``impl`` is a :data:`~sparrow.kernels.common.impl.Impl`: ``"auto"`` (default) runs Triton for CUDA tensors
and the reference elsewhere; ``impl="triton"`` on CPU tensors needs ``TRITON_INTERPRET=1`` (the tests).

All functions take flat bit views (``int16`` for bf16 / fp16, ``int32`` for fp32; see
:func:`~sparrow.kernels.sync.common.bits_view`). Records are ``(pos: int32[m], val: int32[m])`` with
ascending positions; ``val`` is either the delta code ``c = zigzag(new - old) - 1`` (``values="delta"``)
or the new bit pattern zero-extended to 32 bits (``values="new"``).

The ``group_*`` functions process a list of slices (same bit dtype, same device) with one kernel launch
per stage, so the cost of a sync does not grow with the number of tensors; records of a group are
concatenated slice after slice (``rec_off[s]`` is where slice ``s`` starts). The single-slice
functions are groups of one.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from ..common.impl import Impl, resolve_impl
from .common import (
    DIFF_TILE,
    MAX_SLICE_ELEMS,
    META_WORDS,
    RANK_BLOCK,
    SyncFormatError,
    compact_num_blocks,
    slot_words,
)

Values = Literal["delta", "new"]
#: What :func:`~sparrow.kernels.common.impl.resolve_impl` turns an ``Impl`` into.
Resolved = Literal["reference", "triton"]

_BLOCK = 1024  # records per program of the apply kernel
#: Tiles (of ``DIFF_TILE`` elements) per program of the full-data kernels (scan, collect, hash).
TPP = 8
_LAYOUT_CACHE = 64


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether Triton can be imported (the tests skip the Triton paths without it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _tk():
    from . import triton_kernels

    return triton_kernels


def _ref():
    from . import reference

    return reference


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _steps(nslices: int) -> int:
    """Binary-search steps over ``nslices`` entries, rounded up to a multiple of 8: the kernels compile once per
    value, and a sync's slice count follows the data (which slices changed, which codec each takes)."""
    return -(-(nslices.bit_length() + 1) // 8) * 8


def _dev_i64(values: Sequence[int], dev: torch.device) -> torch.Tensor:
    """A small int64 device array from host ints without a stream sync (pinned, non-blocking copy)."""
    t = torch.tensor(list(values), dtype=torch.int64)
    if dev.type == "cuda":
        return t.pin_memory().to(dev, non_blocking=True)
    return t.to(dev)


def _cum(counts: Sequence[int]) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def _aligned(ts: Sequence[torch.Tensor]) -> bool:
    """All slices start 16-byte aligned and have a multiple of 8 elements (vectorised full-data kernels)."""
    return all(t.data_ptr() % 16 == 0 and t.numel() % 8 == 0 for t in ts)


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


def _check_group(ts: Sequence[torch.Tensor], name: str) -> int:
    if not ts:
        raise ValueError(f"{name}: empty group")
    ebits = {_check_bits(name, t) for t in ts}
    devs = {t.device for t in ts}
    if len(ebits) != 1 or len(devs) != 1:
        raise ValueError(f"{name}: a group needs one bit dtype and one device, got {ebits} bits on {devs}")
    return ebits.pop()


@dataclass
class _Layout:
    """Tiling of a list of slices for the full-data kernels (scan, collect, hash): slice ``s`` has
    ``tiles[s]`` tiles of ``DIFF_TILE`` elements, handled by ``progs[s]`` programs of ``TPP`` tiles each.
    Device copies of the cumulative counts and the program -> slice table are cached per slicing."""

    ns: tuple[int, ...]
    tile_cum: list[int]
    prog_cum: list[int]
    n_d: torch.Tensor
    tile_cum_d: torch.Tensor
    prog_cum_d: torch.Tensor
    prog_slice_d: torch.Tensor

    @property
    def tiles(self) -> int:
        return self.tile_cum[-1]

    @property
    def programs(self) -> int:
        return self.prog_cum[-1]


_LAYOUTS: "OrderedDict[tuple, _Layout]" = OrderedDict()


def _layout(ns: Sequence[int], dev: torch.device) -> _Layout:
    key = (str(dev), tuple(int(n) for n in ns))
    lay = _LAYOUTS.get(key)
    if lay is not None:
        _LAYOUTS.move_to_end(key)
        return lay
    tiles = [_cdiv(n, DIFF_TILE) for n in key[1]]
    progs = [_cdiv(t, TPP) for t in tiles]
    tile_cum, prog_cum = _cum(tiles), _cum(progs)
    table = _dev_i64(key[1] + tuple(tile_cum) + tuple(prog_cum), dev)
    S = len(tiles)
    slice_of = torch.repeat_interleave(torch.arange(S, dtype=torch.int32), torch.tensor(progs, dtype=torch.int64))
    lay = _Layout(key[1], tile_cum, prog_cum, table[:S], table[S:2 * S + 1], table[2 * S + 1:],
                  slice_of.to(dev) if dev.type != "cuda" else slice_of.pin_memory().to(dev, non_blocking=True))
    _LAYOUTS[key] = lay
    if len(_LAYOUTS) > _LAYOUT_CACHE:
        _LAYOUTS.popitem(last=False)
    return lay


def _lanes64(lanes32: torch.Tensor) -> torch.Tensor:
    """int32 [.., 2] lane accumulators (wrapped mod 2^32) -> int64 lanes in [0, 2^32)."""
    return lanes32.to(torch.int64) & 0xFFFFFFFF


def hash_zeros(nslices: int, device: torch.device | str) -> torch.Tensor:
    """A zeroed int32 ``[nslices, 2]`` accumulator for the ``hash_out`` arguments (lanes mod 2^32)."""
    return torch.zeros(nslices, 2, dtype=torch.int32, device=device)


def _add_lanes(out: torch.Tensor, row: int, lanes: torch.Tensor) -> None:
    """out[row] += lanes (mod 2^32) for an int32 accumulator and int64 lanes."""
    v = (out[row].to(torch.int64) + lanes) & 0xFFFFFFFF
    out[row] = (v - ((v >> 31) << 32)).to(torch.int32)


# ---------------------------------------------------------------------------------------------------
# hashing
# ---------------------------------------------------------------------------------------------------

def group_hash_bits(bits: Sequence[torch.Tensor], starts: Sequence[int], *, impl: Impl = "auto") -> torch.Tensor:
    """Hash lanes of each slice (int64 ``[S, 2]`` on the device, no host sync); slice ``s`` is hashed
    at positions ``starts[s] + i``. Fold a row with :func:`~sparrow.kernels.sync.common.combine_hash`.

    One launch for the whole group: each program hashes ``TPP`` tiles in registers and adds its two
    32-bit sums into the slice's accumulator with atomics (integer sums mod 2^32: the result does not
    depend on the order)."""
    ebits = _check_group(bits, "bits")
    dev = bits[0].device
    if len(starts) != len(bits):
        raise ValueError("bits and starts must have the same length")
    if resolve_impl(impl, bits[0]) == "reference":
        return torch.stack([_ref().hash_bits(b, st) for b, st in zip(bits, starts)])
    lay = _layout([b.numel() for b in bits], dev)
    out = hash_zeros(len(bits), dev)
    if lay.programs:
        meta = _dev_i64([b.data_ptr() for b in bits] + [int(st) for st in starts], dev)
        S = len(bits)
        _tk()._hash_group_kernel[(lay.programs,)](meta[:S], lay.n_d, meta[S:], lay.tile_cum_d, lay.prog_cum_d,
                                                  lay.prog_slice_d, out, EBITS=ebits, TILE=DIFF_TILE, TPP=TPP,
                                                  ALIGNED=_aligned(bits))
    return _lanes64(out)


def hash_bits(bits: torch.Tensor, start: int = 0, *, impl: Impl = "auto") -> torch.Tensor:
    """Two 32-bit hash lanes (int64 tensor ``[2]`` on ``bits.device``) of the bit patterns at positions
    ``start + i``; fold with :func:`~sparrow.kernels.sync.common.combine_hash`. No host sync."""
    return group_hash_bits([bits], [start], impl=impl)[0]


# ---------------------------------------------------------------------------------------------------
# diff
# ---------------------------------------------------------------------------------------------------

@dataclass
class GroupScan:
    """First pass of the diff over a group: per-slice change counts (int64 ``[S]`` device tensor) and,
    if asked, hash lanes of the new bits (``[S, 2]``). The Triton path keeps the per-tile counts and
    the 1-bit change mask for the second pass."""

    counts: torch.Tensor
    hashes: torch.Tensor | None
    impl: Resolved
    tile_counts: torch.Tensor | None = None
    mask_words: torch.Tensor | None = None
    layout: _Layout | None = None
    _offsets: torch.Tensor | None = None

    def offsets(self) -> torch.Tensor:
        """Exclusive prefix sum of the tile counts (int64, on the device; computed once)."""
        if self._offsets is None:
            tc = self.tile_counts
            self._offsets = torch.cumsum(tc, 0, dtype=torch.int64) - tc
        return self._offsets


@dataclass
class DiffScan:
    """:class:`GroupScan` of a single slice (``count``: 0-d int64, ``hash``: ``[2]`` or None)."""

    count: torch.Tensor
    hash: torch.Tensor | None
    impl: Resolved
    group: GroupScan | None = None


def group_diff_scan(olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor], *,
                    hash_starts: Sequence[int] | None = None, impl: Impl = "auto") -> GroupScan:
    """Count the positions whose bit patterns differ, per slice (device-side; no host sync).

    Triton: one launch for the whole group (``TPP`` tiles per program); per tile a change count and a
    1-bit mask, per slice the count (and with ``hash_starts`` the hash lanes of the new bits) through
    atomics."""
    if len(olds) != len(news):
        raise ValueError("olds and news must have the same length")
    for o, x in zip(olds, news):
        _check_pair(o, x)
    ebits = _check_group(olds, "olds")
    dev = olds[0].device
    which = resolve_impl(impl, olds[0])
    if which == "reference":
        counts = torch.stack([(o != x).sum().to(torch.int64) for o, x in zip(olds, news)])
        h = None
        if hash_starts is not None:
            h = torch.stack([_ref().hash_bits(x, st) for x, st in zip(news, hash_starts)])
        return GroupScan(counts, h, which)
    S = len(olds)
    lay = _layout([o.numel() for o in olds], dev)
    G = lay.tiles
    do_hash = hash_starts is not None
    tile_counts = torch.empty(max(G, 1), dtype=torch.int32, device=dev)
    maskw = torch.empty(max(G, 1) * (DIFF_TILE // 32), dtype=torch.int32, device=dev)
    acc = torch.zeros(3 * S, dtype=torch.int32, device=dev)  # counts, then hash lanes
    if G:
        meta = _dev_i64([o.data_ptr() for o in olds] + [x.data_ptr() for x in news]
                        + (list(hash_starts) if do_hash else [0] * S), dev)
        _tk()._diff_count_group_kernel[(lay.programs,)](
            meta[:S], meta[S:2 * S], lay.n_d, meta[2 * S:], lay.tile_cum_d, lay.prog_cum_d, lay.prog_slice_d,
            tile_counts, maskw, acc[:S], acc[S:], EBITS=ebits, TILE=DIFF_TILE, TPP=TPP, HASH=do_hash,
            ALIGNED=_aligned(olds) and _aligned(news))
    counts = acc[:S].to(torch.int64)
    h = _lanes64(acc[S:].view(S, 2)) if do_hash else None
    return GroupScan(counts, h, which, tile_counts[:G], maskw, lay)


def group_diff_collect(olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor], scan: GroupScan,
                       counts: Sequence[int], *, values: Values = "delta", update_old: bool = False,
                       hash_starts: Sequence[int] | None = None, hash_out: torch.Tensor | None = None,
                       sub: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Second pass: the records of all slices, concatenated (``counts`` = the scan's counts, read by the
    caller with one host sync per group), and ``rec_off`` (where each slice's records start; positions
    are relative to the slice). ``update_old`` writes the new bits of changed positions into ``olds``.

    ``sub = (a, b)``: only slices ``a .. b-1`` of the scanned group (records and ``rec_off`` of those).
    ``hash_out`` (int32 ``[S, 2]``, see :func:`hash_zeros`; row ``s`` for slice ``s`` of the group):
    adds the hash change ``lanes(new) - lanes(old)`` over the changed elements of each slice at
    positions ``hash_starts[s] + i`` (the incremental hash update; fused, no extra pass)."""
    if values not in ("delta", "new"):
        raise ValueError(f"values must be 'delta' or 'new', got {values!r}")
    ebits = _check_group(olds, "olds")
    dev = olds[0].device
    a, b = sub if sub is not None else (0, len(olds))
    if not 0 <= a <= b <= len(olds) or len(counts) != len(olds):
        raise ValueError("group_diff_collect: bad sub range or counts length")
    do_hash = hash_out is not None
    if do_hash and (hash_starts is None or tuple(hash_out.shape) != (len(olds), 2) or hash_out.dtype != torch.int32):
        raise ValueError("hash_out must be an int32 [S, 2] accumulator and needs hash_starts")
    rec_off = _cum(counts[a:b])
    if scan.impl == "reference":
        ref = _ref()
        pos, val = [], []
        for s in range(a, b):
            o, x, m = olds[s], news[s], counts[s]
            if do_hash:
                p0 = torch.nonzero(o != x).reshape(-1)
                _add_lanes(hash_out, s, ref.hash_delta(o[p0], x[p0], p0, int(hash_starts[s])))
            p, v = ref.diff_records(o, x, values, update_old)
            if p.numel() != m:
                raise RuntimeError(f"diff_collect: {p.numel()} changes found, {m} expected")
            pos.append(p)
            val.append(v)
        empty = torch.zeros(0, dtype=torch.int32, device=dev)
        return (torch.cat(pos) if pos else empty, torch.cat(val) if val else empty, rec_off[:-1])
    M = rec_off[-1]
    pos = torch.empty(M, dtype=torch.int32, device=dev)
    val = torch.empty(M, dtype=torch.int32, device=dev)
    lay = scan.layout
    nprog = lay.prog_cum[b] - lay.prog_cum[a]
    if M and nprog:
        S = len(olds)
        meta = _dev_i64([o.data_ptr() for o in olds] + [x.data_ptr() for x in news]
                        + (list(hash_starts) if do_hash else [0] * S), dev)
        rec_base = sum(counts[:a])
        _tk()._diff_collect_group_kernel[(nprog,)](
            meta[:S], meta[S:2 * S], lay.n_d, meta[2 * S:], lay.tile_cum_d, lay.prog_cum_d, lay.prog_slice_d,
            lay.prog_cum[a], scan.tile_counts, scan.offsets(), rec_base, scan.mask_words, pos, val,
            hash_out if do_hash else pos, EBITS=ebits, TILE=DIFF_TILE, TPP=TPP, DELTA=values == "delta",
            UPDATE_OLD=update_old, HASH=do_hash)
    return pos, val, rec_off[:-1]


def diff_scan(old: torch.Tensor, new: torch.Tensor, *, hash_start: int | None = None,
              impl: Impl = "auto") -> DiffScan:
    """Count the positions whose bit patterns differ (device-side; no host sync)."""
    g = group_diff_scan([old], [new], hash_starts=None if hash_start is None else [hash_start], impl=impl)
    return DiffScan(g.counts[0], None if g.hashes is None else g.hashes[0], g.impl, g)


def diff_collect(old: torch.Tensor, new: torch.Tensor, scan: DiffScan, nchanged: int, *,
                 values: Values = "delta", update_old: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Second pass of :func:`diff_scan` (``nchanged = int(scan.count)``)."""
    pos, val, _ = group_diff_collect([old], [new], scan.group, [nchanged], values=values, update_old=update_old)
    return pos, val


def diff_records(old: torch.Tensor, new: torch.Tensor, *, values: Values = "delta", update_old: bool = False,
                 impl: Impl = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Both passes with one host sync (the change count)."""
    scan = diff_scan(old, new, impl=impl)
    return diff_collect(old, new, scan, int(scan.count), values=values, update_old=update_old)


# ---------------------------------------------------------------------------------------------------
# compact packing
# ---------------------------------------------------------------------------------------------------

def group_pack_compact(pos: torch.Tensor, codes: torch.Tensor, counts: Sequence[int], ebits: int, *,
                       impl: Impl = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compact bodies of the concatenated records of a group (slice ``s`` has ``counts[s]`` records).

    Returns ``(out, base, nwords)``: slice ``s``'s body is ``out[base[s] : base[s] + nwords[s]]``;
    ``base`` and ``nwords`` are int64 device tensors (read them with one host sync per group)."""
    if pos.dtype != torch.int32 or codes.dtype != torch.int32 or pos.shape != codes.shape or pos.dim() != 1:
        raise ValueError("pack_compact: pos and codes must be 1-D int32 tensors of the same length")
    if ebits not in (16, 32):
        raise ValueError(f"ebits must be 16 or 32, got {ebits}")
    if sum(counts) != pos.numel():
        raise ValueError(f"pack_compact: counts sum to {sum(counts)}, got {pos.numel()} records")
    dev = pos.device
    S = len(counts)
    rec_off = _cum(counts)
    if resolve_impl(impl, pos) == "reference" or pos.numel() == 0:
        bodies = [_ref().pack_compact(pos[rec_off[s]:rec_off[s + 1]], codes[rec_off[s]:rec_off[s + 1]], ebits)
                  for s in range(S)]
        sizes = [b.numel() for b in bodies]
        out = torch.cat(bodies) if bodies else torch.zeros(0, dtype=torch.int32, device=dev)
        return out, _dev_i64(_cum(sizes)[:-1], dev), _dev_i64(sizes, dev)
    nbs = [compact_num_blocks(m) for m in counts]
    bcum = _cum(nbs)
    NB = bcum[-1]
    slot = slot_words(ebits)
    slots = torch.empty(NB * slot, dtype=torch.int32, device=dev)
    sizes = torch.empty(NB, dtype=torch.int64, device=dev)
    meta = torch.empty(NB * META_WORDS, dtype=torch.int32, device=dev)
    scratch = torch.empty(NB * 4 * RANK_BLOCK, dtype=torch.int32, device=dev)
    bcum_d = _dev_i64(bcum, dev)
    tk = _tk()
    tk._pack_group_kernel[(NB,)](pos, codes, _dev_i64(counts, dev), _dev_i64(rec_off[:-1], dev), bcum_d, S,
                                 slots, sizes, meta, scratch, EBITS=ebits, R=RANK_BLOCK, SLOT=slot, WT=128,
                                 SEARCH_STEPS=RANK_BLOCK.bit_length() + 1, STEPS=_steps(S), num_warps=8)
    excl = torch.cat([torch.zeros(1, dtype=torch.int64, device=dev), torch.cumsum(sizes, 0)])
    nwords = excl[bcum_d[1:]] - excl[bcum_d[:-1]] + META_WORDS * _dev_i64(nbs, dev)
    base = torch.cumsum(nwords, 0) - nwords
    out = torch.empty(META_WORDS * NB + NB * slot, dtype=torch.int32, device=dev)
    tk._assemble_group_kernel[(NB,)](slots, sizes, excl, bcum_d, base, S, meta, out, SLOT=slot, CT=512,
                                     STEPS=_steps(S))
    return out, base, nwords


def pack_compact(pos: torch.Tensor, codes: torch.Tensor, ebits: int, *,
                 impl: Impl = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Compact body of the records: ``(words, nwords)``; the first ``nwords`` (0-d int64 device tensor)
    entries of ``words`` are the body. No host sync on the Triton path."""
    out, base, nwords = group_pack_compact(pos, codes, [pos.numel()], ebits, impl=impl)
    return out, nwords[0]


# ---------------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------------

def group_unpack_compact(words: torch.Tensor, entries: Sequence[tuple[int, int, int, int]], ebits: int, *,
                         impl: Impl = "auto"
                         ) -> tuple[torch.Tensor, torch.Tensor, list[int], torch.Tensor | None]:
    """Decode several compact bodies stored in one int32 buffer: ``entries[s] = (word_offset, nwords, n,
    nchanged)``. Returns ``(pos, val, rec_off, bad)``: concatenated records, where each body's records
    start, and a 0-d bool device flag (``None`` when every check already ran on the host) that must be
    false before the records are used. Length problems visible on the host raise
    :class:`SyncFormatError` immediately. Nothing is written to any weight here."""
    if words.dtype != torch.int32 or words.dim() != 1:
        raise ValueError("unpack_compact: words must be a 1-D int32 tensor")
    if ebits not in (16, 32):
        raise ValueError(f"ebits must be 16 or 32, got {ebits}")
    dev = words.device
    counts = [int(e[3]) for e in entries]
    rec_off = _cum(counts)
    for off, nw, n, m in entries:
        if m < 0 or m > n:
            raise SyncFormatError(f"compact body claims {m} changes for a slice of {n} elements")
        if off < 0 or off + nw > words.numel():
            raise SyncFormatError("compact body lies outside its buffer")
        if m == 0 and nw != 0:
            raise SyncFormatError(f"compact body with 0 changes must be empty, got {nw} words")
        if nw < META_WORDS * compact_num_blocks(m):
            raise SyncFormatError(f"compact body truncated: {nw} words < {META_WORDS * compact_num_blocks(m)} "
                                  "metadata words")
    if resolve_impl(impl, words) == "reference" or rec_off[-1] == 0:
        pos, val = [], []
        for off, nw, n, m in entries:
            p, v = _ref().unpack_compact(words[off:off + nw], n, ebits, m)
            pos.append(p)
            val.append(v)
        empty = torch.zeros(0, dtype=torch.int32, device=dev)
        return (torch.cat(pos) if pos else empty, torch.cat(val) if val else empty, rec_off[:-1], None)
    S = len(entries)
    nbs = [compact_num_blocks(m) for m in counts]
    bcum = _cum(nbs)
    NB = bcum[-1]
    M = rec_off[-1]
    pos = torch.zeros(M, dtype=torch.int32, device=dev)
    val = torch.zeros(M, dtype=torch.int32, device=dev)
    err = torch.ones(NB, dtype=torch.int32, device=dev)
    _tk()._unpack_group_kernel[(NB,)](
        words, _dev_i64([e[0] for e in entries], dev), _dev_i64([e[1] for e in entries], dev),
        _dev_i64([e[2] for e in entries], dev), _dev_i64(counts, dev), _dev_i64(rec_off[:-1], dev),
        _dev_i64(bcum, dev), S, pos, val, err, EBITS=ebits, R=RANK_BLOCK, STEPS=_steps(S), num_warps=8)
    return pos, val, rec_off[:-1], (err != 0).any()


def unpack_compact_deferred(words: torch.Tensor, n: int, ebits: int, nchanged: int, *,
                            impl: Impl = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Single-body :func:`group_unpack_compact`: ``(pos, val, bad)``."""
    pos, val, _, bad = group_unpack_compact(words, [(0, words.numel(), n, int(nchanged))], ebits, impl=impl)
    return pos, val, bad


def unpack_compact(words: torch.Tensor, n: int, ebits: int, nchanged: int, *,
                   impl: Impl = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Decode and validate a compact body (exactly its words) into records.

    Raises :class:`SyncFormatError` (after one host sync on the Triton path) when the body is not a
    canonical encoding of ``nchanged`` increasing positions in ``[0, n)``; nothing is written here."""
    pos, val, bad = unpack_compact_deferred(words, n, ebits, nchanged, impl=impl)
    if bad is not None and bool(bad):  # the one host sync of the decode
        raise SyncFormatError("compact body failed validation (bad metadata, bit counts, offsets or "
                              "positions out of range / not increasing)")
    return pos, val


def positions_bad(pos: torch.Tensor, n: int) -> torch.Tensor:
    """0-d bool device tensor: ``pos`` is not strictly increasing within ``[0, n)`` (no host sync)."""
    if pos.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=pos.device)
    bad = (pos[0] < 0) | (pos[-1] >= n)
    if pos.numel() > 1:
        bad = bad | (pos[1:] <= pos[:-1]).any()
    return bad


# ---------------------------------------------------------------------------------------------------
# apply
# ---------------------------------------------------------------------------------------------------

def group_apply_records(targets: Sequence[torch.Tensor], pos: torch.Tensor, val: torch.Tensor,
                        counts: Sequence[int], *, values: Values = "delta", negate: bool = False,
                        impl: Impl = "auto", hash_starts: Sequence[int] | None = None,
                        hash_out: torch.Tensor | None = None) -> None:
    """Write concatenated records into several bit views in place (slice ``s`` takes the next
    ``counts[s]`` records). Positions must already be validated. ``negate`` undoes a delta application.

    ``hash_out`` (int32 ``[S, 2]``, see :func:`hash_zeros`) receives, per slice, the hash change
    ``lanes(new) - lanes(old)`` of the written elements at positions ``hash_starts[s] + pos`` (fused
    into the apply: the receiver's incremental verification touches only the changed elements)."""
    ebits = _check_group(targets, "targets")
    if values not in ("delta", "new"):
        raise ValueError(f"values must be 'delta' or 'new', got {values!r}")
    if pos.shape != val.shape or pos.dtype != torch.int32 or val.dtype != torch.int32:
        raise ValueError("apply_records: pos and val must be int32 tensors of the same shape")
    if negate and values != "delta":
        raise ValueError("negate is only defined for delta records")
    if sum(counts) != pos.numel():
        raise ValueError(f"apply_records: counts sum to {sum(counts)}, got {pos.numel()} records")
    do_hash = hash_out is not None
    if do_hash and (hash_starts is None or tuple(hash_out.shape) != (len(targets), 2)
                    or hash_out.dtype != torch.int32):
        raise ValueError("hash_out must be an int32 [S, 2] accumulator and needs hash_starts")
    rec_off = _cum(counts)
    dev = targets[0].device
    if resolve_impl(impl, targets[0]) == "reference":
        ref = _ref()
        for s, t in enumerate(targets):
            a, b = rec_off[s], rec_off[s + 1]
            if b > a:
                p = pos[a:b].to(torch.int64)
                old = t[p].clone() if do_hash else None
                ref.apply_records(t, pos[a:b], val[a:b], values, negate)
                if do_hash:
                    _add_lanes(hash_out, s, ref.hash_delta(old, t[p], p, int(hash_starts[s])))
        return
    tiles = [_cdiv(m, _BLOCK) for m in counts]
    cum = _cum(tiles)
    if cum[-1] == 0:
        return
    S = len(targets)
    meta = _dev_i64([t.data_ptr() for t in targets] + rec_off[:-1] + list(counts) + cum
                    + (list(hash_starts) if do_hash else [0] * S), dev)
    _tk()._apply_group_kernel[(cum[-1],)](
        meta[:S], meta[S:2 * S], meta[2 * S:3 * S], meta[3 * S:4 * S + 1], S, pos, val, meta[4 * S + 1:],
        hash_out if do_hash else pos, EBITS=ebits, BLOCK=_BLOCK, DELTA=values == "delta", NEGATE=negate,
        STEPS=_steps(S), HASH=do_hash)


def apply_records(bits: torch.Tensor, pos: torch.Tensor, val: torch.Tensor, *, values: Values = "delta",
                  negate: bool = False, impl: Impl = "auto", hash_start: int | None = None,
                  hash_out: torch.Tensor | None = None) -> None:
    """Write records into ``bits`` in place. Positions must already be validated (see
    :func:`positions_bad` / :func:`unpack_compact`). ``negate`` undoes a delta application.
    ``hash_out`` (int32 ``[1, 2]``) receives the hash change of the written elements (positions
    ``hash_start + pos``)."""
    group_apply_records([bits], pos, val, [pos.numel()], values=values, negate=negate, impl=impl,
                        hash_starts=None if hash_out is None else [hash_start or 0], hash_out=hash_out)

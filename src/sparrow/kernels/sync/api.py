"""Validated entry points of the sync kernels, dispatching to Triton or to the PyTorch reference.

``impl`` is a :data:`~sparrow.kernels.common.impl.Impl`: ``"auto"`` (default) runs Triton for CUDA tensors
and the reference elsewhere; ``impl="triton"`` on CPU tensors needs ``TRITON_INTERPRET=1`` (the tests).

All functions take flat bit views (``int16`` for bf16 / fp16, ``int32`` for fp32; see
:func:`~sparrow.kernels.sync.common.bits_view`) and work on lists of slices of one bit width (a *group*) with
one kernel launch per stage, so the cost of a sync does not grow with the number of tensors.

The encode of a group is two calls around one host read:

* :func:`scan_blocks` (no host sync): per slice the number of changed elements and the words of its compact
  body, as device tensors; the caller reads them (its one host sync) to size its buffers;
* :func:`write_bodies` (no host sync): every slice's body (compact, COO or dense) written at a byte offset of
  the caller's buffer, the old tensors updated and the hash change of each slice accumulated on the device.

The decode of compact bodies is :func:`apply_compact` (no host sync): headers checked into a gate flag, then
one program per block decodes, validates and adds its deltas in place. Records (``(pos: int32[m], val:
int32[m])`` with ascending positions; ``val`` the delta code ``c = zigzag(new - old) - 1`` (``"delta"``) or the
new bit pattern zero-extended (``"new"``)) are what COO bodies and undo logs hold: :func:`diff_records`,
:func:`group_apply_records`.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from ..._transfer import to_device
from ..common.impl import Impl, resolve_impl
from .common import (
    DEFAULT_SPAN_LOG2,
    HEADER_WORDS,
    MAX_SLICE_ELEMS,
    SyncFormatError,
    check_span_log2,
    lanes_i32,
    num_blocks,
)

Values = Literal["delta", "new"]
#: What :func:`~sparrow.kernels.common.impl.resolve_impl` turns an ``Impl`` into.
Resolved = Literal["reference", "triton"]
#: Body kinds :func:`write_bodies` writes.
MODES = {"compact": 0, "coo": 1, "dense": 2}

_BLOCK = 1024  # records per program of the records kernel
#: Tiles per program and elements per tile of the hash kernel.
TPP = 8
_HASH_TILE = 1024
_LAYOUT_CACHE = 64
_GATE_MAX = 8  # gate flags a kernel reads


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


def _dev_ints(values: Sequence[int], dev: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A small integer device array from host ints without a host sync (pinned, non-blocking copy)."""
    return to_device(torch.tensor(list(values), dtype=dtype), dev)


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


def _check_gate(gate: torch.Tensor | None, slot: int = 0) -> None:
    if gate is None:
        return
    if gate.dtype != torch.int32 or gate.dim() != 1 or not 1 <= gate.numel() <= _GATE_MAX:
        raise ValueError(f"gate must be a 1-D int32 tensor of 1..{_GATE_MAX} flags, got "
                         f"{gate.dtype}{tuple(gate.shape)}")
    if not 0 <= slot < gate.numel():
        raise ValueError(f"gate slot {slot} outside the {gate.numel()} flags")


def _check_hash_out(hash_out: torch.Tensor | None, rows: int, name: str = "hash_out") -> None:
    if hash_out is not None and (hash_out.dtype != torch.int32 or tuple(hash_out.shape) != (rows, 2)):
        raise ValueError(f"{name} must be an int32 [{rows}, 2] accumulator (see hash_zeros), got "
                         f"{hash_out.dtype}{tuple(hash_out.shape)}")


def hash_zeros(nslices: int, device: torch.device | str) -> torch.Tensor:
    """A zeroed int32 ``[nslices, 2]`` accumulator for the ``hash_out`` arguments (lanes mod 2^32)."""
    return torch.zeros(nslices, 2, dtype=torch.int32, device=device)


def _lanes64(lanes32: torch.Tensor) -> torch.Tensor:
    """int32 [.., 2] lane accumulators (wrapped mod 2^32) -> int64 lanes in [0, 2^32)."""
    return lanes32.to(torch.int64) & 0xFFFFFFFF


def _add_lanes(out: torch.Tensor, row: int, lanes: torch.Tensor) -> None:
    """out[row] += lanes (mod 2^32) for an int32 accumulator and int64 lanes."""
    out[row] = lanes_i32(out[row].to(torch.int64) + lanes)


# ---------------------------------------------------------------------------------------------------
# hashing
# ---------------------------------------------------------------------------------------------------

@dataclass
class _HashLayout:
    """Tiling of a list of slices for the hash kernel: slice ``s`` has ``tiles[s]`` tiles, handled by
    ``progs[s]`` programs of ``TPP`` tiles each. Device tables cached per slicing."""

    prog_cum: list[int]
    n_d: torch.Tensor
    tile_cum_d: torch.Tensor
    prog_cum_d: torch.Tensor
    prog_slice_d: torch.Tensor

    @property
    def programs(self) -> int:
        return self.prog_cum[-1]


_HASH_LAYOUTS: "OrderedDict[tuple, _HashLayout]" = OrderedDict()


def _cached(cache: OrderedDict, key, make):
    v = cache.get(key)
    if v is not None:
        cache.move_to_end(key)
        return v
    v = cache[key] = make()
    if len(cache) > _LAYOUT_CACHE:
        cache.popitem(last=False)
    return v


def _hash_layout(ns: Sequence[int], dev: torch.device) -> _HashLayout:
    def make() -> _HashLayout:
        tiles = [_cdiv(n, _HASH_TILE) for n in ns]
        progs = [_cdiv(t, TPP) for t in tiles]
        tile_cum, prog_cum = _cum(tiles), _cum(progs)
        S = len(ns)
        table = _dev_ints(list(ns) + tile_cum + prog_cum, dev)
        slice_of = torch.repeat_interleave(torch.arange(S, dtype=torch.int32), torch.tensor(progs, dtype=torch.int64))
        return _HashLayout(prog_cum, table[:S], table[S:2 * S + 1], table[2 * S + 1:], to_device(slice_of, dev))

    return _cached(_HASH_LAYOUTS, (str(dev), tuple(int(n) for n in ns)), make)


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
    lay = _hash_layout([b.numel() for b in bits], dev)
    out = hash_zeros(len(bits), dev)
    if lay.programs:
        meta = _dev_ints([b.data_ptr() for b in bits] + [int(st) for st in starts], dev)
        S = len(bits)
        _tk()._hash_group_kernel[(lay.programs,)](meta[:S], lay.n_d, meta[S:], lay.tile_cum_d, lay.prog_cum_d,
                                                  lay.prog_slice_d, out, EBITS=ebits, TILE=_HASH_TILE, TPP=TPP,
                                                  ALIGNED=_aligned(bits))
    return _lanes64(out)


def hash_bits(bits: torch.Tensor, start: int = 0, *, impl: Impl = "auto") -> torch.Tensor:
    """Two 32-bit hash lanes (int64 tensor ``[2]`` on ``bits.device``) of the bit patterns at positions
    ``start + i``; fold with :func:`~sparrow.kernels.sync.common.combine_hash`. No host sync."""
    return group_hash_bits([bits], [start], impl=impl)[0]


# ---------------------------------------------------------------------------------------------------
# encode: block scan and body writer
# ---------------------------------------------------------------------------------------------------

@dataclass
class _BlockLayout:
    """Blocks of ``2**span_log2`` elements of a list of slices: slice ``s`` owns blocks
    ``[block_cum[s], block_cum[s + 1])`` and mask words from ``mask_off[s]``. Device tables cached."""

    block_cum: list[int]
    mask_words: int
    n_d: torch.Tensor
    block_cum_d: torch.Tensor
    mask_off_d: torch.Tensor
    blk_slice_d: torch.Tensor
    header_words_d: torch.Tensor  # int64 [S]: the header words of each slice's compact body

    @property
    def nblocks(self) -> int:
        return self.block_cum[-1]


_BLOCK_LAYOUTS: "OrderedDict[tuple, _BlockLayout]" = OrderedDict()


def _block_layout(ns: Sequence[int], span_log2: int, dev: torch.device) -> _BlockLayout:
    def make() -> _BlockLayout:
        nbs = [num_blocks(n, span_log2) for n in ns]
        block_cum = _cum(nbs)
        mask_off = _cum([_cdiv(n, 32) for n in ns])
        S = len(ns)
        table = _dev_ints(list(ns) + block_cum + mask_off[:-1] + [HEADER_WORDS * b for b in nbs], dev)
        blk = torch.repeat_interleave(torch.arange(S, dtype=torch.int32), torch.tensor(nbs, dtype=torch.int64))
        return _BlockLayout(block_cum, mask_off[-1], table[:S], table[S:2 * S + 1], table[2 * S + 1:3 * S + 1],
                            to_device(blk, dev), table[3 * S + 1:])

    return _cached(_BLOCK_LAYOUTS, (str(dev), int(span_log2), tuple(int(n) for n in ns)), make)


@dataclass
class BlockScan:
    """What :func:`scan_blocks` found: per slice the changed elements (``counts``) and the words of its compact
    body (``words``, 0 when nothing changed), int64 ``[S]`` device tensors; read both with one host sync. The
    Triton path keeps the change mask and the per-block counts for :func:`write_bodies`."""

    counts: torch.Tensor
    words: torch.Tensor
    impl: Resolved
    span_log2: int
    layout: _BlockLayout | None = None
    mask: torch.Tensor | None = None
    cnt: torch.Tensor | None = None  # int32 [NB] changes per block
    kbits: torch.Tensor | None = None  # int32 [NB] value bits per block
    bwords: torch.Tensor | None = None  # int64 [NB] body words per block
    cnt_cum: torch.Tensor | None = None  # int64 [NB] inclusive prefix sums
    words_cum: torch.Tensor | None = None


def scan_blocks(olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor], *,
                span_log2: int = DEFAULT_SPAN_LOG2, impl: Impl = "auto") -> BlockScan:
    """Count the changed elements of every block of every slice and size its compact body (no host sync).

    Triton: one launch over all blocks of the group reads old and new bits once and writes the change mask
    (1/16 of a bf16 input), then two device prefix sums place every block. Raises ``ValueError`` / ``TypeError``
    for mismatched or unsupported inputs and a bad ``span_log2``."""
    if len(olds) != len(news):
        raise ValueError("olds and news must have the same length")
    for o, x in zip(olds, news):
        _check_pair(o, x)
    ebits = _check_group(olds, "olds")
    check_span_log2(span_log2)
    dev = olds[0].device
    which = resolve_impl(impl, olds[0])
    if which == "reference":
        ref = _ref()
        counts, words = [], []
        for o, x in zip(olds, news):
            cnt, kbits = ref.compact_block_stats(o, x, span_log2)
            counts.append(int(cnt.sum()))  # host sync (reference path: one per slice)
            words.append(ref.compact_words(o.numel(), span_log2, cnt, kbits))
        return BlockScan(torch.tensor(counts, dtype=torch.int64, device=dev),
                         torch.tensor(words, dtype=torch.int64, device=dev), which, span_log2)
    S = len(olds)
    lay = _block_layout([o.numel() for o in olds], span_log2, dev)
    NB = lay.nblocks
    mask = torch.empty(max(lay.mask_words, 1), dtype=torch.int32, device=dev)
    cnt = torch.zeros(max(NB, 1), dtype=torch.int32, device=dev)
    kbits = torch.zeros(max(NB, 1), dtype=torch.int32, device=dev)
    bwords = torch.zeros(max(NB, 1), dtype=torch.int64, device=dev)
    acc = torch.zeros(2 * S, dtype=torch.int64, device=dev)
    if NB:
        meta = _dev_ints([o.data_ptr() for o in olds] + [x.data_ptr() for x in news], dev)
        tile = min(4096, 1 << span_log2)
        _tk()._scan_kernel[(NB,)](meta[:S], meta[S:], lay.n_d, lay.block_cum_d, lay.blk_slice_d, lay.mask_off_d,
                                  mask, cnt, kbits, bwords, acc, S, EBITS=ebits, SPAN=1 << span_log2, TILE=tile,
                                  ALIGNED=_aligned(olds) and _aligned(news), num_warps=8)
    counts = acc[:S]
    words = torch.where(counts > 0, acc[S:] + lay.header_words_d, 0)  # slices with changes carry block headers
    return BlockScan(counts, words, which, span_log2, lay, mask, cnt, kbits, bwords,
                     torch.cumsum(cnt.to(torch.int64), 0), torch.cumsum(bwords, 0))


def body_nbytes(mode: str, n: int, nchanged: int, compact_words: int, ebits: int) -> int:
    """Bytes of a slice's body of kind ``mode`` (``"compact"``, ``"coo"``, ``"dense"``)."""
    if mode == "compact":
        return 4 * compact_words
    if mode == "coo":
        return nchanged * (4 + ebits // 8)
    if mode == "dense":
        return n * (ebits // 8)
    raise ValueError(f"unknown body kind {mode!r}; expected one of {', '.join(MODES)}")


def write_bodies(olds: Sequence[torch.Tensor], news: Sequence[torch.Tensor], scan: BlockScan,
                 counts: Sequence[int], words: Sequence[int], modes: Sequence[str], out: torch.Tensor,
                 offsets: Sequence[int], *, sub: tuple[int, int] | None = None, update_old: bool = False,
                 hash_starts: Sequence[int] | None = None, hash_out: torch.Tensor | None = None,
                 hash_rows: Sequence[int] | None = None) -> None:
    """Write the bodies of slices ``sub = (a, b)`` (default all) of a scanned group into ``out`` (1-D uint8),
    slice ``s`` as a ``modes[s]`` body at byte ``offsets[s]``. ``counts`` / ``words`` are the scan's, read by the
    caller (its host sync); ``modes`` / ``offsets`` outside ``sub`` are ignored. No host sync here.

    ``update_old`` writes the new bits of the changed elements into ``olds`` (only those). ``hash_out`` (int32
    ``[R, 2]``; rows may be strided, e.g. the target lanes of a bucket's hash table) receives, in row
    ``hash_rows[s]`` (``-1``: none), the hash change ``lanes(new) - lanes(old)``
    over the changed elements of slice ``s`` at positions ``hash_starts[s] + i``: the incremental hash
    update, fused into the same pass. The Triton path needs ``4 * (changes of the slices written)`` bytes of
    scratch.

    Raises ``ValueError`` for a bad body kind, a body that would not fit in ``out`` or unaligned offsets
    (multiples of 16 bytes)."""
    ebits = _check_group(olds, "olds")
    S = len(olds)
    a, b = sub if sub is not None else (0, S)
    if not (0 <= a <= b <= S and len(counts) == len(words) == len(modes) == len(offsets) == S):
        raise ValueError("write_bodies: bad sub range or per-slice list lengths")
    if out.dtype != torch.uint8 or out.dim() != 1 or out.device != olds[0].device:
        raise ValueError("write_bodies: out must be a 1-D uint8 tensor on the slices' device")
    do_hash = hash_out is not None
    if do_hash:
        if hash_starts is None or hash_rows is None or len(hash_starts) != S or len(hash_rows) != S:
            raise ValueError("write_bodies: hash_out needs hash_starts and hash_rows (one per slice)")
        if hash_out.dtype != torch.int32 or hash_out.dim() != 2 or hash_out.shape[1] != 2 or hash_out.stride(1) != 1:
            raise ValueError("hash_out must be an int32 [R, 2] accumulator (rows may be strided, lanes contiguous)")
    for s in range(a, b):
        size = body_nbytes(modes[s], olds[s].numel(), counts[s], words[s], ebits)
        if offsets[s] % 16 or offsets[s] < 0 or offsets[s] + size > out.numel():
            raise ValueError(f"write_bodies: slice {s} body [{offsets[s]}, +{size}) does not fit a 16-byte aligned "
                             f"place in the {out.numel()}-byte buffer")
    if scan.impl == "reference":
        _write_bodies_reference(olds, news, scan, counts, modes, out, offsets, a, b, update_old, hash_starts,
                                hash_out, hash_rows)
        return
    lay = scan.layout
    b0, b1 = lay.block_cum[a], lay.block_cum[b]
    if b1 == b0:
        return
    dev = olds[0].device
    scratch = torch.empty(max(1, sum(counts[a:b])), dtype=torch.int32, device=dev)
    meta = _dev_ints([o.data_ptr() for o in olds] + [x.data_ptr() for x in news]
                     + (list(hash_starts) if do_hash else [0] * S) + list(offsets), dev)
    per = _dev_ints([MODES[m] if a <= s < b else -1 for s, m in enumerate(modes)]
                    + (list(hash_rows) if do_hash else [-1] * S), dev, torch.int32)
    _tk()._encode_kernel[(b1 - b0,)](
        meta[:S], meta[S:2 * S], lay.n_d, meta[2 * S:3 * S], lay.block_cum_d, lay.blk_slice_d, lay.mask_off_d,
        scan.mask, scan.cnt, scan.kbits, scan.cnt_cum, scan.bwords, scan.words_cum, b0, per[:S], meta[3 * S:],
        per[S:], out, scratch, hash_out if do_hash else scratch, hash_out.stride(0) if do_hash else 2,
        EBITS=ebits, SPAN=1 << scan.span_log2, WL=1024, CH=1024, CH_LOG2=10, UPDATE_OLD=update_old,
        HASH=do_hash,
        num_warps=4)


def _write_bodies_reference(olds, news, scan, counts, modes, out, offsets, a, b, update_old, hash_starts,
                            hash_out, hash_rows) -> None:
    ref = _ref()
    for s in range(a, b):
        o, x = olds[s], news[s]
        pos = torch.nonzero(o != x).reshape(-1)
        if pos.numel() != counts[s]:
            raise RuntimeError(f"write_bodies: slice {s} has {pos.numel()} changes, the scan counted {counts[s]}")
        if modes[s] == "compact":
            body = ref.compact_encode(o, x, scan.span_log2).view(torch.uint8)
        elif modes[s] == "coo":
            body = torch.cat([pos.to(torch.int32).view(torch.uint8), x[pos].contiguous().view(torch.uint8)])
        else:
            body = x.view(torch.uint8)
        out[offsets[s]:offsets[s] + body.numel()] = body
        if hash_out is not None and hash_rows[s] >= 0:
            _add_lanes(hash_out, hash_rows[s], ref.hash_delta(o[pos], x[pos], pos, int(hash_starts[s])))
        if update_old:
            o[pos] = x[pos]


# ---------------------------------------------------------------------------------------------------
# decode: compact bodies
# ---------------------------------------------------------------------------------------------------

def check_compact_entries(words: torch.Tensor, entries: Sequence[tuple[int, int, int, int]],
                          span_log2: int) -> None:
    """Host checks of compact bodies stored in ``words`` (int32 1-D): ``entries[s] = (word_offset, nwords, n,
    nchanged)``. Raises :class:`SyncFormatError` for a change count outside ``[0, n]``, a body outside the
    buffer, a non-empty body without changes or one shorter than its block headers."""
    if words.dtype != torch.int32 or words.dim() != 1:
        raise ValueError("compact bodies: words must be a 1-D int32 tensor")
    check_span_log2(span_log2)
    for off, nw, n, m in entries:
        if m < 0 or m > n:
            raise SyncFormatError(f"compact body claims {m} changes for a slice of {n} elements")
        if off < 0 or nw < 0 or off + nw > words.numel():
            raise SyncFormatError("compact body lies outside its buffer")
        if m == 0 and nw != 0:
            raise SyncFormatError(f"compact body with 0 changes must be empty, got {nw} words")
        if m > 0 and nw < HEADER_WORDS * num_blocks(n, span_log2):
            raise SyncFormatError(f"compact body truncated: {nw} words < {HEADER_WORDS * num_blocks(n, span_log2)} "
                                  "header words")


def _compact_tables(targets, entries, live, span_log2, hash_starts, dev):
    nbs = [num_blocks(entries[s][2], span_log2) for s in live]
    bcum = _cum(nbs)
    E = len(live)
    rank_base = _cum([entries[s][3] for s in live])
    meta = _dev_ints([entries[s][0] for s in live] + [entries[s][1] for s in live] + [entries[s][2] for s in live]
                     + [entries[s][3] for s in live] + bcum + rank_base[:-1]
                     + ([targets[s].data_ptr() for s in live] if targets is not None else [0] * E)
                     + [int(hash_starts[s]) if hash_starts is not None else 0 for s in live], dev)
    t = {"woff": meta[:E], "nwords": meta[E:2 * E], "n": meta[2 * E:3 * E], "m": meta[3 * E:4 * E],
         "bcum": meta[4 * E:5 * E + 1], "rank_base": meta[5 * E + 1:6 * E + 1], "addr": meta[6 * E + 1:7 * E + 1],
         "start": meta[7 * E + 1:]}
    return t, bcum[-1], rank_base[-1]


def check_compact_headers(words: torch.Tensor, entries: Sequence[tuple[int, int, int, int]], *, ebits: int,
                          span_log2: int, gate: torch.Tensor, gate_slot: int = 0, impl: Impl = "auto") -> None:
    """Check the block headers of compact bodies (``entries[s] = (word_offset, nwords, n, nchanged)`` into
    ``words``, int32 1-D) on the device: ranks start at 0 and give change counts in ``[0, span]``, value bits
    ``K <= (E - 1) cnt``, body offsets start at 0 and tile each body exactly. Any failure sets
    ``gate[gate_slot]`` (int32 ``[G]``); nothing is written. No host sync. Raises :class:`SyncFormatError` for
    what the host sees (:func:`check_compact_entries`)."""
    if ebits not in (16, 32):
        raise ValueError(f"ebits must be 16 or 32, got {ebits}")
    check_compact_entries(words, entries, span_log2)
    _check_gate(gate, gate_slot)
    live = [s for s, e in enumerate(entries) if e[3] > 0]
    if not live:
        return
    if resolve_impl(impl, words) == "reference":
        ref = _ref()
        for s in live:
            off, nw, n, m = entries[s]
            try:
                ref.compact_check_headers(words[off:off + nw], n, ebits, m, span_log2)
            except SyncFormatError:
                gate[gate_slot] = 1
        return
    t, NB, _ = _compact_tables(None, entries, live, span_log2, None, words.device)
    blk = 256
    _tk()._check_headers_kernel[(_cdiv(NB, blk),)](words, t["woff"], t["nwords"], t["n"], t["m"], t["bcum"],
                                                   len(live), NB, gate[gate_slot:], EBITS=ebits,
                                                   SPAN=1 << span_log2, BLK=blk, STEPS=_steps(len(live)))


def apply_compact(targets: Sequence[torch.Tensor], words: torch.Tensor, entries: Sequence[tuple[int, int, int, int]],
                  *, span_log2: int, gate: torch.Tensor, err: torch.Tensor, check_headers: bool = True,
                  gate_slot: int = 0, negate: bool = False, hash_starts: Sequence[int] | None = None,
                  hash_out: torch.Tensor | None = None, impl: Impl = "auto") -> None:
    """Decode compact bodies (``entries[s] = (word_offset, nwords, n, nchanged)`` into ``words``) and add their
    deltas to the bit views ``targets[s]`` in place (``negate``: subtract them, the undo). No host sync.

    Nothing at all is written when a flag of ``gate`` (int32 ``[G]``, ``G <= 8``: the caller's pre-write checks)
    is set. ``check_headers`` first runs :func:`check_compact_headers` into ``gate[gate_slot]``; a caller with
    several groups passes ``False`` after checking all of them (so that a bad header anywhere stops every
    write). Every block is then decoded and validated before it writes (positions inside the block and
    increasing, bit counts, region padding, code lengths); a block that fails writes nothing and increments
    ``err`` (int32 ``[1]``): the caller undoes the others (``negate=True`` with the same arguments restores
    them, bit for bit). ``hash_out`` (int32 ``[S, 2]``) receives the hash change of the written elements at
    positions ``hash_starts[s] + i``. Scratch: 8 bytes per change.

    Raises :class:`SyncFormatError` for problems visible on the host (:func:`check_compact_entries`),
    ``ValueError`` for bad arguments."""
    ebits = _check_group(targets, "targets")
    if len(entries) != len(targets):
        raise ValueError("apply_compact: one entry per target")
    check_compact_entries(words, entries, span_log2)
    for tg, (_, _, n, _) in zip(targets, entries):
        if tg.numel() != n:
            raise ValueError(f"apply_compact: target of {tg.numel()} elements for an entry of {n}")
    _check_gate(gate, gate_slot)
    if err.dtype != torch.int32 or err.numel() != 1:
        raise ValueError("err must be an int32 counter of one element")
    _check_hash_out(hash_out, len(targets))
    if hash_out is not None and (hash_starts is None or len(hash_starts) != len(targets)
                                 or not hash_out.is_contiguous()):
        raise ValueError("hash_out must be contiguous and needs one hash start per target")
    if check_headers:
        check_compact_headers(words, entries, ebits=ebits, span_log2=span_log2, gate=gate, gate_slot=gate_slot,
                              impl=impl)
    live = [s for s, e in enumerate(entries) if e[3] > 0]
    if not live:
        return
    if resolve_impl(impl, targets[0]) == "reference":
        _apply_compact_reference(targets, words, entries, live, span_log2, ebits, gate, err, negate, hash_starts,
                                 hash_out)
        return
    dev = targets[0].device
    t, NB, M = _compact_tables(targets, entries, live, span_log2, hash_starts, dev)
    E = len(live)
    scr = torch.empty(2, max(M, 1), dtype=torch.int32, device=dev)
    every = E == len(targets)  # the kernel adds into hash_out itself; else into rows of the live entries
    hacc = (hash_out if every else hash_zeros(E, dev)) if hash_out is not None else scr
    _tk()._apply_kernel[(NB,)](words, t["woff"], t["n"], t["m"], t["bcum"], t["rank_base"], t["addr"], t["start"],
                               E, gate, gate.numel(), err, scr[0], scr[1], hacc, EBITS=ebits, SPAN=1 << span_log2,
                               TB=2048, CH=1024, STEPS=_steps(E), NEGATE=negate, HASH=hash_out is not None,
                               num_warps=8)
    if hash_out is not None and not every:
        idx = _dev_ints(live, dev)
        hash_out[idx] = lanes_i32(hash_out[idx].to(torch.int64) + hacc.to(torch.int64))


def _apply_compact_reference(targets, words, entries, live, span_log2, ebits, gate, err, negate, hash_starts,
                             hash_out) -> None:
    ref = _ref()
    if bool(gate.any()):  # host sync (reference path): the gate
        return
    for s in live:
        off, nw, n, m = entries[s]
        try:
            pos, v = ref.compact_decode(words[off:off + nw], n, ebits, m, span_log2)
        except SyncFormatError:
            err += 1
            continue
        t = targets[s]
        old = ref._unsigned(t[pos])
        new = ref._to_signed(ref.apply_values(old, v, ebits, negate), ebits, t.dtype)
        if hash_out is not None:
            _add_lanes(hash_out, s, ref.hash_delta(t[pos], new, pos, int(hash_starts[s])))
        t[pos] = new


def decode_compact(words: torch.Tensor, n: int, ebits: int, nchanged: int, span_log2: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode and validate one compact body (exactly its words) into positions (int64, ascending) and value
    codes ``v`` (int64) with the PyTorch reference (any device; an inspection and test helper, not a fast path).
    Raises :class:`SyncFormatError` for any body that is not a canonical encoding."""
    check_span_log2(span_log2)
    return _ref().compact_decode(words, n, ebits, nchanged, span_log2)


# ---------------------------------------------------------------------------------------------------
# records
# ---------------------------------------------------------------------------------------------------

def diff_records(old: torch.Tensor, new: torch.Tensor, *, values: Values = "delta", update_old: bool = False,
                 impl: Impl = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The records of the change ``old -> new``: ascending int32 positions and per position the delta code
    (``values="delta"``) or the new bit pattern (``"new"``), int32. ``update_old`` writes the new bits of the
    changed elements into ``old``. One host sync (the change count)."""
    if values not in ("delta", "new"):
        raise ValueError(f"values must be 'delta' or 'new', got {values!r}")
    ebits = _check_pair(old, new)
    if resolve_impl(impl, old) == "reference":
        return _ref().diff_records(old, new, values, update_old)
    scan = scan_blocks([old], [new], span_log2=DEFAULT_SPAN_LOG2, impl=impl)
    m = int(scan.counts[0])  # the host sync: the change count
    esize = ebits // 8
    out = torch.empty(max(16, m * (4 + esize)), dtype=torch.uint8, device=old.device)
    write_bodies([old], [new], scan, [m], [0], ["coo"], out, [0], update_old=update_old and values == "new")
    pos = out[:4 * m].view(torch.int32).clone()
    newv = out[4 * m:m * (4 + esize)].view(old.dtype).to(torch.int32) & ((1 << ebits) - 1)
    if values == "new":
        return pos, newv
    ref = _ref()
    p64 = pos.to(torch.int64)
    codes = ref.delta_codes(ref._unsigned(old[p64]), newv.to(torch.int64) & ((1 << ebits) - 1), ebits)
    if update_old:
        old[p64] = new[p64]
    return pos, ref._to_signed(codes, 32, torch.int32) if ebits == 32 else codes.to(torch.int32)


def positions_bad(pos: torch.Tensor, n: int) -> torch.Tensor:
    """0-d bool device tensor: ``pos`` is not strictly increasing within ``[0, n)`` (no host sync)."""
    if pos.numel() == 0:
        return torch.zeros((), dtype=torch.bool, device=pos.device)
    bad = (pos[0] < 0) | (pos[-1] >= n)
    if pos.numel() > 1:
        bad = bad | (pos[1:] <= pos[:-1]).any()
    return bad


def group_apply_records(targets: Sequence[torch.Tensor], pos: torch.Tensor, val: torch.Tensor,
                        counts: Sequence[int], *, values: Values = "delta", negate: bool = False,
                        impl: Impl = "auto", hash_starts: Sequence[int] | None = None,
                        hash_out: torch.Tensor | None = None, gate: torch.Tensor | None = None,
                        undo_out: torch.Tensor | None = None) -> None:
    """Write concatenated records into several bit views in place (slice ``s`` takes the next
    ``counts[s]`` records). Positions must already be validated. ``negate`` undoes a delta application.

    ``hash_out`` (int32 ``[S, 2]``, see :func:`hash_zeros`) receives, per slice, the hash change
    ``lanes(new) - lanes(old)`` of the written elements at positions ``hash_starts[s] + pos``. ``gate`` (int32
    ``[G]``): nothing is written when a flag is set (decided on the device, no host sync). ``undo_out`` (int32,
    one per record) receives the bits each record overwrites (zero-extended)."""
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
    if do_hash and hash_starts is None:
        raise ValueError("hash_out needs hash_starts")
    _check_hash_out(hash_out, len(targets))
    _check_gate(gate)
    if undo_out is not None and (undo_out.dtype != torch.int32 or undo_out.shape != pos.shape):
        raise ValueError("undo_out must be an int32 tensor with one element per record")
    rec_off = _cum(counts)
    dev = targets[0].device
    if resolve_impl(impl, targets[0]) == "reference":
        if gate is not None and bool(gate.any()):  # host sync (reference path): the gate
            return
        ref = _ref()
        for s, t in enumerate(targets):
            a, b = rec_off[s], rec_off[s + 1]
            if b > a:
                p = pos[a:b].to(torch.int64)
                old = t[p].clone()
                if undo_out is not None:
                    undo_out[a:b] = old.to(torch.int32) & ((1 << ebits) - 1)
                ref.apply_records(t, pos[a:b], val[a:b], values, negate)
                if do_hash:
                    _add_lanes(hash_out, s, ref.hash_delta(old, t[p], p, int(hash_starts[s])))
        return
    tiles = [_cdiv(m, _BLOCK) for m in counts]
    cum = _cum(tiles)
    if cum[-1] == 0:
        return
    S = len(targets)
    meta = _dev_ints([t.data_ptr() for t in targets] + rec_off[:-1] + list(counts) + cum
                     + (list(hash_starts) if do_hash else [0] * S), dev)
    g = gate if gate is not None else torch.zeros(1, dtype=torch.int32, device=dev)
    _tk()._apply_records_kernel[(cum[-1],)](
        meta[:S], meta[S:2 * S], meta[2 * S:3 * S], meta[3 * S:4 * S + 1], S, pos, val, meta[4 * S + 1:],
        hash_out if do_hash else pos, g, g.numel(), undo_out if undo_out is not None else pos,
        EBITS=ebits, BLOCK=_BLOCK, DELTA=values == "delta", NEGATE=negate, STEPS=_steps(S), HASH=do_hash,
        UNDO=undo_out is not None)


def apply_records(bits: torch.Tensor, pos: torch.Tensor, val: torch.Tensor, *, values: Values = "delta",
                  negate: bool = False, impl: Impl = "auto", hash_start: int | None = None,
                  hash_out: torch.Tensor | None = None) -> None:
    """Write records into ``bits`` in place. Positions must already be validated (see
    :func:`positions_bad`). ``negate`` undoes a delta application. ``hash_out`` (int32 ``[1, 2]``) receives
    the hash change of the written elements (positions ``hash_start + pos``)."""
    group_apply_records([bits], pos, val, [pos.numel()], values=values, negate=negate, impl=impl,
                        hash_starts=None if hash_out is None else [hash_start or 0], hash_out=hash_out)

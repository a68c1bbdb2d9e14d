"""Triton kernels for bit-exact sparse weight sync: block scan, fused encode, fused decode + apply, hashing.

Layout and semantics are those of :mod:`sparrow.kernels.sync.reference` (the test oracle); this module never
imports it. A slice is cut into blocks of ``SPAN = 2**span_log2`` elements; one program handles one block.

Sender, two launches per bit width and sync:

1. ``_scan_kernel`` reads old and new bits once (16-byte loads when slices are aligned), writes a 1-bit change
   mask (1/16 of the bf16 input) and per block the change count ``cnt`` and value bits ``K``, from which it
   computes the block's compact size; per slice change counts and body words through atomics. The device
   prefix sums of ``cnt`` and of the sizes give every block's rank and word offset: nothing else is needed to
   place it.
2. ``_encode_kernel`` (after the sender's one host read, which sizes the buckets) reads the block's mask
   words, lists the changed offsets by rank (one lane per mask word: popcount, prefix sum, lowest set bit),
   then per chunk of ranks gathers old / new bits of the changed elements only, adds the hash change, writes
   the new bits into the snapshot and writes the packed words straight into the bucket: each region's words
   come from one segmented prefix sum over the chunk's fields (disjoint bit fields add up to their OR), the
   word a chunk shares with the next carried over. COO and dense slices are written by the same kernel.

Receiver, per bucket: ``_check_headers_kernel`` validates every block header (ranks, value bits, offsets
tiling the body) into a gate flag; ``_apply_kernel`` checks the gate, decodes its block (a prefix count over
the bits of the two unary regions, fields read by rank), validates every field, and only then adds the
deltas in place, summing the hash change of the written elements per entry. ``_hash_group_kernel`` hashes
whole slices (full verification, anchors, bucket bodies); ``_apply_records_kernel`` writes COO records.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import common as _c

# Triton kernels may only read globals declared as constexpr.
FMIX_1 = tl.constexpr(_c.FMIX_1)
FMIX_2 = tl.constexpr(_c.FMIX_2)
H_ADD_I = tl.constexpr(_c.H_ADD_I)
H_MUL_I = tl.constexpr(_c.H_MUL_I)
H_MUL_X = tl.constexpr(_c.H_MUL_X)
H_XOR_B = tl.constexpr(_c.H_XOR_B)
HEADER_WORDS = tl.constexpr(_c.HEADER_WORDS)
BIG = tl.constexpr(1 << 30)  # word key of padding lanes (larger than any real key)

MODE_COMPACT = tl.constexpr(0)
MODE_COO = tl.constexpr(1)
MODE_DENSE = tl.constexpr(2)


# ---------------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------------

@triton.jit
def _fmix32(h):
    h = h ^ (h >> 16)
    h = h * FMIX_1
    h = h ^ (h >> 13)
    h = h * FMIX_2
    return h ^ (h >> 16)


@triton.jit
def _unsigned32(x, EBITS: tl.constexpr):
    """int16/int32 bit patterns -> uint32 zero-extended value."""
    if EBITS == 16:
        return (x.to(tl.int32) & 0xFFFF).to(tl.uint32, bitcast=True)
    else:
        return x.to(tl.int32).to(tl.uint32, bitcast=True)


@triton.jit
def _lanes(xu, pos):
    """The two uint32 hash lanes of each element (uint32 bit pattern ``xu`` at uint32 position ``pos``);
    a range's hash is the lane-wise sum mod 2^32 (see ``reference.hash_bits``)."""
    t = (xu * H_MUL_X) ^ (pos * H_MUL_I + H_ADD_I)
    return _fmix32(t), _fmix32(t ^ H_XOR_B)


@triton.jit
def _signed_bits(v, EBITS: tl.constexpr):
    """int64 values in [0, 2^EBITS) -> the int16/int32 bit patterns to store (inverse of ``_unsigned32``)."""
    if EBITS == 16:
        return (v - ((v >> 15) << 16)).to(tl.int16)
    else:
        return (v - ((v >> 31) << 32)).to(tl.int32)


@triton.jit
def _lanes_change(new_u, old_u, pos, valid):
    """Per element the hash change ``lanes(new) - lanes(old)`` (uint32, mod 2^32; 0 where not ``valid``)."""
    na, nb = _lanes(new_u, pos)
    oa, ob = _lanes(old_u, pos)
    return tl.where(valid, na - oa, 0), tl.where(valid, nb - ob, 0)


@triton.jit
def _bits_ptr(addr, EBITS: tl.constexpr):
    if EBITS == 16:
        return addr.to(tl.pointer_type(tl.int16))
    else:
        return addr.to(tl.pointer_type(tl.int32))


@triton.jit
def _find(cum_ptr, nslices, x, STEPS: tl.constexpr):
    """Largest s in [0, nslices) with cum[s] <= x (cum ascending, cum[0] = 0); ``x`` scalar or tensor."""
    lo = (x * 0).to(tl.int64)
    hi = lo + nslices - 1
    for _ in tl.static_range(STEPS):
        mid = (lo + hi + 1) // 2
        v = tl.load(cum_ptr + mid)
        go = v <= x
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid - 1)
    return lo


@triton.jit
def _popc32(x):
    """Set bits of each uint32 (SWAR)."""
    x = x - ((x >> 1) & 0x55555555)
    x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F
    return (x * 0x01010101) >> 24


@triton.jit
def _flog2_small(x):
    """floor(log2 x) for integers 1 <= x < 2**24 (exact through the float32 exponent; -127 for x == 0)."""
    return (x.to(tl.float32).to(tl.int32, bitcast=True) >> 23) - 127


@triton.jit
def _ilog2_u32(x):
    """floor(log2 x) of uint32 x >= 1, exact for every x (shift search)."""
    r = (x > 0xFFFF).to(tl.uint32) << 4
    x = x >> r
    s = (x > 0xFF).to(tl.uint32) << 3
    x = x >> s
    r = r | s
    s = (x > 0xF).to(tl.uint32) << 2
    x = x >> s
    r = r | s
    s = (x > 0x3).to(tl.uint32) << 1
    x = x >> s
    r = r | s
    return (r | (x >> 1)).to(tl.int32)


@triton.jit
def _zigzag(o, x, EBITS: tl.constexpr):
    """``v = zigzag((x - o) mod 2**E)`` as uint32 (0 where unchanged) from int16 / int32 bit patterns."""
    d = x.to(tl.int32) - o.to(tl.int32)
    if EBITS == 16:
        d = (d << 16) >> 16
    return ((d << 1) ^ (d >> 31)).to(tl.uint32, bitcast=True)


@triton.jit
def _vlog2(v, EBITS: tl.constexpr):
    """floor(log2 v) of value codes (``v | 1`` makes unchanged lanes 0)."""
    if EBITS == 16:
        return _flog2_small(v | 1)
    else:
        return _ilog2_u32(v | 1)


@triton.jit
def _block_regions(cnt, kbits, span):
    """L and the words of the four regions of a block (int32 scalars; all 0 when ``cnt == 0``)."""
    has = cnt > 0
    low = tl.where(has, _flog2_small(span // tl.maximum(cnt, 1)), 0)
    high = tl.where(has, cnt + ((span - 1) >> low), 0)
    lw = (cnt * low + 31) // 32
    hw = (high + 31) // 32
    uw = (cnt + kbits + 31) // 32
    mw = (kbits + 31) // 32
    return low, high, lw, hw, uw, mw


@triton.jit
def _read_bits(words_ptr, region, bitpos, width, mask):
    """Fields of ``width`` (< 32) bits at bit ``bitpos`` of the region starting at word ``region`` (no word is
    read for an empty field, so a field at the region's end never reads past it)."""
    wi = region + (bitpos >> 5)
    s = (bitpos & 31).to(tl.int64)
    lo = tl.load(words_ptr + wi, mask=mask & (width > 0), other=0).to(tl.int64) & 0xFFFFFFFF
    hi = tl.load(words_ptr + wi + 1, mask=mask & ((s + width) > 32), other=0).to(tl.int64) & 0xFFFFFFFF
    return (((lo | (hi << 32)) >> s) & ((tl.full(bitpos.shape, 1, tl.int64) << width.to(tl.int64)) - 1))


@triton.jit
def _emit(dst, nwords, bitpos, val, width, valid, ck, cs, cp, CH: tl.constexpr, RUN: tl.constexpr):
    """Store the words of a chunk of bit fields (``val`` of ``width`` < 32 bits at increasing, disjoint
    ``bitpos``; at most ``2**RUN`` fields start in one word) into ``dst[0, nwords)``. Disjoint fields add up to
    their OR, so a word is a difference of one prefix sum over the chunk (plus the spill of the field that
    straddles into it). ``(ck, cs, cp)`` carries the previous chunk's last word (key, partial value, spill into
    the next word); returns this chunk's. Words without a field are left alone (the caller zeroes them)."""
    lane = tl.arange(0, CH)
    key = tl.where(valid, bitpos >> 5, BIG)
    sh = (bitpos & 31).to(tl.uint32)
    vv = tl.where(valid, val, 0).to(tl.uint32)
    lo = vv << sh
    sp = tl.where((sh + width.to(tl.uint32)) > 32, (vv >> 1) >> (31 - sh), 0)
    prv = tl.maximum(lane - 1, 0)
    first = lane  # first lane of this lane's word (keys ascend): binary lifting over the run
    for t in tl.static_range(RUN):
        cand = first - (1 << (RUN - 1 - t))
        same = (cand >= 0) & (tl.gather(key, tl.maximum(cand, 0), 0) == key)
        first = tl.where(same, cand, first)
    spill_in = (first == lane) & (lane > 0) & (tl.gather(key, prv, 0) == key - 1)
    inc = tl.where(spill_in, tl.gather(sp, prv, 0), 0)
    tcum = tl.cumsum((lo + inc).to(tl.int64), axis=0)
    before = tl.where(first > 0, tl.gather(tcum, tl.maximum(first - 1, 0), 0), 0)
    cin = tl.where(first == 0, tl.where(key == ck, cs, tl.where(key == ck + 1, cp, 0)), 0)
    word = ((tcum - before + cin.to(tl.int64)) & 0xFFFFFFFF).to(tl.uint32)
    nk = tl.gather(key, tl.minimum(lane + 1, CH - 1), 0)
    nk = tl.where(lane == CH - 1, BIG + 1, nk)
    tl.store(dst + key, word.to(tl.int32, bitcast=True), mask=valid & (nk != key) & (key < nwords))
    last = lane == tl.sum(valid.to(tl.int32), axis=0) - 1
    return (tl.sum(tl.where(last, key, 0), axis=0), tl.sum(tl.where(last, word, 0), axis=0),
            tl.sum(tl.where(last, sp, 0), axis=0))


@triton.jit
def _flush(dst, nwords, ck, cp):
    """The spill of a region's last field into the word after it."""
    tl.store(dst + ck + 1, cp.to(tl.int32, bitcast=True), mask=(cp != 0) & (ck + 1 < nwords) & (ck >= 0))


# ---------------------------------------------------------------------------------------------------
# hashing
# ---------------------------------------------------------------------------------------------------

@triton.jit
def _prog_tiles(pid, prog_slice_ptr, prog_cum_ptr, tile_cum_ptr, n_ptr, TILE: tl.constexpr, TPP: tl.constexpr):
    """Slice ``s`` of program ``pid``, the slice length, the program's first tile within the slice, that
    tile's global index and the number of tiles of the program (<= TPP)."""
    s = tl.load(prog_slice_ptr + pid).to(tl.int64)
    n = tl.load(n_ptr + s)
    j0 = (pid - tl.load(prog_cum_ptr + s)) * TPP
    t0 = tl.load(tile_cum_ptr + s) + j0
    nt = tl.minimum((n + TILE - 1) // TILE - j0, TPP)
    return s, n, j0, t0, nt


@triton.jit
def _tile_base(addr, tile_start, n, TILE: tl.constexpr, EBITS: tl.constexpr, ALIGNED: tl.constexpr):
    """Pointer to a tile's first element and the number of valid lanes (int32, <= TILE). With ALIGNED the
    host guarantees 16-byte aligned slices whose lengths are multiples of 8, so loads vectorise (16 B per
    thread) and masks stay uniform over each vector."""
    ptr = _bits_ptr(addr, EBITS) + tile_start
    rem = tl.minimum(n - tile_start, TILE).to(tl.int32)
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
        rem = tl.multiple_of(rem, 8)
    return ptr, rem


@triton.jit
def _hash_group_kernel(addr_ptr, n_ptr, start_ptr, tile_cum_ptr, prog_cum_ptr, prog_slice_ptr, out_ptr,
                       EBITS: tl.constexpr, TILE: tl.constexpr, TPP: tl.constexpr, ALIGNED: tl.constexpr):
    """Hash lanes of every slice: each program sums TPP tiles in registers (uint32, wrapping) and adds
    its two sums into ``out[s]`` (int32 [S, 2], zero-initialised) with two atomics."""
    pid = tl.program_id(0).to(tl.int64)
    s, n, j0, t0, nt = _prog_tiles(pid, prog_slice_ptr, prog_cum_ptr, tile_cum_ptr, n_ptr, TILE, TPP)
    addr = tl.load(addr_ptr + s)
    start = tl.load(start_ptr + s)
    lane = tl.arange(0, TILE)
    acc_a = tl.zeros((TILE,), tl.uint32)
    acc_b = tl.zeros((TILE,), tl.uint32)
    for k in range(0, nt):
        ts = (j0 + k) * TILE
        ptr, rem = _tile_base(addr, ts, n, TILE, EBITS, ALIGNED)
        valid = lane < rem
        x = tl.load(ptr + lane, mask=valid, other=0)
        a, b = _lanes(_unsigned32(x, EBITS), (ts + start).to(tl.uint32) + lane.to(tl.uint32))
        acc_a += tl.where(valid, a, 0)
        acc_b += tl.where(valid, b, 0)
    tl.atomic_add(out_ptr + 2 * s, tl.sum(acc_a, axis=0).to(tl.int32, bitcast=True))
    tl.atomic_add(out_ptr + 2 * s + 1, tl.sum(acc_b, axis=0).to(tl.int32, bitcast=True))


# ---------------------------------------------------------------------------------------------------
# sender
# ---------------------------------------------------------------------------------------------------

@triton.jit
def _block_of(b, blk_slice_ptr, block_cum_ptr, n_ptr, SPAN: tl.constexpr):
    """Slice of block ``b``, the block's index in it, its first element and its length."""
    s = tl.load(blk_slice_ptr + b).to(tl.int64)
    j = b - tl.load(block_cum_ptr + s)
    e0 = j * SPAN
    span = tl.minimum(tl.load(n_ptr + s) - e0, SPAN).to(tl.int32)
    return s, j, e0, span


@triton.jit(do_not_specialize=["nslices"])  # one compiled variant for any slice count
def _scan_kernel(old_addr_ptr, new_addr_ptr, n_ptr, block_cum_ptr, blk_slice_ptr, mask_off_ptr, mask_ptr,
                 cnt_ptr, kbits_ptr, words_ptr, slice_acc_ptr, nslices,
                 EBITS: tl.constexpr, SPAN: tl.constexpr, TILE: tl.constexpr, ALIGNED: tl.constexpr):
    """Per block: change mask words, ``cnt``, ``K`` and compact body words; per slice (atomics into
    ``slice_acc``: counts in ``[0, S)``, words in ``[S, 2S)``) the sums."""
    b = tl.program_id(0).to(tl.int64)
    s, j, e0, span = _block_of(b, blk_slice_ptr, block_cum_ptr, n_ptr, SPAN)
    old_p = _bits_ptr(tl.load(old_addr_ptr + s), EBITS) + e0
    new_p = _bits_ptr(tl.load(new_addr_ptr + s), EBITS) + e0
    if ALIGNED:
        old_p = tl.multiple_of(old_p, 16)
        new_p = tl.multiple_of(new_p, 16)
    mbase = tl.load(mask_off_ptr + s) + j * (SPAN // 32)
    lane = tl.arange(0, TILE)
    wl = tl.arange(0, TILE // 32)
    bitc = (tl.full((TILE,), 1, tl.int32) << (lane & 31)).to(tl.uint32)
    acc_w = tl.zeros((TILE // 32,), tl.int32)
    acc_k = tl.zeros((TILE,), tl.int32)
    for t0 in range(0, span, TILE):
        rem = span - t0
        if ALIGNED:
            rem = tl.multiple_of(rem, 8)
        valid = lane < rem
        o = tl.load(old_p + t0 + lane, mask=valid, other=0)
        x = tl.load(new_p + t0 + lane, mask=valid, other=0)  # padding lanes: 0 == 0, no change
        d = x.to(tl.int32) - o.to(tl.int32)
        if EBITS == 16:
            d = (d << 16) >> 16
            # floor(log2(zigzag(d) | 1)) = floor(log2(2 (d ^ (d >> 31)) + 1)): the float32 exponent, its bias
            # of 127 per lane taken off once at the end
            acc_k += (((d ^ (d >> 31)) * 2 + 1).to(tl.float32).to(tl.int32, bitcast=True) >> 23)
        else:
            acc_k += _ilog2_u32(((d << 1) ^ (d >> 31)).to(tl.uint32, bitcast=True) | 1) + 127
        words = tl.sum(tl.reshape(tl.where(d != 0, bitc, 0), (TILE // 32, 32)), axis=1)
        acc_w += _popc32(words).to(tl.int32)
        tl.store(mask_ptr + mbase + t0 // 32 + wl, words.to(tl.int32, bitcast=True), mask=wl * 32 < rem)
    cnt = tl.sum(acc_w, axis=0)
    kbits = tl.sum(acc_k, axis=0) - 127 * TILE * ((span + TILE - 1) // TILE)
    _, _, lw, hw, uw, mw = _block_regions(cnt, kbits, span)
    wb = (lw + hw + uw + mw).to(tl.int64)
    tl.store(cnt_ptr + b, cnt)
    tl.store(kbits_ptr + b, kbits)
    tl.store(words_ptr + b, wb)
    tl.atomic_add(slice_acc_ptr + s, cnt.to(tl.int64))
    tl.atomic_add(slice_acc_ptr + nslices + s, wb)


@triton.jit
def _excl(cum_ptr, cnt_ptr, b):
    """Exclusive prefix at block ``b`` of an inclusive cumulative sum (0 for b < 0 is not needed: b >= 0)."""
    return tl.load(cum_ptr + b) - tl.load(cnt_ptr + b)


@triton.jit(do_not_specialize=["b0", "hash_stride"])  # a launch's first block varies
def _encode_kernel(old_addr_ptr, new_addr_ptr, n_ptr, start_ptr, block_cum_ptr, blk_slice_ptr, mask_off_ptr,
                   mask_ptr, cnt_ptr, kbits_ptr, cnt_cum_ptr, words_ptr, words_cum_ptr, b0,
                   mode_ptr, out_off_ptr, hash_row_ptr, out_ptr, scratch_ptr, hash_ptr, hash_stride,
                   EBITS: tl.constexpr, SPAN: tl.constexpr, WL: tl.constexpr, CH: tl.constexpr,
                   CH_LOG2: tl.constexpr, UPDATE_OLD: tl.constexpr, HASH: tl.constexpr):
    """Write block ``b0 + pid`` of its slice's body (compact / COO / dense, per ``mode[s]``) into ``out`` (a byte
    buffer; slice ``s`` at byte ``out_off[s]``), write the new bits of its changed elements into the old
    tensor (UPDATE_OLD) and add their hash change to ``hash[hash_row[s] * hash_stride + 0 / 1]`` (HASH)."""
    b = b0 + tl.program_id(0).to(tl.int64)
    s, j, e0, span = _block_of(b, blk_slice_ptr, block_cum_ptr, n_ptr, SPAN)
    mode = tl.load(mode_ptr + s)
    old_p = _bits_ptr(tl.load(old_addr_ptr + s), EBITS) + e0
    new_p = _bits_ptr(tl.load(new_addr_ptr + s), EBITS) + e0
    cnt = tl.load(cnt_ptr + b)
    kbits = tl.load(kbits_ptr + b)
    bfirst = tl.load(block_cum_ptr + s)
    nb = tl.load(block_cum_ptr + s + 1) - bfirst
    blast = bfirst + nb - 1
    r_slice = _excl(cnt_cum_ptr, cnt_ptr, b) - _excl(cnt_cum_ptr, cnt_ptr, bfirst)  # changes before b in s
    m_slice = tl.load(cnt_cum_ptr + blast) - _excl(cnt_cum_ptr, cnt_ptr, bfirst)
    rank0 = _excl(cnt_cum_ptr, cnt_ptr, b) - _excl(cnt_cum_ptr, cnt_ptr, b0)  # scratch base of this launch
    off = _excl(words_cum_ptr, words_ptr, b) - _excl(words_cum_ptr, words_ptr, bfirst)
    out_b = out_ptr + tl.load(out_off_ptr + s)
    lane_w = tl.arange(0, WL)
    lane = tl.arange(0, CH)
    low, _, lw, hw, uw, mw = _block_regions(cnt, kbits, span)
    out_w = out_b.to(tl.pointer_type(tl.int32))
    body = out_w + HEADER_WORDS * nb + off
    if mode == MODE_DENSE:
        out_e = _bits_ptr(out_b.to(tl.int64, bitcast=True), EBITS) + e0
        for t0 in range(0, span, WL):
            ok = t0 + lane_w < span
            tl.store(out_e + t0 + lane_w, tl.load(new_p + t0 + lane_w, mask=ok, other=0), mask=ok)
    if mode == MODE_COMPACT:
        if m_slice > 0:
            k3 = tl.arange(0, 4)
            hdr = tl.where(k3 == 0, r_slice, tl.where(k3 == 1, kbits.to(tl.int64), off))
            tl.store(out_w + HEADER_WORDS * j + k3, hdr.to(tl.int32), mask=k3 < HEADER_WORDS)
        size = lw + hw + uw + mw
        for t0 in range(0, size, WL):  # bitset regions have words without set bits: zero the block first
            tl.store(body + t0 + lane_w, tl.zeros((WL,), tl.int32), mask=t0 + lane_w < size)
    # list the changed offsets of the block by rank: one lane per mask word
    mbase = mask_ptr + tl.load(mask_off_ptr + s) + j * (SPAN // 32)
    nwords = (span + 31) // 32
    running = cnt * 0
    for w0 in range(0, nwords, WL):
        wi = w0 + lane_w
        wv = tl.load(mbase + wi, mask=wi < nwords, other=0).to(tl.uint32, bitcast=True)
        pc = _popc32(wv).to(tl.int32)
        ex = running + tl.cumsum(pc, axis=0) - pc
        for t in range(0, tl.max(pc, axis=0)):
            lowbit = wv & ((~wv) + 1)
            u = wi * 32 + _flog2_small(lowbit)
            tl.store(scratch_ptr + rank0 + ex + t, u, mask=wv != 0)
            wv = wv ^ lowbit
        running += tl.sum(pc, axis=0)
    tl.debug_barrier()
    hstart = tl.load(start_ptr + s) + e0
    acc_a = tl.zeros((CH,), tl.uint32)
    acc_b = tl.zeros((CH,), tl.uint32)
    one = tl.full((CH,), 1, tl.uint32)
    breg = body + lw
    creg = breg + hw
    dreg = creg + uw
    ksum = cnt * 0
    a_k, a_s, a_p = cnt * 0 - 2, tl.zeros((), tl.uint32), tl.zeros((), tl.uint32)
    b_k, b_s, b_p = cnt * 0 - 2, tl.zeros((), tl.uint32), tl.zeros((), tl.uint32)
    c_k, c_s, c_p = cnt * 0 - 2, tl.zeros((), tl.uint32), tl.zeros((), tl.uint32)
    d_k, d_s, d_p = cnt * 0 - 2, tl.zeros((), tl.uint32), tl.zeros((), tl.uint32)
    for c0 in range(0, cnt, CH):
        r = c0 + lane
        valid = r < cnt
        u = tl.load(scratch_ptr + rank0 + r, mask=valid, other=0)
        o = tl.load(old_p + u, mask=valid, other=0)
        x = tl.load(new_p + u, mask=valid, other=0)
        if HASH:
            da, db = _lanes_change(_unsigned32(x, EBITS), _unsigned32(o, EBITS), (hstart + u).to(tl.uint32), valid)
            acc_a += da
            acc_b += db
        if UPDATE_OLD:
            tl.store(old_p + u, x, mask=valid)
        if mode == MODE_COMPACT:
            v = _zigzag(o, x, EBITS)
            k = tl.where(valid, _vlog2(v, EBITS), 0)
            kex = ksum + tl.cumsum(k, axis=0) - k
            ksum += tl.sum(k, axis=0)
            lmask = (one << low.to(tl.uint32)) - 1
            a_k, a_s, a_p = _emit(body, lw, r * low, u.to(tl.uint32) & lmask, low + r * 0, valid,
                                  a_k, a_s, a_p, CH, 5)  # L >= 1 bits per field (L = 0: no words)
            b_k, b_s, b_p = _emit(breg, hw, (u >> low) + r, one, r * 0 + 1, valid, b_k, b_s, b_p, CH, 5)
            c_k, c_s, c_p = _emit(creg, uw, kex + k + r, one, r * 0 + 1, valid, c_k, c_s, c_p, CH, 5)
            d_k, d_s, d_p = _emit(dreg, mw, kex, v & ((one << k.to(tl.uint32)) - 1), k, valid,
                                  d_k, d_s, d_p, CH, CH_LOG2)  # zero-width fields: any number per word
        if mode == MODE_COO:
            rr = r_slice + r
            tl.store(out_w + rr, (e0 + u).to(tl.int32), mask=valid)
            vals = _bits_ptr((out_b + 4 * m_slice).to(tl.int64, bitcast=True), EBITS)
            tl.store(vals + rr, x, mask=valid)
        tl.debug_barrier()  # a chunk re-stores the word it shares with the previous one
    if mode == MODE_COMPACT:
        _flush(body, lw, a_k, a_p)
        _flush(dreg, mw, d_k, d_p)
    if HASH:
        row = tl.load(hash_row_ptr + s).to(tl.int64)
        if row >= 0:
            tl.atomic_add(hash_ptr + row * hash_stride, tl.sum(acc_a, axis=0).to(tl.int32, bitcast=True))
            tl.atomic_add(hash_ptr + row * hash_stride + 1, tl.sum(acc_b, axis=0).to(tl.int32, bitcast=True))


# ---------------------------------------------------------------------------------------------------
# receiver
# ---------------------------------------------------------------------------------------------------

@triton.jit
def _entry_block(g, block_cum_ptr, nentries, STEPS: tl.constexpr):
    """Entry of (global) block ``g`` and the block's index in it (scalars or tensors)."""
    e = _find(block_cum_ptr, nentries, g, STEPS)
    return e, g - tl.load(block_cum_ptr + e)


@triton.jit(do_not_specialize=["nentries", "nblocks"])
def _check_headers_kernel(words_ptr, woff_ptr, nwords_ptr, n_ptr, m_ptr, block_cum_ptr, nentries, nblocks,
                          gate_ptr, EBITS: tl.constexpr, SPAN: tl.constexpr, BLK: tl.constexpr,
                          STEPS: tl.constexpr):
    """Every block header of the compact entries: ranks ``R`` start at 0 and give counts in ``[0, span]``,
    ``K <= (E - 1) cnt``, body offsets start at 0 and tile the entry's body exactly. Any failure sets the gate
    (``gate[0]``), so that no block of the bucket is written."""
    g = tl.program_id(0).to(tl.int64) * BLK + tl.arange(0, BLK)
    act = g < nblocks
    gg = tl.where(act, g, 0)
    e, j = _entry_block(gg, block_cum_ptr, nentries, STEPS)
    nb = tl.load(block_cum_ptr + e + 1) - tl.load(block_cum_ptr + e)
    n = tl.load(n_ptr + e)
    m = tl.load(m_ptr + e)
    total = tl.load(nwords_ptr + e)
    w = words_ptr + tl.load(woff_ptr + e)
    has_next = j + 1 < nb
    rr = tl.load(w + HEADER_WORDS * j, mask=act, other=0).to(tl.int64) & 0xFFFFFFFF
    kb = tl.load(w + HEADER_WORDS * j + 1, mask=act, other=0).to(tl.int64) & 0xFFFFFFFF
    off = tl.load(w + HEADER_WORDS * j + 2, mask=act, other=0).to(tl.int64) & 0xFFFFFFFF
    r_next = tl.load(w + HEADER_WORDS * (j + 1), mask=act & has_next, other=0).to(tl.int64) & 0xFFFFFFFF
    r_next = tl.where(has_next, r_next, m)
    off_next = tl.load(w + HEADER_WORDS * (j + 1) + 2, mask=act & has_next, other=0).to(tl.int64) & 0xFFFFFFFF
    span = tl.minimum(n - j * SPAN, SPAN)
    cnt = r_next - rr
    ok = (cnt >= 0) & (cnt <= span) & (kb <= (EBITS - 1) * cnt) & ((j > 0) | ((rr == 0) & (off == 0)))
    c32 = tl.where(ok, cnt, 0).to(tl.int32)
    k32 = tl.where(ok, kb, 0).to(tl.int32)
    _, _, lw, hw, uw, mw = _block_regions(c32, k32, span.to(tl.int32))
    end = off + (lw + hw + uw + mw).to(tl.int64)
    ok = ok & tl.where(has_next, end == off_next, HEADER_WORDS * nb + end == total)
    tl.atomic_max(gate_ptr, tl.max(tl.where(act & (ok == 0), 1, 0), axis=0))


@triton.jit(do_not_specialize=["nentries", "ngate"])
def _apply_kernel(words_ptr, woff_ptr, n_ptr, m_ptr, block_cum_ptr, rank_base_ptr, addr_ptr, start_ptr,
                  nentries, gate_ptr, ngate, err_ptr, scr_h_ptr, scr_p_ptr, hash_ptr,
                  EBITS: tl.constexpr, SPAN: tl.constexpr, TB: tl.constexpr, CH: tl.constexpr,
                  STEPS: tl.constexpr, NEGATE: tl.constexpr, HASH: tl.constexpr):
    """Decode, validate and apply one block of a compact entry (validated headers: see
    ``_check_headers_kernel``). Nothing is written when any gate flag is set or the block fails a check (then
    ``err`` is incremented and the caller undoes the other blocks). HASH: per entry ``e`` the hash change of
    the written elements into ``hash[e]`` (int32 [E, 2])."""
    g = tl.program_id(0).to(tl.int64)
    gk = tl.arange(0, 8)
    closed = tl.sum(tl.load(gate_ptr + gk, mask=gk < ngate, other=0), axis=0) != 0
    e, j = _entry_block(g, block_cum_ptr, nentries, STEPS)
    nb = tl.load(block_cum_ptr + e + 1) - tl.load(block_cum_ptr + e)
    n = tl.load(n_ptr + e)
    m = tl.load(m_ptr + e)
    w = words_ptr + tl.load(woff_ptr + e)
    rr = tl.load(w + HEADER_WORDS * j).to(tl.int64) & 0xFFFFFFFF
    kbits = (tl.load(w + HEADER_WORDS * j + 1).to(tl.int64) & 0xFFFFFFFF).to(tl.int32)
    off = tl.load(w + HEADER_WORDS * j + 2).to(tl.int64) & 0xFFFFFFFF
    r_next = tl.load(w + HEADER_WORDS * (j + 1), mask=j + 1 < nb, other=0).to(tl.int64) & 0xFFFFFFFF
    r_next = tl.where(j + 1 < nb, r_next, m)
    cnt = tl.where(closed, 0, r_next - rr).to(tl.int32)
    e0 = j * SPAN
    span = tl.minimum(n - e0, SPAN).to(tl.int32)
    low, high, lw, hw, uw, mw = _block_regions(cnt, kbits, span)
    areg = HEADER_WORDS * nb + off
    breg = areg + lw
    creg = breg + hw
    dreg = creg + uw
    base = tl.load(rank_base_ptr + e) + rr
    sh = scr_h_ptr + base
    sp = scr_p_ptr + base
    tb = tl.arange(0, TB)
    bad = cnt * 0
    # B: the set bits of the high region, by rank (padding bits must be zero)
    run = cnt * 0
    for t0 in range(0, hw * 32, TB):
        bp = t0 + tb
        wv = tl.load(w + breg + (bp >> 5), mask=bp < hw * 32, other=0)
        on = ((wv >> (bp & 31)) & 1) != 0
        inr = on & (bp < high)
        rank = run + tl.cumsum(inr.to(tl.int32), axis=0) - 1
        bad += tl.sum((on & (bp >= high)).to(tl.int32), axis=0) + tl.sum((inr & (rank >= cnt)).to(tl.int32), axis=0)
        tl.store(sh + rank, bp - rank, mask=inr & (rank < cnt))
        run += tl.sum(inr.to(tl.int32), axis=0)
    bad += (run != cnt).to(tl.int32)
    # C: the set bits of the value-length region, by rank; the region ends with the last code
    run = cnt * 0
    lastbit = cnt * 0 - 1
    clen = cnt + kbits
    for t0 in range(0, uw * 32, TB):
        bp = t0 + tb
        wv = tl.load(w + creg + (bp >> 5), mask=bp < uw * 32, other=0)
        on = ((wv >> (bp & 31)) & 1) != 0
        inr = on & (bp < clen)
        rank = run + tl.cumsum(inr.to(tl.int32), axis=0) - 1
        bad += tl.sum((on & (bp >= clen)).to(tl.int32), axis=0) + tl.sum((inr & (rank >= cnt)).to(tl.int32), axis=0)
        tl.store(sp + rank, bp, mask=inr & (rank < cnt))
        lastbit = tl.maximum(lastbit, tl.max(tl.where(inr, bp, -1), axis=0))
        run += tl.sum(inr.to(tl.int32), axis=0)
    bad += (run != cnt).to(tl.int32) + ((cnt > 0) & (lastbit != clen - 1)).to(tl.int32)
    # padding of the two field regions
    alen = cnt * low
    apad = tl.load(w + areg + lw - 1, mask=(cnt > 0) & ((alen & 31) != 0), other=0).to(tl.uint32, bitcast=True)
    bad += ((apad >> (alen & 31).to(tl.uint32)) != 0).to(tl.int32) * ((alen & 31) != 0).to(tl.int32)
    dpad = tl.load(w + dreg + mw - 1, mask=(cnt > 0) & ((kbits & 31) != 0), other=0).to(tl.uint32, bitcast=True)
    bad += ((dpad >> (kbits & 31).to(tl.uint32)) != 0).to(tl.int32) * ((kbits & 31) != 0).to(tl.int32)
    tl.debug_barrier()
    # by rank: position (low bits + high part), value code (length from C, bits from D); checks
    lane = tl.arange(0, CH)
    prev_p = cnt * 0 - 1
    prev_pos = cnt * 0 - 1
    for c0 in range(0, cnt, CH):
        r = c0 + lane
        valid = r < cnt
        hv = tl.load(sh + r, mask=valid, other=0)
        pv = tl.load(sp + r, mask=valid, other=0)
        lowv = _read_bits(w, areg, r * low, low + r * 0, valid).to(tl.int32)
        pos = (hv << low) | lowv
        pp = tl.where(lane == 0, prev_p, tl.gather(pv, tl.maximum(lane - 1, 0), 0))
        qq = tl.where(lane == 0, prev_pos, tl.gather(pos, tl.maximum(lane - 1, 0), 0))
        k = pv - pp - 1
        ok = (pos < span) & (pos > qq) & (k <= EBITS - 1) & (k >= 0)
        bad += tl.sum((valid & (ok == 0)).to(tl.int32), axis=0)
        kk = tl.where(valid & ok, k, 0)
        mant = _read_bits(w, dreg, pp + 1 - r, kk, valid & ok)
        v = (tl.full((CH,), 1, tl.int64) << kk.to(tl.int64)) | mant
        tl.store(sh + r, pos, mask=valid)
        tl.store(sp + r, v.to(tl.int32, bitcast=False), mask=valid)
        last = lane == tl.sum(valid.to(tl.int32), axis=0) - 1
        prev_p = tl.sum(tl.where(last, pv, 0), axis=0)
        prev_pos = tl.sum(tl.where(last, pos, 0), axis=0)
    if bad != 0:
        tl.atomic_add(err_ptr, 1)
    tl.debug_barrier()
    bits = _bits_ptr(tl.load(addr_ptr + e), EBITS) + e0
    hstart = tl.load(start_ptr + e) + e0
    MASK: tl.constexpr = (1 << EBITS) - 1
    acc_a = tl.zeros((CH,), tl.uint32)
    acc_b = tl.zeros((CH,), tl.uint32)
    nwrite = tl.where(bad == 0, cnt, 0)
    for c0 in range(0, nwrite, CH):
        r = c0 + lane
        valid = r < nwrite
        pos = tl.load(sh + r, mask=valid, other=0)
        v = tl.load(sp + r, mask=valid, other=0).to(tl.int64) & 0xFFFFFFFF
        old = tl.load(bits + pos, mask=valid, other=0).to(tl.int64) & MASK
        d = ((v >> 1) ^ (0 - (v & 1))) & MASK
        if NEGATE:
            d = (0 - d) & MASK
        new = (old + d) & MASK
        tl.store(bits + pos, _signed_bits(new, EBITS), mask=valid)
        if HASH:
            da, db = _lanes_change(new.to(tl.uint32), old.to(tl.uint32), (hstart + pos).to(tl.uint32), valid)
            acc_a += da
            acc_b += db
    if HASH:
        tl.atomic_add(hash_ptr + 2 * e, tl.sum(acc_a, axis=0).to(tl.int32, bitcast=True))
        tl.atomic_add(hash_ptr + 2 * e + 1, tl.sum(acc_b, axis=0).to(tl.int32, bitcast=True))


@triton.jit(do_not_specialize=["nslices", "ngate"])  # one compiled variant for any slice count
def _apply_records_kernel(addr_ptr, rec_off_ptr, m_ptr, tile_cum_ptr, nslices, pos_ptr, val_ptr, start_ptr,
                          hash_ptr, gate_ptr, ngate, undo_ptr, EBITS: tl.constexpr, BLOCK: tl.constexpr,
                          DELTA: tl.constexpr, NEGATE: tl.constexpr, STEPS: tl.constexpr, HASH: tl.constexpr,
                          UNDO: tl.constexpr):
    """Write records in place (nothing when a gate flag is set); with HASH also add the per-slice sum of
    ``lanes(new) - lanes(old)`` over the written elements into ``hash[s]`` (int32 [S, 2], atomics); with UNDO
    store the overwritten bits (zero-extended) at the records' places in ``undo``."""
    tid = tl.program_id(0).to(tl.int64)
    gk = tl.arange(0, 8)
    open_ = (tl.sum(tl.load(gate_ptr + gk, mask=gk < ngate, other=0), axis=0) == 0).to(tl.int32)
    s = _find(tile_cum_ptr, nslices, tid, STEPS)
    bits = _bits_ptr(tl.load(addr_ptr + s), EBITS)
    offs = (tid - tl.load(tile_cum_ptr + s)) * BLOCK + tl.arange(0, BLOCK)
    valid = (offs < tl.load(m_ptr + s)) & ((offs * 0 + open_) != 0)  # a scalar mask broadcast explicitly
    g = tl.load(rec_off_ptr + s) + offs
    p = tl.load(pos_ptr + g, mask=valid, other=0).to(tl.int64)
    MASK: tl.constexpr = (1 << EBITS) - 1
    v = tl.load(val_ptr + g, mask=valid, other=0).to(tl.int64) & MASK
    old = tl.load(bits + p, mask=valid, other=0).to(tl.int64) & MASK
    if UNDO:
        tl.store(undo_ptr + g, old.to(tl.int32), mask=valid)
    if DELTA:
        zz = v + 1
        d = tl.where((zz & 1) == 1, (~(zz >> 1)) & MASK, zz >> 1)
        if NEGATE:
            d = (0 - d) & MASK
        v = (old + d) & MASK
    tl.store(bits + p, _signed_bits(v, EBITS), mask=valid)
    if HASH:
        da, db = _lanes_change(v.to(tl.uint32), old.to(tl.uint32), (p + tl.load(start_ptr + s)).to(tl.uint32), valid)
        tl.atomic_add(hash_ptr + 2 * s, tl.sum(da, axis=0).to(tl.int32, bitcast=True))
        tl.atomic_add(hash_ptr + 2 * s + 1, tl.sum(db, axis=0).to(tl.int32, bitcast=True))

"""Triton kernels for bit-exact sparse weight sync (diff, compaction, compact packing, decode, apply).

Layout and semantics are those of :mod:`sparrow.kernels.sync.reference` (the test oracle); this module
never imports it. Scheme on the GPU (no host round trip of indices):

1. ``_diff_count_group_kernel``: one program per ``DIFF_TILE`` elements reads old and new bit patterns once,
   writes the tile's change count and a 1-bit-per-element change mask (1/16 of the bf16 input), and
   optionally the two hash lanes of the new bits.
2. exclusive scan of the tile counts on the device (``torch.cumsum``, no sync).
3. ``_diff_collect_group_kernel``: one program per tile reads only the mask words, ranks the set bits with an
   in-tile prefix sum and gathers old/new bits of the changed lanes only (masked loads touch only the
   memory sectors that hold changes), writing ``(position, code)`` records at ``tile offset + rank``;
   optionally it writes the new bits into the old tensor (the sender's snapshot update).
4. ``_pack_group_kernel``: one program per block of ``RANK_BLOCK`` records computes the Elias-Fano parameter
   ``L``, the value width ``W`` (exact cost minimisation), escapes, and packs the four bit regions
   word-parallel (each output word gathers the fields it overlaps; no atomics) into a fixed-capacity slot.
5. exclusive scan of the slot sizes on the device, ``_assemble_group_kernel`` copies the used part of every
   slot behind the metadata.

Every kernel works on a *group* of slices in one launch (per-slice base addresses, lengths and
cumulative tile / block counts in small device arrays; a program finds its slice in a per-tile table
(full-data kernels) or by binary search over the cumulative counts (per-change kernels)), so
the launch count per sync does not grow with the number of tensors.

Decode: ``_unpack_group_kernel`` (one program per block) expands the high bits tile by tile, ranks them with a
prefix sum, and reads low bits, value codes and exceptions by rank; it validates every field and flags
bad blocks instead of writing out of range. ``_apply_group_kernel`` then adds the decoded deltas in place.
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
def _delta_code(old, new, EBITS: tl.constexpr):
    """c = zigzag(new - old) - 1 as int64 (unsigned value < 2^EBITS)."""
    MASK: tl.constexpr = (1 << EBITS) - 1
    o = old.to(tl.int64) & MASK
    x = new.to(tl.int64) & MASK
    d = (x - o) & MASK
    zz = tl.where((d >> (EBITS - 1)) == 1, (~(d << 1)) & MASK, (d << 1) & MASK)
    return zz - 1


@triton.jit
def _pack_fixed(dst_ptr, nwords, src_ptr, count, width, WT: tl.constexpr):
    """Words [0, nwords) of dst = the fields src[0..count) of ``width`` bits packed back to back."""
    wsafe = tl.maximum(width, 1).to(tl.int64)
    fmask = (tl.full((WT,), 1, tl.int64) << wsafe) - 1
    kmax = 32 // wsafe + 2
    for w0 in range(0, nwords, WT):
        wi = w0 + tl.arange(0, WT)
        active = wi < nwords
        bit0 = wi.to(tl.int64) * 32
        f0 = bit0 // wsafe
        acc = tl.zeros((WT,), tl.int64)
        for k in range(0, kmax):
            f = f0 + k
            fs = f * wsafe - bit0
            fa = active & (f < count) & (fs < 32)
            v = tl.load(src_ptr + f, mask=fa, other=0).to(tl.int64) & fmask
            left = v << tl.maximum(fs, 0)
            right = v >> tl.maximum(-fs, 0)
            acc = acc | tl.where(fa, tl.where(fs >= 0, left, right), 0)
        tl.store(dst_ptr + wi, (acc & 0xFFFFFFFF).to(tl.int32), mask=active)


@triton.jit
def _pack_bitset(dst_ptr, nwords, h_ptr, count, WT: tl.constexpr, SEARCH_STEPS: tl.constexpr):
    """Words [0, nwords) of dst = bitset with bits h[0..count) set (h strictly increasing)."""
    for w0 in range(0, nwords, WT):
        wi = w0 + tl.arange(0, WT)
        active = wi < nwords
        bit0 = wi * 32
        lo = tl.zeros((WT,), tl.int32)
        hi = tl.zeros((WT,), tl.int32) + count
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi) >> 1
            go = lo < hi
            hv = tl.load(h_ptr + mid, mask=go & (mid < count), other=0)
            right = go & (hv < bit0)
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(go & (hv >= bit0), mid, hi)
        acc = tl.zeros((WT,), tl.int64)
        for k in tl.static_range(32):
            idx = lo + k
            a = active & (idx < count)
            hv = tl.load(h_ptr + idx, mask=a, other=0)
            rel = hv - bit0
            a = a & (rel < 32) & (rel >= 0)
            acc = acc | tl.where(a, tl.full((WT,), 1, tl.int64) << tl.maximum(rel, 0).to(tl.int64), 0)
        tl.store(dst_ptr + wi, (acc & 0xFFFFFFFF).to(tl.int32), mask=active)


@triton.jit
def _find(cum_ptr, nslices, x, STEPS: tl.constexpr):
    """Largest s in [0, nslices) with cum[s] <= x (cum ascending, cum[0] = 0)."""
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
def _bits_ptr(addr, EBITS: tl.constexpr):
    if EBITS == 16:
        return addr.to(tl.pointer_type(tl.int16))
    else:
        return addr.to(tl.pointer_type(tl.int32))


@triton.jit
def _lanes(xu, pos):
    """The two uint32 hash lanes of each element (uint32 bit pattern ``xu`` at uint32 position ``pos``);
    a range's hash is the lane-wise sum mod 2^32 (see ``reference.hash_bits``)."""
    t = (xu * H_MUL_X) ^ (pos * H_MUL_I + H_ADD_I)
    return _fmix32(t), _fmix32(t ^ H_XOR_B)


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


@triton.jit
def _diff_count_group_kernel(old_addr_ptr, new_addr_ptr, n_ptr, start_ptr, tile_cum_ptr, prog_cum_ptr,
                             prog_slice_ptr, counts_ptr, maskw_ptr, slice_counts_ptr, hash_ptr,
                             EBITS: tl.constexpr, TILE: tl.constexpr, TPP: tl.constexpr, HASH: tl.constexpr,
                             ALIGNED: tl.constexpr):
    """Per tile: change count and 1-bit change mask; per slice (atomics): change count and, with HASH,
    the hash lanes of the new bits."""
    pid = tl.program_id(0).to(tl.int64)
    s, n, j0, t0, nt = _prog_tiles(pid, prog_slice_ptr, prog_cum_ptr, tile_cum_ptr, n_ptr, TILE, TPP)
    old_addr = tl.load(old_addr_ptr + s)
    new_addr = tl.load(new_addr_ptr + s)
    lane = tl.arange(0, TILE)
    wl = tl.arange(0, TILE // 32)
    acc_c = tl.zeros((TILE,), tl.int32)
    acc_a = tl.zeros((TILE,), tl.uint32)
    acc_b = tl.zeros((TILE,), tl.uint32)
    if HASH:
        start = tl.load(start_ptr + s)
    for k in range(0, nt):
        ts = (j0 + k) * TILE
        old_p, rem = _tile_base(old_addr, ts, n, TILE, EBITS, ALIGNED)
        new_p, _ = _tile_base(new_addr, ts, n, TILE, EBITS, ALIGNED)
        valid = lane < rem
        old = tl.load(old_p + lane, mask=valid, other=0)
        new = tl.load(new_p + lane, mask=valid, other=0)
        c = (old != new).to(tl.int32)  # masked lanes load 0 == 0
        tl.store(counts_ptr + t0 + k, tl.sum(c, axis=0))
        acc_c += c
        bitv = c.to(tl.uint32) << (lane & 31).to(tl.uint32)
        words = tl.sum(tl.reshape(bitv, (TILE // 32, 32)), axis=1)
        tl.store(maskw_ptr + (t0 + k) * (TILE // 32) + wl, words.to(tl.int32, bitcast=True))
        if HASH:
            a, b = _lanes(_unsigned32(new, EBITS), (ts + start).to(tl.uint32) + lane.to(tl.uint32))
            acc_a += tl.where(valid, a, 0)
            acc_b += tl.where(valid, b, 0)
    tl.atomic_add(slice_counts_ptr + s, tl.sum(acc_c, axis=0))
    if HASH:
        tl.atomic_add(hash_ptr + 2 * s, tl.sum(acc_a, axis=0).to(tl.int32, bitcast=True))
        tl.atomic_add(hash_ptr + 2 * s + 1, tl.sum(acc_b, axis=0).to(tl.int32, bitcast=True))


@triton.jit
def _diff_collect_group_kernel(old_addr_ptr, new_addr_ptr, n_ptr, start_ptr, tile_cum_ptr, prog_cum_ptr,
                               prog_slice_ptr, prog0, counts_ptr, offsets_ptr, rec_base, maskw_ptr, pos_ptr,
                               val_ptr, hash_ptr, EBITS: tl.constexpr, TILE: tl.constexpr, TPP: tl.constexpr,
                               DELTA: tl.constexpr, UPDATE_OLD: tl.constexpr, HASH: tl.constexpr):
    """Records of the changed lanes (tiles without changes are skipped); with HASH the per-slice sum of
    ``lanes(new) - lanes(old)`` over the changed elements (the incremental hash update)."""
    pid = tl.program_id(0).to(tl.int64) + prog0
    s, n, j0, t0, nt = _prog_tiles(pid, prog_slice_ptr, prog_cum_ptr, tile_cum_ptr, n_ptr, TILE, TPP)
    old_p = _bits_ptr(tl.load(old_addr_ptr + s), EBITS)
    new_p = _bits_ptr(tl.load(new_addr_ptr + s), EBITS)
    lane = tl.arange(0, TILE)
    acc_a = tl.zeros((TILE,), tl.uint32)
    acc_b = tl.zeros((TILE,), tl.uint32)
    if HASH:
        start = tl.load(start_ptr + s)
    for k in range(0, nt):
        t = t0 + k
        if tl.load(counts_ptr + t) > 0:
            offs = (j0 + k) * TILE + lane
            w = tl.load(maskw_ptr + t * (TILE // 32) + (lane >> 5))
            ch = (((w.to(tl.uint32, bitcast=True) >> (lane & 31).to(tl.uint32)) & 1) != 0) & (offs < n)
            rank = tl.cumsum(ch.to(tl.int32), axis=0) - 1
            dst = tl.load(offsets_ptr + t) - rec_base + rank
            new = tl.load(new_p + offs, mask=ch, other=0)
            if DELTA or HASH:
                old = tl.load(old_p + offs, mask=ch, other=0)
            if DELTA:
                val = _delta_code(old, new, EBITS)
            else:
                val = new.to(tl.int64) & ((1 << EBITS) - 1)
            tl.store(pos_ptr + dst, offs.to(tl.int32), mask=ch)
            tl.store(val_ptr + dst, val.to(tl.int32), mask=ch)
            if UPDATE_OLD:
                tl.store(old_p + offs, new, mask=ch)
            if HASH:
                hp = (offs + start).to(tl.uint32)
                na, nb = _lanes(_unsigned32(new, EBITS), hp)
                oa, ob = _lanes(_unsigned32(old, EBITS), hp)
                acc_a += tl.where(ch, na - oa, 0)
                acc_b += tl.where(ch, nb - ob, 0)
    if HASH:
        tl.atomic_add(hash_ptr + 2 * s, tl.sum(acc_a, axis=0).to(tl.int32, bitcast=True))
        tl.atomic_add(hash_ptr + 2 * s + 1, tl.sum(acc_b, axis=0).to(tl.int32, bitcast=True))


@triton.jit(do_not_specialize=["nslices"])  # one compiled variant for any slice count
def _pack_group_kernel(pos_ptr, val_ptr, m_ptr, rec_off_ptr, block_cum_ptr, nslices,
                       slots_ptr, sizes_ptr, meta_ptr, scratch_ptr,
                       EBITS: tl.constexpr, R: tl.constexpr, SLOT: tl.constexpr, WT: tl.constexpr,
                       SEARCH_STEPS: tl.constexpr, STEPS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    s = _find(block_cum_ptr, nslices, b, STEPS)
    j = b - tl.load(block_cum_ptr + s)
    m = tl.load(m_ptr + s)
    i = tl.arange(0, R)
    cnt = tl.minimum(m - j * R, R)
    valid = i < cnt
    g = tl.load(rec_off_ptr + s) + j * R + i
    p = tl.load(pos_ptr + g, mask=valid, other=0).to(tl.int64)
    p_first = tl.min(tl.where(valid, p, 2**40), axis=0)  # positions ascend
    p_last = tl.max(tl.where(valid, p, -1), axis=0)
    span = p_last - p_first
    q = (span + 1) // cnt
    L = (q * 0).to(tl.int64)
    for k in tl.static_range(1, 32):
        L += ((q >> k) > 0).to(tl.int64)
    u = p - p_first
    low = u & ((tl.full((R,), 1, tl.int64) << L) - 1)
    h = (u >> L) + i
    high_len = (span >> L) + cnt
    MASK: tl.constexpr = (1 << EBITS) - 1
    cu = tl.load(val_ptr + g, mask=valid, other=0).to(tl.int64) & MASK
    zz = cu + 1
    need = tl.zeros((R,), tl.int32)
    for k in tl.static_range(EBITS):
        need += ((zz >> k) > 0).to(tl.int32)
    best = cnt * EBITS + 1
    W = (cnt * 0 + 1).to(tl.int64)
    for w in tl.static_range(1, EBITS + 1):
        cost = cnt * w + EBITS * tl.sum((valid & (need > w)).to(tl.int64), axis=0)
        better = cost < best
        W = tl.where(better, w, W)
        best = tl.where(better, cost, best)
    esc_code = (tl.full((R,), 1, tl.int64) << W) - 1
    esc = valid & (cu >= esc_code)
    code = tl.where(esc, esc_code, cu)
    e = tl.sum(esc.to(tl.int64), axis=0)
    erank = tl.cumsum(esc.to(tl.int32), axis=0) - 1
    lw = (cnt * L + 31) // 32
    hw = (high_len + 31) // 32
    vw = (cnt * W + 31) // 32
    if EBITS == 32:
        xw = e
    else:
        xw = (e + 1) // 2
    scr = scratch_ptr + b * (4 * R)
    tl.store(scr + i, low.to(tl.int32), mask=valid)
    tl.store(scr + R + i, h.to(tl.int32), mask=valid)
    tl.store(scr + 2 * R + i, code.to(tl.int32), mask=valid)
    tl.store(scr + 3 * R + erank, cu.to(tl.int32), mask=esc)
    tl.debug_barrier()
    slot = slots_ptr + b * SLOT
    _pack_fixed(slot, lw, scr, cnt, L, WT)
    _pack_bitset(slot + lw, hw, scr + R, cnt, WT, SEARCH_STEPS)
    _pack_fixed(slot + lw + hw, vw, scr + 2 * R, cnt, W, WT)
    _pack_fixed(slot + lw + hw + vw, xw, scr + 3 * R, e, W * 0 + EBITS, WT)
    tl.store(sizes_ptr + b, lw + hw + vw + xw)
    k4 = tl.arange(0, 4)
    meta = tl.where(k4 == 0, p_first, tl.where(k4 == 2, L | (W << 8) | (e << 16), high_len))
    tl.store(meta_ptr + 4 * b + k4, meta.to(tl.int32))


@triton.jit(do_not_specialize=["nslices"])  # one compiled variant for any slice count
def _assemble_group_kernel(slots_ptr, sizes_ptr, size_excl_ptr, block_cum_ptr, base_ptr, nslices, meta_ptr,
                           out_ptr, SLOT: tl.constexpr, CT: tl.constexpr, STEPS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    s = _find(block_cum_ptr, nslices, b, STEPS)
    b0 = tl.load(block_cum_ptr + s)
    nb = tl.load(block_cum_ptr + s + 1) - b0
    size = tl.load(sizes_ptr + b)
    off = tl.load(size_excl_ptr + b) - tl.load(size_excl_ptr + b0)  # body offset within the slice
    base = tl.load(base_ptr + s)
    dst = out_ptr + base + 4 * nb + off
    for w0 in range(0, size, CT):
        wi = w0 + tl.arange(0, CT)
        a = wi < size
        tl.store(dst + wi, tl.load(slots_ptr + b * SLOT + wi, mask=a, other=0), mask=a)
    k = tl.arange(0, 4)
    meta = tl.load(meta_ptr + 4 * b + k)
    meta = tl.where(k == 1, off.to(tl.int32), meta)
    tl.store(out_ptr + base + 4 * (b - b0) + k, meta)


@triton.jit
def _read_field(words_ptr, region, idx, width, mask):
    """Field ``idx`` of ``width`` bits (int64 tensors) in the region starting at word ``region``."""
    bitpos = idx * width
    wi = region + (bitpos >> 5)
    s = bitpos & 31
    lo = tl.load(words_ptr + wi, mask=mask, other=0).to(tl.int64) & 0xFFFFFFFF
    hi = tl.load(words_ptr + wi + 1, mask=mask & (s + width > 32), other=0).to(tl.int64) & 0xFFFFFFFF
    return ((lo | (hi << 32)) >> s) & ((tl.full(idx.shape, 1, tl.int64) << width) - 1)


@triton.jit(do_not_specialize=["nslices"])  # one compiled variant for any slice count
def _unpack_group_kernel(words_ptr, word_off_ptr, total_ptr, n_ptr, m_ptr, rec_off_ptr, block_cum_ptr, nslices,
                         pos_ptr, val_ptr, err_ptr, EBITS: tl.constexpr, R: tl.constexpr, STEPS: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    s = _find(block_cum_ptr, nslices, b, STEPS)
    b0 = tl.load(block_cum_ptr + s)
    j = b - b0
    nb = tl.load(block_cum_ptr + s + 1) - b0
    words = words_ptr + tl.load(word_off_ptr + s)
    total = tl.load(total_ptr + s)
    n = tl.load(n_ptr + s)
    m = tl.load(m_ptr + s)
    lane = tl.arange(0, R).to(tl.int64)
    cnt = tl.minimum(m - j * R, R)
    # this block's metadata and the next block's offset / first position (cross-block checks)
    k8 = tl.arange(0, 8)
    has_next = j + 1 < nb
    meta = tl.load(words + 4 * j + k8, mask=k8 < tl.where(has_next, 8, 4), other=0).to(tl.int64) & 0xFFFFFFFF
    p_first = tl.sum(tl.where(k8 == 0, meta, 0), axis=0)
    body_off = tl.sum(tl.where(k8 == 1, meta, 0), axis=0)
    packed = tl.sum(tl.where(k8 == 2, meta, 0), axis=0)
    high_len = tl.sum(tl.where(k8 == 3, meta, 0), axis=0)
    next_first = tl.sum(tl.where(k8 == 4, meta, 0), axis=0)
    next_off = tl.sum(tl.where(k8 == 5, meta, 0), axis=0)
    L = packed & 0xFF
    W = (packed >> 8) & 0xFF
    e = packed >> 16
    ok = (L <= 31) & (W >= 1) & (W <= EBITS) & (e <= cnt) & (p_first < n) & (high_len >= cnt)
    ok = ok & ((j > 0) | (body_off == 0))
    L = tl.minimum(L, 31)
    W = tl.maximum(tl.minimum(W, EBITS), 1)
    ok = ok & (high_len <= cnt + (n >> L) + 1)
    high_len = tl.where(ok, high_len, 0)
    e = tl.where(ok, e, 0)
    lw = (cnt * L + 31) // 32
    hw = (high_len + 31) // 32
    vw = (cnt * W + 31) // 32
    if EBITS == 32:
        xw = e
    else:
        xw = (e + 1) // 2
    start = 4 * nb + body_off
    end = start + lw + hw + vw + xw
    # blocks tile the body exactly: each ends where the next begins, the last at the body's end
    ok = ok & (end <= total) & tl.where(has_next, end == 4 * nb + next_off, end == total)
    high_len = tl.where(ok, high_len, 0)
    e = tl.where(ok, e, 0)
    hreg = start + lw
    vreg = hreg + hw
    xreg = vreg + vw
    esc_code = (tl.full((R,), 1, tl.int64) << W) - 1
    MAXC: tl.constexpr = (1 << EBITS) - 2
    running = (cnt * 0).to(tl.int64)
    erun = (cnt * 0).to(tl.int64)
    bad = (cnt * 0).to(tl.int64)
    last_p = (cnt * 0 - 1).to(tl.int64)
    for t in range(0, (high_len + R - 1) // R):
        jb = t * R + lane
        inb = jb < high_len
        wv = tl.load(words + hreg + (jb >> 5), mask=inb, other=0).to(tl.int64) & 0xFFFFFFFF
        sbit = inb & (((wv >> (jb & 31)) & 1) != 0)
        r = running + tl.cumsum(sbit.to(tl.int64), axis=0) - 1
        v = sbit & (r < cnt)
        bad += tl.sum((sbit & (r >= cnt)).to(tl.int64), axis=0)
        low = _read_field(words, start, r, L, v)
        u = ((jb - r) << L) | low
        p = p_first + u
        bad += tl.sum((v & ((p >= n) | ((r == 0) & (u != 0)))).to(tl.int64), axis=0)
        last_p = tl.maximum(last_p, tl.max(tl.where(v, p, -1), axis=0))
        code = _read_field(words, vreg, r, W, v)
        esc = v & (code == esc_code)
        er = erun + tl.cumsum(esc.to(tl.int64), axis=0) - 1
        esc_ok = esc & (er < e)
        bad += tl.sum((esc & (er >= e)).to(tl.int64), axis=0)
        exc = _read_field(words, xreg, er, tl.full((R,), EBITS, tl.int64), esc_ok)
        c = tl.where(esc, exc, code)
        bad += tl.sum((v & (c > MAXC)).to(tl.int64), axis=0)
        dst = tl.load(rec_off_ptr + s) + j * R + r
        tl.store(pos_ptr + dst, p.to(tl.int32), mask=v)
        tl.store(val_ptr + dst, c.to(tl.int32), mask=v)
        running += tl.sum(sbit.to(tl.int64), axis=0)
        erun += tl.sum(esc.to(tl.int64), axis=0)
    bad += (running != cnt).to(tl.int64) + (erun != e).to(tl.int64)
    bad += (has_next & (next_first <= last_p)).to(tl.int64)  # blocks in increasing position order
    tl.store(err_ptr + b, tl.where(ok, bad, 1).to(tl.int32))


@triton.jit(do_not_specialize=["nslices"])  # one compiled variant for any slice count
def _apply_group_kernel(addr_ptr, rec_off_ptr, m_ptr, tile_cum_ptr, nslices, pos_ptr, val_ptr, start_ptr, hash_ptr,
                        EBITS: tl.constexpr, BLOCK: tl.constexpr, DELTA: tl.constexpr, NEGATE: tl.constexpr,
                        STEPS: tl.constexpr, HASH: tl.constexpr):
    """Write records in place; with HASH also add the per-slice sum of ``lanes(new) - lanes(old)`` over
    the written elements into ``hash[s]`` (int32 [S, 2], atomics): the incremental hash update."""
    tid = tl.program_id(0).to(tl.int64)
    s = _find(tile_cum_ptr, nslices, tid, STEPS)
    bits = _bits_ptr(tl.load(addr_ptr + s), EBITS)
    offs = (tid - tl.load(tile_cum_ptr + s)) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < tl.load(m_ptr + s)
    g = tl.load(rec_off_ptr + s) + offs
    p = tl.load(pos_ptr + g, mask=valid, other=0).to(tl.int64)
    MASK: tl.constexpr = (1 << EBITS) - 1
    v = tl.load(val_ptr + g, mask=valid, other=0).to(tl.int64) & MASK
    if DELTA or HASH:
        old = tl.load(bits + p, mask=valid, other=0).to(tl.int64) & MASK
    if DELTA:
        zz = v + 1
        d = tl.where((zz & 1) == 1, (~(zz >> 1)) & MASK, zz >> 1)
        if NEGATE:
            d = (0 - d) & MASK
        v = (old + d) & MASK
    if EBITS == 16:
        out = (v - ((v >> 15) << 16)).to(tl.int16)
    else:
        out = (v - ((v >> 31) << 32)).to(tl.int32)
    tl.store(bits + p, out, mask=valid)
    if HASH:
        hp = (p + tl.load(start_ptr + s)).to(tl.uint32)
        na, nb = _lanes(v.to(tl.uint32), hp)
        oa, ob = _lanes(old.to(tl.uint32), hp)
        tl.atomic_add(hash_ptr + 2 * s, tl.sum(tl.where(valid, na - oa, 0), axis=0).to(tl.int32, bitcast=True))
        tl.atomic_add(hash_ptr + 2 * s + 1, tl.sum(tl.where(valid, nb - ob, 0), axis=0).to(tl.int32, bitcast=True))

"""Eager PyTorch reference of the sync kernels (any device; used on CPU and as the test oracle).

All functions take flat integer bit views (``int16`` for 16-bit floats, ``int32`` for fp32; see
:func:`sparrow.kernels.sync.common.bits_view`) and never look at float values.

Compact body layout (format 2, little-endian ``uint32`` words) of a slice of ``n`` elements with ``E``-bit
elements whose ``m >= 1`` changed positions are ``p_0 < p_1 < ...`` (``m == 0``: the body is empty). The slice
is cut into ``nb = ceil(n / S)`` blocks of ``S = 2**span_log2`` elements; block ``j`` spans
``[j S, j S + span_j)``, ``span_j = min(S, n - j S)``, and holds ``cnt_j`` of the changes. Per change ``i``
of a block: ``u_i = p_i - j S`` (offset in the block), ``v_i = zigzag((new - old) mod 2**E)`` (``+-1`` ULP ->
2 / 1; ``1 <= v_i < 2**E``) and ``k_i = floor(log2 v_i)``. ``K_j = sum k_i``.

* ``nb`` headers of 3 words: ``R_j`` (changes in the blocks before ``j``), ``K_j``, ``off_j`` (word offset of
  the block's body after the headers; ``off_0 = 0``, each block starts where the previous ends).
  ``cnt_j = R_{j+1} - R_j`` (the last block: ``m - R_j``).
* per block with ``cnt_j > 0``, four regions, each padded to whole words, with
  ``L = floor(log2(span_j // cnt_j))``:
  - A, low bits: ``cnt * L`` bits, field ``i`` = ``u_i & (2**L - 1)`` (Elias-Fano low part);
  - B, high bits: ``H = cnt + ((span_j - 1) >> L)`` bits, bit ``(u_i >> L) + i`` set (the high parts in unary);
  - C, value lengths: ``cnt + K`` bits, bit ``k_0 + ... + k_i + i`` set (each code's ``k_i`` in unary);
  - D, value bits: ``K`` bits, field ``i`` (``k_i`` bits at bit ``k_0 + ... + k_{i-1}``) = ``v_i - 2**k_i``.

The values are Elias-gamma codes split into a unary stream (C) and a mantissa stream (D): ``-1`` ULP costs 1
bit, ``+1`` and ``-2`` ULP 3 bits, ``+2``, ``+-3`` and ``-4`` ULP 5 bits. Every block's size is a function of
``(cnt_j, K_j, span_j)`` only, so an encoder knows every offset from a diff scan before it writes a word, and
every field is at a computable offset (a set bit of B or C is found by a prefix count), so decode is parallel too.
"""

from __future__ import annotations

import torch

from .common import HEADER_WORDS, M32, SyncFormatError, hash_lanes

_I64 = torch.int64


def _mask(ebits: int) -> int:
    return (1 << ebits) - 1


def _unsigned(bits: torch.Tensor) -> torch.Tensor:
    """int16/int32 bit patterns -> int64 holding the unsigned value."""
    ebits = 8 * bits.element_size()
    return bits.to(_I64) & _mask(ebits)


def _to_signed(x: torch.Tensor, ebits: int, dtype: torch.dtype) -> torch.Tensor:
    """int64 unsigned values < 2^ebits -> the same bit pattern as a signed ``dtype`` tensor."""
    x = x & _mask(ebits)
    return (x - ((x >> (ebits - 1)) << ebits)).to(dtype)


def hash_bits(bits: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Two 32-bit hash lanes (int64 tensor ``[2]``) of the bit patterns ``bits`` at positions ``start + i``:
    the lane-wise sums (mod 2^32) of :func:`hash_lanes`. Position-sensitive, additive over elements
    (so it can be updated from the changed elements alone), not cryptographic.
    """
    x = _unsigned(bits.reshape(-1))
    pos = torch.arange(start, start + x.numel(), device=x.device, dtype=_I64)
    a, b = hash_lanes(x, pos)
    return torch.stack([a.sum() & M32, b.sum() & M32])


def hash_delta(old_bits: torch.Tensor, new_bits: torch.Tensor, pos: torch.Tensor, start: int = 0) -> torch.Tensor:
    """Change of :func:`hash_bits` (lanes ``[2]``, mod 2^32) when the elements at positions ``pos`` (relative
    to ``start``) go from ``old_bits`` to ``new_bits`` (bit patterns at those positions)."""
    p = pos.to(_I64) + start
    na, nb = hash_lanes(_unsigned(new_bits.reshape(-1)), p)
    oa, ob = hash_lanes(_unsigned(old_bits.reshape(-1)), p)
    return torch.stack([(na - oa).sum() & M32, (nb - ob).sum() & M32])


def delta_codes(old_u: torch.Tensor, new_u: torch.Tensor, ebits: int) -> torch.Tensor:
    """c = zigzag((new - old) mod 2^E) - 1 for unsigned int64 inputs; in [0, 2^E - 2] when new != old."""
    m = _mask(ebits)
    d = (new_u - old_u) & m
    zz = torch.where((d >> (ebits - 1)) == 1, (~(d << 1)) & m, (d << 1) & m)
    return zz - 1


def apply_codes(old_u: torch.Tensor, c: torch.Tensor, ebits: int, negate: bool = False) -> torch.Tensor:
    """Inverse of :func:`delta_codes`: old + unzigzag(c + 1) (mod 2^E); ``negate`` subtracts instead."""
    m = _mask(ebits)
    zz = c + 1
    d = torch.where((zz & 1) == 1, (~(zz >> 1)) & m, zz >> 1)
    if negate:
        d = (-d) & m
    return (old_u + d) & m


def diff_records(base_bits: torch.Tensor, new_bits: torch.Tensor, values: str = "delta",
                 update_base: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (int32, ascending) of differing bit patterns and, per position, either the delta code
    ``c`` (``values="delta"``) or the new bit pattern (``values="new"``) as int32.

    With ``update_base`` the changed elements of ``base_bits`` are overwritten with ``new_bits``.
    """
    ebits = 8 * base_bits.element_size()
    pos = torch.nonzero(base_bits != new_bits).reshape(-1)
    new_u = _unsigned(new_bits[pos])
    if values == "delta":
        val = delta_codes(_unsigned(base_bits[pos]), new_u, ebits)
    elif values == "new":
        val = new_u
    else:
        raise ValueError(f"values must be 'delta' or 'new', got {values!r}")
    if update_base:
        base_bits[pos] = new_bits[pos]
    return pos.to(torch.int32), _to_signed(val, 32, torch.int32) if ebits == 32 else val.to(torch.int32)


def apply_records(base_bits: torch.Tensor, pos: torch.Tensor, val: torch.Tensor, values: str = "delta",
                  negate: bool = False) -> None:
    """Write the records of :func:`diff_records` into ``base_bits`` in place (indices must be checked)."""
    ebits = 8 * base_bits.element_size()
    p = pos.to(_I64)
    v = val.to(_I64) & _mask(ebits)
    if values == "delta":
        out = apply_codes(_unsigned(base_bits[p]), v, ebits, negate)
    elif values == "new":
        out = v
    else:
        raise ValueError(f"values must be 'delta' or 'new', got {values!r}")
    base_bits[p] = _to_signed(out, ebits, base_bits.dtype)


# ---------------------------------------------------------------------------------------------------
# compact format
# ---------------------------------------------------------------------------------------------------

def _ceil32(bits: torch.Tensor) -> torch.Tensor:
    return (bits + 31) >> 5


def floor_log2(x: torch.Tensor) -> torch.Tensor:
    """floor(log2 x) of an int64 tensor with ``1 <= x < 2**52`` (exact: float64 ``frexp``)."""
    _, e = torch.frexp(x.to(torch.float64))
    return e.to(_I64) - 1


def _excl_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def _pack_fields(words: torch.Tensor, bitpos: torch.Tensor, val: torch.Tensor, width: torch.Tensor) -> None:
    """OR ``val & (2^width - 1)`` into the int64 word array at bit offsets ``bitpos`` (disjoint fields)."""
    v = val & ((torch.ones_like(width) << width) - 1)
    keep = v != 0
    bitpos, v = bitpos[keep], v[keep]
    w = bitpos >> 5
    s = bitpos & 31
    words.index_add_(0, w, (v << s) & M32)
    hi = v >> (32 - s)
    spill = hi != 0
    words.index_add_(0, w[spill] + 1, hi[spill])


def _read_fields(words_u: torch.Tensor, bitpos: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """Fields of ``width`` bits at ``bitpos`` from unsigned int64 words (with two zero words at the end)."""
    w = bitpos >> 5
    s = bitpos & 31
    two = words_u[w] | (words_u[w + 1] << 32)
    return (two >> s) & ((torch.ones_like(width) << width) - 1)


def value_codes(old_bits: torch.Tensor, new_bits: torch.Tensor) -> torch.Tensor:
    """``v = zigzag((new - old) mod 2**E)`` (int64; 0 where nothing changed) of two bit views."""
    ebits = 8 * old_bits.element_size()
    m = _mask(ebits)
    d = (_unsigned(new_bits) - _unsigned(old_bits)) & m
    return torch.where((d >> (ebits - 1)) == 1, (~(d << 1)) & m, (d << 1) & m)


def apply_values(old_u: torch.Tensor, v: torch.Tensor, ebits: int, negate: bool = False) -> torch.Tensor:
    """Inverse of :func:`value_codes`: ``old + unzigzag(v)`` (mod 2**E, unsigned int64); ``negate`` subtracts."""
    return apply_codes(old_u, v - 1, ebits, negate)


def _block_geometry(n: int, nb: int, span_log2: int, cnt: torch.Tensor, kbits: torch.Tensor, dev):
    """Per block: span, L, H and the words of the four regions (int64 tensors of length ``nb``)."""
    S = 1 << span_log2
    span = torch.clamp(n - torch.arange(nb, device=dev, dtype=_I64) * S, max=S)
    has = cnt > 0
    L = torch.where(has, floor_log2(torch.where(has, span // torch.clamp(cnt, min=1), 1)), 0)
    H = torch.where(has, cnt + ((span - 1) >> L), 0)
    regions = torch.stack([_ceil32(cnt * L), _ceil32(H), _ceil32(cnt + kbits), _ceil32(kbits)], 1)
    return span, L, H, regions


def compact_block_stats(old_bits: torch.Tensor, new_bits: torch.Tensor, span_log2: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of ``2**span_log2`` elements: the change count ``cnt`` and the value bits ``K`` (int64)."""
    n = old_bits.numel()
    nb = -(-n // (1 << span_log2))
    dev = old_bits.device
    v = value_codes(old_bits.reshape(-1), new_bits.reshape(-1))
    pos = torch.nonzero(v).reshape(-1)
    blk = pos >> span_log2
    cnt = torch.zeros(nb, dtype=_I64, device=dev).index_add_(0, blk, torch.ones_like(blk))
    kbits = torch.zeros(nb, dtype=_I64, device=dev).index_add_(0, blk, floor_log2(v[pos]))
    return cnt, kbits


def compact_words(n: int, span_log2: int, cnt: torch.Tensor, kbits: torch.Tensor) -> int:
    """Words of a compact body with the given per-block counts (0 when nothing changed)."""
    if int(cnt.sum()) == 0:
        return 0
    nb = cnt.numel()
    _, _, _, regions = _block_geometry(n, nb, span_log2, cnt, kbits, cnt.device)
    return HEADER_WORDS * nb + int(regions.sum())


def compact_encode(old_bits: torch.Tensor, new_bits: torch.Tensor, span_log2: int) -> torch.Tensor:
    """Compact body (int32 words, format 2: see the module docstring) of the change ``old -> new``."""
    dev = old_bits.device
    o, x = old_bits.reshape(-1), new_bits.reshape(-1)
    n = o.numel()
    v_all = value_codes(o, x)
    pos = torch.nonzero(v_all).reshape(-1)
    m = pos.numel()
    if m == 0:
        return torch.zeros(0, dtype=torch.int32, device=dev)
    S = 1 << span_log2
    nb = -(-n // S)
    v = v_all[pos]
    k = floor_log2(v)
    blk = pos >> span_log2
    u = pos & (S - 1)
    cnt = torch.zeros(nb, dtype=_I64, device=dev).index_add_(0, blk, torch.ones_like(blk))
    kbits = torch.zeros(nb, dtype=_I64, device=dev).index_add_(0, blk, k)
    span, L, H, regions = _block_geometry(n, nb, span_log2, cnt, kbits, dev)
    size = regions.sum(1)
    off = _excl_cumsum(size)
    R = _excl_cumsum(cnt)
    total = HEADER_WORDS * nb + int(size.sum())
    words = torch.zeros(total + 1, dtype=_I64, device=dev)
    words[: HEADER_WORDS * nb] = torch.stack([R, kbits, off], 1).reshape(-1)
    start = HEADER_WORDS * nb + off
    reg0 = torch.cumsum(regions, 1) - regions  # first word of each region, relative to the block body
    i = torch.arange(m, device=dev, dtype=_I64) - R[blk]
    Lb = L[blk]
    kex = _excl_cumsum(k) - _excl_cumsum(kbits)[blk]  # k_0 + ... + k_{i-1} within the block
    base = 32 * (start[:, None] + reg0)[blk]  # bit offset of each change's four regions
    one = torch.ones_like(u)
    _pack_fields(words, base[:, 0] + i * Lb, u, Lb)
    _pack_fields(words, base[:, 1] + (u >> Lb) + i, one, one)
    _pack_fields(words, base[:, 2] + kex + k + i, one, one)
    _pack_fields(words, base[:, 3] + kex, v, k)
    return _to_signed(words[:total], 32, torch.int32)


def _bits_in(words_u: torch.Tensor, first_bit: torch.Tensor, nbits: torch.Tensor):
    """Set bits of the bit ranges ``[first_bit_j, first_bit_j + nbits_j)``: (range index, offset in range)."""
    seg = torch.repeat_interleave(torch.arange(nbits.numel(), device=words_u.device), nbits)
    local = torch.arange(seg.numel(), device=words_u.device, dtype=_I64) - _excl_cumsum(nbits)[seg]
    bitpos = first_bit[seg] + local
    on = ((words_u[bitpos >> 5] >> (bitpos & 31)) & 1) == 1
    return seg[on], local[on]


def compact_check_headers(words: torch.Tensor, n: int, ebits: int, nchanged: int, span_log2: int):
    """The block headers of a compact body (``nchanged >= 1``), checked: ranks start at 0 and give change
    counts in ``[0, span]``, ``K <= (E - 1) cnt``, body offsets start at 0 and tile the body exactly.
    Returns ``(wu, cnt, kbits, off, span, L, H, regions)``; raises :class:`SyncFormatError`."""
    dev = words.device
    m = int(nchanged)
    total = words.numel()
    S = 1 << span_log2
    nb = -(-n // S)
    if total < HEADER_WORDS * nb:
        raise SyncFormatError(f"compact body truncated: {total} words < {HEADER_WORDS * nb} header words")
    wu = torch.cat([words.to(_I64) & M32, torch.zeros(2, dtype=_I64, device=dev)])  # reads may touch the end
    R, kbits, off = wu[: HEADER_WORDS * nb].view(nb, HEADER_WORDS).unbind(1)
    nxt = torch.cat([R[1:], torch.tensor([m], dtype=_I64, device=dev)])
    cnt = nxt - R
    span = torch.clamp(n - torch.arange(nb, device=dev, dtype=_I64) * S, max=S)
    bad = (cnt < 0) | (cnt > span) | (kbits > (ebits - 1) * torch.clamp(cnt, min=0))
    if int(R[0]) != 0 or bool(bad.any()):
        b = int(torch.nonzero(bad)[0]) if bool(bad.any()) else 0
        raise SyncFormatError(f"compact block {b}: invalid header (R={int(R[b])}, K={int(kbits[b])}, "
                              f"next R={int(nxt[b])}, span={int(span[b])})")
    _, L, H, regions = _block_geometry(n, nb, span_log2, cnt, kbits, dev)
    size = regions.sum(1)
    if not torch.equal(off, _excl_cumsum(size)) or HEADER_WORDS * nb + int(size.sum()) != total:
        raise SyncFormatError(f"compact body length / block offsets inconsistent ({total} words for {nb} blocks)")
    return wu, cnt, kbits, off, span, L, H, regions


def compact_decode(words: torch.Tensor, n: int, ebits: int, nchanged: int, span_log2: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode a compact body into (positions int64 ascending, value codes ``v`` int64), checking every field.

    Raises :class:`SyncFormatError` unless the body is the canonical encoding of ``nchanged`` strictly
    increasing positions in ``[0, n)`` with valid value codes (headers, region lengths and padding, bit
    counts, positions inside their blocks and increasing). Writes nothing.
    """
    dev = words.device
    m = int(nchanged)
    if m < 0 or m > n:
        raise SyncFormatError(f"compact body claims {m} changes for a slice of {n} elements")
    if m == 0:
        if words.numel():
            raise SyncFormatError(f"compact body with 0 changes must be empty, got {words.numel()} words")
        empty = torch.zeros(0, dtype=_I64, device=dev)
        return empty, empty.clone()
    S = 1 << span_log2
    nb = -(-n // S)
    wu, cnt, kbits, off, span, L, H, regions = compact_check_headers(words, n, ebits, m, span_log2)
    R = _excl_cumsum(cnt)
    reg0 = torch.cumsum(regions, 1) - regions
    first = 32 * (HEADER_WORDS * nb + off[:, None] + reg0)  # [nb, 4] first bit of each region
    # padding bits of every region must be zero
    used = torch.stack([cnt * L, H, cnt + kbits, kbits], 1)
    pad = 32 * regions - used
    pseg, _ = _bits_in(wu, (first + used).reshape(-1), pad.reshape(-1))
    if pseg.numel():
        raise SyncFormatError(f"compact block {int(pseg[0]) // 4}: padding bits are not zero")
    # B: high parts; C: value lengths (one set bit per change in each)
    bseg, bloc = _bits_in(wu, first[:, 1], H)
    cseg, cloc = _bits_in(wu, first[:, 2], cnt + kbits)
    if not (torch.equal(torch.bincount(bseg, minlength=nb), cnt)
            and torch.equal(torch.bincount(cseg, minlength=nb), cnt)):
        raise SyncFormatError("compact body: set-bit counts of the high-bit / value-length regions do not match "
                              "the block change counts")
    last = cnt > 0
    ends = torch.cumsum(cnt, 0) - 1
    if not torch.equal(cloc[ends[last]], (cnt + kbits - 1)[last]):
        raise SyncFormatError("compact body: a value-length region does not end with its last code")
    blk = bseg
    i = torch.arange(m, device=dev, dtype=_I64) - R[blk]
    Lb = L[blk]
    low = _read_fields(wu, first[blk, 0] + i * Lb, Lb)
    u = ((bloc - i) << Lb) | low
    pos = blk * S + u
    if bool((u >= span[blk]).any()) or (m > 1 and bool((pos[1:] <= pos[:-1]).any())):
        raise SyncFormatError(f"compact body: positions out of range [0, {n}) or not strictly increasing")
    prev = torch.where(i > 0, torch.cat([cloc.new_full((1,), -1), cloc[:-1]]), -1)
    k = cloc - prev - 1
    if bool((k > ebits - 1).any()):
        raise SyncFormatError("compact body: a value code is longer than the element")
    kex = prev + 1 - i  # bits of the codes before i in the block
    v = (torch.ones_like(k) << k) | _read_fields(wu, first[blk, 3] + kex, k)
    return pos, v

"""Eager PyTorch reference of the sync kernels (any device; used on CPU and as the test oracle).

All functions take flat integer bit views (``int16`` for 16-bit floats, ``int32`` for fp32; see
:func:`sparrow.kernels.sync.common.bits_view`) and never look at float values.

Compact body layout (format 1, all little-endian ``uint32`` words), for ``m`` changed positions
``p_0 < p_1 < ...`` of a slice of ``n`` elements with ``E``-bit elements, grouped in blocks of
``RANK_BLOCK`` consecutive changes:

* ``nb = ceil(m / RANK_BLOCK)`` metadata records of 4 words: ``p_first``, body word offset,
  ``L | W << 8 | e << 16``, ``high_len``.
* per block, four regions, each padded to a whole word:
  - low bits: ``cnt * L`` bits, field ``i`` = ``u_i & (2^L - 1)`` where ``u_i = p_i - p_first``
    (Elias-Fano low part, ``L = floor(log2((u_last + 1) // cnt))``);
  - high bits: ``high_len = (u_last >> L) + cnt`` bits with bit ``(u_i >> L) + i`` set (Elias-Fano
    high part: the gaps of the bucket indices in unary);
  - value codes: ``cnt * W`` bits, code ``min(c_i, 2^W - 1)`` where ``c_i = zigzag(new - old) - 1`` is
    the zig-zag code of the bit-pattern difference (``±1`` ULP -> 0 / 1) and ``2^W - 1`` is an escape;
  - exceptions: the full ``E``-bit ``c_i`` of each escaped value, in order.

``W`` (1..E) minimises ``cnt * W + E * escapes`` per block (ties: smaller ``W``).
"""

from __future__ import annotations

import torch

from .common import (
    FMIX_1,
    FMIX_2,
    H_ADD_I,
    H_MUL_I,
    H_MUL_X,
    H_XOR_B,
    M32,
    META_WORDS,
    RANK_BLOCK,
    SyncFormatError,
)

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


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2^32 for 0 <= a, c < 2^32: int64 products wrap modulo 2^64 (two's complement) on
    every PyTorch backend, and the low 32 bits of the wrapped product are the low 32 bits of a * c."""
    return (a * c) & M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, FMIX_1)
    h = h ^ (h >> 13)
    h = _mul32(h, FMIX_2)
    return h ^ (h >> 16)


def hash_lanes(x_u: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-element hash lanes (int64 tensors holding uint32 values) of unsigned bit patterns ``x_u`` at
    positions ``pos`` (both int64): ``t = (x * H_MUL_X) ^ (pos * H_MUL_I + H_ADD_I)``, lane A =
    ``fmix32(t)``, lane B = ``fmix32(t ^ H_XOR_B)``."""
    t = _mul32(x_u, H_MUL_X) ^ ((_mul32(pos, H_MUL_I) + H_ADD_I) & M32)
    return _fmix32(t), _fmix32(t ^ H_XOR_B)


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


def _bitlen(x: torch.Tensor, maxbits: int) -> torch.Tensor:
    out = torch.zeros_like(x)
    for k in range(maxbits):
        out += ((x >> k) > 0).to(x.dtype)
    return out


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


def _unpack_fields(words_u: torch.Tensor, bitpos: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """Read fields from unsigned int64 words (with one extra zero word at the end)."""
    w = bitpos >> 5
    s = bitpos & 31
    two = words_u[w] | (words_u[w + 1] << 32)
    return (two >> s) & ((torch.ones_like(width) << width) - 1)


def _block_layout(cnt: torch.Tensor, L: torch.Tensor, W: torch.Tensor, e: torch.Tensor,
                  high_len: torch.Tensor, ebits: int) -> tuple[torch.Tensor, ...]:
    lw = _ceil32(cnt * L)
    hw = _ceil32(high_len)
    vw = _ceil32(cnt * W)
    xw = e if ebits == 32 else (e + 1) >> 1
    return lw, hw, vw, xw, lw + hw + vw + xw


def pack_compact(pos: torch.Tensor, codes: torch.Tensor, ebits: int) -> torch.Tensor:
    """Compact body (int32 words) for ascending positions ``pos`` and delta codes ``codes``."""
    dev = pos.device
    m = pos.numel()
    if m == 0:
        return torch.zeros(0, dtype=torch.int32, device=dev)
    p = pos.to(_I64)
    c = codes.to(_I64) & _mask(ebits)
    nb = (m + RANK_BLOCK - 1) // RANK_BLOCK
    idx = torch.arange(m, device=dev, dtype=_I64)
    blk = idx // RANK_BLOCK
    i = idx % RANK_BLOCK
    starts = torch.arange(nb, device=dev, dtype=_I64) * RANK_BLOCK
    cnt = torch.clamp(m - starts, max=RANK_BLOCK)
    p_first = p[starts]
    span = p[starts + cnt - 1] - p_first
    L = _bitlen((span + 1) // cnt, 32) - 1
    Lb = L[blk]
    u = p - p_first[blk]
    high_len = (span >> L) + cnt
    need = _bitlen(c + 1, ebits)
    hist = torch.zeros(nb * (ebits + 1), dtype=_I64, device=dev)
    hist.index_add_(0, blk * (ebits + 1) + need, torch.ones_like(need))
    hist = hist.view(nb, ebits + 1)
    gt = hist.flip(1).cumsum(1).flip(1)  # gt[:, w] = #(need >= w)
    widths = torch.arange(1, ebits + 1, device=dev, dtype=_I64)
    greater = torch.cat([gt[:, 2:], torch.zeros(nb, 1, dtype=_I64, device=dev)], 1)  # #(need > w), w=1..E
    cost = cnt[:, None] * widths[None, :] + ebits * greater
    W = torch.argmin(cost, dim=1) + 1
    Wb = W[blk]
    esc_code = (torch.ones_like(Wb) << Wb) - 1
    esc = c >= esc_code
    code = torch.where(esc, esc_code, c)
    e = torch.zeros(nb, dtype=_I64, device=dev).index_add_(0, blk, esc.to(_I64))
    lw, hw, vw, xw, body = _block_layout(cnt, L, W, e, high_len, ebits)
    body_off = _excl_cumsum(body)
    total = META_WORDS * nb + int(body.sum())
    words = torch.zeros(total + 1, dtype=_I64, device=dev)
    start = META_WORDS * nb + body_off  # first word of each block body
    _pack_fields(words, 32 * start[blk] + i * Lb, u, Lb)
    one = torch.ones_like(u)
    _pack_fields(words, 32 * (start + lw)[blk] + (u >> Lb) + i, one, one)
    _pack_fields(words, 32 * (start + lw + hw)[blk] + i * Wb, code, Wb)
    if bool(esc.any()):
        eb = blk[esc]
        erank = torch.arange(eb.numel(), device=dev, dtype=_I64) - _excl_cumsum(e)[eb]
        _pack_fields(words, 32 * (start + lw + hw + vw)[eb] + ebits * erank, c[esc],
                     torch.full_like(eb, ebits))
    meta = torch.stack([p_first, body_off, L | (W << 8) | (e << 16), high_len], 1).reshape(-1)
    words[: META_WORDS * nb] = meta
    return _to_signed(words[:total], 32, torch.int32)


def unpack_compact(words: torch.Tensor, n: int, ebits: int, nchanged: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode a compact body into (positions int32, delta codes int32), validating every field.

    Raises :class:`SyncFormatError` when the body is not a canonical encoding of ``nchanged`` strictly
    increasing positions in ``[0, n)`` (wrong length, bad metadata, bit counts, positions out of range).
    """
    dev = words.device
    m = int(nchanged)
    if m < 0 or m > n:
        raise SyncFormatError(f"compact body claims {m} changes for a slice of {n} elements")
    if m == 0:
        if words.numel() != 0:
            raise SyncFormatError(f"compact body with 0 changes must be empty, got {words.numel()} words")
        return (torch.zeros(0, dtype=torch.int32, device=dev), torch.zeros(0, dtype=torch.int32, device=dev))
    nb = (m + RANK_BLOCK - 1) // RANK_BLOCK
    total = words.numel()
    if total < META_WORDS * nb:
        raise SyncFormatError(f"compact body truncated: {total} words < {META_WORDS * nb} metadata words")
    wu = torch.cat([words.to(_I64) & M32, torch.zeros(1, dtype=_I64, device=dev)])
    meta = wu[: META_WORDS * nb].view(nb, META_WORDS)
    p_first, body_off, packed, high_len = meta.unbind(1)
    L, W, e = packed & 0xFF, (packed >> 8) & 0xFF, packed >> 16
    starts = torch.arange(nb, device=dev, dtype=_I64) * RANK_BLOCK
    cnt = torch.clamp(m - starts, max=RANK_BLOCK)
    bad = (L > 31) | (W < 1) | (W > ebits) | (e > cnt) | (p_first >= n) | (high_len < cnt) \
        | (high_len > cnt + (n >> torch.clamp(L, max=31)) + 1)
    if bool(bad.any()):
        b = int(torch.nonzero(bad)[0])
        raise SyncFormatError(f"compact block {b}: invalid metadata (p_first={int(p_first[b])}, L={int(L[b])}, "
                              f"W={int(W[b])}, e={int(e[b])}, high_len={int(high_len[b])}, cnt={int(cnt[b])})")
    lw, hw, vw, xw, body = _block_layout(cnt, L, W, e, high_len, ebits)
    if not torch.equal(body_off, _excl_cumsum(body)) or META_WORDS * nb + int(body.sum()) != total:
        raise SyncFormatError(f"compact body length / block offsets inconsistent ({total} words for {nb} blocks)")
    start = META_WORDS * nb + body_off
    # high bits: expand every block's high region, find the set bits
    seg = torch.repeat_interleave(torch.arange(nb, device=dev), high_len)
    local = torch.arange(seg.numel(), device=dev, dtype=_I64) - _excl_cumsum(high_len)[seg]
    bitpos = 32 * (start + lw)[seg] + local
    bit = (wu[bitpos >> 5] >> (bitpos & 31)) & 1
    set_at = torch.nonzero(bit).reshape(-1)
    if set_at.numel() != m or not torch.equal(torch.bincount(seg[set_at], minlength=nb), cnt):
        raise SyncFormatError("compact body: high-bit counts do not match the number of changes")
    idx = torch.arange(m, device=dev, dtype=_I64)
    blk = idx // RANK_BLOCK
    i = idx % RANK_BLOCK
    high = local[set_at] - i
    Lb, Wb = L[blk], W[blk]
    low = _unpack_fields(wu, 32 * start[blk] + i * Lb, Lb)
    u = (high << Lb) | low
    pos = p_first[blk] + u
    if bool((u[starts] != 0).any()):
        raise SyncFormatError("compact body: first position of a block differs from its p_first")
    if bool((pos >= n).any()) or (m > 1 and bool((pos[1:] <= pos[:-1]).any())):
        raise SyncFormatError(f"compact body: positions out of range [0, {n}) or not strictly increasing")
    code = _unpack_fields(wu, 32 * (start + lw + hw)[blk] + i * Wb, Wb)
    esc_code = (torch.ones_like(Wb) << Wb) - 1
    esc = code == esc_code
    if not torch.equal(torch.zeros(nb, dtype=_I64, device=dev).index_add_(0, blk, esc.to(_I64)), e):
        raise SyncFormatError("compact body: escape count does not match block metadata")
    c = code
    if bool(esc.any()):
        eb = blk[esc]
        erank = torch.arange(int(esc.sum()), device=dev, dtype=_I64) - _excl_cumsum(e)[eb]
        c = c.clone()
        c[esc] = _unpack_fields(wu, 32 * (start + lw + hw + vw)[eb] + ebits * erank, torch.full_like(eb, ebits))
    if bool((c > _mask(ebits) - 1).any()):
        raise SyncFormatError("compact body: value code encodes a zero change")
    return pos.to(torch.int32), _to_signed(c, 32, torch.int32)

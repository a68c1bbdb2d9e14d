"""Constants and small helpers shared by the reference and the Triton implementations.

Nothing here imports either implementation, so the fast path never pulls in the reference.

Bit views: a bf16 / fp16 tensor is handled as ``int16`` bit patterns, fp32 as ``int32`` bit patterns
(``tensor.view(torch.int16)``); every comparison and every arithmetic step works on those integers, so
NaN payloads, signed zeros, infinities and subnormals are ordinary values.

Compact body (format 2; the layout is described in :mod:`sparrow.kernels.sync.reference` and ``docs/sync.md``):
a slice is cut into *blocks* of ``2**span_log2`` consecutive elements; each block's encoded size follows from
two numbers the diff scan counts (its changed elements and the bit lengths of their value codes), so every
block's place in the body is a prefix sum computed on the device before anything is written.
"""

from __future__ import annotations

import torch

#: Elements per block of the compact format unless a sender picks another span (``2**17``).
DEFAULT_SPAN_LOG2 = 17
#: Smallest / largest block span a compact body may use (``2**10`` .. ``2**20`` elements).
MIN_SPAN_LOG2 = 10
MAX_SPAN_LOG2 = 20
#: ``uint32`` words of per-block header at the start of a compact body: rank offset, value bits, body offset.
HEADER_WORDS = 3
#: Largest element count of one encoded slice (positions are stored as int32).
MAX_SLICE_ELEMS = 2**31 - 1

BITS_DTYPE: dict[torch.dtype, torch.dtype] = {
    torch.bfloat16: torch.int16,
    torch.float16: torch.int16,
    torch.float32: torch.int32,
    torch.int16: torch.int16,
    torch.int32: torch.int32,
}

M32 = 0xFFFFFFFF
# Hash constants (murmur3 finaliser and two odd multipliers); see ``hash_bits``.
H_MUL_X = 0xCC9E2D51
H_MUL_I = 0x9E3779B1
H_ADD_I = 0x7F4A7C15
H_XOR_B = 0x5BD1E995
FMIX_1 = 0x85EBCA6B
FMIX_2 = 0xC2B2AE35


def _mul32(a, c: int):
    """(a * c) mod 2^32 for 0 <= a, c < 2^32. ``a``: an int64 tensor (its products wrap modulo 2^64, two's
    complement, on every PyTorch backend) or a uint64 numpy array (the products fit); the low 32 bits are those
    of a * c either way."""
    return (a * c) & M32


def _fmix32(h):
    h = h ^ (h >> 16)
    h = _mul32(h, FMIX_1)
    h = h ^ (h >> 13)
    h = _mul32(h, FMIX_2)
    return h ^ (h >> 16)


def hash_lanes(x_u, pos):
    """Per-element hash lanes (uint32 values) of unsigned bit patterns ``x_u`` at positions ``pos``, both int64
    tensors (the PyTorch reference) or both uint64 numpy arrays (host bytes: ``sparrow.sync._util``):
    ``t = (x * H_MUL_X) ^ (pos * H_MUL_I + H_ADD_I)``, lane A = ``fmix32(t)``, lane B = ``fmix32(t ^ H_XOR_B)``.
    The Triton kernels compute the same in registers."""
    t = _mul32(x_u, H_MUL_X) ^ ((_mul32(pos, H_MUL_I) + H_ADD_I) & M32)
    return _fmix32(t), _fmix32(t ^ H_XOR_B)


def element_bits(dtype: torch.dtype) -> int:
    """16 for bf16 / fp16 / int16, 32 for fp32 / int32; ``TypeError`` otherwise."""
    try:
        return 8 * torch.empty((), dtype=BITS_DTYPE[dtype]).element_size()
    except KeyError:
        raise TypeError(f"unsupported dtype {dtype}: expected one of bfloat16, float16, float32") from None


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """The flat integer bit-pattern view (int16 or int32) of a contiguous tensor, sharing its storage."""
    if t.dtype not in BITS_DTYPE:
        raise TypeError(f"unsupported dtype {t.dtype}: expected one of bfloat16, float16, float32")
    if not t.is_contiguous():
        raise ValueError("tensor must be contiguous (bit views share storage)")
    return t.reshape(-1).view(BITS_DTYPE[t.dtype])


def check_span_log2(span_log2: object) -> int:
    """``span_log2`` if it is an int in ``[MIN_SPAN_LOG2, MAX_SPAN_LOG2]``; ``ValueError`` otherwise."""
    if not isinstance(span_log2, int) or isinstance(span_log2, bool) or not (
            MIN_SPAN_LOG2 <= span_log2 <= MAX_SPAN_LOG2):
        raise ValueError(f"span_log2 must be an int in [{MIN_SPAN_LOG2}, {MAX_SPAN_LOG2}], got {span_log2!r}")
    return span_log2


def num_blocks(n: int, span_log2: int) -> int:
    """Blocks of ``2**span_log2`` elements covering ``n`` elements."""
    return -(-int(n) // (1 << span_log2))


def block_words(cnt: int, kbits: int, span: int) -> int:
    """Body words of one compact block with ``cnt`` changes whose value codes have ``kbits`` mantissa bits in
    all, in a block of ``span`` elements (the four regions, each padded to whole words; 0 when ``cnt == 0``)."""
    if cnt == 0:
        return 0
    low = (span // cnt).bit_length() - 1
    high = cnt + ((span - 1) >> low)
    return -(-cnt * low // 32) + -(-high // 32) + -(-(cnt + kbits) // 32) + -(-kbits // 32)


def fold_lanes(a: int, b: int) -> int:
    """Fold two 32-bit hash lanes (host ints, taken mod 2^32) into one 64-bit Python int."""
    return ((int(b) & M32) << 32) | (int(a) & M32)


def add_lanes(h: int, da: int, db: int) -> int:
    """The 64-bit hash ``h`` advanced by the lane changes ``(da, db)`` (host ints, mod 2^32 per lane)."""
    return fold_lanes((h & M32) + int(da), (h >> 32) + int(db))


def split_lanes(h: int) -> tuple[int, int]:
    """The two 32-bit lanes of a 64-bit hash (inverse of :func:`fold_lanes`)."""
    return int(h) & M32, (int(h) >> 32) & M32


def lanes_i32(lanes: torch.Tensor) -> torch.Tensor:
    """Integer hash lanes (taken mod 2^32) -> the int32 tensor with the same low 32 bits (device-side, no sync)."""
    v = lanes.to(torch.int64) & M32
    return (v - ((v >> 31) << 32)).to(torch.int32)


def combine_hash(lanes: torch.Tensor) -> int:
    """Fold the two 32-bit hash lanes (an int64 tensor of shape [2]) into one Python int."""
    return fold_lanes(*lanes.tolist())


class SyncFormatError(ValueError):
    """A compact / COO / dense body that does not decode to a valid, in-bounds change set."""

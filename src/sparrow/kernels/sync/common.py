"""Constants and small helpers shared by the reference and the Triton implementations.

Nothing here imports either implementation, so the fast path never pulls in the reference.

Bit views: a bf16 / fp16 tensor is handled as ``int16`` bit patterns, fp32 as ``int32`` bit patterns
(``tensor.view(torch.int16)``); every comparison and every arithmetic step works on those integers, so
NaN payloads, signed zeros, infinities and subnormals are ordinary values.
"""

from __future__ import annotations

import torch

#: Changed elements per compact block (every block but the last holds exactly this many).
RANK_BLOCK = 1024
#: ``uint32`` words of per-block metadata at the start of a compact body.
META_WORDS = 4
#: Elements per program of the diff kernels (must be a multiple of 32: one mask word per 32 lanes).
DIFF_TILE = 1024
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


def compact_num_blocks(nchanged: int) -> int:
    return (nchanged + RANK_BLOCK - 1) // RANK_BLOCK


def slot_words(ebits: int) -> int:
    """Upper bound on the body words of one compact block (see ``docs/sync.md``)."""
    # low bits <= 31 per change, high bits < 3 per change, values + exceptions <= ebits per change,
    # plus padding of four regions.
    return (RANK_BLOCK * (31 + 3 + ebits) + 31) // 32 + 8


def fold_lanes(a: int, b: int) -> int:
    """Fold two 32-bit hash lanes (host ints, taken mod 2^32) into one 64-bit Python int."""
    return ((int(b) & M32) << 32) | (int(a) & M32)


def add_lanes(h: int, da: int, db: int) -> int:
    """The 64-bit hash ``h`` advanced by the lane changes ``(da, db)`` (host ints, mod 2^32 per lane)."""
    return fold_lanes((h & M32) + int(da), (h >> 32) + int(db))


def combine_hash(lanes: torch.Tensor) -> int:
    """Fold the two 32-bit hash lanes (an int64 tensor of shape [2]) into one Python int."""
    return fold_lanes(*lanes.tolist())


class SyncFormatError(ValueError):
    """A compact / COO / dense body that does not decode to a valid, in-bounds change set."""

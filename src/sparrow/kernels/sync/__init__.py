"""Kernels of SparseRL-Sync: block scan, fused compact encode, fused decode + apply, hashing, records.

See :mod:`sparrow.kernels.sync.api` for the entry points (``impl="auto" | "reference" | "triton"``).
"""

from .api import (
    MODES,
    BlockScan,
    Impl,
    apply_compact,
    apply_records,
    body_nbytes,
    check_compact_entries,
    check_compact_headers,
    decode_compact,
    diff_records,
    group_apply_records,
    group_hash_bits,
    hash_bits,
    hash_zeros,
    positions_bad,
    resolve_impl,
    scan_blocks,
    triton_available,
    write_bodies,
)
from .common import (
    DEFAULT_SPAN_LOG2,
    HEADER_WORDS,
    MAX_SPAN_LOG2,
    MIN_SPAN_LOG2,
    SyncFormatError,
    bits_view,
    block_words,
    combine_hash,
    element_bits,
)

__all__ = [
    "BlockScan", "DEFAULT_SPAN_LOG2", "HEADER_WORDS", "Impl", "MAX_SPAN_LOG2", "MIN_SPAN_LOG2", "MODES",
    "SyncFormatError", "apply_compact", "apply_records", "bits_view", "block_words", "body_nbytes",
    "check_compact_entries", "check_compact_headers", "combine_hash", "decode_compact", "diff_records", "element_bits",
    "group_apply_records", "group_hash_bits", "hash_bits", "hash_zeros", "positions_bad", "resolve_impl",
    "scan_blocks", "triton_available", "write_bodies",
]

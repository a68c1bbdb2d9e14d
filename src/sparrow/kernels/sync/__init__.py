"""Kernels of SparseRL-Sync: bit-pattern diff, compaction, compact packing, decode and in-place apply.

See :mod:`sparrow.kernels.sync.api` for the entry points (``impl="reference" | "triton"``).
"""

from .api import (
    DiffScan,
    apply_records,
    check_positions,
    diff_collect,
    diff_records,
    diff_scan,
    hash_bits,
    pack_compact,
    positions_bad,
    resolve_impl,
    triton_available,
    unpack_compact,
    unpack_compact_deferred,
)
from .common import SyncFormatError, bits_view, combine_hash, element_bits

__all__ = [
    "DiffScan", "SyncFormatError", "apply_records", "bits_view", "check_positions", "combine_hash",
    "diff_collect", "diff_records", "diff_scan", "element_bits", "hash_bits", "pack_compact",
    "positions_bad", "resolve_impl", "triton_available", "unpack_compact", "unpack_compact_deferred",
]

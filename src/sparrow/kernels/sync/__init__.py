"""Kernels of SparseRL-Sync: bit-pattern diff, compaction, compact packing, decode and in-place apply.

See :mod:`sparrow.kernels.sync.api` for the entry points (``impl="auto" | "reference" | "triton"``).
"""

from .api import (
    DiffScan,
    Impl,
    GroupScan,
    apply_records,
    diff_collect,
    diff_records,
    diff_scan,
    group_apply_records,
    group_diff_collect,
    group_diff_scan,
    group_hash_bits,
    group_pack_compact,
    group_unpack_compact,
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
    "DiffScan", "GroupScan", "Impl", "SyncFormatError", "apply_records", "bits_view", "combine_hash",
    "diff_collect", "diff_records", "diff_scan", "element_bits", "group_apply_records", "group_diff_collect",
    "group_diff_scan", "group_hash_bits", "group_pack_compact", "group_unpack_compact", "hash_bits", "pack_compact",
    "positions_bad", "resolve_impl", "triton_available", "unpack_compact", "unpack_compact_deferred",
]

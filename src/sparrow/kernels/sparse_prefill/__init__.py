from .api import (
    LocalImpl, PrefillImpl, SparsePrefillConfig, local_prefill_attention, prefill_block_scores,
    sparse_prefill_attention,
)
from .masks import local_block_mask, retrieval_block_mask

__all__ = ["LocalImpl", "PrefillImpl", "SparsePrefillConfig", "local_prefill_attention", "prefill_block_scores",
           "sparse_prefill_attention", "local_block_mask", "retrieval_block_mask"]

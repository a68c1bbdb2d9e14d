from .api import SparseDecodeConfig, sparse_decode_attention
from .cache import SparseDecodeCache

__all__ = ["SparseDecodeCache", "SparseDecodeConfig", "sparse_decode_attention"]

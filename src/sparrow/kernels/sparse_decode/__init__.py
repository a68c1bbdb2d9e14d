from .api import RTPurboCache, SparseDecodeConfig, sparse_decode_attention

__all__ = ["RTPurboCache", "SparseDecodeConfig", "sparse_decode_attention"]

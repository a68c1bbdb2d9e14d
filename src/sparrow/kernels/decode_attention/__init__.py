from .api import cascade_decode_attention, cascade_local_attention, decode_attention, prefix_groups

__all__ = ["cascade_decode_attention", "cascade_local_attention", "decode_attention", "prefix_groups"]

from .api import cascade_decode_attention, cascade_local_attention, decode_attention, prefix_groups
from .dispatch import CASCADE_MAX_TOKENS, CASCADE_MIN_ROWS, CASCADE_MIN_SHARE, per_row_decode, shares_enough

__all__ = ["CASCADE_MAX_TOKENS", "CASCADE_MIN_ROWS", "CASCADE_MIN_SHARE", "cascade_decode_attention",
           "cascade_local_attention", "decode_attention", "per_row_decode", "prefix_groups", "shares_enough"]

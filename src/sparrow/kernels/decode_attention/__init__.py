from .api import (
    CASCADE_MIN_ROWS, CASCADE_MIN_SHARE, cascade_decode_attention, cascade_local_attention, decode_attention,
    per_row_decode, prefix_groups, shares_enough,
)

__all__ = ["CASCADE_MIN_ROWS", "CASCADE_MIN_SHARE", "cascade_decode_attention", "cascade_local_attention",
           "decode_attention", "per_row_decode", "prefix_groups", "shares_enough"]

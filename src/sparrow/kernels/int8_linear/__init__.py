"""Weight-only int8 linear (W8A16): per-output-channel symmetric int8 weights, activations in their own dtype."""

from .api import Int8Linear, int8_linear, quantize_int8

__all__ = ["Int8Linear", "int8_linear", "quantize_int8"]

"""``tl.dot`` with the precision the inputs call for."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    """``a @ b`` accumulated in float32: exact float32 products when ``IEEE`` (float32 inputs, whose results
    must match the eager reference), the tensor cores' precision otherwise (tf32 for float32 would lose ~1e-3)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)

"""Merging split-KV partial results: the step every split-KV ("flash-decoding") kernel ends with."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def merge_splits(O_PART, LSE_PART, OUT, o_row, l_row, out_row, stride_os, n_valid,
                 D: tl.constexpr, SPLITS_P2: tl.constexpr):
    """out = sum_s 2^(lse_s - lse) o_s over the first ``n_valid`` splits (lse in the log2 domain).

    ``o_row`` / ``l_row`` / ``out_row``: offsets of this (row, head, token) in the partial outputs
    ``[.., splits, D]``, the partial log-sum-exps ``[.., splits]`` and the output ``[.., D]``. A split that saw
    nothing (lse = -inf) may have written no output: its partial is never read. A row whose splits all saw
    nothing gets zeros.
    """
    offs_s = tl.arange(0, SPLITS_P2)
    valid = offs_s < n_valid
    lse = tl.load(LSE_PART + l_row + offs_s, mask=valid, other=float("-inf"))
    live = lse > float("-inf")
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(live, tl.exp2(lse - m_safe), 0.0)
    offs_d = tl.arange(0, D)
    o = tl.load(O_PART + o_row + offs_s[:, None] * stride_os + offs_d[None, :], mask=live[:, None], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.maximum(tl.sum(w, 0), 1e-30)
    tl.store(OUT + out_row + offs_d, out.to(OUT.dtype.element_ty))

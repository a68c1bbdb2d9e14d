"""Triton merge for the chunked sliding-window prefill (:mod:`.local_chunked`).

The window of query ``i`` is split into up to three exact pieces computed by dense attention kernels (each
with its log-sum-exp); the sinks that fall outside the window are a fourth, computed here. Program per
(``BLOCK_M`` query rows, prompt x query head): it reads each piece's output row and log-sum-exp, scores the
``NS`` sink keys (one at a time, float32: a few multiply-adds per row), and writes the softmax-weighted
combination to the output head ``HEAD_MAP[h]``.

A piece is a tensor of ``[batch, heads, rows, D]`` holding the chunks of the rows this launch covers: chunk
``c`` of prompt ``p`` is batch entry ``p * NCH + c - FIRST`` (chunks ``c < FIRST`` have no such piece), and a
row ``a`` of a chunk of ``CL`` rows sits at ``a`` or, for pieces computed on reversed sequences, ``CL - 1 - a``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _piece(O, L, ob, oh, orow, lb, lh, lrow, p, h, c, a, rv, offs_d, NCH, FIRST, CL, FLIP: tl.constexpr):
    """Output rows [BLOCK_M, D] (float32) and log2-sum-exps [BLOCK_M] (``-inf`` where the piece is absent)."""
    valid = rv & (c >= FIRST)
    b = (p * NCH + c - FIRST).to(tl.int64)
    if FLIP:
        row = CL - 1 - a
    else:
        row = a
    o = tl.load(O + b[:, None] * ob + h * oh + row[:, None].to(tl.int64) * orow + offs_d[None, :],
                mask=valid[:, None], other=0.0).to(tl.float32)
    lse = tl.load(L + b * lb + h * lh + row.to(tl.int64) * lrow, mask=valid, other=float("-inf"))
    return o, lse * 1.4426950408889634


@triton.jit
def _local_merge_kernel(
    Q, KS, VS, OUT, HEAD_MAP,
    X1_O, X1_L, X2_O, X2_L, X3_O, X3_L,
    stride_qp, stride_qh, stride_qs,
    stride_kp, stride_kh, stride_ks,
    stride_op, stride_oh, stride_os,
    x1_ob, x1_oh, x1_or, x1_lb, x1_lh, x1_lr,
    x2_ob, x2_oh, x2_or, x2_lb, x2_lh, x2_lr,
    x3_ob, x3_oh, x3_or, x3_lb, x3_lh, x3_lr,
    R0, R, CL, X1_NCH, X2_NCH, X2_FIRST, X3_NCH, HQ, WINDOW, qk_scale,
    QPK: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, NS: tl.constexpr,
    HAS2: tl.constexpr, HAS3: tl.constexpr, FLIP2: tl.constexpr,
):
    pid = tl.program_id(0)
    ph = tl.program_id(1)
    p = (ph // HQ).to(tl.int64)
    h = (ph % HQ).to(tl.int64)
    r = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rv = r < R
    c = r // CL
    a = r % CL
    i = R0 + r  # query positions
    offs_d = tl.arange(0, D)

    # piece 1: the query's own chunk (causal); always present
    o1, l1 = _piece(X1_O, X1_L, x1_ob, x1_oh, x1_or, x1_lb, x1_lh, x1_lr, p, h, c, a, rv, offs_d, X1_NCH, 0, CL,
                    False)
    m = l1
    if HAS2:  # piece 2: the triangle of the previous keys (computed reversed when FLIP2)
        o2, l2 = _piece(X2_O, X2_L, x2_ob, x2_oh, x2_or, x2_lb, x2_lh, x2_lr, p, h, c, a, rv, offs_d, X2_NCH,
                        X2_FIRST, CL, FLIP2)
        m = tl.maximum(m, l2)
    if HAS3:  # piece 3: previous keys every query of the chunk sees
        o3, l3 = _piece(X3_O, X3_L, x3_ob, x3_oh, x3_or, x3_lb, x3_lh, x3_lr, p, h, c, a, rv, offs_d, X3_NCH, 0,
                        CL, False)
        m = tl.maximum(m, l3)
    m = tl.where(m == float("-inf"), 0.0, m)  # rows past R only
    w = tl.exp2(l1 - m)
    num = o1 * w[:, None]
    den = w
    if HAS2:
        w = tl.exp2(l2 - m)
        num += o2 * w[:, None]
        den += w
    if HAS3:
        w = tl.exp2(l3 - m)
        num += o3 * w[:, None]
        den += w
    if NS > 0:  # sinks outside the window (j < NS, i - j >= WINDOW), one at a time with an online softmax
        q = tl.load(Q + p * stride_qp + h * stride_qh + i[:, None].to(tl.int64) * stride_qs + offs_d[None, :],
                    mask=rv[:, None], other=0.0).to(tl.float32)
        kv = KS + p * stride_kp + (h // QPK) * stride_kh + offs_d
        vv = VS + p * stride_kp + (h // QPK) * stride_kh + offs_d
        for j in range(NS):
            kj = tl.load(kv + j * stride_ks).to(tl.float32)
            vj = tl.load(vv + j * stride_ks).to(tl.float32)
            sj = tl.where(rv & (i - j >= WINDOW), tl.sum(q * kj[None, :], 1) * qk_scale, float("-inf"))
            m_new = tl.maximum(m, sj)
            alpha = tl.exp2(m - m_new)
            pj = tl.exp2(sj - m_new)
            num = num * alpha[:, None] + pj[:, None] * vj[None, :]
            den = den * alpha + pj
            m = m_new
    out = num / tl.maximum(den, 1e-30)[:, None]
    oh = tl.load(HEAD_MAP + h).to(tl.int64)
    tl.store(OUT + p * stride_op + oh * stride_oh + i[:, None].to(tl.int64) * stride_os + offs_d[None, :],
             out.to(OUT.dtype.element_ty), mask=rv[:, None])


def _strides(o: torch.Tensor, lse: torch.Tensor) -> tuple[int, ...]:
    return (o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1), lse.stride(2))


def local_merge_triton(q, k_sink, v_sink, out, head_map, pieces, *, row0: int, rows: int, chunk: int,
                       num_sinks: int, window: int, scale: float) -> None:
    """Write ``out[p, head_map[h], row0 : row0 + rows]`` from up to three pieces and the sinks.

    q: [P, Hq, S, D] (the sinks' queries); k_sink, v_sink: [P, Hkv, >= num_sinks, D]; out: [P, *, S, D];
    head_map: [Hq] int64. ``pieces``: ``(o, lse, nch, first, flip)`` tuples — o [batch, Hq, chunk, D], lse
    [batch, Hq, chunk] natural-log float32; the first piece must cover every row (``first = 0``, no flip), a
    third piece may not be reversed.
    """
    P, Hq, S, D = q.shape
    if rows <= 0:
        return
    qpk = Hq // k_sink.shape[1]
    dummy = (pieces[0][0], pieces[0][1], 1, 0, False)
    p1, p2, p3 = (list(pieces) + [None, None])[:3]
    block_m = 64 if D <= 64 else 32
    grid = (triton.cdiv(rows, block_m), P * Hq)
    _local_merge_kernel[grid](
        q, k_sink, v_sink, out, head_map,
        p1[0], p1[1], (p2 or dummy)[0], (p2 or dummy)[1], (p3 or dummy)[0], (p3 or dummy)[1],
        q.stride(0), q.stride(1), q.stride(2),
        k_sink.stride(0), k_sink.stride(1), k_sink.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        *_strides(p1[0], p1[1]), *_strides(*(p2 or dummy)[:2]), *_strides(*(p3 or dummy)[:2]),
        row0, rows, chunk, p1[2], (p2 or dummy)[2], (p2 or dummy)[3], (p3 or dummy)[2], Hq, window,
        scale * LOG2E,
        QPK=qpk, D=D, BLOCK_M=block_m, NS=num_sinks, HAS2=p2 is not None, HAS3=p3 is not None,
        FLIP2=bool((p2 or dummy)[4]),
        num_warps=4,
    )

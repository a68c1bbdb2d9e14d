"""Triton kernel for RTPurbo prefill block scores: mean per-query indexer mass of every causal key block.

Program per (prompt, retrieval head, query block): the block's ``block x r`` indexer queries (r = 16) sweep
the causal key blocks twice — first for each query's log-normaliser (online max / sum, like flash
attention at head dim r), then for the mass each key block receives, averaged over the block's real
queries. Output: ``log`` of that mean, ``[P, H, Qb, KVb]`` float32 (blocks past the diagonal unwritten).
Costs ``~2 S^2 r`` multiply-adds and ``S^2`` exponentials per head: a sixteenth of the dot products of
the attention it replaces, at head dim 128 — and only retrieval heads run it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparrow.kernels.common.triton_dot import dot


@triton.jit
def _block_mass_kernel(
    QI, KI, PLEN, OUT,
    stride_qp, stride_qh, stride_qs,
    stride_kp, stride_kh, stride_ks,
    stride_op, stride_oh, stride_oq,
    H,
    R: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr,
):
    ph = tl.program_id(0)
    qb = tl.num_programs(1) - 1 - tl.program_id(1)  # longest rows first: a shorter tail
    p = ph // H
    h = ph % H
    plen = tl.load(PLEN + p)
    offs = tl.arange(0, BLOCK)
    offs_r = tl.arange(0, R)
    i = qb * BLOCK + offs
    q_real = i < plen
    q = tl.load(QI + p * stride_qp + h * stride_qh + i[:, None] * stride_qs + offs_r[None, :],
                mask=q_real[:, None], other=0.0)
    k_base = KI + p * stride_kp + h * stride_kh
    LOG2E: tl.constexpr = 1.4426950408889634

    m_i = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK], dtype=tl.float32)
    for kb in range(0, qb + 1):
        j = kb * BLOCK + offs
        k = tl.load(k_base + j[:, None] * stride_ks + offs_r[None, :], mask=(j < plen)[:, None], other=0.0)
        s = dot(q, tl.trans(k), IEEE) * LOG2E
        s = tl.where((j[None, :] <= i[:, None]) & (j < plen)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_safe) + tl.sum(tl.exp2(s - m_safe[:, None]), 1)
        m_i = m_new
    lse = tl.where(l_i > 0.0, m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0)), float("inf"))
    n_q = tl.maximum(tl.sum(q_real.to(tl.float32), 0), 1.0)
    out = OUT + p * stride_op + h * stride_oh + qb * stride_oq
    for kb in range(0, qb + 1):
        j = kb * BLOCK + offs
        k = tl.load(k_base + j[:, None] * stride_ks + offs_r[None, :], mask=(j < plen)[:, None], other=0.0)
        s = dot(q, tl.trans(k), IEEE) * LOG2E
        vis = (j[None, :] <= i[:, None]) & (j < plen)[None, :] & q_real[:, None]
        pm = tl.where(vis, tl.exp2(s - lse[:, None]), 0.0)
        mass = tl.sum(tl.sum(pm, 1), 0) / n_q
        tl.store(out + kb, tl.where(mass > 0.0, tl.log(tl.where(mass > 0.0, mass, 1.0)), float("-inf")))


def prefill_block_scores_triton(q_idx: torch.Tensor, k_idx: torch.Tensor, prompt_len: torch.Tensor, block: int,
                                out: torch.Tensor | None = None) -> torch.Tensor:
    """q_idx, k_idx: [P, H, S, r] (unit stride on r) -> [P, H, Qb, KVb] float32 log mean masses."""
    P, H, S, r = q_idx.shape
    nb = -(-S // block)
    if out is None:
        out = torch.empty((P, H, nb, nb), device=q_idx.device, dtype=torch.float32)
    _block_mass_kernel[(P * H, nb)](
        q_idx, k_idx, prompt_len, out,
        q_idx.stride(0), q_idx.stride(1), q_idx.stride(2),
        k_idx.stride(0), k_idx.stride(1), k_idx.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        H, R=r, BLOCK=block, IEEE=q_idx.dtype == torch.float32, num_warps=8 if block >= 128 else 4,
    )
    return out

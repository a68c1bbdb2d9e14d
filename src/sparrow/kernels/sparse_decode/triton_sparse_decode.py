"""Triton kernels for RTPurbo decode: indexer block scores, top-p selection, sparse + local split-KV attention.

The default (*fused*) pipeline is two launches per decode call, none of which waits on the host:

1. ``_score_kernel`` — program per (row, retrieval head, new token, split): the indexer query (projected here
   from the pre-RoPE queries when the caller passes them instead of ``q_idx``), then the indexer scores
   ``q_idx . k_idx`` of the split's tokens (prompt tokens read in place from the prefix slot, generated ones
   from the row's slot), reduced to one log-mass per 64-token block (logsumexp). It also zeroes the merge
   counters of launch 2.
2. ``_attn_kernel`` — both kinds of heads, each program one split of one (row, head[, token]). A retrieval
   program first selects: it reads the query's block log-masses (at most 4096 blocks, in registers), finds
   the top-p threshold by bisection and writes the kept blocks (top-p + sinks + local window) in order, as
   the top-p kernel would; then it takes its share of that *kept-block list* (so work is balanced whatever
   the selection's layout) and attends exactly, the head's ``q_per_kv`` queries as one tile. A local program
   reads sinks + sliding window from the ring buffers. Every program stores its partial result and counts
   itself in; the last of a (row, head[, token]) group to finish merges the group's splits (log-sum-exp).

So one row pays two dependent launches, not four: the selection runs beside the local heads' attention
instead of in a launch of its own, and there is no merge launch. Every retrieval split repeats its query's
selection, so rows longer than 4096 blocks, and batches with more than 256 retrieval programs (where the repeats
would cost more than the launch they save), take the selection from the top-p kernel: a third launch. The
*staged* pipeline — scores, the top-p kernel
(:func:`sparrow.kernels.topp.triton_topp.topp_select_triton`), attention, a merge launch — stays selectable
(``fused=False``) so both can be measured in one run.

Selection is block-granular (64 tokens): a block's score is the logsumexp of its tokens' indexer scores,
i.e. its exact share of the indexer's softmax mass, so "top-p over blocks" keeps whole blocks whose mass
reaches ``p``; reads are then contiguous 64 x D tiles that feed ``tl.dot`` directly, and the selection
costs ``L / 64`` values per query instead of ``L``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from sparrow.kernels.common.triton_dot import dot
from sparrow.kernels.common.triton_merge import merge_splits
from sparrow.kernels.topp.triton_topp import MODE_DECODE, top_p_threshold, topp_select_triton

from .cache import SparseDecodeCache


@triton.jit
def _score_kernel(
    QI, QP, WQ, QSCALE, RET_HEADS, PIK, GIK, ROW_SLOT, PREFIX_SLOT, PREFIX_LEN, CACHED_LEN, BS, COUNTERS,
    stride_qa, stride_qh, stride_qt,
    stride_ps, stride_ph, stride_pl,
    stride_gs, stride_gh, stride_gl,
    stride_bn, stride_wh, stride_wc, H_RET, NG,
    T: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr, BB: tl.constexpr, NUM_SPLITS: tl.constexpr,
    MIN_BLOCKS: tl.constexpr, PROJECT: tl.constexpr, QPK: tl.constexpr, D: tl.constexpr,
    ZERO: tl.constexpr, NG_P2: tl.constexpr,
):
    a = tl.program_id(0)
    ht = tl.program_id(1)
    split = tl.program_id(2)
    hr = ht // T
    t = ht % T
    if ZERO:  # the merge counters of this row, for the attention launch that follows
        if (ht == 0) & (split == 0):
            offs_g = tl.arange(0, NG_P2)
            tl.store(COUNTERS + a * NG + offs_g, tl.zeros([NG_P2], dtype=tl.int32), mask=offs_g < NG)
    pslot = tl.load(PREFIX_SLOT + a)
    rslot = tl.load(ROW_SLOT + a)
    plen = tl.load(PREFIX_LEN + a)
    pos = plen + tl.load(CACHED_LEN + a) + t
    nb = pos // BLOCK + 1
    per = tl.cdiv(tl.maximum(tl.cdiv(nb, NUM_SPLITS), MIN_BLOCKS), BB) * BB
    b_start = split * per
    b_end = tl.minimum(b_start + per, nb)

    offs_r = tl.arange(0, R)
    if PROJECT:  # q_idx = scale[hr] * sum over the group's heads g and dims d of q_pre[g, d] * W[g * D + d]
        hkv = tl.load(RET_HEADS + hr)
        offs_dd = tl.arange(0, D)
        qv = tl.zeros([R], dtype=tl.float32)
        for g in tl.static_range(QPK):
            x = tl.load(QP + a * stride_qa + (hkv * QPK + g) * stride_qh + t * stride_qt + offs_dd).to(tl.float32)
            w = tl.load(WQ + hr * stride_wh + (g * D + offs_dd)[:, None] * stride_wc + offs_r[None, :])
            qv += tl.sum(x[:, None] * w.to(tl.float32), 0)
        qv = qv * tl.load(QSCALE + hr).to(tl.float32)
    else:
        qv = tl.load(QI + a * stride_qa + hr * stride_qh + t * stride_qt + offs_r).to(tl.float32)
    offs_tok = tl.arange(0, BB * BLOCK)
    pbase = PIK + pslot * stride_ps + hr * stride_ph
    gbase = GIK + rslot * stride_gs + hr * stride_gh
    out = BS + ((a * H_RET + hr) * T + t).to(tl.int64) * stride_bn
    for b0 in range(b_start, b_end, BB):
        j = b0 * BLOCK + offs_tok
        vis = j <= pos
        in_p = j < plen
        ptrs = tl.where(in_p[:, None], pbase + j[:, None] * stride_pl + offs_r[None, :],
                        gbase + (j - plen)[:, None] * stride_gl + offs_r[None, :])
        k = tl.load(ptrs, mask=vis[:, None], other=0.0)
        s = tl.sum(k.to(tl.float32) * qv[None, :], 1)
        s = tl.where(vis, s, float("-inf"))
        s2 = tl.reshape(s, (BB, BLOCK))
        mx = tl.max(s2, 1)
        mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
        z = tl.sum(tl.exp(s2 - mx_safe[:, None]), 1)
        lse = tl.where(z > 0.0, mx_safe + tl.log(tl.where(z > 0.0, z, 1.0)), float("-inf"))
        bidx = b0 + tl.arange(0, BB)
        tl.store(out + bidx, lse, mask=bidx < b_end)


@triton.jit
def _select_decode_row(row, out, pos, NB, top_p, BLOCK: tl.constexpr, SINK_BLOCKS: tl.constexpr,
                       LOCAL_WINDOW: tl.constexpr, CHUNK: tl.constexpr, ITERS: tl.constexpr,
                       KEEP_ALL: tl.constexpr, TOP_P_PTR: tl.constexpr):
    """The kept blocks of one decode query (position ``pos``), ascending, written to ``out``; returns their count.

    The top-p kernel's rule on a row held in registers (``NB <= CHUNK``): the largest threshold ``tau`` whose
    blocks ``x_b >= tau`` hold ``top_p`` of the row's mass, found by ``ITERS`` halvings of a bracket at most
    81 nats wide, plus the sink blocks and the blocks overlapping ``[pos - LOCAL_WINDOW + 1, pos]``. A ``top_p``
    read from the device (``TOP_P_PTR``) keeps every block at 1, as ``KEEP_ALL`` does for a launch constant.
    """
    n_valid = tl.minimum(pos // BLOCK + 1, NB)
    if LOCAL_WINDOW > 0:
        first_local = tl.maximum(pos - LOCAL_WINDOW + 1, 0) // BLOCK
    else:
        first_local = n_valid
    offs = tl.arange(0, CHUNK)
    valid = offs < n_valid
    x = tl.load(row + offs, mask=valid, other=float("-inf"))
    tau = top_p_threshold(x, top_p, ITERS, KEEP_ALL, TOP_P_PTR)
    sel = valid & ((x >= tau) | (offs < SINK_BLOCKS) | (offs >= first_local))
    rank = tl.cumsum(sel.to(tl.int32), 0) - 1
    tl.store(out + rank, offs.to(tl.int32), mask=sel)
    return tl.sum(sel.to(tl.int32), 0)


@triton.jit
def _merge_rows(O_PART, LSE_PART, OUT, o_row, l_row, out_row, m_valid, n_splits, stride_os, offs_d,
                BLOCK_M: tl.constexpr, D: tl.constexpr, SPL: tl.constexpr):
    """out[row] = sum_s 2^(lse_s - lse) o_s over splits ``0 .. n_splits - 1`` of ``BLOCK_M`` rows, ``SPL`` splits
    at a time (the partials were written by other programs of this launch: read past L1)."""
    offs_s = tl.arange(0, SPL)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    den = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    for s0 in range(0, n_splits, SPL):
        sv = m_valid[:, None] & (s0 + offs_s < n_splits)[None, :]
        lse = tl.load(LSE_PART + l_row[:, None] + (s0 + offs_s)[None, :], mask=sv, other=float("-inf"),
                      cache_modifier=".cg")
        o = tl.load(O_PART + o_row[:, None, None] + (s0 + offs_s)[None, :, None] * stride_os
                    + offs_d[None, None, :], mask=sv[:, :, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_i, tl.max(lse, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        w = tl.exp2(lse - m_safe[:, None])
        acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], 1)
        den = den * alpha + tl.sum(w, 1)
        m_i = m_new
    out = acc / tl.maximum(den, 1e-30)[:, None]  # a row that saw nothing gets zeros
    tl.store(OUT + out_row[:, None] + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=m_valid[:, None])


@triton.jit
def _attend(acc, m_i, l_i, q, k, v, visible, qk_scale, IEEE: tl.constexpr):
    s = dot(q, tl.trans(k), IEEE) * qk_scale  # log2 domain
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
    return acc, m_new, l_i


@triton.jit
def _store_partial(O_PART, LSE_PART, acc, m_i, l_i, o_row, l_row, m_valid, offs_d):
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
    tl.store(O_PART + o_row[:, None] + offs_d[None, :], out, mask=m_valid[:, None])
    tl.store(LSE_PART + l_row, lse, mask=m_valid)


@triton.jit
def _ret_attn(
    a, ht, split,
    Q, PK, PV, GK, GV, BS, SEL_IDX, SEL_CNT, RET_HEADS, ROW_SLOT, PREFIX_SLOT, PREFIX_LEN, CACHED_LEN, O_PART,
    LSE_PART, OUT, COUNTERS,
    stride_qa, stride_qh, stride_qt,
    stride_ps, stride_ph, stride_pl,
    stride_gs, stride_gh, stride_gl,
    stride_si, stride_bn,
    stride_oa, stride_oh, stride_ot, stride_os,
    stride_la, stride_lh, stride_lt,
    stride_a, stride_h, stride_t,
    qk_scale, TOP_P, stride_tp, H_RET, NB, NG,
    T: tl.constexpr, QPK: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_BLOCKS: tl.constexpr, IEEE: tl.constexpr,
    SELECT: tl.constexpr, MERGE: tl.constexpr, CHUNK: tl.constexpr, ITERS: tl.constexpr, KEEP_ALL: tl.constexpr,
    SINK_BLOCKS: tl.constexpr, RET_WINDOW: tl.constexpr, SPL: tl.constexpr, TOP_P_PTR: tl.constexpr,
):
    """Program (row ``a``, retrieval head and new token ``ht``, ``split``) of the retrieval-head attention:
    selection first when ``SELECT``, the group's merge at the end when ``MERGE`` and it finishes last."""
    hr = ht // T
    t = ht % T
    hkv = tl.load(RET_HEADS + hr)
    pslot = tl.load(PREFIX_SLOT + a)
    rslot = tl.load(ROW_SLOT + a)
    plen = tl.load(PREFIX_LEN + a)
    pos = plen + tl.load(CACHED_LEN + a) + t
    n = ((a * H_RET + hr) * T + t).to(tl.int64)
    if SELECT:  # every split of the query computes the same list; each then reads its own share of it
        if TOP_P_PTR:  # a device value, 0-dim (stride 0) or one per row
            top_p = tl.load(TOP_P + a * stride_tp).to(tl.float32)
        else:
            top_p = TOP_P
        cnt = _select_decode_row(BS + n * stride_bn, SEL_IDX + n * stride_si, pos, NB, top_p, BLOCK, SINK_BLOCKS,
                                 RET_WINDOW, CHUNK, ITERS, KEEP_ALL, TOP_P_PTR)
        if split == 0:
            tl.store(SEL_CNT + n, cnt)
        tl.debug_barrier()  # the list is in memory before any thread reads an entry another one wrote
    else:
        cnt = tl.load(SEL_CNT + n)
    per = tl.maximum(tl.cdiv(cnt, NUM_SPLITS), MIN_BLOCKS)
    i_start = split * per
    i_end = tl.minimum(i_start + per, cnt)

    offs_m = tl.arange(0, BLOCK_M)
    m_valid = offs_m < QPK
    offs_d = tl.arange(0, D)
    heads = hkv * QPK + offs_m
    q = tl.load(Q + a * stride_qa + heads[:, None] * stride_qh + t * stride_qt + offs_d[None, :],
                mask=m_valid[:, None], other=0.0)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)  # BLOCK_N = max(BLOCK, 16) lanes: tl.dot needs K >= 16 on the GPU
    in_block = offs_n < BLOCK
    pk_base = PK + pslot * stride_ps + hr * stride_ph
    pv_base = PV + pslot * stride_ps + hr * stride_ph
    gk_base = GK + rslot * stride_gs + hr * stride_gh
    gv_base = GV + rslot * stride_gs + hr * stride_gh
    for i in range(i_start, i_end):
        b = tl.load(SEL_IDX + n * stride_si + i).to(tl.int64)
        j0 = b * BLOCK
        j = j0 + offs_n
        vis = in_block & (j <= pos)
        # a block lies in the prompt, in the generation, or (once per row) across both: one load per part
        if j0 < plen:
            mp = vis & (j < plen)
            jp = j[:, None] * stride_pl + offs_d[None, :]
            k = tl.load(pk_base + jp, mask=mp[:, None], other=0.0)
            v = tl.load(pv_base + jp, mask=mp[:, None], other=0.0)
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, k, v, mp[None, :] & m_valid[:, None], qk_scale, IEEE)
        if j0 + BLOCK > plen:
            mg = vis & (j >= plen)
            jg = (j - plen)[:, None] * stride_gl + offs_d[None, :]
            k = tl.load(gk_base + jg, mask=mg[:, None], other=0.0)
            v = tl.load(gv_base + jg, mask=mg[:, None], other=0.0)
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, k, v, mg[None, :] & m_valid[:, None], qk_scale, IEEE)
    o_row = a * stride_oa + heads * stride_oh + t * stride_ot
    l_row = a * stride_la + heads * stride_lh + t * stride_lt
    _store_partial(O_PART, LSE_PART, acc, m_i, l_i, o_row + split * stride_os, l_row + split, m_valid, offs_d)
    if MERGE:
        tl.debug_barrier()  # every thread's partial is stored before the release below
        if tl.atomic_add(COUNTERS + a * NG + ht, 1, sem="acq_rel") == NUM_SPLITS - 1:  # the group's last split
            _merge_rows(O_PART, LSE_PART, OUT, o_row, l_row, a * stride_a + heads * stride_h + t * stride_t,
                        m_valid, tl.cdiv(cnt, per), stride_os, offs_d, BLOCK_M, D, SPL)


@triton.jit
def _local_attn(
    a, hl, split,
    Q, PLK, PLV, GLK, GLV, LOC_HEADS, ROW_SLOT, PREFIX_SLOT, PREFIX_LEN, CACHED_LEN, O_PART, LSE_PART, OUT, COUNTERS,
    stride_qa, stride_qh, stride_qt,
    stride_ps, stride_ph, stride_pl,
    stride_gs, stride_gh, stride_gl,
    stride_oa, stride_oh, stride_ot, stride_os,
    stride_la, stride_lh, stride_lt,
    stride_a, stride_h, stride_t,
    qk_scale, G0, NG,
    T: tl.constexpr, QPK: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr, SINKS: tl.constexpr, SINK_P2: tl.constexpr,
    WINDOW: tl.constexpr, WP: tl.constexpr, WG: tl.constexpr, IEEE: tl.constexpr, MERGE: tl.constexpr,
    SPL: tl.constexpr,
):
    """Program (row ``a``, local head ``hl``, ``split``) of the sinks + window attention (the head's merge at the
    end when ``MERGE`` and it finishes last; its counter is entry ``G0 + hl`` of the row's)."""
    hkv = tl.load(LOC_HEADS + hl)
    pslot = tl.load(PREFIX_SLOT + a)
    rslot = tl.load(ROW_SLOT + a)
    plen = tl.load(PREFIX_LEN + a)
    pos0 = plen + tl.load(CACHED_LEN + a)
    s_eff = tl.minimum(plen, SINKS)
    lo = tl.maximum(s_eff, pos0 - WINDOW + 1)
    hi = pos0 + T
    chunk = tl.cdiv(tl.maximum(tl.cdiv(hi - lo, NUM_SPLITS), MIN_CHUNK), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, hi)

    offs_m = tl.arange(0, BLOCK_M)
    t_of_m = offs_m // QPK
    g_of_m = offs_m % QPK
    m_valid = offs_m < T * QPK
    offs_d = tl.arange(0, D)
    heads = hkv * QPK + g_of_m
    q = tl.load(Q + a * stride_qa + heads[:, None] * stride_qh + t_of_m[:, None] * stride_qt + offs_d[None, :],
                mask=m_valid[:, None], other=0.0)
    q_hi = pos0 + t_of_m
    q_lo = q_hi - WINDOW + 1
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    p_base_k = PLK + pslot * stride_ps + hl * stride_ph
    p_base_v = PLV + pslot * stride_ps + hl * stride_ph
    g_base_k = GLK + rslot * stride_gs + hl * stride_gh
    g_base_v = GLV + rslot * stride_gs + hl * stride_gh
    if SINKS > 0:
        if split == 0:
            js = tl.arange(0, SINK_P2)
            sm = js < s_eff
            ks = tl.load(p_base_k + js[:, None] * stride_pl + offs_d[None, :], mask=sm[:, None], other=0.0)
            vs = tl.load(p_base_v + js[:, None] * stride_pl + offs_d[None, :], mask=sm[:, None], other=0.0)
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, ks, vs, sm[None, :] & m_valid[:, None], qk_scale, IEEE)
    offs_n = tl.arange(0, BLOCK_N)
    for j0 in range(start, end, BLOCK_N):
        j = j0 + offs_n
        visible = ((j < end)[None, :] & (j[None, :] <= q_hi[:, None]) & (j[None, :] >= q_lo[:, None])
                   & m_valid[:, None])
        if j0 < plen:  # prompt positions, from the prefix slot's ring
            mp = (j < end) & (j < plen)
            jp = (SINKS + j % WP)[:, None] * stride_pl + offs_d[None, :]
            k = tl.load(p_base_k + jp, mask=mp[:, None], other=0.0)
            v = tl.load(p_base_v + jp, mask=mp[:, None], other=0.0)
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, k, v, visible & mp[None, :], qk_scale, IEEE)
        if j0 + BLOCK_N > plen:  # generated positions, from the row's ring
            mg = (j < end) & (j >= plen)
            jg = ((j - plen) % WG)[:, None] * stride_gl + offs_d[None, :]
            k = tl.load(g_base_k + jg, mask=mg[:, None], other=0.0)
            v = tl.load(g_base_v + jg, mask=mg[:, None], other=0.0)
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, k, v, visible & mg[None, :], qk_scale, IEEE)
    o_row = a * stride_oa + heads * stride_oh + t_of_m * stride_ot
    l_row = a * stride_la + heads * stride_lh + t_of_m * stride_lt
    _store_partial(O_PART, LSE_PART, acc, m_i, l_i, o_row + split * stride_os, l_row + split, m_valid, offs_d)
    if MERGE:
        tl.debug_barrier()  # every thread's partial is stored before the release below
        if tl.atomic_add(COUNTERS + a * NG + G0 + hl, 1, sem="acq_rel") == NUM_SPLITS - 1:  # the head's last split
            _merge_rows(O_PART, LSE_PART, OUT, o_row, l_row, a * stride_a + heads * stride_h + t_of_m * stride_t,
                        m_valid, tl.cdiv(hi - lo, chunk), stride_os, offs_d, BLOCK_M, D, SPL)


@triton.jit
def _attn_kernel(
    Q, PK, PV, GK, GV, BS, SEL_IDX, SEL_CNT, RET_HEADS, PLK, PLV, GLK, GLV, LOC_HEADS,
    ROW_SLOT, PREFIX_SLOT, PREFIX_LEN, CACHED_LEN, O_PART, LSE_PART, OUT, COUNTERS,
    stride_qa, stride_qh, stride_qt,
    stride_ps, stride_ph, stride_pl, stride_gs, stride_gh, stride_gl, stride_si, stride_bn,
    stride_lps, stride_lph, stride_lpl, stride_lgs, stride_lgh, stride_lgl,
    stride_oa, stride_oh, stride_ot, stride_os,
    stride_la, stride_lh, stride_lt,
    stride_a, stride_h, stride_t,
    qk_scale, TOP_P, stride_tp, H_RET, NB, NG,
    T: tl.constexpr, QPK: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr,
    RET_BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, RET_BLOCK_N: tl.constexpr, NS_RET: tl.constexpr,
    MIN_BLOCKS: tl.constexpr,
    LOC_BLOCK_M: tl.constexpr, LOC_BLOCK_N: tl.constexpr, NS_LOC: tl.constexpr, MIN_CHUNK: tl.constexpr,
    SINKS: tl.constexpr, SINK_P2: tl.constexpr, WINDOW: tl.constexpr, WP: tl.constexpr, WG: tl.constexpr,
    SELECT: tl.constexpr, MERGE: tl.constexpr, CHUNK: tl.constexpr, ITERS: tl.constexpr, KEEP_ALL: tl.constexpr,
    SINK_BLOCKS: tl.constexpr, RET_WINDOW: tl.constexpr, RET_SPL: tl.constexpr, LOC_SPL: tl.constexpr,
    TOP_P_PTR: tl.constexpr,
):
    """Retrieval and local heads in one launch: programs ``(a, 0 .. H_RET*T - 1, split)`` are retrieval
    (head, token) pairs, the following ones local heads (either kind may be absent); each runs only its own
    number of splits. ``SELECT``: retrieval programs select their blocks from the block scores ``BS`` (else
    they read the top-p kernel's ``SEL_IDX`` / ``SEL_CNT``); ``MERGE``: the last split of each group merges
    into ``OUT`` (else the merge kernel does)."""
    a = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    if h < H_RET * T:
        if split < NS_RET:
            _ret_attn(a, h, split, Q, PK, PV, GK, GV, BS, SEL_IDX, SEL_CNT, RET_HEADS, ROW_SLOT, PREFIX_SLOT,
                      PREFIX_LEN, CACHED_LEN, O_PART, LSE_PART, OUT, COUNTERS, stride_qa, stride_qh, stride_qt,
                      stride_ps, stride_ph, stride_pl, stride_gs, stride_gh, stride_gl, stride_si, stride_bn,
                      stride_oa, stride_oh, stride_ot, stride_os, stride_la, stride_lh, stride_lt, stride_a,
                      stride_h, stride_t, qk_scale, TOP_P, stride_tp, H_RET, NB, NG, T, QPK, D, RET_BLOCK_M,
                      BLOCK, RET_BLOCK_N, NS_RET, MIN_BLOCKS, IEEE, SELECT, MERGE, CHUNK, ITERS, KEEP_ALL,
                      SINK_BLOCKS, RET_WINDOW, RET_SPL, TOP_P_PTR)
    else:
        if split < NS_LOC:
            _local_attn(a, h - H_RET * T, split, Q, PLK, PLV, GLK, GLV, LOC_HEADS, ROW_SLOT, PREFIX_SLOT,
                        PREFIX_LEN, CACHED_LEN, O_PART, LSE_PART, OUT, COUNTERS, stride_qa, stride_qh, stride_qt,
                        stride_lps, stride_lph, stride_lpl, stride_lgs, stride_lgh, stride_lgl, stride_oa, stride_oh,
                        stride_ot, stride_os, stride_la, stride_lh, stride_lt, stride_a, stride_h, stride_t,
                        qk_scale, H_RET * T, NG, T, QPK, D, LOC_BLOCK_M, LOC_BLOCK_N, NS_LOC, MIN_CHUNK, SINKS,
                        SINK_P2, WINDOW, WP, WG, IEEE, MERGE, LOC_SPL)


@triton.jit
def _merge_kernel(
    O_PART, LSE_PART, OUT, HEAD_IS_RET,
    stride_oa, stride_oh, stride_ot, stride_os,
    stride_la, stride_lh, stride_lt,
    stride_a, stride_h, stride_t,
    QPK: tl.constexpr, D: tl.constexpr, NS_RET: tl.constexpr, NS_LOC: tl.constexpr, SPLITS_P2: tl.constexpr,
):
    a = tl.program_id(0)
    h = tl.program_id(1)
    t = tl.program_id(2)
    is_ret = tl.load(HEAD_IS_RET + h // QPK)
    ns = tl.where(is_ret != 0, NS_RET, NS_LOC)
    merge_splits(O_PART, LSE_PART, OUT, a * stride_oa + h * stride_oh + t * stride_ot,
                 a * stride_la + h * stride_lh + t * stride_lt, a * stride_a + h * stride_h + t * stride_t,
                 stride_os, ns, D, SPLITS_P2)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


RET_MIN_BLOCKS = 4  # kept blocks per split at least (256 tokens)
LOCAL_MIN_CHUNK = 256
SCORE_MIN_BLOCKS = 16
SCORE_BB = 8
SELECT_CHUNK = 4096  # longest row (blocks) the fused launch selects in registers; longer: the top-p kernel
# every retrieval split of a query repeats its selection (a bisection over the row in registers): worth a launch
# saved while the repeats stay few; past this many retrieval programs the top-p kernel selects once per query
SELECT_PROGRAMS = 256


def merge_splits_per_step(block_m: int, d: int) -> int:
    """Splits the in-kernel merge reads at once (a power of two): ``block_m x splits x d`` float32 values, at most
    16K."""
    return max(1, min(16, 16384 // (block_m * d)))


def splits_for(n_units: int, min_units: int, max_splits: int = 64) -> int:
    return max(1, min(max_splits, _cdiv(n_units, min_units)))


# A retrieval head's row is cut into at least 64 splits (fewer for a short cache); when the call has few
# (row, retrieval head, token) triples, into more, up to RET_MAX_SPLITS, so that about RET_PROGRAMS programs
# read the cache at once: at batch 1 one retrieval kv head makes 64 programs for 132 multiprocessors, which left
# 1M-token rows at half the bandwidth of batch 4 (H100: 256 splits 2.0x faster than 64 at 1M, density 1).
RET_PROGRAMS = 256
RET_MAX_SPLITS = 256


def ret_splits_for(n_blocks: int, triples: int, min_blocks: int = RET_MIN_BLOCKS) -> int:
    """Retrieval splits per (row, retrieval head, token) for rows of up to ``n_blocks`` blocks and ``triples``
    such (row, head, token) triples in the call: at least ``min_blocks`` blocks per split, 64 splits or as many
    as bring the call to :data:`RET_PROGRAMS` programs (at most :data:`RET_MAX_SPLITS`)."""
    return splits_for(n_blocks, min_blocks, min(RET_MAX_SPLITS, max(64, _cdiv(RET_PROGRAMS, max(triples, 1)))))


def sparse_decode_triton(
    q, q_idx, cache, row_slot, prefix_slot, prefix_len, cached_len, ret_heads, loc_heads, head_is_ret, *,
    top_p: float | torch.Tensor, block: int, num_sinks: int, window: int, ret_window: int,
    scale: float | None = None, return_selection: bool = False, q_pre: torch.Tensor | None = None,
    indexer_q: torch.Tensor | None = None, q_scale: torch.Tensor | None = None, fused: bool = True,
    ret_splits: int | None = None, local_splits: int | None = None,
    ret_min_blocks: int = RET_MIN_BLOCKS, local_min_chunk: int = LOCAL_MIN_CHUNK, select_chunk: int = SELECT_CHUNK,
    select_programs: int = SELECT_PROGRAMS,
):
    """The launches of one decode call (arguments as :func:`.api.sparse_decode_attention`, ``cache`` a
    :class:`SparseDecodeCache`, no validation). ``q_idx`` None: the score kernel projects ``q_pre`` with
    ``indexer_q`` (and multiplies by ``q_scale`` [H_ret], if given). ``fused``: two launches (three when the
    selection goes to the top-p kernel: rows longer than ``select_chunk`` blocks, or more than
    ``select_programs`` retrieval programs), else the staged four. ``ret_splits`` / ``local_splits`` and the
    minimum work per split override the split heuristics (tests). Returns [A, Hq, T, D] (and
    ``(block ids, counts)`` when asked)."""
    A, Hq, T, D = q.shape
    Hr, Hl = ret_heads.shape[0], loc_heads.shape[0]
    qpk = Hq // (Hr + Hl)
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    qk_scale = scale * 1.4426950408889634
    ieee = q.dtype == torch.float32
    Lp, Lg = cache.prefix_k.shape[2], cache.gen_k.shape[2]
    nb_max = _cdiv(Lp + Lg, block)
    ns_ret = ret_splits or ret_splits_for(nb_max, A * Hr * T, ret_min_blocks)
    Wp = cache.prefix_lk.shape[2] - num_sinks
    Wg = cache.gen_lk.shape[2]
    ns_loc = local_splits or splits_for(min(window, Lp + Lg) + T - 1, local_min_chunk)
    ns = max(ns_ret if Hr else 1, ns_loc if Hl else 1)
    ng = Hr * T + Hl  # merge groups per row: (retrieval head, token) pairs, then local heads
    o_part = torch.empty((A, Hq, T, ns, D), device=q.device, dtype=torch.float32)
    lse_part = torch.empty((A, Hq, T, ns), device=q.device, dtype=torch.float32)
    out = torch.empty_like(q)
    # the fused launch counts finished splits per group: zeroed by the score kernel, or here without one
    counters = (torch.zeros if fused and not Hr else torch.empty)((max(A * ng, 1),), device=q.device,
                                                                  dtype=torch.int32)
    on_device = isinstance(top_p, torch.Tensor)  # read by the kernels, 0-dim or one value per row
    tp, stride_tp = (top_p.float(), top_p.stride(0) if top_p.dim() else 0) if on_device else (float(top_p), 0)
    sink_blocks = _cdiv(num_sinks, block)
    select = fused and nb_max <= select_chunk and A * Hr * T * ns_ret <= select_programs
    selection = None
    bs = sel_idx = sel_cnt = row_slot
    if Hr:
        r = cache.prefix_ik.shape[-1]
        project = q_idx is None
        if project:
            q_pre = q_pre if q_pre.stride(-1) == 1 else q_pre.contiguous()
            wq = indexer_q if indexer_q.stride(-1) == 1 else indexer_q.contiguous()
            qs = q_scale if q_scale is not None else torch.ones(Hr, device=q.device)
        qi, qp, qs, wq = (q, q_pre, qs, wq) if project else (q_idx, q_idx, q_idx, q_idx)  # unread: placeholders
        bs = torch.empty((A * Hr * T, nb_max), device=q.device, dtype=torch.float32)
        ns_score = splits_for(nb_max, SCORE_MIN_BLOCKS, 128)
        _score_kernel[(A, Hr * T, ns_score)](
            qi, qp, wq, qs, ret_heads, cache.prefix_ik, cache.gen_ik, row_slot, prefix_slot,
            prefix_len, cached_len, bs, counters,
            qp.stride(0), qp.stride(1), qp.stride(2),
            cache.prefix_ik.stride(0), cache.prefix_ik.stride(1), cache.prefix_ik.stride(2),
            cache.gen_ik.stride(0), cache.gen_ik.stride(1), cache.gen_ik.stride(2),
            bs.stride(0), wq.stride(0), wq.stride(1), Hr, ng,
            T=T, R=r, BLOCK=block, BB=SCORE_BB, NUM_SPLITS=ns_score, MIN_BLOCKS=SCORE_MIN_BLOCKS,
            PROJECT=project, QPK=qpk, D=D, ZERO=fused, NG_P2=triton.next_power_of_2(ng),
        )
        sel_idx = torch.empty((A * Hr * T, nb_max), device=q.device, dtype=torch.int32)
        if select:
            sel_cnt = torch.empty((A * Hr * T,), device=q.device, dtype=torch.int32)
        else:
            sel_idx, sel_cnt = topp_select_triton(
                bs, prefix_len, cached_len, top_p, mode=MODE_DECODE, block=block, sink_blocks=sink_blocks,
                local_window=ret_window, inner=T, h_inner=Hr * T, sel_idx=sel_idx,
            )
        selection = (sel_idx, sel_cnt)
    ret_block_m = max(16, triton.next_power_of_2(qpk))
    ret = dict(BLOCK=block, MIN_BLOCKS=ret_min_blocks, NS_RET=ns_ret if Hr else 1, RET_BLOCK_M=ret_block_m,
               RET_BLOCK_N=max(16, block))
    loc_block_m = max(16, triton.next_power_of_2(T * qpk))
    loc = dict(LOC_BLOCK_M=loc_block_m, LOC_BLOCK_N=64 if D <= 64 or loc_block_m <= 64 else 32,
               NS_LOC=ns_loc if Hl else 1, MIN_CHUNK=local_min_chunk, SINKS=num_sinks,
               SINK_P2=max(16, triton.next_power_of_2(max(num_sinks, 1))), WINDOW=window, WP=max(Wp, 1), WG=Wg)
    chunk = max(16, triton.next_power_of_2(nb_max))
    fuse = dict(SELECT=select, MERGE=fused, CHUNK=chunk if select else 16, ITERS=32,
                KEEP_ALL=not on_device and top_p >= 1.0 - 2.0**-25, TOP_P_PTR=on_device, SINK_BLOCKS=sink_blocks,
                RET_WINDOW=ret_window,
                RET_SPL=merge_splits_per_step(ret_block_m, D), LOC_SPL=merge_splits_per_step(loc_block_m, D))
    full = (cache.prefix_k.stride(0), cache.prefix_k.stride(1), cache.prefix_k.stride(2),
            cache.gen_k.stride(0), cache.gen_k.stride(1), cache.gen_k.stride(2))
    ring = (cache.prefix_lk.stride(0), cache.prefix_lk.stride(1), cache.prefix_lk.stride(2),
            cache.gen_lk.stride(0), cache.gen_lk.stride(1), cache.gen_lk.stride(2))

    def live(t: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
        # a kind of head the layer lacks has empty tensors, whose pointers may be null: no program reads them
        return t if t.numel() else fallback

    _attn_kernel[(A, Hr * T + Hl, ns)](
        q, *(live(t, q) for t in (cache.prefix_k, cache.prefix_v, cache.gen_k, cache.gen_v)), bs, sel_idx, sel_cnt,
        live(ret_heads, row_slot), *(live(t, q) for t in (cache.prefix_lk, cache.prefix_lv, cache.gen_lk,
                                                           cache.gen_lv)), live(loc_heads, row_slot),
        row_slot, prefix_slot, prefix_len, cached_len, o_part, lse_part, out, counters,
        q.stride(0), q.stride(1), q.stride(2), *full, sel_idx.stride(0), bs.stride(0), *ring,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
        lse_part.stride(0), lse_part.stride(1), lse_part.stride(2), out.stride(0), out.stride(1), out.stride(2),
        qk_scale, tp, stride_tp, Hr, nb_max, ng,
        T=T, QPK=qpk, D=D, IEEE=ieee, **ret, **loc, **fuse, num_warps=8 if D >= 128 else 4,
    )
    if not fused:
        _merge_kernel[(A, Hq, T)](
            o_part, lse_part, out, head_is_ret,
            o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
            lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            QPK=qpk, D=D, NS_RET=ns_ret if Hr else 1, NS_LOC=ns_loc if Hl else 1,
            SPLITS_P2=max(2, triton.next_power_of_2(ns)),
        )
    return (out, selection) if return_selection else out


@torch.library.custom_op("sparrow::sparse_decode", mutates_args=())
def _sparse_decode_op(
    q: torch.Tensor, q_idx: Optional[torch.Tensor], prefix_k: torch.Tensor, prefix_v: torch.Tensor, gen_k: torch.Tensor,
    gen_v: torch.Tensor, prefix_ik: torch.Tensor, gen_ik: torch.Tensor, prefix_lk: torch.Tensor,
    prefix_lv: torch.Tensor, gen_lk: torch.Tensor, gen_lv: torch.Tensor, row_slot: torch.Tensor,
    prefix_slot: torch.Tensor, prefix_len: torch.Tensor, cached_len: torch.Tensor, ret_heads: torch.Tensor,
    loc_heads: torch.Tensor, head_is_ret: torch.Tensor, top_p: torch.Tensor, block: int, num_sinks: int, window: int,
    ret_window: int, scale: float, q_pre: Optional[torch.Tensor] = None, indexer_q: Optional[torch.Tensor] = None,
    q_scale: Optional[torch.Tensor] = None, fused: bool = True,
) -> torch.Tensor:
    cache = SparseDecodeCache(prefix_k, prefix_v, gen_k, gen_v, prefix_ik, gen_ik, prefix_lk, prefix_lv, gen_lk, gen_lv)
    return sparse_decode_triton(q, q_idx, cache, row_slot, prefix_slot, prefix_len, cached_len, ret_heads, loc_heads,
                                head_is_ret, top_p=top_p, block=block, num_sinks=num_sinks, window=window,
                                ret_window=ret_window, scale=scale, q_pre=q_pre, indexer_q=indexer_q, q_scale=q_scale,
                                fused=fused)


@_sparse_decode_op.register_fake
def _(q, q_idx, prefix_k, prefix_v, gen_k, gen_v, prefix_ik, gen_ik, prefix_lk, prefix_lv, gen_lk, gen_lv, row_slot,
      prefix_slot, prefix_len, cached_len, ret_heads, loc_heads, head_is_ret, top_p, block, num_sinks, window,
      ret_window, scale, q_pre=None, indexer_q=None, q_scale=None, fused=True):
    return torch.empty_like(q)


def sparse_decode_op(q, q_idx, cache, row_slot, prefix_slot, prefix_len, cached_len, ret_heads, loc_heads,
                     head_is_ret, *, top_p: float | torch.Tensor, block: int, num_sinks: int, window: int, ret_window: int,
                     scale: float | None = None, q_pre: torch.Tensor | None = None,
                     indexer_q: torch.Tensor | None = None, q_scale: torch.Tensor | None = None,
                     fused: bool = True) -> torch.Tensor:
    """:func:`sparse_decode_triton` as the custom op ``sparrow::sparse_decode``: opaque to ``torch.compile``
    (Inductor does not re-trace the Triton kernels; it re-typed a float argument as float64 inside them) and
    safe inside CUDA graphs. Returns the attention output only."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if not isinstance(top_p, torch.Tensor):  # the op reads top_p on the device (a schedule updates it in place)
        top_p = torch.full((), float(top_p), dtype=torch.float32, device=q.device)
    return _sparse_decode_op(q, q_idx, *cache, row_slot, prefix_slot, prefix_len, cached_len, ret_heads, loc_heads,
                             head_is_ret, top_p, int(block), int(num_sinks), int(window), int(ret_window),
                             float(scale), q_pre, indexer_q, q_scale, bool(fused))


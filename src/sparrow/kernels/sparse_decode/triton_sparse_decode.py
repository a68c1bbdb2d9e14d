"""Triton kernels for RTPurbo decode: indexer block scores, top-p selection, sparse + local split-KV attention.

One decode call is four launches, none of which waits on the host:

1. ``_score_kernel`` — program per (row, retrieval head, new token, split): indexer scores
   ``q_idx . k_idx`` of the split's tokens (prompt tokens read in place from the prefix slot, generated
   ones from the row's slot), reduced to one log-mass per 64-token block (logsumexp).
2. :func:`sparrow.kernels.topp.triton_topp.topp_select_triton` — bisection threshold on the block
   log-masses (no sort), compacted list of kept blocks (top-p + sinks + local window) per query.
3. ``_attn_kernel`` — both kinds of heads in one launch. A retrieval program (row, retrieval head, new
   token, split; ``_ret_attn``) takes the split's share of the *kept-block list* (so work is balanced
   whatever the selection's layout): exact attention with an online softmax for the head's ``q_per_kv``
   queries as one tile. A local program (row, local head, split; ``_local_attn``) reads sinks + sliding
   window from the ring buffers, like the dense split-KV kernel but over at most ``window + T - 1``
   positions.
4. ``_merge_kernel`` — per (row, query head, new token): log-sum-exp merge of the splits.

Selection is block-granular (64 tokens): a block's score is the logsumexp of its tokens' indexer scores,
i.e. its exact share of the indexer's softmax mass, so "top-p over blocks" keeps whole blocks whose mass
reaches ``p``; reads are then contiguous 64 x D tiles that feed ``tl.dot`` directly, and the selection
costs ``L / 64`` values per query instead of ``L``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sparrow.kernels.common.triton_dot import dot
from sparrow.kernels.common.triton_merge import merge_splits
from sparrow.kernels.topp.triton_topp import MODE_DECODE, topp_select_triton

from .cache import SparseDecodeCache


@triton.jit
def _score_kernel(
    QI, PIK, GIK, ROW_SLOT, PREFIX_SLOT, PREFIX_LEN, CACHED_LEN, BS,
    stride_qa, stride_qh, stride_qt,
    stride_ps, stride_ph, stride_pl,
    stride_gs, stride_gh, stride_gl,
    stride_bn, H_RET,
    T: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr, BB: tl.constexpr, NUM_SPLITS: tl.constexpr,
    MIN_BLOCKS: tl.constexpr,
):
    a = tl.program_id(0)
    ht = tl.program_id(1)
    split = tl.program_id(2)
    hr = ht // T
    t = ht % T
    pslot = tl.load(PREFIX_SLOT + a)
    rslot = tl.load(ROW_SLOT + a)
    plen = tl.load(PREFIX_LEN + a)
    pos = plen + tl.load(CACHED_LEN + a) + t
    nb = pos // BLOCK + 1
    per = tl.cdiv(tl.maximum(tl.cdiv(nb, NUM_SPLITS), MIN_BLOCKS), BB) * BB
    b_start = split * per
    b_end = tl.minimum(b_start + per, nb)

    offs_r = tl.arange(0, R)
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
    Q, PK, PV, GK, GV, SEL_IDX, SEL_CNT, RET_HEADS, ROW_SLOT, PREFIX_SLOT, PREFIX_LEN, CACHED_LEN, O_PART, LSE_PART,
    stride_qa, stride_qh, stride_qt,
    stride_ps, stride_ph, stride_pl,
    stride_gs, stride_gh, stride_gl,
    stride_si,
    stride_oa, stride_oh, stride_ot, stride_os,
    stride_la, stride_lh, stride_lt,
    qk_scale, H_RET,
    T: tl.constexpr, QPK: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_BLOCKS: tl.constexpr, IEEE: tl.constexpr,
):
    """Program (row ``a``, retrieval head and new token ``ht``, ``split``) of the retrieval-head attention."""
    hr = ht // T
    t = ht % T
    hkv = tl.load(RET_HEADS + hr)
    pslot = tl.load(PREFIX_SLOT + a)
    rslot = tl.load(ROW_SLOT + a)
    plen = tl.load(PREFIX_LEN + a)
    pos = plen + tl.load(CACHED_LEN + a) + t
    n = ((a * H_RET + hr) * T + t).to(tl.int64)
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
    o_row = a * stride_oa + heads * stride_oh + t * stride_ot + split * stride_os
    l_row = a * stride_la + heads * stride_lh + t * stride_lt + split
    _store_partial(O_PART, LSE_PART, acc, m_i, l_i, o_row, l_row, m_valid, offs_d)


@triton.jit
def _local_attn(
    a, hl, split,
    Q, PLK, PLV, GLK, GLV, LOC_HEADS, ROW_SLOT, PREFIX_SLOT, PREFIX_LEN, CACHED_LEN, O_PART, LSE_PART,
    stride_qa, stride_qh, stride_qt,
    stride_ps, stride_ph, stride_pl,
    stride_gs, stride_gh, stride_gl,
    stride_oa, stride_oh, stride_ot, stride_os,
    stride_la, stride_lh, stride_lt,
    qk_scale,
    T: tl.constexpr, QPK: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr, SINKS: tl.constexpr, SINK_P2: tl.constexpr,
    WINDOW: tl.constexpr, WP: tl.constexpr, WG: tl.constexpr, IEEE: tl.constexpr,
):
    """Program (row ``a``, local head ``hl``, ``split``) of the sinks + window attention."""
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
    o_row = a * stride_oa + heads * stride_oh + t_of_m * stride_ot + split * stride_os
    l_row = a * stride_la + heads * stride_lh + t_of_m * stride_lt + split
    _store_partial(O_PART, LSE_PART, acc, m_i, l_i, o_row, l_row, m_valid, offs_d)


@triton.jit
def _attn_kernel(
    Q, PK, PV, GK, GV, SEL_IDX, SEL_CNT, RET_HEADS, PLK, PLV, GLK, GLV, LOC_HEADS,
    ROW_SLOT, PREFIX_SLOT, PREFIX_LEN, CACHED_LEN, O_PART, LSE_PART,
    stride_qa, stride_qh, stride_qt,
    stride_ps, stride_ph, stride_pl, stride_gs, stride_gh, stride_gl, stride_si,
    stride_lps, stride_lph, stride_lpl, stride_lgs, stride_lgh, stride_lgl,
    stride_oa, stride_oh, stride_ot, stride_os,
    stride_la, stride_lh, stride_lt,
    qk_scale, H_RET,
    T: tl.constexpr, QPK: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr,
    RET_BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, RET_BLOCK_N: tl.constexpr, NS_RET: tl.constexpr,
    MIN_BLOCKS: tl.constexpr,
    LOC_BLOCK_M: tl.constexpr, LOC_BLOCK_N: tl.constexpr, NS_LOC: tl.constexpr, MIN_CHUNK: tl.constexpr,
    SINKS: tl.constexpr, SINK_P2: tl.constexpr, WINDOW: tl.constexpr, WP: tl.constexpr, WG: tl.constexpr,
):
    """Retrieval and local heads in one launch: programs ``(a, 0 .. H_RET*T - 1, split)`` are retrieval
    (head, token) pairs, the following ones local heads (either kind may be absent); each runs only its own
    number of splits."""
    a = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    if h < H_RET * T:
        if split < NS_RET:
            _ret_attn(a, h, split, Q, PK, PV, GK, GV, SEL_IDX, SEL_CNT, RET_HEADS, ROW_SLOT, PREFIX_SLOT, PREFIX_LEN,
                      CACHED_LEN, O_PART, LSE_PART, stride_qa, stride_qh, stride_qt, stride_ps, stride_ph, stride_pl,
                      stride_gs, stride_gh, stride_gl, stride_si, stride_oa, stride_oh, stride_ot, stride_os,
                      stride_la, stride_lh, stride_lt, qk_scale, H_RET, T, QPK, D, RET_BLOCK_M, BLOCK, RET_BLOCK_N,
                      NS_RET, MIN_BLOCKS, IEEE)
    else:
        if split < NS_LOC:
            _local_attn(a, h - H_RET * T, split, Q, PLK, PLV, GLK, GLV, LOC_HEADS, ROW_SLOT, PREFIX_SLOT,
                        PREFIX_LEN, CACHED_LEN, O_PART, LSE_PART, stride_qa, stride_qh, stride_qt, stride_lps,
                        stride_lph, stride_lpl, stride_lgs, stride_lgh, stride_lgl, stride_oa, stride_oh, stride_ot,
                        stride_os, stride_la, stride_lh, stride_lt, qk_scale, T, QPK, D, LOC_BLOCK_M, LOC_BLOCK_N,
                        NS_LOC, MIN_CHUNK, SINKS, SINK_P2, WINDOW, WP, WG, IEEE)


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


def splits_for(n_units: int, min_units: int, max_splits: int = 64) -> int:
    return max(1, min(max_splits, _cdiv(n_units, min_units)))


def sparse_decode_triton(
    q, q_idx, cache, row_slot, prefix_slot, prefix_len, cached_len, ret_heads, loc_heads, head_is_ret, *,
    top_p: float, block: int, num_sinks: int, window: int, ret_window: int, scale: float | None = None,
    return_selection: bool = False, ret_splits: int | None = None, local_splits: int | None = None,
    ret_min_blocks: int = RET_MIN_BLOCKS, local_min_chunk: int = LOCAL_MIN_CHUNK,
):
    """The four launches of one decode call (arguments as :func:`.api.sparse_decode_attention`, ``cache`` a
    :class:`SparseDecodeCache`, no validation). ``ret_splits`` / ``local_splits`` and the minimum work per split
    override the split heuristics (tests). Returns [A, Hq, T, D] (and ``(block ids, counts)`` when asked)."""
    A, Hq, T, D = q.shape
    Hr, Hl = ret_heads.shape[0], loc_heads.shape[0]
    qpk = Hq // (Hr + Hl)
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    qk_scale = scale * 1.4426950408889634
    ieee = q.dtype == torch.float32
    Lp, Lg = cache.prefix_k.shape[2], cache.gen_k.shape[2]
    nb_max = _cdiv(Lp + Lg, block)
    ns_ret = ret_splits or splits_for(nb_max, ret_min_blocks)
    Wp = cache.prefix_lk.shape[2] - num_sinks
    Wg = cache.gen_lk.shape[2]
    ns_loc = local_splits or splits_for(min(window, Lp + Lg) + T - 1, local_min_chunk)
    ns = max(ns_ret if Hr else 1, ns_loc if Hl else 1)
    o_part = torch.empty((A, Hq, T, ns, D), device=q.device, dtype=torch.float32)
    lse_part = torch.empty((A, Hq, T, ns), device=q.device, dtype=torch.float32)
    selection = None
    if Hr:
        r = q_idx.shape[-1]
        bs = torch.empty((A * Hr * T, nb_max), device=q.device, dtype=torch.float32)
        ns_score = splits_for(nb_max, SCORE_MIN_BLOCKS, 128)
        _score_kernel[(A, Hr * T, ns_score)](
            q_idx, cache.prefix_ik, cache.gen_ik, row_slot, prefix_slot, prefix_len, cached_len, bs,
            q_idx.stride(0), q_idx.stride(1), q_idx.stride(2),
            cache.prefix_ik.stride(0), cache.prefix_ik.stride(1), cache.prefix_ik.stride(2),
            cache.gen_ik.stride(0), cache.gen_ik.stride(1), cache.gen_ik.stride(2),
            bs.stride(0), Hr,
            T=T, R=r, BLOCK=block, BB=SCORE_BB, NUM_SPLITS=ns_score, MIN_BLOCKS=SCORE_MIN_BLOCKS,
        )
        sel_idx, sel_cnt = topp_select_triton(
            bs, prefix_len, cached_len, top_p, mode=MODE_DECODE, block=block, sink_blocks=_cdiv(num_sinks, block),
            local_window=ret_window, inner=T, h_inner=Hr * T,
        )
        selection = (sel_idx, sel_cnt)
    ret = dict(BLOCK=block, MIN_BLOCKS=ret_min_blocks, NS_RET=ns_ret if Hr else 1,
               RET_BLOCK_M=max(16, triton.next_power_of_2(qpk)), RET_BLOCK_N=max(16, block))
    loc_block_m = max(16, triton.next_power_of_2(T * qpk))
    loc = dict(LOC_BLOCK_M=loc_block_m, LOC_BLOCK_N=64 if D <= 64 or loc_block_m <= 64 else 32,
               NS_LOC=ns_loc if Hl else 1, MIN_CHUNK=local_min_chunk, SINKS=num_sinks,
               SINK_P2=max(16, triton.next_power_of_2(max(num_sinks, 1))), WINDOW=window, WP=max(Wp, 1), WG=Wg)
    q_strides = (q.stride(0), q.stride(1), q.stride(2))
    out_strides = (o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
                   lse_part.stride(0), lse_part.stride(1), lse_part.stride(2))
    full = (cache.prefix_k.stride(0), cache.prefix_k.stride(1), cache.prefix_k.stride(2),
            cache.gen_k.stride(0), cache.gen_k.stride(1), cache.gen_k.stride(2))
    ring = (cache.prefix_lk.stride(0), cache.prefix_lk.stride(1), cache.prefix_lk.stride(2),
            cache.gen_lk.stride(0), cache.gen_lk.stride(1), cache.gen_lk.stride(2))
    if not Hr:
        sel_idx = sel_cnt = row_slot

    def live(t: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
        # a kind of head the layer lacks has empty tensors, whose pointers may be null: no program reads them
        return t if t.numel() else fallback

    _attn_kernel[(A, Hr * T + Hl, ns)](
        q, *(live(t, q) for t in (cache.prefix_k, cache.prefix_v, cache.gen_k, cache.gen_v)), sel_idx, sel_cnt,
        live(ret_heads, row_slot), *(live(t, q) for t in (cache.prefix_lk, cache.prefix_lv, cache.gen_lk,
                                                           cache.gen_lv)), live(loc_heads, row_slot),
        row_slot, prefix_slot, prefix_len, cached_len, o_part, lse_part,
        *q_strides, *full, sel_idx.stride(0), *ring, *out_strides, qk_scale, Hr,
        T=T, QPK=qpk, D=D, IEEE=ieee, **ret, **loc, num_warps=8 if D >= 128 else 4,
    )
    out = torch.empty_like(q)
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
    q: torch.Tensor, q_idx: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor, gen_k: torch.Tensor,
    gen_v: torch.Tensor, prefix_ik: torch.Tensor, gen_ik: torch.Tensor, prefix_lk: torch.Tensor,
    prefix_lv: torch.Tensor, gen_lk: torch.Tensor, gen_lv: torch.Tensor, row_slot: torch.Tensor,
    prefix_slot: torch.Tensor, prefix_len: torch.Tensor, cached_len: torch.Tensor, ret_heads: torch.Tensor,
    loc_heads: torch.Tensor, head_is_ret: torch.Tensor, top_p: float, block: int, num_sinks: int, window: int,
    ret_window: int, scale: float,
) -> torch.Tensor:
    cache = SparseDecodeCache(prefix_k, prefix_v, gen_k, gen_v, prefix_ik, gen_ik, prefix_lk, prefix_lv, gen_lk, gen_lv)
    return sparse_decode_triton(q, q_idx, cache, row_slot, prefix_slot, prefix_len, cached_len, ret_heads, loc_heads,
                                head_is_ret, top_p=top_p, block=block, num_sinks=num_sinks, window=window,
                                ret_window=ret_window, scale=scale)


@_sparse_decode_op.register_fake
def _(q, q_idx, prefix_k, prefix_v, gen_k, gen_v, prefix_ik, gen_ik, prefix_lk, prefix_lv, gen_lk, gen_lv, row_slot,
      prefix_slot, prefix_len, cached_len, ret_heads, loc_heads, head_is_ret, top_p, block, num_sinks, window,
      ret_window, scale):
    return torch.empty_like(q)


def sparse_decode_op(q, q_idx, cache, row_slot, prefix_slot, prefix_len, cached_len, ret_heads, loc_heads,
                     head_is_ret, *, top_p: float, block: int, num_sinks: int, window: int, ret_window: int,
                     scale: float | None = None) -> torch.Tensor:
    """:func:`sparse_decode_triton` as the custom op ``sparrow::sparse_decode``: opaque to ``torch.compile``
    (Inductor does not re-trace the Triton kernels; it re-typed a float argument as float64 inside them) and
    safe inside CUDA graphs. Returns the attention output only."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _sparse_decode_op(q, q_idx, *cache, row_slot, prefix_slot, prefix_len, cached_len, ret_heads, loc_heads,
                             head_is_ret, float(top_p), int(block), int(num_sinks), int(window), int(ret_window),
                             float(scale))


"""Eager PyTorch oracle for RTPurbo decode attention (gathers the rows' caches: readable, not fast).

Semantics (shared with the Triton kernels). A row's virtual sequence is its prompt (positions
``0 .. prefix_len - 1``) followed by its generated tokens; new token ``t`` sits at
``pos = prefix_len + cached_len + t`` and sees positions ``<= pos``.

* Retrieval kv heads: token scores ``s_j = q_idx . k_idx_j``; block ``b`` (``block`` tokens) scores
  ``x_b = logsumexp_{j in b, j <= pos} s_j``; the top-p blocks of ``softmax(x)`` plus the sink block(s) and
  the blocks overlapping ``[pos - ret_window + 1, pos]`` are attended exactly.
* Local kv heads: the first ``min(num_sinks, prefix_len)`` prompt tokens and the positions
  ``pos - window < j <= pos``, read from ring buffers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparrow.kernels.topp.reference import topp_select_reference


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def retrieval_block_scores_reference(q_idx, prefix_ik, gen_ik, row_slot, prefix_slot, prefix_len, cached_len,
                                     block: int):
    """Block log-masses [A, H_ret, T, NB] (``-inf`` for blocks past the query) and positions [A, T]."""
    A, Hr, T, _ = q_idx.shape
    Lp, Lg = prefix_ik.shape[2], gen_ik.shape[2]
    NB = _cdiv(Lp + Lg, block)
    pos = (prefix_len + cached_len)[:, None] + torch.arange(T, device=q_idx.device)  # [A, T]
    ik = _virtual(prefix_ik, gen_ik, row_slot, prefix_slot, prefix_len, NB * block)  # [A, Hr, Lpad, r]
    p = torch.arange(NB * block, device=q_idx.device)
    vis = (p[None, None, :] <= pos[:, :, None])[:, None]  # [A, 1, T, Lpad]
    s = torch.einsum("ahtr,ahlr->ahtl", q_idx.float(), ik.float())
    s = torch.where(vis, s, float("-inf"))
    return torch.logsumexp(s.view(A, Hr, T, NB, block), -1), pos


def _virtual(prefix, gen, row_slot, prefix_slot, prefix_len, length: int) -> torch.Tensor:
    """Each row's cache in virtual-position order, [A, H, length, X] (positions past the row are junk)."""
    Lp, Lg = prefix.shape[2], gen.shape[2]
    full = torch.cat([prefix[prefix_slot], gen[row_slot]], dim=2)  # [A, H, Lp + Lg, X]
    p = torch.arange(length, device=prefix.device)
    src = torch.where(p[None] < prefix_len[:, None], p[None], Lp + p[None] - prefix_len[:, None])
    src = src.clamp(0, Lp + Lg - 1)  # [A, length]
    A, H, _, X = full.shape
    return full.gather(2, src[:, None, :, None].expand(A, H, length, X))


def project_indexer_queries(q_pre: torch.Tensor, indexer_q: torch.Tensor, ret_heads: torch.Tensor,
                            q_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Indexer queries [A, H_ret, T, r] float32: each retrieval head's pre-RoPE query group q_pre [A, Hq, T, D]
    (heads ``h * q_per_kv + g``, concatenated as ``g * D + d``) times indexer_q [H_ret, q_per_kv * D, r], times
    ``q_scale`` [H_ret]."""
    A, Hq, T, D = q_pre.shape
    Hr = ret_heads.shape[0]
    qpk = indexer_q.shape[1] // D
    g = q_pre.view(A, Hq // qpk, qpk, T, D)[:, ret_heads].permute(0, 1, 3, 2, 4).reshape(A, Hr, T, qpk * D)
    q_idx = torch.einsum("ahtc,hcr->ahtr", g.float(), indexer_q.float())
    return q_idx if q_scale is None else q_idx * q_scale.float()[None, :, None, None]


def sparse_decode_reference(q, q_idx, cache, row_slot, prefix_slot, prefix_len, cached_len, ret_heads, loc_heads,
                            *, top_p: float | torch.Tensor, block: int, num_sinks: int, window: int, ret_window: int,
                            scale: float | None = None, return_selection: bool = False):
    """q: [A, Hq, T, D]; q_idx: [A, H_ret, T, r]. Returns [A, Hq, T, D] (and the block mask if asked)."""
    A, Hq, T, D = q.shape
    Hr, Hl = int(ret_heads.numel()), int(loc_heads.numel())
    Hkv = Hr + Hl
    qpk = Hq // Hkv
    out = q.new_zeros(A, Hkv, qpk, T, D)
    q5 = q.view(A, Hkv, qpk, T, D)
    selection = None
    if Hr:
        bs, pos = retrieval_block_scores_reference(q_idx, cache.prefix_ik, cache.gen_ik, row_slot, prefix_slot,
                                                   prefix_len, cached_len, block)
        NB = bs.shape[-1]
        pos4 = pos[:, None, :].expand(A, Hr, T)
        tp = top_p[:, None, None] if isinstance(top_p, torch.Tensor) and top_p.dim() else top_p  # per row
        sel = topp_select_reference(bs, pos4, pos4, tp, block=block, sink_blocks=_cdiv(num_sinks, block),
                                    local_window=ret_window)  # [A, Hr, T, NB]
        selection = sel
        L = NB * block
        p = torch.arange(L, device=q.device)
        vis = p[None, None, :] <= pos[:, :, None]  # [A, T, L]
        tok = sel.repeat_interleave(block, dim=-1) & vis[:, None]  # [A, Hr, T, L]
        live = (p[None, :] <= pos[:, -1:])[:, None, :, None]  # [A, 1, L, 1]: zero junk past the row
        k = torch.where(live, _virtual(cache.prefix_k, cache.gen_k, row_slot, prefix_slot, prefix_len, L), 0)
        v = torch.where(live, _virtual(cache.prefix_v, cache.gen_v, row_slot, prefix_slot, prefix_len, L), 0)
        qr = q5[:, ret_heads].reshape(A, Hr, qpk * T, D)
        mask = tok[:, :, None].expand(A, Hr, qpk, T, L).reshape(A, Hr, qpk * T, L)
        o = F.scaled_dot_product_attention(qr, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale)
        out = out.index_copy(1, ret_heads, o.view(A, Hr, qpk, T, D))
    if Hl:
        out = out.index_copy(1, loc_heads, _local_reference(q5[:, loc_heads], cache, row_slot, prefix_slot,
                                                              prefix_len, cached_len, num_sinks=num_sinks,
                                                              window=window, scale=scale))
    out = out.view(A, Hq, T, D)
    return (out, selection) if return_selection else out


def _local_reference(ql, cache, row_slot, prefix_slot, prefix_len, cached_len, *, num_sinks, window, scale):
    """ql: [A, Hl, qpk, T, D] -> [A, Hl, qpk, T, D]: attention over sinks + sliding window."""
    A, Hl, qpk, T, D = ql.shape
    S = num_sinks
    Wp = cache.prefix_lk.shape[2] - S
    Wg = cache.gen_lk.shape[2]
    span = min(window, Wp + Wg) + T - 1  # window positions any of the T queries can see
    pos0 = prefix_len + cached_len  # [A]
    w = (pos0 - min(window, Wp + Wg) + 1)[:, None] + torch.arange(span, device=ql.device)  # [A, span]
    in_p = w < prefix_len[:, None]
    idx_p = S + w.clamp_min(0) % max(Wp, 1)
    idx_g = Wp + S + (w - prefix_len[:, None]).clamp_min(0) % Wg
    src = torch.where(in_p, idx_p, idx_g)
    sink = torch.arange(S, device=ql.device)[None].expand(A, S)
    src = torch.cat([sink, src], 1)  # [A, S + span]
    full_k = torch.cat([cache.prefix_lk[prefix_slot], cache.gen_lk[row_slot]], 2)  # [A, Hl, S + Wp + Wg, D]
    full_v = torch.cat([cache.prefix_lv[prefix_slot], cache.gen_lv[row_slot]], 2)
    g = src[:, None, :, None].expand(A, Hl, src.shape[1], D)
    k, v = full_k.gather(2, g), full_v.gather(2, g)
    s_eff = prefix_len.clamp(max=S)[:, None]  # [A, 1]
    pos = pos0[:, None] + torch.arange(T, device=ql.device)  # [A, T]
    sink_vis = (torch.arange(S, device=ql.device)[None] < s_eff)[:, None, :].expand(A, T, S)
    wv = w[:, None, :]
    win_vis = (wv <= pos[:, :, None]) & (wv > pos[:, :, None] - window) & (wv >= s_eff[:, :, None]) & (wv >= 0)
    vis = torch.cat([sink_vis, win_vis], -1)  # [A, T, S + span]
    k = torch.where(vis.any(1)[:, None, :, None], k, 0)
    v = torch.where(vis.any(1)[:, None, :, None], v, 0)
    mask = vis[:, None, None].expand(A, Hl, qpk, T, vis.shape[-1]).reshape(A, Hl, qpk * T, -1)
    o = F.scaled_dot_product_attention(ql.reshape(A, Hl, qpk * T, D), k.to(ql.dtype), v.to(ql.dtype),
                                       attn_mask=mask, scale=scale)
    return o.view(A, Hl, qpk, T, D)

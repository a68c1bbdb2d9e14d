"""Eager PyTorch oracle for RTPurbo prefill (dense [S, S] masks: readable, small shapes only).

Semantics (shared with the Triton + FlexAttention path), for a prompt of ``plen`` tokens cut into blocks
of ``block`` tokens:

* Retrieval kv heads: each query ``i`` has an indexer distribution ``softmax_j(q_idx_i . k_idx_j)`` over
  ``j <= i``. Query block ``qb`` scores key block ``kb`` by the *mean* over its real queries of the mass
  they put on ``kb`` (kept as a log). The top-p key blocks of that distribution, plus block 0 (sinks) and
  the blocks overlapping ``[qb * block - ret_window + 1, qb * block + block - 1]`` (the diagonal
  included), are attended exactly, causally.
* Local kv heads: ``j <= i`` and (``i - j < window`` or ``j < num_sinks``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparrow.kernels.topp.reference import topp_select_reference


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def prefill_block_scores_reference(q_idx: torch.Tensor, k_idx: torch.Tensor, prompt_len: torch.Tensor,
                                   block: int) -> torch.Tensor:
    """q_idx, k_idx: [P, H, S, r] -> log of the mean per-query mass, [P, H, Qb, KVb] (``-inf``: no mass)."""
    P, H, S, _ = q_idx.shape
    nb = _cdiv(S, block)
    s = torch.einsum("phir,phjr->phij", q_idx.float(), k_idx.float())
    i = torch.arange(S, device=q_idx.device)
    vis = (i[None, :] <= i[:, None])[None] & (i[None, None, :] < prompt_len[:, None, None])  # [P, S, S]
    s = torch.where(vis[:, None], s, float("-inf"))
    prob = torch.softmax(s, -1).nan_to_num(0.0)  # rows with no visible key (padding) -> 0
    prob = F.pad(prob, (0, nb * block - S, 0, nb * block - S))
    q_real = F.pad((i[None] < prompt_len[:, None]).float(), (0, nb * block - S))  # [P, Sp]
    mass = (prob * q_real[:, None, :, None]).view(P, H, nb, block, nb, block).sum((3, 5))
    n_q = q_real.view(P, nb, block).sum(-1).clamp_min(1)[:, None, :, None]
    return torch.log(mass / n_q)


def retrieval_selection_reference(scores: torch.Tensor, prompt_len: torch.Tensor, *, top_p: float, block: int,
                                  num_sinks: int, ret_window: int) -> torch.Tensor:
    """scores [P, H, Qb, KVb] -> bool block mask [P, H, Qb, KVb] (top-p + sinks + local window)."""
    P, H, Qb, _ = scores.shape
    q_lo = torch.arange(Qb, device=scores.device) * block
    q_hi = torch.maximum(q_lo, torch.minimum(q_lo + block, prompt_len[:, None]) - 1)  # [P, Qb]
    q_lo = q_lo[None].expand(P, Qb)
    return topp_select_reference(scores, q_lo[:, None].expand(P, H, Qb), q_hi[:, None].expand(P, H, Qb), top_p,
                                 block=block, sink_blocks=_cdiv(num_sinks, block), local_window=ret_window)


def local_token_mask(S: int, *, num_sinks: int, window: int, device) -> torch.Tensor:
    i = torch.arange(S, device=device)
    causal = i[None, :] <= i[:, None]
    return causal & ((i[:, None] - i[None, :] < window) | (i[None, :] < num_sinks))


def local_prefill_reference(q, k, v, *, num_sinks: int, window: int, scale: float | None = None) -> torch.Tensor:
    """q: [P, Hq, S, D]; k, v: [P, Hkv, S, D] -> [P, Hq, S, D]: SDPA under the dense sink + window mask."""
    mask = local_token_mask(q.shape[2], num_sinks=num_sinks, window=window, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def sparse_prefill_reference(q, k, v, q_idx, k_idx, prompt_len, ret_heads, loc_heads, *, top_p: float, block: int,
                             num_sinks: int, window: int, ret_window: int, scale: float | None = None,
                             return_selection: bool = False):
    """q: [P, Hq, S, D]; k, v: [P, Hkv, S, D]; q_idx, k_idx: [P, H_ret, S, r]. Returns [P, Hq, S, D]."""
    P, Hq, S, D = q.shape
    Hr, Hl = int(ret_heads.numel()), int(loc_heads.numel())
    Hkv = Hr + Hl
    qpk = Hq // Hkv
    q5 = q.view(P, Hkv, qpk, S, D)
    out = q.new_zeros(P, Hkv, qpk, S, D)
    selection = None
    if Hr:
        sel = retrieval_selection_reference(prefill_block_scores_reference(q_idx, k_idx, prompt_len, block),
                                            prompt_len, top_p=top_p, block=block, num_sinks=num_sinks,
                                            ret_window=ret_window)
        selection = sel
        tok = sel.repeat_interleave(block, 2).repeat_interleave(block, 3)[:, :, :S, :S]
        i = torch.arange(S, device=q.device)
        mask = tok & (i[None, :] <= i[:, None])  # [P, Hr, S, S]
        o = F.scaled_dot_product_attention(q5[:, ret_heads], k[:, ret_heads, None], v[:, ret_heads, None],
                                           attn_mask=mask[:, :, None], scale=scale)
        out = out.index_copy(1, ret_heads, o)
    if Hl:
        mask = local_token_mask(S, num_sinks=num_sinks, window=window, device=q.device)
        o = F.scaled_dot_product_attention(q5[:, loc_heads], k[:, loc_heads, None], v[:, loc_heads, None],
                                           attn_mask=mask, scale=scale)
        out = out.index_copy(1, loc_heads, o)
    out = out.view(P, Hq, S, D)
    return (out, selection) if return_selection else out

"""Eager PyTorch oracle for decode attention over a two-level (prefix slot + generation slot) cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def decode_attention_reference(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    gen_k: torch.Tensor,
    gen_v: torch.Tensor,
    row_slot: torch.Tensor,
    prefix_slot: torch.Tensor,
    prefix_len: torch.Tensor,
    cached_len: torch.Tensor,
    scale: float | None = None,
    window: int | None = None,
    sink: int = 0,
) -> torch.Tensor:
    """Attention of ``T`` new tokens per row over its prompt prefix and generated tokens (with ``window``:
    only over the first ``sink`` positions and the last ``window`` ones, counted up to the last new token).

    q: [A, Hq, T, D]; prefix_k/v: [P, Hkv, Lp, D]; gen_k/v: [R, Hkv, Lg, D] (the new tokens' K/V
    already written at ``cached_len .. cached_len+T-1``). Index tensors [A] int64. Returns [A, Hq, T, D].
    Gathers the rows' caches (a copy): the readable oracle, not the fast path.
    """
    A, Hq, T, D = q.shape
    Lp, Lg = prefix_k.shape[2], gen_k.shape[2]
    k = torch.cat([prefix_k[prefix_slot], gen_k[row_slot]], dim=2)  # [A, Hkv, Lp+Lg, D]
    v = torch.cat([prefix_v[prefix_slot], gen_v[row_slot]], dim=2)
    j = torch.arange(Lp + Lg, device=q.device)
    t = torch.arange(T, device=q.device)
    in_prefix = (j[None, :] < prefix_len[:, None])[:, None, :]  # [A, 1, L]
    gen_j = (j - Lp)[None, None, :]
    in_gen = (j[None, None, :] >= Lp) & (gen_j <= cached_len[:, None, None] + t[None, :, None])  # [A, T, L]
    mask = in_prefix | in_gen  # [A, T, L]
    if window is not None:
        pos = torch.where(j[None, :] < Lp, j[None, :], prefix_len[:, None] + j[None, :] - Lp)  # [A, L]
        w_lo = (prefix_len + cached_len + T - window).clamp(min=0)[:, None]
        mask = mask & ((pos >= w_lo) | (pos < torch.clamp(w_lo, max=sink)))[:, None, :]
    mask = mask[:, None]  # [A, 1, T, L]
    out = F.scaled_dot_product_attention(
        q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=Hq != k.shape[1]
    )
    return out

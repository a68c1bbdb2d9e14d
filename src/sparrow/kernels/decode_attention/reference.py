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


# -- shared-prefix ("cascade") decode: a prefix state, a suffix state, one exact merge -----------------------------

def attention_state(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of ``q`` over the visible keys, with its log-sum-exp: the state two attentions over
    disjoint key sets merge by (:func:`merge_states`).

    q: [A, H, M, D]; k, v: [A, H, N, D]; visible: bool broadcastable to [A, H, M, N]. Returns ``(o, lse)``:
    o [A, H, M, D] float32 (zeros where nothing is visible), lse [A, H, M] float32, natural log (``-inf``
    where nothing is visible).
    """
    s = torch.einsum("ahmd,ahnd->ahmn", q.float(), k.float()) * scale
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])  # 0 where not visible
    return torch.einsum("ahmn,ahnd->ahmd", p, v.float()), lse


def merge_states(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
                 lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention over the union of two disjoint key sets from the attentions over each: the outputs weighted
    by ``exp(lse_i - lse)``, ``lse = logaddexp(lse1, lse2)``. An empty side (``lse = -inf``) contributes
    nothing; both empty give zeros. o: [..., D], lse: [...]."""
    lse = torch.logaddexp(lse1, lse2)
    safe = torch.where(torch.isfinite(lse), lse, 0.0)
    w1 = torch.exp(lse1 - safe).nan_to_num(0.0)[..., None]
    w2 = torch.exp(lse2 - safe).nan_to_num(0.0)[..., None]
    return w1 * o1 + w2 * o2, lse


def _grouped(q: torch.Tensor, hkv: int) -> torch.Tensor:
    """[A, Hq, T, D] -> [A, Hkv, q_per_kv * T, D] (query ``m = g * T + t`` of kv head ``h`` is head ``h * q_per_kv
    + g``, token ``t``)."""
    A, Hq, T, D = q.shape
    return q.reshape(A, hkv, (Hq // hkv) * T, D)


def cascade_states(q, prefix_k, prefix_v, gen_k, gen_v, row_slot, prefix_slot, prefix_len, cached_len,
                   scale: float | None = None, window: int | None = None, sink: int = 0):
    """The two partial states of :func:`cascade_decode_attention_reference`: ``(o, lse)`` over each row's prompt
    and over its generated tokens, [A, Hkv, q_per_kv * T, D] / [A, Hkv, q_per_kv * T] (see :func:`_grouped`).
    Visibility as :func:`decode_attention_reference`."""
    A, _, T, D = q.shape
    hkv, Lp, Lg = prefix_k.shape[1], prefix_k.shape[2], gen_k.shape[2]
    scale = scale if scale is not None else D ** -0.5
    qg = _grouped(q, hkv)
    t = torch.arange(qg.shape[2], device=q.device) % T  # token of each grouped query
    total = prefix_len + cached_len + T
    lo = (total - window).clamp(min=0) if window is not None else torch.zeros_like(total)
    n_sink = lo.clamp(max=sink)

    def sees(pos):  # pos [A, N] absolute positions -> [A, 1, 1, N]: inside the row's sinks or window
        return ((pos < n_sink[:, None]) | (pos >= lo[:, None]))[:, None, None, :]

    jp = torch.arange(Lp, device=q.device)[None, :].expand(A, Lp)
    vis_p = sees(jp) & (jp < prefix_len[:, None])[:, None, None, :]
    state_p = attention_state(qg, prefix_k[prefix_slot], prefix_v[prefix_slot], vis_p, scale)
    g = torch.arange(Lg, device=q.device)
    causal = g[None, None, :] <= cached_len[:, None, None] + t[None, :, None]  # [A, M, Lg]
    vis_g = sees(prefix_len[:, None] + g[None, :]) & causal[:, None]
    state_g = attention_state(qg, gen_k[row_slot], gen_v[row_slot], vis_g, scale)
    return state_p, state_g


def cascade_decode_attention_reference(q, prefix_k, prefix_v, gen_k, gen_v, row_slot, prefix_slot, prefix_len,
                                       cached_len, scale: float | None = None, window: int | None = None,
                                       sink: int = 0) -> torch.Tensor:
    """Decode attention computed the cascade way: each row's attention over its prompt and over its own
    generated tokens as two softmax states, merged exactly by their log-sum-exps. Same arguments, visibility and
    result as :func:`decode_attention_reference` (the prompt part is the same for every row of a GRPO group;
    which rows share it only changes what a kernel reads, not the result). Returns [A, Hq, T, D] in ``q.dtype``."""
    (op, lp), (og, lg) = cascade_states(q, prefix_k, prefix_v, gen_k, gen_v, row_slot, prefix_slot, prefix_len,
                                        cached_len, scale, window, sink)
    o, _ = merge_states(op, lp, og, lg)
    return o.reshape(q.shape).to(q.dtype)


def local_states(q, prefix_lk, prefix_lv, gen_lk, gen_lv, row_slot, prefix_slot, prefix_len, cached_len, *,
                 num_sinks: int, window: int, scale: float | None = None):
    """The two partial states of :func:`cascade_local_attention_reference`, as :func:`cascade_states`."""
    A, _, T, D = q.shape
    hl, S = prefix_lk.shape[1], num_sinks
    Wp, Wg = prefix_lk.shape[2] - S, gen_lk.shape[2]
    scale = scale if scale is not None else D ** -0.5
    qg = _grouped(q, hl)
    t = torch.arange(qg.shape[2], device=q.device) % T
    pos_q = (prefix_len + cached_len)[:, None] + t[None, :]  # [A, M] position of each query
    q_lo = (pos_q - window + 1)[:, None, :, None]  # [A, 1, M, 1] the query's window starts here
    s_eff = prefix_len.clamp(max=S)[:, None]  # [A, 1] sinks: prompt tokens only
    # the prompt's keys: sinks (index i = position i), then the ring (index S + i holds position j = i mod Wp,
    # the latest one below the prompt's length)
    i = torch.arange(Wp, device=q.device)[None, :]
    ring_pos = prefix_len[:, None] - 1 - (prefix_len[:, None] - 1 - i) % Wp  # [A, Wp]
    pos_p = torch.cat([torch.arange(S, device=q.device)[None, :].expand(A, S), ring_pos], 1)  # [A, S + Wp]
    is_sink = torch.arange(S + Wp, device=q.device)[None, :] < S
    vis_p = torch.where(is_sink, pos_p < s_eff, (pos_p >= s_eff) & (pos_p >= 0))[:, None, None, :]
    vis_p = vis_p & (is_sink[:, None, None, :] | (pos_p[:, None, None, :] >= q_lo))
    state_p = attention_state(qg, prefix_lk[prefix_slot], prefix_lv[prefix_slot], vis_p, scale)
    # the row's ring: index i holds the latest generated index g = i mod Wg written so far
    last = (cached_len + T - 1)[:, None]
    g = last - (last - torch.arange(Wg, device=q.device)[None, :]) % Wg  # [A, Wg]
    causal = g[:, None, :] <= (cached_len[:, None] + t[None, :])[:, :, None]  # [A, M, Wg]
    vis_g = ((g >= 0)[:, None, :] & causal)[:, None] & ((prefix_len[:, None] + g)[:, None, None, :] >= q_lo)
    state_g = attention_state(qg, gen_lk[row_slot], gen_lv[row_slot], vis_g, scale)
    return state_p, state_g


def cascade_local_attention_reference(q, prefix_lk, prefix_lv, gen_lk, gen_lv, row_slot, prefix_slot, prefix_len,
                                      cached_len, *, num_sinks: int, window: int,
                                      scale: float | None = None) -> torch.Tensor:
    """RTPurbo's local-head attention (the first ``min(num_sinks, prefix_len)`` prompt tokens and the ``window``
    positions up to each query, read from ring buffers; see :mod:`sparrow.kernels.sparse_decode.reference`)
    computed the cascade way: a prompt state and a generated-tokens state per row, merged by log-sum-exp.

    q: [A, Hq, T, D] (the local heads' queries, grouped by local kv head); prefix_lk/lv: [P, H_loc, S + Wp, D];
    gen_lk/lv: [R, H_loc, Wg, D]. Returns [A, Hq, T, D] in ``q.dtype``."""
    (op, lp), (og, lg) = local_states(q, prefix_lk, prefix_lv, gen_lk, gen_lv, row_slot, prefix_slot, prefix_len,
                                      cached_len, num_sinks=num_sinks, window=window, scale=scale)
    o, _ = merge_states(op, lp, og, lg)
    return o.reshape(q.shape).to(q.dtype)

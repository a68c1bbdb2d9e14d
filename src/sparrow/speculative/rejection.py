"""Exact speculative (rejection) sampling, batched with per-row acceptance.

For each row the drafter proposed ``k`` tokens ``d_1..d_k``, token ``d_i`` drawn from the processed draft
distribution ``q_i``; the target scored the same positions plus one more, giving ``p_1..p_{k+1}``. Walking
left to right, ``d_i`` is accepted with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first rejection
``j`` a replacement is drawn from the normalised residual ``(p_j - q_j)+`` and the row stops there; when all
``k`` are accepted a bonus token is drawn from ``p_{k+1}``. Every emitted token then follows the target
distribution exactly: ``P(x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) (p(x) - q(x))+ / Z
= min(p, q)(x) + (p - q)+(x) = p(x)``.

:func:`rejection_sample` is the standalone API (explicit probabilities, optional ``torch.Generator``).
:func:`accept_counter_based` is the engine's variant: it takes the target's processed log-probabilities
and draws its uniforms from the engine's counter-based noise, so runs are seeded, reproducible and
batch-invariant. Both use :func:`acceptance_probability` and :func:`residual_distribution`, which the
exactness tests check analytically.
"""

from __future__ import annotations

import torch

from sparrow.sampling import uniform_noise, vocab_argmax

# salts of the counter-based noise streams (the autoregressive path uses salt 0)
DRAFT_SALT = 0x3C6EF372
ACCEPT_SALT = 0x1B873593
FINAL_SALT = 0x68E31DA4


def acceptance_probability(target_p: torch.Tensor, draft_q: torch.Tensor) -> torch.Tensor:
    """``min(1, p / q)`` elementwise (tokens the draft gives zero probability are never proposed; for
    them the value is 1 where ``p > 0``). Any matching shapes, floating point."""
    ratio = target_p / draft_q.clamp_min(torch.finfo(draft_q.dtype).tiny)
    return ratio.clamp(max=1.0)


def residual_distribution(target_p: torch.Tensor, draft_q: torch.Tensor) -> torch.Tensor:
    """Normalised ``(p - q)+`` over the last dim; ``p`` itself where the residual has no mass (then
    rejection has probability zero, so the choice never matters). Shapes ``[..., V]``."""
    r = (target_p - draft_q).clamp_min(0.0)
    mass = r.sum(-1, keepdim=True)
    return torch.where(mass > 0, r / mass.clamp_min(torch.finfo(r.dtype).tiny), target_p)


def _first_rejection(accepted: torch.Tensor) -> torch.Tensor:
    """accepted: [B, k] bool -> [B] int64 number of leading accepted drafts (``k`` if all)."""
    return accepted.long().cumprod(-1).sum(-1)


def _final_distribution(target_p: torch.Tensor, draft_q: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """[B, V] distribution of the token emitted at position ``j`` [B]: the residual at a rejection
    (``j < k``), the target itself for the bonus token (``j == k``)."""
    B, k1, V = target_p.shape
    k = k1 - 1
    p_j = target_p.gather(1, j.view(B, 1, 1).expand(B, 1, V)).squeeze(1)
    if k == 0:
        return p_j
    q_j = draft_q.gather(1, j.clamp(max=k - 1).view(B, 1, 1).expand(B, 1, V)).squeeze(1)
    q_j = q_j * (j < k).to(q_j.dtype)[:, None]  # bonus position: residual against q = 0 is p
    return residual_distribution(p_j, q_j)


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched exact speculative sampling with per-row acceptance.

    Args:
        draft_tokens: [B, k] int64 proposed tokens, ``draft_tokens[b, i]`` drawn from ``draft_probs[b, i]``.
        draft_probs: [B, k, V] float processed draft probabilities (temperature / top-k / top-p applied).
        target_probs: [B, k + 1, V] float processed target probabilities at the same positions plus the
            bonus position, with the same processing as the draft.
        generator: optional ``torch.Generator`` (on the tensors' device) for the uniforms.

    Returns:
        ``(tokens, num_emitted)``: tokens [B, k + 1] int64, the accepted drafts followed by the residual or
        bonus token, padded with ``-1``; num_emitted [B] int64 in ``[1, k + 1]``. An empty batch (``B == 0``)
        gives empty results.

    Raises:
        ValueError: inconsistent shapes, non-floating probabilities, or draft tokens outside ``[0, V)``.
    """
    if draft_tokens.dim() != 2 or draft_probs.dim() != 3 or target_probs.dim() != 3:
        raise ValueError(
            f"expected draft_tokens [B,k], draft_probs [B,k,V], target_probs [B,k+1,V]; got "
            f"{tuple(draft_tokens.shape)}, {tuple(draft_probs.shape)}, {tuple(target_probs.shape)}")
    B, k = draft_tokens.shape
    V = target_probs.shape[-1]
    if draft_probs.shape != (B, k, V) or target_probs.shape != (B, k + 1, V):
        raise ValueError(
            f"shapes do not match: draft_tokens {tuple(draft_tokens.shape)} needs draft_probs {(B, k, V)} "
            f"and target_probs {(B, k + 1, V)}; got {tuple(draft_probs.shape)}, {tuple(target_probs.shape)}")
    if not (draft_probs.is_floating_point() and target_probs.is_floating_point()):
        raise ValueError("draft_probs and target_probs must be floating point")
    if draft_tokens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"draft_tokens must be an integer tensor, got {draft_tokens.dtype}")
    if draft_tokens.numel() and (int(draft_tokens.min()) < 0 or int(draft_tokens.max()) >= V):
        raise ValueError(f"draft_tokens must lie in [0, {V})")
    draft_tokens = draft_tokens.long()
    if B == 0:
        return draft_tokens.new_zeros((0, k + 1)), draft_tokens.new_zeros((0,))
    dtype = torch.promote_types(draft_probs.dtype, target_probs.dtype)
    p, q = target_probs.to(dtype), draft_probs.to(dtype)
    u = torch.rand((B, k), generator=generator, device=p.device, dtype=dtype)
    p_d = p[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
    q_d = q.gather(-1, draft_tokens[..., None]).squeeze(-1)
    j = _first_rejection(u < acceptance_probability(p_d, q_d))
    final = torch.multinomial(_final_distribution(p, q, j), 1, generator=generator).squeeze(-1)
    pos = torch.arange(k + 1, device=p.device)[None, :]
    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(B, 1)], dim=1)
    tokens = torch.where(pos == j[:, None], final[:, None], tokens)
    tokens = torch.where(pos > j[:, None], torch.full_like(tokens, -1), tokens)
    return tokens, j + 1


def accept_counter_based(
    target_logprobs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    keys: torch.Tensor,
    greedy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's rejection step: shape-static, no host sync, counter-based noise.

    Args:
        target_logprobs: [A, k + 1, V] float32 processed target log-probabilities.
        draft_tokens: [A, k] int64. draft_probs: [A, k, V] float32 (unused, may be None, when ``greedy``).
        keys: [A, k + 1] int64 noise keys of the ``k + 1`` output positions
            (:func:`sparrow.sampling.row_keys`); acceptance uniforms use ``ACCEPT_SALT`` and the
            residual / bonus draw uses ``FINAL_SALT``.
        greedy: temperature 0: a draft is accepted iff it is the target's argmax, and the emitted token at
            the first mismatch is the target's argmax (exactly autoregressive greedy decoding).

    Returns:
        ``(tokens, num_accepted)``: tokens [A, k + 1] int64 whose first ``num_accepted + 1`` entries are the
        emitted tokens (entries after them are unspecified); num_accepted [A] int64 in ``[0, k]``.
    """
    A, k1, V = target_logprobs.shape
    k = k1 - 1
    if greedy:
        best = vocab_argmax(target_logprobs)  # [A, k + 1]
        j = _first_rejection(draft_tokens == best[:, :k])
        final = best.gather(1, j[:, None]).squeeze(1)
    else:
        p = target_logprobs.exp()
        p_d = p[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
        q_d = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
        u = uniform_noise(keys[:, :k], 1, ACCEPT_SALT)[..., 0]
        j = _first_rejection(u < acceptance_probability(p_d, q_d))
        dist = _final_distribution(p, draft_probs, j)
        key_j = keys.gather(1, j[:, None]).squeeze(1)
        gumbel = -torch.log(-torch.log(uniform_noise(key_j, V, FINAL_SALT)))
        final = vocab_argmax(torch.log(dist) + gumbel)
    pos = torch.arange(k1, device=target_logprobs.device)[None, :]
    tokens = torch.cat([draft_tokens, draft_tokens.new_zeros(A, 1)], dim=1)
    tokens = torch.where(pos == j[:, None], final[:, None], tokens)
    return tokens, j

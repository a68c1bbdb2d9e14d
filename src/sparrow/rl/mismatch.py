"""Per-token agreement between the rollout's and the trainer's distributions, and its lower tail.

A sparse (or quantized, or stale) rollout samples ``y_t`` from ``mu`` while the trainer scores it under ``pi``.
Most tokens agree; training instability comes from the few that do not, so the statistic to watch is a low
quantile of the per-token agreement, not its mean (Taming Sparse Rollout: a 5th percentile held at or above 0.86
kept sparse-rollout RL of Qwen3 1.7B-14B stable). Their per-token measure compares the two distributions over the
vocabulary (one minus the total variation, ``sum_v min(mu_v, pi_v)``); the rollout engine records only the sampled
token's log-probability, so Sparrow uses its single-sample estimate

    a_t = min(1, pi(y_t) / mu(y_t)) = exp(min(0, log pi(y_t) - log mu(y_t)))

the probability that a token drawn from the rollout would be accepted by rejection sampling against the trainer.
Since ``y_t ~ mu``, ``E[a_t] = sum_v min(mu_v, pi_v)``: the mean of ``a_t`` is unbiased for the mean overlap, and
its distribution is a mean-preserving spread of the overlaps (a single draw adds noise), so its low quantiles sit
at or below theirs — a threshold on them is conservative. ``a_t`` is 1 where the trainer gives the token at least
the rollout's probability and 0 for a token outside the trainer's support (``log pi = -inf``).

:func:`tail_agreement` is the step's statistic (device ops only: no host sync, cheap enough for every step);
:func:`tail_agreement_by` breaks it down by an integer key (e.g. the policy version a partial rollout's tokens were
sampled at) and returns host floats.
"""

from __future__ import annotations

import torch

__all__ = ["tail_agreement", "tail_agreement_by", "token_agreement"]


def _check(rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor, q: float) -> None:
    if rollout_logprobs.shape != trainer_logprobs.shape or mask.shape != rollout_logprobs.shape:
        raise ValueError(f"rollout_logprobs, trainer_logprobs and mask must have one shape, got "
                         f"{tuple(rollout_logprobs.shape)}, {tuple(trainer_logprobs.shape)}, {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor, got {mask.dtype}")
    if not rollout_logprobs.is_floating_point() or not trainer_logprobs.is_floating_point():
        raise ValueError(f"log-probabilities must be floating point, got {rollout_logprobs.dtype} and "
                         f"{trainer_logprobs.dtype}")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")


def token_agreement(rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor) -> torch.Tensor:
    """``a_t = min(1, exp(trainer - rollout))`` elementwise, float32 (module docstring). A token the rollout gave
    probability 0 (``-inf``, never sampled) counts as agreeing."""
    d = trainer_logprobs.float() - rollout_logprobs.float()
    return torch.exp(d.nan_to_num(nan=0.0, neginf=float("-inf")).clamp(max=0.0))


def _quantile(values: torch.Tensor, mask: torch.Tensor, q: float) -> torch.Tensor:
    """The ``q`` quantile of ``values[mask]`` (linear interpolation, as ``torch.quantile``), NaN when nothing is
    selected; sorts the whole tensor with the unselected entries pushed past every value, so no shape depends on
    the data and nothing is read back."""
    if values.numel() == 0:  # a static shape: no branch on data
        return torch.full((), float("nan"), dtype=values.dtype, device=values.device)
    flat = torch.where(mask, values, torch.full_like(values, float("inf"))).flatten()
    ordered = torch.sort(flat).values
    n = mask.sum()
    pos = (n - 1).clamp_min(0).to(torch.float64) * q
    lo = pos.floor().long()
    hi = torch.minimum(lo + 1, (n - 1).clamp_min(0))
    frac = (pos - lo).to(values.dtype)
    a, b = ordered.gather(0, lo.view(1))[0], ordered.gather(0, hi.view(1))[0]  # gathers: no index read back
    out = a + (b - a) * frac
    return torch.where(n > 0, out, torch.full_like(out, float("nan")))


def tail_agreement(rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor,
                   q: float = 0.05) -> torch.Tensor:
    """The ``q`` quantile of the per-token agreement over the response tokens of a step.

    Args:
        rollout_logprobs: [N, L] (any shape) log-probabilities of the sampled tokens under the rollout's
            distribution (the engine's behaviour log-probs).
        trainer_logprobs: the same tokens under the trainer's distribution (``pi_old``), same shape.
        mask: bool, same shape: the response tokens (padding excluded).
        q: the quantile, in [0, 1] (0.05: the 5th percentile).

    Returns: a 0-dim float32 tensor on the inputs' device (NaN when ``mask`` selects nothing); no host sync.

    Raises: ValueError on mismatched shapes, a non-bool mask, integer log-probs or ``q`` outside [0, 1].
    """
    _check(rollout_logprobs, trainer_logprobs, mask, q)
    return _quantile(token_agreement(rollout_logprobs, trainer_logprobs), mask, q)


def tail_agreement_by(key: torch.Tensor, rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor,
                      mask: torch.Tensor, q: float = 0.05) -> dict[int, float]:
    """:func:`tail_agreement` per value of an integer ``key``: ``{key value: quantile}`` over the masked tokens
    that carry it (e.g. the weight version a partial rollout sampled each token at, for a breakdown by age).

    ``key`` has the log-probs' shape, or their leading dimensions (one key per row, [N] for [N, L]). Keys with no
    masked token are left out. Reads the result back to the host (one sync for the keys, one for the values).

    Raises: ValueError as :func:`tail_agreement`, on a non-integer key or one whose shape does not lead the
    log-probs'.
    """
    _check(rollout_logprobs, trainer_logprobs, mask, q)
    if key.is_floating_point() or key.dtype == torch.bool:
        raise ValueError(f"key must be an integer tensor, got {key.dtype}")
    if key.shape != mask.shape[:key.dim()]:
        raise ValueError(f"key shape {tuple(key.shape)} must lead the log-probs' shape {tuple(mask.shape)}")
    key = key.reshape(key.shape + (1,) * (mask.dim() - key.dim())).expand(mask.shape)
    a = token_agreement(rollout_logprobs, trainer_logprobs)
    values = torch.unique(key[mask]).tolist()  # the one data-dependent shape: host side by design
    if not values:
        return {}
    tails = torch.stack([_quantile(a, mask & (key == v), q) for v in values])
    return dict(zip((int(v) for v in values), tails.tolist()))

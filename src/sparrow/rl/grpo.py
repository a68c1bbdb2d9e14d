"""GRPO: group-normalised advantages, the clipped policy loss, loss aggregation, KL terms and the
truncated importance-sampling correction for the rollout/trainer mismatch.

Notation, per response token ``t`` of sequence ``i``:

* ``logp``  — log π_θ(y_t | ...), the policy being optimised (with gradient);
* ``old``   — log π_old, the trainer's policy when the batch was sampled (dense attention, no grad);
* ``behav`` — log μ, the behaviour policy the rollout engine actually sampled from (bf16 copy,
  sparse attention, speculative decoding...): what the engine reports per token.

The policy-gradient term uses the PPO ratio π_θ/π_old with separate low/high clipping; the mismatch
between μ and π_old is corrected by the truncated importance weight w = π_old/μ (per token, or per
sequence as a product), either clipped at ``C`` (``truncate``) or dropped above ``C`` (``mask``).

All three are log-probs of the *processed* distribution (vocabulary limit, temperature, top-k, top-p), so a
sampled token can lie outside π_old's support: top-p / top-k under the trainer's weights drop a token that the
rollout copy's nucleus held. Its importance weight π_old/μ is exactly 0, so such a token carries no loss; the
fraction is logged (``outside_support_frac``).

Partial rollout (tokens of one sequence sampled by several policy versions, the older ones stale): ``behav`` holds,
per token, the log-prob under the version that sampled it, and π_old is the proximal policy of the decoupled PPO
objective: the trust region is taken around π_old (the ratio π_θ/π_old) while w = π_old/μ, per token, corrects
for the sampling having been done by older (and sparser) policies. This is the loss above, unchanged; what grows
with staleness is the spread of w, which :class:`StalenessStats` breaks down by version age.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_sum_constant"]


@dataclass(frozen=True)
class GRPOConfig:
    """Loss configuration (validated on construction).

    Attributes:
        clip_low, clip_high: the ratio is clipped to ``[1 - clip_low, 1 + clip_high]``.
        aggregation: ``token_mean`` (all tokens of the minibatch weigh the same),
            ``seq_mean_token_mean`` (mean over sequences of each sequence's token mean) or
            ``seq_sum_constant`` (Dr. GRPO: token sum divided by sequences x ``max_response_len``).
        max_response_len: the constant of ``seq_sum_constant`` (required for it).
        advantage_scale: ``group`` divides by the group's reward std; ``none`` only centres.
        kl_beta: weight of the k3 KL to a frozen reference policy (0 disables it; no reference is kept).
        is_level: ``token``, ``sequence`` or ``none`` (no mismatch correction).
        is_threshold: ``C`` of the truncated importance weight.
        is_mode: ``truncate`` (w = min(w, C)) or ``mask`` (w = 0 where w > C).
    """

    clip_low: float = 0.2
    clip_high: float = 0.28
    aggregation: Aggregation = "token_mean"
    max_response_len: int | None = None
    advantage_scale: Literal["group", "none"] = "group"
    kl_beta: float = 0.0
    is_level: Literal["token", "sequence", "none"] = "token"
    is_threshold: float = 2.0
    is_mode: Literal["truncate", "mask"] = "truncate"

    def __post_init__(self) -> None:
        if not (0 <= self.clip_low < 1) or self.clip_high < 0:
            raise ValueError(f"clip_low must be in [0, 1) and clip_high >= 0, got {self.clip_low}, {self.clip_high}")
        if self.aggregation not in ("token_mean", "seq_mean_token_mean", "seq_sum_constant"):
            raise ValueError(f"unknown aggregation {self.aggregation!r}; expected token_mean, "
                             "seq_mean_token_mean or seq_sum_constant")
        if self.aggregation == "seq_sum_constant" and not self.max_response_len:
            raise ValueError("aggregation 'seq_sum_constant' needs max_response_len")
        if self.advantage_scale not in ("group", "none"):
            raise ValueError(f"advantage_scale must be 'group' or 'none', got {self.advantage_scale!r}")
        if self.kl_beta < 0:
            raise ValueError(f"kl_beta must be >= 0, got {self.kl_beta}")
        if self.is_level not in ("token", "sequence", "none"):
            raise ValueError(f"is_level must be token, sequence or none, got {self.is_level!r}")
        if self.is_threshold < 1:
            raise ValueError(f"is_threshold must be >= 1, got {self.is_threshold}")
        if self.is_mode not in ("truncate", "mask"):
            raise ValueError(f"is_mode must be 'truncate' or 'mask', got {self.is_mode!r}")


def group_advantages(rewards: torch.Tensor, scale: str = "group", eps: float = 1e-6) -> torch.Tensor:
    """rewards: [P, G] (G samples of each of P prompts) -> advantages [P, G]."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [prompts, group], got shape {tuple(rewards.shape)}")
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == "none":
        return centred
    if scale == "group":
        return centred / (rewards.std(dim=1, keepdim=True, unbiased=False) + eps)
    raise ValueError(f"scale must be 'group' or 'none', got {scale!r}")


def aggregation_weights(mask: torch.Tensor, cfg: GRPOConfig) -> torch.Tensor:
    """Per-token weights [N, L] that turn per-token losses into the minibatch loss (sum of weight x loss).

    Computed once per minibatch so micro-batches of it accumulate to exactly the same loss.
    """
    m = mask.float()
    n_seq = max(1, int((m.sum(1) > 0).sum()))
    if cfg.aggregation == "token_mean":
        return m / m.sum().clamp_min(1.0)
    if cfg.aggregation == "seq_mean_token_mean":
        return m / (m.sum(1, keepdim=True).clamp_min(1.0) * n_seq)
    return m / (n_seq * float(cfg.max_response_len))


def importance_weights(old: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor, cfg: GRPOConfig):
    """Truncated IS weights w = π_old/μ [N, L] and the fraction of tokens (or sequences) above C."""
    log_ratio = (old - behav).masked_fill(~mask, 0.0)
    if cfg.is_level == "none":
        return torch.ones_like(old), old.new_zeros(())
    if cfg.is_level == "sequence":
        w = log_ratio.sum(1, keepdim=True).clamp(max=60.0).exp().expand_as(old)
        over = w[:, 0] > cfg.is_threshold
        frac = over.float().mean() if len(over) else old.new_zeros(())
    else:
        w = log_ratio.clamp(max=60.0).exp()
        over_t = (w > cfg.is_threshold) & mask
        frac = over_t.sum() / mask.sum().clamp_min(1)
    w = w.clamp(max=cfg.is_threshold) if cfg.is_mode == "truncate" else w * (w <= cfg.is_threshold)
    return w.detach(), frac


def grpo_loss(
    logp: torch.Tensor,
    old: torch.Tensor,
    behav: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    weights: torch.Tensor,
    cfg: GRPOConfig,
    ref: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO loss of one (micro-)batch.

    Args:
        logp: [N, L] log-probs of the response tokens under the policy being trained (with grad).
        old: [N, L] the same under π_old (no grad). behav: [N, L] the rollout engine's log-probs.
        advantages: [N] per sequence. mask: [N, L] bool, True on response tokens.
        weights: [N, L] from :func:`aggregation_weights` (over the whole minibatch).
        ref: [N, L] reference-policy log-probs, required when ``cfg.kl_beta > 0``.

    Returns: (loss, metrics) — metrics are detached scalars: ``policy_clip_frac``, ``is_clip_frac``,
    ``mismatch_kl`` (k3 estimate of KL(μ || π_old) per token, over the tokens inside π_old's support),
    ``outside_support_frac`` (tokens π_old gives probability 0: no loss, module docstring), ``ratio_mean``,
    ``kl_ref``.
    """
    if cfg.kl_beta > 0 and ref is None:
        raise ValueError("kl_beta > 0 needs reference log-probs")
    n_tok = mask.sum().clamp_min(1)
    outside = mask & ~torch.isfinite(old)
    mask = mask & ~outside  # importance weight 0: no loss, no gradient, no NaN from -inf - -inf
    n_in = mask.sum().clamp_min(1)
    log_ratio = (logp - old).masked_fill(~mask, 0.0)
    ratio = log_ratio.exp()
    adv = advantages[:, None].to(logp.dtype)
    clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    pg = -torch.minimum(ratio * adv, clipped * adv)
    w_is, is_frac = importance_weights(old, behav, mask, cfg)
    if cfg.is_level == "sequence":  # π_old(y) / μ(y) is 0 for a sequence with a token outside the support
        w_is = w_is * ~outside.any(1, keepdim=True)
    token_loss = torch.where(mask, pg * w_is, 0.0)
    kl_ref = logp.new_zeros(())
    if cfg.kl_beta > 0:
        d = (ref - logp).masked_fill(~mask, 0.0)
        k3 = d.exp() - d - 1.0
        token_loss = token_loss + cfg.kl_beta * k3
        kl_ref = (k3 * mask).sum().detach() / n_tok
    loss = (token_loss * weights).sum()
    with torch.no_grad():
        d = (old - behav).masked_fill(~mask, 0.0)
        metrics = {
            "policy_clip_frac": (((ratio - clipped).abs() > 0) & mask).sum() / n_in,
            "is_clip_frac": is_frac.detach(),
            "mismatch_kl": ((d.exp() - d - 1.0) * mask).sum() / n_in,
            "outside_support_frac": outside.sum() / n_tok,
            "ratio_mean": (ratio * mask).sum() / n_in,
            "kl_ref": kl_ref,
        }
    return loss, metrics


@dataclass
class StalenessStats:
    """Counts and sums over response tokens by version age ``k = 0 .. K-1`` (the version of π_old minus the
    version that sampled the token), on the device; add the stats of micro-batches, then read :meth:`metrics`.

    Attributes:
        tokens: [K] float64 response tokens of each age.
        over: [K] of those, tokens whose per-token weight π_old/μ exceeds ``is_threshold`` (truncated or masked
            by the loss with ``is_level: token``).
        outside: [K] tokens outside π_old's support (weight 0).
        kl: [K] sum over the tokens inside the support of the k3 estimate of KL(μ ‖ π_old).
    """

    tokens: torch.Tensor
    over: torch.Tensor
    outside: torch.Tensor
    kl: torch.Tensor

    @classmethod
    def of(cls, old: torch.Tensor, behav: torch.Tensor, mask: torch.Tensor, age: torch.Tensor, cfg: GRPOConfig,
           max_age: int) -> StalenessStats:
        """old, behav: [N, L] log π_old and log μ; mask: [N, L] bool response tokens; age: [N, L] integer version
        ages (read where ``mask``). No host sync.

        Raises:
            ValueError: mismatched shapes, a non-integer ``age`` or ``max_age`` < 0. Ages outside
                ``[0, max_age]`` are not checked here (that would read the device): they count in no bin.
        """
        if not old.shape == behav.shape == mask.shape == age.shape:
            raise ValueError(f"old, behav, mask and age must have one shape, got {tuple(old.shape)}, "
                             f"{tuple(behav.shape)}, {tuple(mask.shape)}, {tuple(age.shape)}")
        if age.is_floating_point() or age.dtype == torch.bool:
            raise ValueError(f"age must be an integer tensor, got {age.dtype}")
        if max_age < 0:
            raise ValueError(f"max_age must be >= 0, got {max_age}")
        sel = (mask & (age >= 0) & (age <= max_age)).flatten().double()  # the tokens binned
        idx = age.clamp(0, max_age).flatten()
        outside = ~torch.isfinite(old)
        d = (old - behav).masked_fill(~mask | outside, 0.0).flatten().double()
        over = (d.clamp(max=60.0).exp() > cfg.is_threshold).double()

        def binned(x: torch.Tensor) -> torch.Tensor:
            return torch.zeros(max_age + 1, dtype=torch.float64, device=old.device).index_add_(0, idx, x * sel)

        return cls(binned(torch.ones_like(sel)), binned(over), binned(outside.flatten().double()),
                   binned(d.exp() - d - 1.0))

    def __add__(self, other: StalenessStats) -> StalenessStats:
        return StalenessStats(self.tokens + other.tokens, self.over + other.over, self.outside + other.outside,
                              self.kl + other.kl)

    def as_tensor(self) -> torch.Tensor:
        """[4, K] float64 (tokens, over, outside, kl): one tensor to all-reduce or read back."""
        return torch.stack([self.tokens, self.over, self.outside, self.kl])

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> StalenessStats:
        return cls(*t.unbind(0))

    def metrics(self, prefix: str = "partial") -> dict[str, float]:
        """``{prefix}/staleness_<k>`` (fraction of the response tokens of age k), and for each age that has tokens
        ``{prefix}/is_clip_frac_age<k>`` and ``{prefix}/mismatch_kl_age<k>`` (as ``grpo_loss``'s, over those
        tokens). One read of the device."""
        tokens, over, outside, kl = self.as_tensor().tolist()
        total = sum(tokens)
        out = {}
        for k, n in enumerate(tokens):
            out[f"{prefix}/staleness_{k}"] = n / total if total else 0.0
            if n:
                out[f"{prefix}/is_clip_frac_age{k}"] = over[k] / n
                inside = n - outside[k]
                out[f"{prefix}/mismatch_kl_age{k}"] = kl[k] / inside if inside else 0.0
        return out

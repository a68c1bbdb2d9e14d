"""Interfaces of speculative decoding: :class:`Drafter` proposes, :class:`ToggleController` decides.

The engine asks the toggle, at each host synchronisation point (every ``sync_every`` decode steps), whether
to speculate over the next block of steps and with how many draft tokens; it reports back what was
proposed and accepted. A drafter proposes ``k`` tokens per active row and the *processed* probabilities
it drew them from; the target verifies all ``k + 1`` positions in one pass and
:func:`sparrow.speculative.rejection_sample` keeps a prefix, so the emitted tokens follow the target's
distribution exactly.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from sparrow.attention.base import DecodeMeta


class DraftContext(NamedTuple):
    """What a drafter sees for one proposal over ``A`` rows.

    last_tokens: [A] int64 — each row's last emitted token (its KV is not cached yet).
    caches:      the target's per-layer caches; a drafter that shares them writes its KV at the draft
                 positions, which the verify pass overwrites.
    meta:        DecodeMeta of the first draft position (``cached_len`` = tokens already cached).
    process:     maps logits [..., V] to the processed log-probabilities the target also uses
                 (temperature / top-k / top-p), so draft and target distributions are comparable.
    keys:        [A, k] int64 noise keys (see :func:`sparrow.rollout.sampling.row_keys`), one per draft
                 position, so drafts are reproducible and batch-invariant.
    greedy:      temperature 0: drafts are the draft model's argmax.
    """

    last_tokens: torch.Tensor
    caches: Any
    meta: DecodeMeta
    process: Callable[[torch.Tensor], torch.Tensor]
    keys: torch.Tensor
    greedy: bool = False

    def sample(self, logprobs: torch.Tensor, i: int) -> torch.Tensor:
        """Draw draft position ``i`` from processed log-probabilities [A, V] -> [A] int64 (Gumbel-max on the
        counter-based noise, with the draft stream's salt)."""
        from sparrow.rollout.sampling import gumbel_noise
        from sparrow.speculative.rejection import DRAFT_SALT

        if self.greedy:
            return torch.argmax(logprobs, dim=-1)
        return torch.argmax(logprobs + gumbel_noise(self.keys[:, i], logprobs.shape[-1], DRAFT_SALT), dim=-1)


class DraftProposal(NamedTuple):
    """tokens: [A, k] int64; probs: [A, k, V] float32 processed probabilities the tokens were drawn from."""

    tokens: torch.Tensor
    probs: torch.Tensor


class Drafter(abc.ABC):
    """A cheap model that proposes tokens for the target (policy) to verify.

    The engine drives a drafter one position at a time through :meth:`forward_logits` (each draft step is
    its own compiled, graph-captured step, so compile time does not grow with the draft length) and does the
    sampling itself; :meth:`propose` is the same loop for standalone use.
    """

    @abc.abstractmethod
    def refresh(self) -> None:
        """Rebuild from the target's current weights, in place (call after every weight sync)."""

    @abc.abstractmethod
    def forward_logits(self, tokens: torch.Tensor, caches: Any, meta: DecodeMeta) -> torch.Tensor:
        """Draft logits after feeding ``tokens`` [A, T] int64 at ``meta.cached_len`` -> [A, T, V] float32.

        Writes the tokens' KV into ``caches`` at the draft positions (the verify pass overwrites them).
        Runs inside compiled steps: no host sync, no data-dependent Python branching.
        """

    def propose(self, ctx: DraftContext, num_tokens: int) -> DraftProposal:
        """Propose ``num_tokens`` tokens per row (autoregressively through :meth:`forward_logits`)."""
        tok = ctx.last_tokens
        meta = ctx.meta
        tokens, probs = [], []
        for i in range(num_tokens):
            logprobs = ctx.process(self.forward_logits(tok[:, None], ctx.caches, meta)[:, 0])
            tok = ctx.sample(logprobs, i)
            tokens.append(tok)
            probs.append(logprobs.exp())
            meta = meta._replace(cached_len=meta.cached_len + 1)
        return DraftProposal(torch.stack(tokens, 1), torch.stack(probs, 1))


@dataclass(frozen=True)
class StepStats:
    """The decode state a toggle decides on (host-side numbers known at a sync point)."""

    active_rows: int
    mean_context: float
    max_context: int
    bucket: int | None = None  # the padded batch the next block runs at (None: same as active_rows)


@dataclass(frozen=True)
class SpecDecision:
    speculate: bool
    num_draft: int = 0

    def __post_init__(self) -> None:
        if self.num_draft < 0 or (self.speculate and self.num_draft == 0):
            raise ValueError(f"a speculative decision needs num_draft >= 1, got {self.num_draft}")


class ToggleController(abc.ABC):
    """Decides per block of decode steps whether to speculate, and with how many draft tokens."""

    @abc.abstractmethod
    def decide(self, stats: StepStats) -> SpecDecision:
        """Called at each sync point, before the next block of decode steps."""

    def observe(self, *, proposed: int, accepted: int, rows: int, seconds: float | None = None) -> None:
        """Feedback after a speculative block: draft tokens proposed and accepted over ``rows`` row-cycles."""

    def observe_block(self, stats: StepStats, *, num_draft: int, steps: int, seconds: float) -> None:
        """Feedback after every block, speculative (``num_draft`` > 0: ``steps`` cycles) or not (``steps``
        decode steps): its wall-clock ``seconds``, host sync included, on the rows ``stats`` describes."""

    def reset(self) -> None:
        """Forget measured acceptance (e.g. when a new rollout phase starts)."""

    def draft_lengths(self) -> tuple[int, ...]:
        """Every draft length :meth:`decide` can ask for: what :meth:`RolloutEngine.prepare` compiles ahead of
        the first generation. Default ``()``: a toggle that does not say has its cycles compiled at first use."""
        return ()


class AlwaysOff(ToggleController):
    """Never speculate: plain autoregressive decoding."""

    def decide(self, stats: StepStats) -> SpecDecision:
        return SpecDecision(False, 0)

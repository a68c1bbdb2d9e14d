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
    """

    last_tokens: torch.Tensor
    caches: Any
    meta: DecodeMeta
    process: Callable[[torch.Tensor], torch.Tensor]
    keys: torch.Tensor


class DraftProposal(NamedTuple):
    """tokens: [A, k] int64; probs: [A, k, V] float32 processed probabilities the tokens were drawn from."""

    tokens: torch.Tensor
    probs: torch.Tensor


class Drafter(abc.ABC):
    """A cheap model that proposes tokens for the target (policy) to verify."""

    @abc.abstractmethod
    def refresh(self) -> None:
        """Rebuild from the target's current weights, in place (call after every weight sync)."""

    @abc.abstractmethod
    def propose(self, ctx: DraftContext, num_tokens: int) -> DraftProposal:
        """Propose ``num_tokens`` tokens per row. Runs inside compiled steps: no host sync."""


@dataclass(frozen=True)
class StepStats:
    """The decode state a toggle decides on (host-side numbers known at a sync point)."""

    active_rows: int
    mean_context: float
    max_context: int


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

    def reset(self) -> None:
        """Forget measured acceptance (e.g. when a new rollout phase starts)."""


class AlwaysOff(ToggleController):
    """Never speculate: plain autoregressive decoding."""

    def decide(self, stats: StepStats) -> SpecDecision:
        return SpecDecision(False, 0)

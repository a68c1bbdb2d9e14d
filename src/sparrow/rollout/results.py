"""What the engine returns: :class:`Sample` (one sequence), :class:`Generation` (a call's samples and
:class:`GenerationStats`) and :class:`GroupProgress` (where an open group of a session stands)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Literal

import torch

FinishReason = Literal["stop", "length"]


@dataclass
class Sample:
    """One generated sequence.

    prompt_index: the prompt's index in :meth:`RolloutEngine.generate`'s list (in a :class:`RolloutSession`: its
        group id, the order it was added in). sample_index: the sample's index within its group.
    tokens: [L] int64 generated tokens (the stop token included when ``finish_reason == "stop"``).
    logprobs: [L] float32 log-probability of each token under the distribution it was sampled from (the weights
        of the version that sampled it).
    versions: [L] int32 the policy version that sampled each token (:meth:`RolloutEngine.set_policy_version`);
        None for samples not made by the engine.
    """

    prompt_index: int
    sample_index: int
    tokens: torch.Tensor
    logprobs: torch.Tensor
    finish_reason: FinishReason
    versions: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return int(self.tokens.numel())


@dataclass
class GenerationStats:
    """What one :meth:`RolloutEngine.generate` or :meth:`RolloutSession.run` call did: times, token counts and
    per-bucket histograms (each field commented where it is declared)."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    decode_steps: int = 0
    row_steps: int = 0  # sum over decode steps of the padded batch size
    active_hist: dict[int, int] = field(default_factory=dict)  # bucket -> steps run at that bucket
    # with a drafter (speculative path): a cycle is k draft steps + one verify step and counts as one step
    spec_cycles: int = 0  # cycles run (each over a padded batch)
    spec_row_cycles: int = 0  # sum over cycles of the live rows
    draft_proposed: int = 0  # draft tokens proposed to live rows
    draft_accepted: int = 0  # of those, accepted
    spec_hist: dict[int, int] = field(default_factory=dict)  # bucket -> speculative cycles at that bucket
    draft_len_hist: dict[int, int] = field(default_factory=dict)  # draft length -> cycles
    block_tokens: dict[int, int] = field(default_factory=dict)  # bucket -> tokens emitted in blocks at it
    block_time_s: dict[int, float] = field(default_factory=dict)  # bucket -> seconds of blocks at it
    apart_steps: int = 0  # steps (or cycles) run with the rows apart: too little sharing for the cascade

    def add_block(self, bucket: int, steps: int, tokens: int, seconds: float, *, apart: bool, num_draft: int = 0,
                  proposed: int = 0, accepted: int = 0, row_cycles: int = 0) -> None:
        """Count one decode block: ``steps`` steps (speculative cycles of ``num_draft`` drafts when it is > 0) at
        ``bucket`` rows, with the rows apart or not, that emitted ``tokens`` in ``seconds``; a speculative block's
        draft tokens ``proposed`` to live rows, of those ``accepted``, over ``row_cycles`` live row-cycles."""
        self.decode_steps += steps
        self.apart_steps += steps if apart else 0
        self.row_steps += steps * bucket
        self.active_hist[bucket] = self.active_hist.get(bucket, 0) + steps
        self.block_tokens[bucket] = self.block_tokens.get(bucket, 0) + tokens
        self.block_time_s[bucket] = self.block_time_s.get(bucket, 0.0) + seconds
        if num_draft:
            self.spec_cycles += steps
            self.spec_row_cycles += row_cycles
            self.draft_proposed += proposed
            self.draft_accepted += accepted
            self.spec_hist[bucket] = self.spec_hist.get(bucket, 0) + steps
            self.draft_len_hist[num_draft] = self.draft_len_hist.get(num_draft, 0) + steps

    @property
    def decode_tokens_per_s(self) -> float:
        return self.generated_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def __add__(self, other: GenerationStats) -> GenerationStats:
        """The stats of two calls together (sums; per-key sums of the histograms)."""
        out = {}
        for f in self.__dataclass_fields__:
            x, y = getattr(self, f), getattr(other, f)
            out[f] = ({k: x.get(k, 0) + y.get(k, 0) for k in sorted(x.keys() | y.keys())} if isinstance(x, dict)
                      else x + y)
        return GenerationStats(**out)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 when nothing was proposed)."""
        return self.draft_accepted / self.draft_proposed if self.draft_proposed else 0.0

    @property
    def tokens_per_cycle(self) -> float:
        """Mean tokens a live row emitted per speculative cycle, before stop / length truncation."""
        return 1.0 + self.draft_accepted / self.spec_row_cycles if self.spec_row_cycles else 0.0


@dataclass
class Generation:
    """Result of :meth:`RolloutEngine.generate` or :meth:`RolloutSession.run`: samples in prompt-major (group-major)
    order, plus the call's timing stats."""

    samples: list[Sample]
    stats: GenerationStats

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self) -> Iterator[Sample]:
        return iter(self.samples)

    def __getitem__(self, i: int) -> Sample:
        return self.samples[i]


@dataclass(frozen=True)
class GroupProgress:
    """Where one open group of a :class:`RolloutSession` stands.

    group: its id (groups are numbered in the order they were added, from 0). admitted_version: the policy version
    that prefilled its prompt and sampled its first tokens (None while it waits for slots). lengths: tokens each
    sample has emitted so far (0 while waiting; a finished sample keeps its final length).
    """

    group: int
    admitted_version: int | None
    lengths: tuple[int, ...]

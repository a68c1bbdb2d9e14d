"""Interfaces of speculative decoding: :class:`Drafter` proposes, :class:`ToggleController` decides, and a
:class:`StepTimer` (the rollout engine) is what the cost model measures.

The engine asks the toggle, at each block boundary (every ``block_steps`` decode steps, where the host reads the
block back), whether to speculate over the next block of steps and with how many draft tokens; it reports back
what was proposed and accepted. In a cycle the engine feeds the drafter one position at a time (its logits, processed
as the target's, give each draft token and the probability it was drawn with); the target verifies all
``k + 1`` positions in one pass and exact rejection sampling
(:func:`~sparrow.speculative.rejection.accept_counter_based`) keeps a prefix, so the emitted tokens follow the
target's distribution exactly.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
from torchtune.modules import TransformerDecoder

from sparrow.attention.base import DecodeMeta
from sparrow.compile_cache import CompileCache
from sparrow.sampling import SamplingParams

ProgramKind = Literal["decode", "draft", "cycle"]  # a plain step, one draft step, k draft steps and a verify step


class Drafter(abc.ABC):
    """A cheap model that proposes tokens for the target (policy) to verify.

    The engine drives a drafter one position at a time through :meth:`forward_logits` (each draft step is
    its own compiled, graph-captured step, so compile time does not grow with the draft length) and does the
    processing (the target's temperature / top-k / top-p / vocabulary limit) and the sampling itself, with a
    draft noise stream of its own; :meth:`refresh` follows the target's weights after a weight sync.
    """

    @abc.abstractmethod
    def refresh(self) -> None:
        """Rebuild from the target's current weights, in place (call after every weight sync)."""

    @abc.abstractmethod
    def forward_logits(self, tokens: torch.Tensor, caches: Any, meta: DecodeMeta) -> torch.Tensor:
        """Draft logits after feeding ``tokens`` [A, T] int64 at ``meta.cached_len`` -> [A, T, V] float32.

        Writes the tokens' KV into ``caches`` at the draft positions (the verify pass overwrites them).
        Runs inside compiled steps: no host read, no data-dependent Python branching.
        """


@dataclass(frozen=True)
class StepStats:
    """The decode state a toggle decides on (host-side numbers known at a block boundary)."""

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
        """Called at each block boundary, before the next block of decode steps."""

    def observe(self, *, proposed: int, accepted: int, rows: int, seconds: float | None = None) -> None:
        """Feedback after a speculative block: draft tokens proposed and accepted over ``rows`` row-cycles."""

    def observe_block(self, stats: StepStats, *, num_draft: int, steps: int, seconds: float) -> None:
        """Feedback after every block, speculative (``num_draft`` > 0: ``steps`` cycles) or not (``steps``
        decode steps): its wall-clock ``seconds``, host read included, on the rows ``stats`` describes."""

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


class TimerConfig(Protocol):
    """The options of a :class:`StepTimer` that a calibration reads (:class:`~sparrow.rollout.EngineConfig` has
    them)."""

    @property
    def buckets(self) -> tuple[int, ...]: ...

    @property
    def max_prompt_len(self) -> int: ...

    @property
    def max_new_tokens(self) -> int: ...

    @property
    def max_draft(self) -> int: ...

    @property
    def progress(self) -> bool: ...


class StepTimer(Protocol):
    """What :meth:`~sparrow.speculative.costs.CostModel.calibrate` measures: an engine that times its own compiled
    steps and names what they depend on. :class:`~sparrow.rollout.RolloutEngine` is one, structurally (nothing in
    this package imports the engine).

    Attributes:
        config: the batch buckets, the context and draft capacity, and whether to show progress.
        drafter: the drafter whose steps are timed (a calibration needs one).
        model: the target (its shape is part of :func:`~sparrow.speculative.costs.cost_key`).
        device: where the steps run (part of the key).
        compile_cache: the on-disk cache whose ``costs_dir`` keeps calibrations, or None.
    """

    @property
    def config(self) -> TimerConfig: ...

    @property
    def drafter(self) -> Drafter | None: ...

    @property
    def model(self) -> TransformerDecoder: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def compile_cache(self) -> CompileCache | None: ...

    def compile_key(self) -> dict[str, str]:
        """What the timed steps' compiled code depends on (architecture, backends, drafter, dtype, options)."""
        ...

    def time_step(self, kind: ProgramKind, bucket: int, *, context: int, k: int = 0, steps: int = 8,
                  params: SamplingParams | None = None) -> float:
        """Seconds per run of ``steps`` runs of program ``kind`` (``cycle``: ``k`` drafts and a verify) at batch
        ``bucket`` and mean context ``context``, sampling with ``params``' processing."""
        ...

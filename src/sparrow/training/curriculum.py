"""The context curriculum: the longest training context over the run, and each step's context.

The longest context doubles from ``min_context`` up to ``max_context`` (:meth:`CurriculumConfig.levels`).
``mode="auto"`` moves up a level as soon as the held-out accuracy of every curriculum task at the current
longest context reaches ``advance_acc``, and once ``ramp / (levels - 1)`` of the run has passed on the level
if that accuracy has passed ``min_advance_acc`` (the model has begun to solve it: pushing an unsolved model to
longer contexts leaves it unsolved at every length); so the maximum is reached by ``ramp`` of the run when
learning keeps pace. ``mode="time"`` grows it geometrically over ``ramp`` of the run. Each step draws its
length log-uniformly below the current longest, or that longest itself with probability 1/2.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Mapping

MODES = ("auto", "time")


@dataclass(frozen=True)
class CurriculumConfig:
    """Attributes: see the module docstring. One level (``min_context == max_context``) trains at one length.

    Raises:
        ValueError: ``min_context < 1``, ``max_context < min_context``, ``ramp`` outside ``(0, 1]``, an unknown
            ``mode``, or accuracies outside ``[0, 1]``.
    """

    min_context: int = 64
    max_context: int = 8192
    ramp: float = 0.6
    mode: str = "auto"
    advance_acc: float = 0.8
    min_advance_acc: float = 0.3

    def __post_init__(self) -> None:
        if not 1 <= self.min_context <= self.max_context:
            raise ValueError(f"curriculum: need 1 <= min_context <= max_context, got {self.min_context}, "
                             f"{self.max_context}")
        if not 0 < self.ramp <= 1:
            raise ValueError(f"curriculum: ramp must be in (0, 1], got {self.ramp}")
        if self.mode not in MODES:
            raise ValueError(f"curriculum: mode must be one of {MODES}, got {self.mode!r}")
        if not (0 <= self.advance_acc <= 1 and 0 <= self.min_advance_acc <= 1):
            raise ValueError(f"curriculum: accuracies must be in [0, 1], got advance_acc={self.advance_acc}, "
                             f"min_advance_acc={self.min_advance_acc}")

    def levels(self) -> list[int]:
        """The longest contexts in turn: ``min_context`` times powers of two, then ``max_context``."""
        out, n = [], self.min_context
        while n < self.max_context:
            out.append(n)
            n *= 2
        return out + [self.max_context]


class Curriculum:
    """The state of a :class:`CurriculumConfig` over one run; ``seed`` draws the steps' lengths."""

    def __init__(self, cfg: CurriculumConfig, seed: int = 0) -> None:
        self.cfg = cfg
        self.levels = cfg.levels()
        self.stage = 0
        self.stage_share = cfg.ramp / max(1, len(self.levels) - 1)  # of the run, per level
        self.stage_start = 0.0
        self.events: list[dict] = []
        self.rng = random.Random(seed)
        self.last_accuracy: dict[str, float] | None = None  # held-out accuracy at the current level

    @property
    def top(self) -> int:
        """The current longest context."""
        return self.levels[self.stage]

    def update(self, progress: float, accuracy: dict[str, float] | None = None, *, elapsed_s: float = 0.0) -> bool:
        """Move up a level if due at ``progress`` (the fraction of the run done) given ``accuracy`` (task ->
        held-out accuracy at :attr:`top`, when just measured); True when it moved."""
        if self.cfg.mode == "time":
            lo, hi = math.log(self.cfg.min_context), math.log(self.cfg.max_context)
            top = math.exp(lo + (hi - lo) * min(1.0, progress / self.cfg.ramp))
            stage = max(i for i, n in enumerate(self.levels) if n <= max(top, self.levels[0]) * 1.0001)
            moved, self.stage = stage != self.stage, stage
            return moved
        if self.stage == len(self.levels) - 1:
            return False
        if accuracy:
            self.last_accuracy = dict(accuracy)
        acc = min(self.last_accuracy.values()) if self.last_accuracy else 0.0
        if accuracy and acc >= self.cfg.advance_acc:
            why = "accuracy"
        elif progress - self.stage_start >= self.stage_share - 1e-12 and acc >= self.cfg.min_advance_acc:
            why = "time"
        else:
            return False
        self.stage += 1
        self.stage_start = progress
        self.last_accuracy = None
        self.events.append({"elapsed_s": round(elapsed_s, 1), "progress": round(progress, 4), "max_context": self.top,
                            "reason": why, "accuracy": accuracy if why == "accuracy" else None})
        return True

    def state_dict(self) -> dict[str, Any]:
        """The run's state (JSON-able): level, when it began, events, the last accuracy and the draws' generator."""
        version, internal, gauss = self.rng.getstate()
        return {"stage": self.stage, "stage_start": self.stage_start, "events": list(self.events),
                "last_accuracy": self.last_accuracy, "rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s ``state``. ``ValueError`` (nothing changed) for a level this
        curriculum does not have."""
        stage = int(state["stage"])
        if not 0 <= stage < len(self.levels):
            raise ValueError(f"curriculum state at level {stage}, but this curriculum has {len(self.levels)} levels")
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.stage, self.stage_start = stage, float(state["stage_start"])
        self.events = list(state["events"])
        self.last_accuracy = None if state["last_accuracy"] is None else dict(state["last_accuracy"])

    def sample(self) -> int:
        """The next step's context length (multiples of 64 once ``min_context >= 64``)."""
        top, lo = self.top, self.cfg.min_context
        n = top if self.rng.random() < 0.5 else int(math.exp(self.rng.uniform(math.log(lo), math.log(top))))
        if lo >= 64:
            n = n // 64 * 64
        return max(lo, min(n, top))

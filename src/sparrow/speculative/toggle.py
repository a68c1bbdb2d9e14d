"""When and how far to speculate: :class:`ToggleController` implementations and adaptive draft length.

* :class:`AlwaysOn` — speculate at every block with a fixed draft length.
* :class:`ThresholdToggle` — speculate while the active batch is at most ``max_active`` rows.
* :class:`CostModelToggle` — speculate when the predicted speedup of a cycle over plain decoding,
  ``tau(alpha, k) * c_target / c_cycle(k)`` with ``tau = (1 - alpha^(k+1)) / (1 - alpha)`` expected tokens
  per cycle, is at least ``1 + margin`` (with hysteresis), the step costs coming from a
  :class:`~sparrow.speculative.costs.CostModel` measured on the engine at start-up.

:class:`AdaptiveDraft` tracks the acceptance rate (an exponential average over blocks, weighted by the
number of draft tokens observed) and picks the draft length that maximises predicted tokens per second
within bounds. Decisions depend only on the calibrated cost model and on acceptance counts, never on
timings measured during the run, so a seeded run is reproducible.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from sparrow.sampling import SamplingParams
from sparrow.speculative.base import SpecDecision, StepStats, StepTimer, ToggleController
from sparrow.speculative.costs import CostModel, expected_tokens_per_cycle


class AlwaysOn(ToggleController):
    """Speculate at every block with ``num_draft`` draft tokens.

    Raises:
        ValueError: ``num_draft < 1``.
    """

    def __init__(self, num_draft: int = 4) -> None:
        if num_draft < 1:
            raise ValueError(f"num_draft must be >= 1, got {num_draft}")
        self.num_draft = int(num_draft)

    def decide(self, stats: StepStats) -> SpecDecision:
        return SpecDecision(True, self.num_draft)

    def draft_lengths(self) -> tuple[int, ...]:
        return (self.num_draft,)

    def __repr__(self) -> str:
        return f"AlwaysOn(num_draft={self.num_draft})"


@dataclass
class AdaptiveDraft:
    """Draft length chosen from the measured acceptance rate.

    Attributes:
        lengths: candidate draft lengths (each one compiles its own verify step and, on CUDA, captures one
            graph per batch bucket: keep the set small).
        ema: weight of a new observation of ``ema_tokens`` draft tokens (heavier blocks weigh more).
        ema_tokens: draft tokens an observation must hold to get weight ``ema``.
        prior: acceptance assumed before anything is measured.
    """

    lengths: tuple[int, ...] = (2, 3, 4, 6, 8)
    ema: float = 0.2
    ema_tokens: int = 256
    prior: float = 0.8
    alpha: float = field(init=False)
    observed_tokens: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        ls = tuple(sorted(set(int(x) for x in self.lengths)))
        if not ls or ls[0] < 1:
            raise ValueError(f"AdaptiveDraft.lengths must be positive integers, got {self.lengths}")
        self.lengths = ls
        if not 0.0 < self.ema <= 1.0:
            raise ValueError(f"AdaptiveDraft.ema must be in (0, 1], got {self.ema}")
        if self.ema_tokens < 1:
            raise ValueError(f"AdaptiveDraft.ema_tokens must be >= 1, got {self.ema_tokens}")
        if not 0.0 <= self.prior <= 1.0:
            raise ValueError(f"AdaptiveDraft.prior must be in [0, 1], got {self.prior}")
        self.alpha = self.prior

    def observe(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        w = 1.0 - (1.0 - self.ema) ** (proposed / self.ema_tokens)
        self.alpha = (1.0 - w) * self.alpha + w * accepted / proposed
        self.observed_tokens += proposed

    def reset(self) -> None:
        self.alpha = self.prior
        self.observed_tokens = 0

    def best(self, costs: CostModel | None, stats: StepStats, max_draft: int | None = None,
             alpha: float | None = None) -> tuple[int, float]:
        """(draft length, predicted speedup over plain decoding) maximising tokens per second, at the measured
        acceptance (or at ``alpha``, e.g. 1.0 for the best case).

        Without a cost model, the draft and verify steps are assumed to cost as much as a target step
        each (the worst case for a self-drafter); the speedup is then ``tau / (k + 1)``.
        """
        bucket = _bucket(stats)
        ctx = stats.mean_context
        best_k, best_s = self.lengths[0], -math.inf
        for k in self.lengths:
            if max_draft is not None and k > max_draft:
                continue
            tau = expected_tokens_per_cycle(self.alpha if alpha is None else alpha, k)
            if costs is None:
                s = tau / (k + 1)
            else:
                s = tau * costs.target_step(bucket, ctx) / costs.cycle(bucket, ctx, k)
            if s > best_s:
                best_k, best_s = k, s
        return best_k, best_s


class ThresholdToggle(ToggleController):
    """Speculate when the active batch has at most ``max_active`` rows.

    Args:
        max_active: largest active batch that speculates.
        num_draft: draft length when ``adaptive`` is None.
        adaptive: pick the draft length from measured acceptance (needs ``costs`` for meaningful choices).
        costs: step costs for the adaptive choice.

    Raises:
        ValueError: ``max_active < 1`` or ``num_draft < 1``.
    """

    def __init__(self, max_active: int, num_draft: int = 4, adaptive: AdaptiveDraft | None = None,
                 costs: CostModel | None = None) -> None:
        if max_active < 1:
            raise ValueError(f"max_active must be >= 1, got {max_active}")
        if num_draft < 1:
            raise ValueError(f"num_draft must be >= 1, got {num_draft}")
        self.max_active, self.num_draft = int(max_active), int(num_draft)
        self.adaptive, self.costs = adaptive, costs

    def draft_lengths(self) -> tuple[int, ...]:
        return self.adaptive.lengths if self.adaptive is not None else (self.num_draft,)

    def decide(self, stats: StepStats) -> SpecDecision:
        if stats.active_rows > self.max_active:
            return SpecDecision(False, 0)
        if self.adaptive is None:
            return SpecDecision(True, self.num_draft)
        return SpecDecision(True, self.adaptive.best(self.costs, stats)[0])

    def observe(self, *, proposed: int, accepted: int, rows: int, seconds: float | None = None) -> None:
        if self.adaptive is not None:
            self.adaptive.observe(proposed, accepted)

    def reset(self) -> None:
        if self.adaptive is not None:
            self.adaptive.reset()

    def __repr__(self) -> str:
        k = "adaptive" if self.adaptive is not None else self.num_draft
        return f"ThresholdToggle(max_active={self.max_active}, num_draft={k})"


class CostModelToggle(ToggleController):
    """Speculate when the cost model predicts a speedup of at least ``1 + margin``.

    The predicted speedup of the best draft length ``k`` (see :class:`AdaptiveDraft`) at the block's
    batch bucket and mean context is ``tau(alpha, k) * c_target / c_cycle(k)``. Hysteresis: once on, SD
    stays on until the prediction falls below ``1 + margin - hysteresis``; once off, it needs
    ``1 + margin``.

    Measured block times: the calibration times the steps alone, on rows set up for it; a rollout's blocks
    also pay the host read and bookkeeping, on rows whose contexts and acceptance vary. Each block's
    wall-clock time is compared with what the cost model predicts for it (``steps`` target steps, or
    ``steps`` cycles of ``k`` drafts), and an exponential average of that ratio is kept per batch bucket and
    mode (plain / speculative; ``ema_blocks`` blocks' memory, each ratio clamped to ``[1/4, 4]`` so a block
    that compiled or captured a graph cannot dominate). The predicted speedup is multiplied by
    ``ratio_plain / ratio_spec`` where both are known (a mode not yet seen at a bucket counts as 1).
    ``correct_costs=False`` keeps the calibrated costs as they are.

    Probing: acceptance is measured only while speculating, so an estimate that fell (e.g. on the
    unpredictable first tokens of every response, which all rows decode at once) would keep SD off for
    good. While off, every ``probe_every``-th block speculates anyway to measure acceptance again, unless
    even perfect acceptance would not reach ``1 + margin`` there (then no acceptance could turn SD on, and
    probing would only cost time). Each probe that leaves SD off doubles the interval (up to
    ``probe_max``); turning on resets it. So where SD does not pay, probes cost one block in ``probe_every``
    at first and one in ``probe_max`` in the long run, run at the speculative rate.

    Args:
        costs: measured step costs (:meth:`CostModel.calibrate` or :meth:`CostModel.load`).
        margin: required predicted gain (0.05: 5 %).
        hysteresis: band below ``1 + margin`` in which speculation, once on, stays on.
        adaptive: acceptance tracking and candidate draft lengths (default :class:`AdaptiveDraft()`).
        fixed_draft: use this draft length instead of adapting it (the on / off decision still uses the
            measured acceptance).
        probe_every: while off, speculate one block in this many to measure acceptance (0: never).
        probe_max: the longest interval between probes (after unsuccessful probes doubled it).
        correct_costs: scale the predicted speedup by the measured / predicted block times (see above).
        ema_blocks: memory of that average, in blocks.

    Raises:
        ValueError: negative ``margin`` / ``hysteresis`` / ``probe_every``, ``hysteresis > margin + 1``,
            ``fixed_draft < 1``.
    """

    def __init__(self, costs: CostModel, margin: float = 0.05, hysteresis: float = 0.03,
                 adaptive: AdaptiveDraft | None = None, fixed_draft: int | None = None,
                 probe_every: int = 8, correct_costs: bool = True, ema_blocks: int = 4,
                 probe_max: int = 64) -> None:
        if margin < 0 or hysteresis < 0:
            raise ValueError(f"margin and hysteresis must be >= 0, got {margin}, {hysteresis}")
        if probe_every < 0:
            raise ValueError(f"probe_every must be >= 0, got {probe_every}")
        if ema_blocks < 1:
            raise ValueError(f"ema_blocks must be >= 1, got {ema_blocks}")
        if fixed_draft is not None and fixed_draft < 1:
            raise ValueError(f"fixed_draft must be >= 1, got {fixed_draft}")
        self.costs, self.margin, self.hysteresis = costs, float(margin), float(hysteresis)
        self.adaptive = adaptive or AdaptiveDraft()
        if fixed_draft is not None:
            self.adaptive.lengths = (int(fixed_draft),)
        self.probe_every, self.probe_max = int(probe_every), max(int(probe_every), int(probe_max))
        self._interval = self.probe_every
        self.on = False
        self.last_prediction: float | None = None
        self.probes = 0  # speculative blocks run only to measure acceptance
        self._blocks_off, self._probing = 0, False
        self.correct_costs, self.ema_blocks = bool(correct_costs), int(ema_blocks)
        self.time_ratio: dict[tuple[int, bool], float] = {}  # (bucket, speculative) -> measured / predicted

    def predict(self, stats: StepStats) -> tuple[int, float]:
        """(draft length, predicted speedup) for the next block."""
        k, speedup = self.adaptive.best(self.costs, stats)
        return k, speedup * self.correction(_bucket(stats))

    def correction(self, bucket: int) -> float:
        """``ratio_plain / ratio_spec`` of the measured / predicted block times at ``bucket`` (1 if unknown)."""
        if not self.correct_costs:
            return 1.0
        return self.time_ratio.get((bucket, False), 1.0) / self.time_ratio.get((bucket, True), 1.0)

    def observe_block(self, stats: StepStats, *, num_draft: int, steps: int, seconds: float) -> None:
        bucket = _bucket(stats)
        if num_draft > 0:
            predicted = steps * self.costs.cycle(bucket, stats.mean_context, num_draft)
        else:
            predicted = steps * self.costs.target_step(bucket, stats.mean_context)
        if steps < 1 or predicted <= 0 or not seconds > 0:
            return
        ratio = min(4.0, max(0.25, seconds / predicted))
        key = (bucket, num_draft > 0)
        w = 1.0 / self.ema_blocks
        old = self.time_ratio.get(key)
        self.time_ratio[key] = ratio if old is None else (1.0 - w) * old + w * ratio

    def draft_lengths(self) -> tuple[int, ...]:
        return self.adaptive.lengths

    def decide(self, stats: StepStats) -> SpecDecision:
        k, speedup = self.predict(stats)
        self.last_prediction = speedup
        threshold = 1.0 + self.margin - (self.hysteresis if self.on else 0.0)
        self.on = speedup >= threshold
        if self.on:
            self._blocks_off, self._interval = 0, self.probe_every
            return SpecDecision(True, k)
        if self._probing:  # the last block was a probe and SD stays off: probe half as often
            self._interval = min(2 * self._interval, self.probe_max)
            self._probing = False
        self._blocks_off += 1
        if self.probe_every and self._blocks_off >= self._interval:
            self._blocks_off = 0
            k1, best_case = self.adaptive.best(self.costs, stats, alpha=1.0)
            if best_case * self.correction(_bucket(stats)) >= 1.0 + self.margin:
                self.probes += 1
                self._probing = True
                return SpecDecision(True, k1)
        return SpecDecision(False, 0)

    def observe(self, *, proposed: int, accepted: int, rows: int, seconds: float | None = None) -> None:
        self.adaptive.observe(proposed, accepted)

    def reset(self) -> None:
        self.adaptive.reset()
        self.on = False
        self.probes = self._blocks_off = 0
        self._probing, self._interval = False, self.probe_every
        self.time_ratio.clear()

    def __repr__(self) -> str:
        return (f"CostModelToggle(margin={self.margin}, hysteresis={self.hysteresis}, "
                f"probe_every={self.probe_every}, lengths={self.adaptive.lengths}, alpha={self.adaptive.alpha:.3f})")


def _bucket(stats: StepStats) -> int:
    """The padded batch a block runs at (its active rows when the engine did not say)."""
    return stats.bucket or stats.active_rows


# --------------------------------------------------------------------------------------------- builders
# A recipe's ``speculative.toggle`` is one of these, as a component: ``{_component_: sparrow.speculative.threshold,
# max_active: 32}``. Each takes the engine it will steer and the sampling parameters it will run with (the cost
# model measures that engine in that sampling mode), then its own settings.

def always_on(engine: StepTimer, params: SamplingParams, *, num_draft: int = 4) -> AlwaysOn:
    """Speculate at every block with ``num_draft`` draft tokens (:class:`AlwaysOn`)."""
    return AlwaysOn(num_draft)


def threshold(engine: StepTimer, params: SamplingParams, *, max_active: int, num_draft: int = 4,
              draft_lengths: Sequence[int] = ()) -> ThresholdToggle:
    """Speculate while at most ``max_active`` rows are active (:class:`ThresholdToggle`); with several
    ``draft_lengths`` the length follows the measured acceptance (:class:`AdaptiveDraft`), else ``num_draft``."""
    lengths = tuple(draft_lengths)
    return ThresholdToggle(max_active, num_draft, adaptive=AdaptiveDraft(lengths=lengths) if len(lengths) > 1 else None)


def cost_model(engine: StepTimer, params: SamplingParams, *, draft_lengths: Sequence[int] = (),
               margin: float = 0.05, hysteresis: float = 0.03, probe_every: int = 8,
               correct_costs: bool = True) -> CostModelToggle:
    """Speculate where the cost model, measured now on ``engine`` (or loaded from its cache), predicts a speedup
    (:class:`CostModelToggle`), at the draft length of :class:`AdaptiveDraft` over ``draft_lengths`` (default:
    its own ladder, clamped to the engine's ``max_draft``). Given ``draft_lengths``, the calibration times cycles
    of the shortest and longest of them only: the engine compiled those lengths ahead, and a cycle of any other
    length would compile a verify step of its own in the middle of the measurement."""
    lengths = tuple(draft_lengths)
    adaptive = AdaptiveDraft(lengths=lengths) if lengths else AdaptiveDraft()
    measured = (min(lengths), max(lengths)) if lengths else None
    return CostModelToggle(CostModel.calibrate(engine, params, draft_lengths=measured), margin=margin,
                           hysteresis=hysteresis, adaptive=adaptive, probe_every=probe_every,
                           correct_costs=correct_costs)

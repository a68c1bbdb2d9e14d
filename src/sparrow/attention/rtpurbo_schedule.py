"""A sparsity schedule for RTPurbo rollouts: the selection's top-p by generation length, moved between RL steps by
the measured tail of the per-token sparse-vs-dense agreement.

Sparse rollouts drift from the dense policy the trainer scores, and the drift is heavy-tailed and grows with the
generation length (Taming Sparse Rollout: holding the 5th percentile of the per-token agreement at or above 0.86
kept training stable, with a budget that grows with length). The schedule keeps the selection as sparse as that
allows:

* **tiers by length** — ``lengths = (0, n1, n2, ...)``: a row that has generated ``n_i`` tokens or more selects
  with tier ``i``'s top-p. Each tier drops a share ``d_i = 1 - top_p_i`` of the indexer's mass, starting at
  ``d_i = (1 - top_p) * length_factor ** i`` (later tiers keep more).
* **feedback from the tail** — after every step, per tier (or for all tiers from one number): below
  ``threshold`` the tier tightens (``d_i *= tighten``: more blocks kept), at or above ``threshold + margin`` it
  relaxes (``d_i *= relax``), in between it holds. Top-p stays in ``[min_top_p, max_top_p]`` and never decreases
  with length.

:meth:`SparsitySchedule.apply` writes the tiers into every RTPurbo backend's device buffers in place
(:meth:`~sparrow.attention.rtpurbo.RTPurboAttention.set_selection`): the compiled decode step and its CUDA graphs
read them when they run, so nothing recompiles. Host side, between steps; the statistic comes from
:func:`sparrow.rl.mismatch.tail_agreement` / :func:`~sparrow.rl.mismatch.tail_agreement_by` (keys: the tier of
each response token, :meth:`SparsitySchedule.tier_of`).

In a recipe config (``_component_`` is the config; the recipe builds the schedule on its rollout model)::

    rtpurbo_schedule:
      _component_: sparrow.attention.rtpurbo_schedule.SparsityScheduleConfig
      threshold: 0.86
      lengths: [0, 256, 1024]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import nn

from sparrow.attention.rtpurbo import RTPurboAttention, rtpurbo_backends

__all__ = ["SparsityScheduleConfig", "SparsitySchedule"]


@dataclass(frozen=True)
class SparsityScheduleConfig:
    """Parameters of :class:`SparsitySchedule` (validated on construction; module docstring for the rule).

    Attributes:
        threshold: the tail agreement to hold (at or above).
        quantile: the quantile of the per-token agreement the tail is (0.05: the 5th percentile).
        margin: relax only when the tail is at least ``threshold + margin``.
        top_p: the first tier's starting top-p.
        min_top_p, max_top_p: bounds of every tier's top-p.
        tighten: factor (< 1) on a tier's dropped mass ``1 - top_p`` when its tail is below the threshold.
        relax: factor (> 1) on it when the tail is comfortably above.
        lengths: generated lengths where the tiers start: ``0`` first, strictly increasing, at most
            :attr:`RTPurboAttention.SELECTION_TIERS`.
        length_factor: each tier's starting dropped mass is the previous tier's times this (in (0, 1]).
        version: format of this config (saved schedules stay readable).
    """

    threshold: float = 0.86
    quantile: float = 0.05
    margin: float = 0.04
    top_p: float = 0.9
    min_top_p: float = 0.5
    max_top_p: float = 0.999
    tighten: float = 0.5
    relax: float = 1.25
    lengths: tuple[int, ...] = (0,)
    length_factor: float = 0.5
    version: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "lengths", tuple(int(n) for n in self.lengths))  # a YAML list
        if self.version != 1:
            raise ValueError(f"SparsityScheduleConfig version {self.version} is unknown (this Sparrow reads 1)")
        for name in ("threshold", "quantile"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"SparsityScheduleConfig.{name} must be in [0, 1], got {getattr(self, name)}")
        if not 0.0 <= self.margin < 1.0:
            raise ValueError(f"SparsityScheduleConfig.margin must be in [0, 1), got {self.margin}")
        if not 0.0 < self.min_top_p <= self.top_p <= self.max_top_p <= 1.0:
            raise ValueError(f"need 0 < min_top_p <= top_p <= max_top_p <= 1, got {self.min_top_p}, {self.top_p}, "
                             f"{self.max_top_p}")
        if not 0.0 < self.tighten < 1.0 or not self.relax > 1.0:
            raise ValueError(f"need 0 < tighten < 1 < relax, got tighten {self.tighten}, relax {self.relax}")
        if not 0.0 < self.length_factor <= 1.0:
            raise ValueError(f"SparsityScheduleConfig.length_factor must be in (0, 1], got {self.length_factor}")
        n = self.lengths
        if not n or n[0] != 0 or any(b <= a for a, b in zip(n, n[1:])) or len(n) > RTPurboAttention.SELECTION_TIERS:
            raise ValueError(f"SparsityScheduleConfig.lengths must start at 0, increase strictly and hold at most "
                             f"{RTPurboAttention.SELECTION_TIERS} tiers, got {list(n)}")


class SparsitySchedule:
    """RTPurbo's top-p per generation-length tier, updated from the tail agreement (module docstring).

    Args:
        config: a :class:`SparsityScheduleConfig` (default: its defaults).

    Host state only (one float per tier); :meth:`step` (or :meth:`update` + :meth:`apply`) between RL steps.
    """

    def __init__(self, config: SparsityScheduleConfig | None = None) -> None:
        self.config = config = config or SparsityScheduleConfig()
        self._drop = [(1.0 - config.top_p) * config.length_factor ** i for i in range(len(config.lengths))]
        self._clamp()

    @property
    def top_p(self) -> list[float]:
        """The current top-p of every tier (first tier first)."""
        return [1.0 - d for d in self._drop]

    def tier_of(self, position: torch.Tensor) -> torch.Tensor:
        """The tier index of response tokens at generated positions ``position`` (any shape, int): the keys of
        :func:`sparrow.rl.mismatch.tail_agreement_by`."""
        starts = torch.tensor(self.config.lengths, device=position.device)
        return (position[..., None] >= starts).sum(-1) - 1

    def update(self, tail: float | Mapping[int, float]) -> list[float]:
        """Move the tiers by the last step's tail agreement: one value for every tier, or ``{tier: value}`` for
        some (tiers without a finite value hold). Returns the new top-p of every tier.

        Raises: ValueError on a tier index outside the schedule.
        """
        c = self.config
        tails = {i: tail for i in range(len(self._drop))} if not isinstance(tail, Mapping) else dict(tail)
        for i, t in tails.items():
            if not 0 <= int(i) < len(self._drop):
                raise ValueError(f"tier {i} is not one of the schedule's {len(self._drop)}")
            if t is None or not math.isfinite(t):
                continue
            if t < c.threshold:
                self._drop[int(i)] *= c.tighten
            elif t >= c.threshold + c.margin:
                self._drop[int(i)] *= c.relax
        self._clamp()
        return self.top_p

    def _clamp(self) -> None:
        c = self.config
        lo, hi = 1.0 - c.max_top_p, 1.0 - c.min_top_p
        out, prev = [], hi
        for d in self._drop:  # within the bounds, and never more aggressive than an earlier tier
            prev = min(max(lo, min(hi, d)), prev)
            out.append(prev)
        self._drop = out

    def apply(self, model: nn.Module | Sequence[RTPurboAttention]) -> None:
        """Write the tiers into every RTPurbo backend of ``model`` (or the given backends), in place.

        Raises: ValueError when a layer of ``model`` has another backend.
        """
        backends = rtpurbo_backends(model) if isinstance(model, nn.Module) else list(model)
        for b in backends:
            b.set_selection(self.top_p, self.config.lengths)

    def step(self, tail: float | Mapping[int, float],
             model: nn.Module | Sequence[RTPurboAttention]) -> dict[str, float]:
        """:meth:`update` then :meth:`apply`; returns the metrics to log (``rtpurbo/top_p`` of the first tier,
        ``rtpurbo/top_p/tier<i>`` of every later one)."""
        top = self.update(tail)
        self.apply(model)
        return {"rtpurbo/top_p": top[0], **{f"rtpurbo/top_p/tier{i}": v for i, v in enumerate(top) if i}}

    def state_dict(self) -> dict:
        return {"version": self.config.version, "drop": list(self._drop)}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict` (ValueError on another version or tier count)."""
        if state.get("version") != self.config.version or len(state.get("drop", ())) != len(self._drop):
            raise ValueError(f"schedule state {dict(state)} does not fit this schedule ({len(self._drop)} tiers, "
                             f"version {self.config.version})")
        self._drop = [float(d) for d in state["drop"]]
        self._clamp()

"""Partial rollout: a GRPO step trains on the groups that have finished, and the unfinished ones keep decoding
into the next step instead of holding the step back.

A synchronous step waits for its longest response. Here each rollout rank keeps ``prompts_per_step +
overprovision`` groups in flight in one :class:`~sparrow.rollout.RolloutSession`; a step decodes until
``prompts_per_step`` groups have finished, trains on them (the oldest first), and leaves the rest decoding. The
weight sync then changes the rollout weights in place under the unfinished rows: they continue over the KV that
the earlier weights cached (prompt and generated tokens alike; RTPurbo's rings and indexer keys too), and every
token keeps the log-prob and the version of the policy that sampled it, so the loss can correct for it
(:mod:`sparrow.rl.grpo`: π_old is the proximal policy, w = π_old/μ per token).

Staleness. A group admitted (prefilled, first tokens sampled) at version ``a`` and trained at version ``v`` has
tokens of ages up to ``v - a``. ``max_staleness`` bounds it: before the step's weight sync, every group admitted at
or before ``v - max_staleness`` must be trained at this step; ``on_stale`` says what happens to those that have
not finished by then: ``finish`` (the step waits for them) or ``drop`` (they are discarded, prompt and all). With
``max_staleness: 0`` nothing outlives its step, and without over-provisioning the mode is the synchronous recipe,
bit for bit.

Checkpoints restart the in-flight groups: :meth:`PartialRollout.state_dict` holds the data rows of the open groups
(and those drawn but not yet started); after a resume they are queued first, in their order, into a new session
whose seed is the resumed step's, so two resumes of one checkpoint run identically (what they had sampled before
the checkpoint is not kept).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch

from sparrow.rollout.engine import Generation, RolloutEngine, RolloutSession, Sample
from sparrow.sampling import SamplingParams

OnStale = Literal["drop", "finish"]


@dataclass(frozen=True)
class PartialRolloutConfig:
    """The recipe's ``partial_rollout`` section.

    Attributes:
        enabled: train each step on the groups that finished and keep the others decoding (off: synchronous).
        overprovision: groups kept in flight beyond ``prompts_per_step`` (over every rollout rank).
        max_staleness: policy versions a group may span: one admitted at version ``a`` is trained at
            ``a + max_staleness`` at the latest.
        on_stale: what happens to a group that reaches that bound unfinished: ``finish`` (the step waits for it)
            or ``drop`` (discarded).
    """

    enabled: bool = False
    overprovision: int = 0
    max_staleness: int = 1
    on_stale: OnStale = "finish"

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise ValueError(f"partial_rollout.enabled must be true or false, got {self.enabled!r}")
        for name in ("overprovision", "max_staleness"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"partial_rollout.{name} must be an integer >= 0, got {v!r}")
        if self.on_stale not in ("drop", "finish"):
            raise ValueError(f"partial_rollout.on_stale must be 'drop' or 'finish', got {self.on_stale!r}")

    def check(self, prompts_per_step: int, rollout_ranks: int = 1) -> None:
        """The checks that need the recipe's batch: over-provisioning splits over the rollout ranks, and with
        ``finish`` the groups that must train at one step never exceed a step's groups (at most ``overprovision``
        of them are left from earlier steps; with ``max_staleness: 0`` every group of the step must finish in it).

        Raises:
            ValueError: naming the values.
        """
        if self.overprovision % rollout_ranks:
            raise ValueError(f"partial_rollout.overprovision ({self.overprovision}) must divide evenly over the "
                             f"{rollout_ranks} rollout ranks")
        if self.on_stale == "finish":
            if self.max_staleness == 0 and self.overprovision:
                raise ValueError("partial_rollout.max_staleness 0 lets no group outlive its step, so with on_stale "
                                 "finish over-provisioned groups would all finish and exceed the step: set "
                                 "overprovision 0 (or on_stale drop)")
            if self.overprovision > prompts_per_step:
                raise ValueError(f"partial_rollout.overprovision ({self.overprovision}) above prompts_per_step "
                                 f"({prompts_per_step}) with on_stale finish: more groups could come due at one step "
                                 "than it trains")


@dataclass
class _Ready:
    """A finished group waiting to be trained."""

    group: int
    row: dict[str, Any]
    samples: list[Sample]
    rewards: list[float]
    version: int  # the version that admitted it


@dataclass
class PartialStep:
    """What one step of partial rollout gives the trainer.

    rows: the data rows (``prompt_ids``, ``answer``, ...) of the trained groups, oldest first.
    generation: their samples, prompt-major (group ``i``'s sample ``j`` at ``i * group + j``), with the stats of
        everything this step's runs decoded.
    rewards: [len(samples)] float32. metrics: ``partial/*`` counters of the step (see :meth:`PartialRollout.step`).
    """

    rows: list[dict[str, Any]]
    generation: Generation
    rewards: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


class PartialRollout:
    """One rollout rank's side of partial rollout (module docstring).

    Args:
        engine: the rank's rollout engine (its policy version is set by the caller after each weight sync).
        config: the section (``enabled`` is not read here).
        prompts_per_step: groups this rank delivers per step. overprovision: groups it keeps in flight beyond.
        group: samples per group.
        draw: returns the next data rows for this rank (dicts with ``prompt_ids``), called when it needs prompts.
        score: reward of a sample given its group's data row.
    """

    def __init__(self, engine: RolloutEngine, config: PartialRolloutConfig, *, prompts_per_step: int,
                 overprovision: int, group: int, draw: Callable[[], list[dict[str, Any]]],
                 score: Callable[[dict[str, Any], Sample], float]) -> None:
        if prompts_per_step < 1 or overprovision < 0:
            raise ValueError(f"prompts_per_step must be >= 1 and overprovision >= 0, got {prompts_per_step}, "
                             f"{overprovision}")
        self.engine, self.config = engine, config
        self.prompts_per_step, self.overprovision, self.group = prompts_per_step, overprovision, group
        self._draw, self._score = draw, score
        self.session: RolloutSession | None = None
        self._buffer: list[dict[str, Any]] = []  # drawn, not yet added
        self._rows: dict[int, dict[str, Any]] = {}  # open group -> its data row
        self._ready: dict[int, _Ready] = {}  # finished groups not yet trained

    @property
    def held(self) -> int:
        """Groups held: open in the session (waiting or running) or finished and not yet trained."""
        return len(self._rows) + len(self._ready)

    def step(self, version: int, params: SamplingParams, drain: bool = False) -> PartialStep:
        """Decode until ``prompts_per_step`` groups are ready, apply the staleness bound, return the groups to train.

        Args:
            version: the policy version the engine holds now (= π_old's at the training of this step).
            params: sampling parameters; a new session (when none is open) takes them, its seed included.
            drain: also finish every running row before returning (admitting nothing new): the engine is then free,
                e.g. for an evaluation; the extra groups wait for the next step.

        Returns:
            :class:`PartialStep`; its metrics: ``partial/dropped_groups`` (this step), ``partial/held_groups``
            (after it), ``partial/due_groups`` (groups the bound made this step train or drop),
            ``partial/generated_tokens`` (decoded by this step's runs).
        """
        P, S, c = self.prompts_per_step, self.config.max_staleness, self.config
        if self.session is None:
            self.session = self.engine.start(self.group, params)
        self._top_up()
        due = version - S  # groups admitted at or before this version must be trained now
        s = self.session
        gens = []
        if c.on_stale == "finish":
            running = [p.group for p in s.progress() if p.admitted_version is not None and p.admitted_version <= due]
            gens.append(s.run(max(0, P - len(self._ready)), finish=running))
        else:
            gens.append(s.run(max(0, P - len(self._ready))))
        self._take(gens[-1])
        if drain:
            gens.append(s.run(admit=False))
            self._take(gens[-1])
        order = sorted(self._ready)
        chosen = [self._ready.pop(g) for g in order[:P]]
        late_ready = [g for g in order[P:] if self._ready[g].version <= due]
        late_running = [p.group for p in s.progress() if p.admitted_version is not None and p.admitted_version <= due]
        if c.on_stale == "finish" and (late_ready or late_running):  # PartialRolloutConfig.check excludes it
            raise RuntimeError(f"groups {late_ready + late_running} exceed max_staleness {S} after this step")
        for g in late_ready:
            del self._ready[g]
        s.drop(late_running)
        for g in late_running:
            del self._rows[g]
        if not self.held:  # nothing in flight: the next step starts a session with its own seed
            s.close()
            self.session = None
        stats = gens[0].stats
        for g in gens[1:]:
            stats = stats + g.stats
        samples = [x for r in chosen for x in r.samples]
        rewards = torch.tensor([x for r in chosen for x in r.rewards], dtype=torch.float32)
        metrics = {"partial/dropped_groups": float(len(late_ready) + len(late_running)),
                   "partial/held_groups": float(self.held),
                   "partial/due_groups": float(sum(r.version <= due for r in chosen) + len(late_ready)
                                               + len(late_running)),
                   "partial/generated_tokens": float(stats.generated_tokens)}
        return PartialStep([r.row for r in chosen], Generation(samples, stats), rewards, metrics)

    def _top_up(self) -> None:
        want = self.prompts_per_step + self.overprovision - self.held
        rows = []
        while len(rows) < want:
            if not self._buffer:
                self._buffer.extend(self._draw())
                if not self._buffer:
                    raise RuntimeError("the prompt source returned no rows")
            rows.append(self._buffer.pop(0))
        if rows:
            ids = self.session.add([r["prompt_ids"] for r in rows])
            self._rows.update(zip(ids, rows))

    def _take(self, gen: Generation) -> None:
        """Finished groups of ``gen`` into the ready set, scored."""
        n = self.group
        for i in range(0, len(gen.samples), n):
            samples = gen.samples[i:i + n]
            g = samples[0].prompt_index
            row = self._rows.pop(g)
            self._ready[g] = _Ready(g, row, samples, [float(self._score(row, x)) for x in samples],
                                    int(samples[0].versions[0]))

    # ------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The data rows to restart from: every held group's (oldest first), then those drawn and not started."""
        held = {**self._rows, **{g: r.row for g, r in self._ready.items()}}
        return {"queue": [held[g] for g in sorted(held)] + list(self._buffer)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restart from :meth:`state_dict`: its rows are queued first, into the next step's new session.

        Raises:
            RuntimeError: groups are already held. ValueError: a malformed state.
        """
        if self.held or self.session is not None:
            raise RuntimeError("load_state_dict needs a PartialRollout that holds no groups")
        queue = state.get("queue") if isinstance(state, dict) else None
        if not isinstance(queue, list) or not all(isinstance(r, dict) and "prompt_ids" in r for r in queue):
            raise ValueError("a partial-rollout state needs a 'queue' list of data rows with 'prompt_ids'")
        self._buffer = [dict(r) for r in queue]


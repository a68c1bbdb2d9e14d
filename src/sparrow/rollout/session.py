"""Resumable generation: :class:`RolloutSession`, the host loop of the rollout engine.

A session holds groups across calls: each :meth:`RolloutSession.run` admits waiting groups into free slots (the
engine prefills their prompts and samples their first tokens), runs decode blocks on its active rows (the engine's
:meth:`~sparrow.rollout.RolloutEngine.decode_block`, ending in one host read: which rows finished) and retires the
finished ones, until enough groups have finished; the unfinished rows keep their slots, caches and prefix slots for
the next call. The session reaches the engine only through :class:`SessionEngine`, public members that
:class:`~sparrow.rollout.RolloutEngine` has (so this module need not import the engine, which makes sessions).
"""

from __future__ import annotations

from typing import Collection, Mapping, Protocol, Sequence

import torch

from sparrow.rollout.config import EngineConfig
from sparrow.rollout.results import Generation, GenerationStats, GroupProgress, Sample
from sparrow.rollout.slots import SlotTable
from sparrow.rollout.state import RowState
from sparrow.sampling import SamplingParams

Admission = tuple[int, list[int], list[int]]  # (group, its rows, its prefix slots)


class SessionEngine(Protocol):
    """The engine members a session uses, all public members of :class:`~sparrow.rollout.RolloutEngine`."""

    config: EngineConfig
    device: torch.device
    slots: SlotTable
    rows: RowState | None

    @property
    def policy_version(self) -> int: ...

    def validate(self, prompts: Sequence, n_samples: int, params: SamplingParams) -> list[torch.Tensor]: ...

    def set_sampling_params(self, params: SamplingParams) -> None: ...

    def admit(self, groups: Sequence[Admission], prompts: Mapping[int, torch.Tensor], n_samples: int,
              stats: GenerationStats) -> None: ...

    def decode_block(self, rows: list[int], prompt_lens: list[int], prefixes: list[int],
                     stats: GenerationStats) -> list[int]: ...

    def collect(self, rows: list[int], owners: list[tuple[int, int]], params: SamplingParams) -> list[Sample]: ...


class RolloutSession:
    """Generation that can stop and resume: groups of ``n_samples`` samples are added, :meth:`run` decodes until
    enough of them have finished and returns those, and the unfinished rows keep their generation slots, caches
    and prefix slots for the next :meth:`run`. Made by :meth:`RolloutEngine.start`; :meth:`RolloutEngine.generate`
    is one session run to the end.

    A group's noise stream is its id (sample ``j`` of group ``g`` is stream ``g * n_samples + j`` under the
    session's seed), so what a sample draws does not depend on when it was admitted, on how the session's runs were
    cut, or on what runs beside it: the groups of a session whose weights never change draw exactly the tokens of
    one :meth:`RolloutEngine.generate` of all its prompts. Weights may change between runs (updated in place, so
    compiled steps and CUDA graphs stay valid): running rows continue over the KV the earlier weights cached, and
    :meth:`RolloutEngine.set_policy_version` stamps the tokens sampled after the change with the new version.

    Several sessions may be open on one engine: they share its slots (a session admits a group when ``n_samples``
    generation slots and its prefix slots are free) and each run makes its own sampling parameters current.
    """

    def __init__(self, engine: SessionEngine, n_samples: int, params: SamplingParams) -> None:
        self.engine = engine
        self.n_samples = n_samples
        self.params = params
        self._prompts: dict[int, torch.Tensor] = {}  # open group -> prompt
        self._pending: list[int] = []  # groups waiting for slots, in order
        self._next = 0
        self._owner: dict[int, tuple[int, int]] = {}  # row -> (group, sample)
        self._active: list[int] = []  # rows decoding, ascending
        self._done: dict[int, dict[int, Sample]] = {}  # running group -> its samples that finished
        self._admitted: dict[int, int] = {}  # running group -> policy version at admission
        self._closed = False

    # ----------------------------------------------------------------------------------- groups
    def add(self, prompts: Sequence[Sequence[int] | torch.Tensor]) -> list[int]:
        """Queue ``prompts`` (token id sequences, each non-empty) as groups of ``n_samples``; returns their ids.

        Raises:
            ValueError: as :meth:`RolloutEngine.generate` for the prompts; RuntimeError: the session is closed.
        """
        self._check_open()
        toks = self.engine.validate(prompts, self.n_samples, self.params)
        ids = list(range(self._next, self._next + len(toks)))
        self._next += len(toks)
        self._prompts.update(zip(ids, toks))
        self._pending.extend(ids)
        return ids

    @property
    def open_groups(self) -> list[int]:
        """Groups added and not yet returned or dropped (waiting or running), ascending."""
        return sorted(self._prompts)

    def progress(self) -> list[GroupProgress]:
        """Every open group's :class:`GroupProgress` (host bookkeeping, exact after every block: no device read)."""
        out = []
        rows = {owner: r for r, owner in self._owner.items()}
        for g in self.open_groups:
            if g not in self._admitted:
                out.append(GroupProgress(g, None, (0,) * self.n_samples))
                continue
            done = self._done.get(g, {})
            lengths = tuple(done[j].length if j in done else self.engine.slots.length(rows[(g, j)])
                            for j in range(self.n_samples))
            out.append(GroupProgress(g, self._admitted[g], lengths))
        return out

    def drop(self, groups: Collection[int]) -> None:
        """Abandon open ``groups``: waiting ones leave the queue, running ones free their slots now (what they
        sampled is discarded).

        Raises:
            ValueError: a group that is not open.
        """
        self._check_open()
        missing = sorted(set(groups) - set(self._prompts))
        if missing:
            raise ValueError(f"groups {missing} are not open in this session")
        e, gone = self.engine, set(groups)
        self._pending = [g for g in self._pending if g not in gone]
        rows = [r for r, (g, _) in self._owner.items() if g in gone]
        if rows:
            e.rows.idle(torch.tensor(rows, dtype=torch.int64, device=e.device))
            self._release(rows)
        for g in gone:
            del self._prompts[g]
            self._done.pop(g, None)
            self._admitted.pop(g, None)

    def close(self) -> None:
        """Drop every open group and give the slots back; the session cannot be used afterwards."""
        if not self._closed:
            self.drop(list(self._prompts))
            self._closed = True

    # -------------------------------------------------------------------------------------- run
    @torch.no_grad()
    def run(self, min_groups: int | None = None, *, finish: Collection[int] = (), admit: bool = True) -> Generation:
        """Decode until at least ``min_groups`` groups have finished during this call (None: until every open group
        has, or with ``admit=False`` every running one) and every group of ``finish`` has; check after every block.

        Args:
            min_groups: groups to finish before returning.
            finish: open groups that must finish before returning (waiting ones are admitted first).
            admit: admit waiting groups into free slots (``False``: only the running rows decode).

        Returns:
            :class:`Generation` of the groups that finished during the call, ascending by group id (each group's
            samples by sample index), and the call's stats. Unfinished groups stay open.

        Raises:
            ValueError: ``min_groups`` above what the session can finish, or ``finish`` naming a group that is
                not open (or waits, with ``admit=False``). RuntimeError: the session is closed, or waiting
                groups cannot be admitted because other sessions hold the slots.
        """
        self._check_open()
        target, finish = self._goal(min_groups, set(finish), admit)
        e = self.engine
        e.set_sampling_params(self.params)
        stats = GenerationStats()
        finished: dict[int, list[Sample]] = {}
        admitted_rows = 0
        while (admit and self._pending) or self._active:
            if len(finished) >= target and not finish & self._prompts.keys():
                break
            if admit:
                admitted_rows += self._admit_waiting(stats)
            if not self._active:
                raise RuntimeError(
                    f"the engine has {len(e.slots.free_rows)} free generation slots and {len(e.slots.free_prefixes)} "
                    f"free prefix slots, too few for a group of {self.n_samples}: other open rollout sessions hold "
                    "the rest")
            # a block of steps on the active rows, then one host read to retire finished rows
            done = e.decode_block(self._active, [self._prompts[self._owner[r][0]].numel() for r in self._active],
                                  [e.slots.prefix_of(r) for r in self._active], stats)
            if done:
                self._retire(done, finished)
        samples = [s for g in sorted(finished) for s in finished[g]]
        stats.generated_tokens = admitted_rows + sum(stats.block_tokens.values())
        return Generation(samples, stats)

    def _goal(self, min_groups: int | None, finish: set[int], admit: bool) -> tuple[int, set[int]]:
        """``run``'s arguments checked: (groups to finish, the groups that must be among them)."""
        reachable = len(self._prompts) if admit else len(self._prompts) - len(self._pending)
        if min_groups is not None and not 0 <= min_groups <= reachable:
            raise ValueError(f"min_groups ({min_groups}) must lie in [0, {reachable}]: the groups this session can "
                             "finish" + ("" if admit else " without admitting new ones"))
        bad = sorted(g for g in finish if g not in self._prompts or (not admit and g in self._pending))
        if bad:
            raise ValueError(f"groups {bad} cannot finish in this run: not open" + ("" if admit else " or waiting"))
        return (reachable if min_groups is None else min_groups), finish

    def _admit_waiting(self, stats: GenerationStats) -> int:
        """Admit waiting groups, in order, while their slots are free (the engine prefills them and samples their
        first tokens); returns the rows admitted."""
        e, n = self.engine, self.n_samples
        per_prompt = 1 if e.config.share_prefix else n  # prefix slots a group takes
        batch: list[Admission] = []
        while self._pending and e.slots.fits(n, per_prompt):
            g = self._pending.pop(0)
            rows, slots = e.slots.admit(n, per_prompt)
            self._owner.update((r, (g, j)) for j, r in enumerate(rows))
            self._admitted[g] = e.policy_version
            batch.append((g, rows, slots))
        if batch:
            e.admit(batch, self._prompts, n, stats)
            self._active = sorted(self._active + [r for _, rows, _ in batch for r in rows])
        return n * len(batch)

    def _retire(self, rows: list[int], finished: dict[int, list[Sample]]) -> None:
        """Collect finished ``rows`` and free their slots; a group whose last sample finished moves to
        ``finished`` and leaves the session."""
        for s in self.engine.collect(rows, [self._owner[r] for r in rows], self.params):
            done = self._done.setdefault(s.prompt_index, {})
            done[s.sample_index] = s
            if len(done) == self.n_samples:
                finished[s.prompt_index] = [done[j] for j in range(self.n_samples)]
                del self._done[s.prompt_index], self._prompts[s.prompt_index], self._admitted[s.prompt_index]
        self._release(rows)

    def _release(self, rows: list[int]) -> None:
        self.engine.slots.release(rows)
        for r in rows:
            del self._owner[r]
        gone = set(rows)
        self._active = [r for r in self._active if r not in gone]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this rollout session is closed")

"""The rollout engine: batched sampling with shared prompt prefixes, continuous batching and exact
self-speculative decoding.

Reading order: :meth:`RolloutSession.run` (the host loop; :meth:`RolloutEngine.generate` is one session run to
the end) -> :meth:`_admit` (prefill new prompts, sample their first tokens) -> :meth:`_decode_block` (a block of
steps on the active rows, then the block's one host sync: which rows finished). A block runs one of two
programs, replayed as one CUDA graph per batch bucket:

* a plain step, :meth:`_decode_step`: one token for every active row;
* with a drafter, when the toggle says so, a speculative *cycle*: ``k`` :meth:`_draft_step` s (one draft
  token per row, from the drafter, over the target's caches) and one :meth:`_verify_step` (the target over
  ``[last token, d_1..d_k]``, exact rejection sampling: 1..k+1 tokens per row).

Both end in :meth:`_emit`, the one place where a row's tokens, log-probs, version stamps, length and done flag
change. Steps
are compiled with ``fullgraph=True`` (one compiled step for every batch bucket; a verify step for every draft
length) and never synchronise with the host.

Layout. Every distinct prompt is prefilled once into a *prefix slot*; its ``n_samples`` rows each own a
*generation slot* and point at the shared prefix slot. Rows that finish leave the active set at the next
block boundary, and new prompts are admitted into the freed slots, so a step's cost follows the number of
active rows. Device state: :class:`~sparrow.rollout.state.RowState` per generation slot,
:class:`~sparrow.rollout.state.DraftState` for the cycle's scratch.

Resumable generation. A :class:`RolloutSession` (:meth:`RolloutEngine.start`) holds groups across calls: each
:meth:`RolloutSession.run` decodes until enough groups have finished and returns them, leaving the unfinished
rows, their caches and prefix slots in place for the next call. Between calls the weights may change in place
(a weight sync; :meth:`RolloutEngine.set_policy_version` names the new version): rows continue over the KV that
the earlier weights cached, and every token carries the version that sampled it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Literal, Mapping, Sequence

import torch
from torch._dynamo.utils import counters as dynamo_counters
from torchtune.modules import TransformerDecoder
from tqdm import tqdm

from sparrow.attention.base import CacheSpec, PrefillMeta
from sparrow.attention.common import decode_impl
from sparrow.compile_cache import CompileCache, cache_counters, module_signature
from sparrow.kernels.decode_attention import CASCADE_MIN_ROWS, per_row_decode, shares_enough
from sparrow.models.attention import attention_modules
from sparrow.models.fuse import fuse_projections_, unfuse_projections_
from sparrow.rollout.forward import decode_hidden, logits_from_hidden, prefill_hidden
from sparrow.sampling import (SamplingParams, gumbel_noise, process_logits, row_keys, sample_from_logprobs,
                              vocab_argmax)
from sparrow.rollout.state import DraftState, RowState
from sparrow.speculative.base import AlwaysOff, Drafter, StepStats, ToggleController
from sparrow.speculative.costs import expected_tokens_per_cycle
from sparrow.speculative.rejection import DRAFT_SALT, accept_counter_based
from sparrow.speculative.toggle import AlwaysOn

FinishReason = Literal["stop", "length"]
StepKind = Literal["decode", "draft", "cycle"]
STOP_SLOTS = 8  # stop-id buffer entries; a mode's compiled steps and graphs are shared by all stop sets that fit


@dataclass
class _Mode:
    """What one sampling mode compiled and captured: compiled steps by kind (``decode``, ``draft``,
    ``verify``), CUDA graphs by ``(kind, bucket, draft length)``, and its stop-id buffer (which they read)."""

    stop_ids: torch.Tensor
    steps: dict[str, Callable] = field(default_factory=dict)
    graphs: dict[tuple[str, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = field(default_factory=dict)


def _flat_options(options: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"triton": {"enable_pdl": True}}`` -> ``{"triton.enable_pdl": True}`` (flat names pass unchanged)."""
    flat: dict[str, Any] = {}
    for key, value in options.items():
        name = f"{prefix}{key}"
        flat.update(_flat_options(value, name + ".") if isinstance(value, Mapping) else {name: value})
    return flat


NEEDS_DRAFTER = "a toggle needs a drafter (only AlwaysOff, which never speculates, goes without one)"
RECOMPILE_LIMIT = 64  # compiled graphs of one step kind, over every engine in the process (see compile_step)
ACCUMULATED_RECOMPILE_LIMIT = 256  # and of all kinds (Dynamo's default)


def is_stop(tokens: torch.Tensor, stop_ids: torch.Tensor) -> torch.Tensor:
    """Whether each of ``tokens`` (any shape, int64) is one of ``stop_ids`` [S] (padded with -1): one broadcast
    compare, since ``torch.isin`` on CUDA may sort, which a CUDA graph cannot capture in eager mode."""
    return (tokens[..., None] == stop_ids).any(-1)


def stop_slots(n: int) -> int:
    """Entries of the stop-id buffer for ``n`` stop ids: :data:`STOP_SLOTS`, or the next power of two above."""
    slots = STOP_SLOTS
    while slots < n:
        slots *= 2
    return slots


@dataclass(frozen=True)
class EngineConfig:
    """Capacity and execution options of a :class:`RolloutEngine`.

    Attributes:
        max_rows: generation slots: samples decoded at once.
        max_prompts: prefix slots: distinct prompts resident at once (default ``max_rows``).
        max_prompt_len: longest prompt, in tokens.
        max_new_tokens: longest generation the caches can hold.
        compile: compile the decode step with ``torch.compile(fullgraph=True)``.
        cuda_graphs: replay the compiled decode step as CUDA graphs, one per batch bucket (CUDA only).
        batch_buckets: active-row counts the decode step is specialised for (default: powers of two up to
            ``max_rows``, plus ``max_rows``). The active set is padded up to the next bucket.
        block_steps: decode steps per block: the host checks for finished rows (and the toggle decides) once
            per block.
        prefill_tokens: token budget of one prefill micro-batch (prompts padded to the longest in it).
        share_prefix: prefill each prompt once for all its samples (``False`` prefills every sample,
            for comparison).
        compile_backend: ``torch.compile`` backend (``"inductor"``; ``"eager"`` checks graph capture only).
        max_draft: longest speculative draft (0 without a drafter); generation slots keep this many extra
            positions of scratch for the verify pass.
        dynamic_batch: compile each kind of step once for every batch bucket and draft length (their sizes are
            symbolic, ``docs/rollout.md``); ``False`` compiles one static step per bucket and draft length (the
            reference the dynamic one is tested against, bit for bit).
        compile_cache: a directory for compiled code and cost-model calibrations, reused by later engines of the
            same compile key (:class:`sparrow.compile_cache.CompileCache`); ``None``: Inductor's own caches.
        progress: show progress bars over compilation, graph capture and calibration.
        fuse_projections: run each layer's q / k / v projections as one matmul and its MLP's gate / up projections
            as another (:func:`sparrow.models.fuse_projections_`, applied to the model when the engine is made:
            every parameter keeps its name and object, as views of the fused storage, so the weight sync, the
            drafter's refresh and ``load_state_dict`` work unchanged). ``False`` runs the separate projections
            (a fused model is unfused, :func:`sparrow.models.unfuse_projections_`: structurally only, its storage
            kept), for comparison.
        inductor_options: Inductor settings for the compiled steps, by their ``torch._inductor.config`` names
            (e.g. ``{"triton.enable_pdl": True}``: programmatic dependent launch on Hopper, where a kernel's launch
            overlaps the previous one's tail; nested mappings, as a YAML section gives them, are flattened to
            such names); part of the compile key. Needs ``compile_backend="inductor"``.
    """

    max_rows: int = 64
    max_prompts: int | None = None
    max_prompt_len: int = 2048
    max_new_tokens: int = 512
    compile: bool = True
    cuda_graphs: bool = True
    batch_buckets: tuple[int, ...] | None = None
    block_steps: int = 8
    prefill_tokens: int = 32768
    share_prefix: bool = True
    compile_backend: str = "inductor"
    max_draft: int = 0
    dynamic_batch: bool = True
    compile_cache: str | None = None
    progress: bool = False
    fuse_projections: bool = True
    inductor_options: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.inductor_options is not None:
            if not isinstance(self.inductor_options, Mapping):
                raise ValueError(f"EngineConfig.inductor_options must be a mapping of Inductor config names to "
                                 f"values, got {self.inductor_options!r}")
            from torch._inductor import config as inductor_config

            options = _flat_options(self.inductor_options)
            unknown = sorted(set(options) - set(inductor_config.get_config_copy()))
            if unknown:
                raise ValueError(f"EngineConfig.inductor_options: {unknown} are not torch._inductor.config names")
            if self.compile_backend != "inductor":
                raise ValueError(f"EngineConfig.inductor_options need compile_backend='inductor', got "
                                 f"{self.compile_backend!r}")
            object.__setattr__(self, "inductor_options", options)
        if not isinstance(self.fuse_projections, bool):
            raise ValueError(f"EngineConfig.fuse_projections must be a bool, got {self.fuse_projections!r}")
        if self.compile_cache is not None:
            if not isinstance(self.compile_cache, (str, os.PathLike)) or not str(self.compile_cache):
                raise ValueError(f"EngineConfig.compile_cache must be a directory path or None, got "
                                 f"{self.compile_cache!r}")
            object.__setattr__(self, "compile_cache", str(self.compile_cache))
        if self.max_draft < 0:
            raise ValueError(f"EngineConfig.max_draft must be >= 0, got {self.max_draft}")
        for name in ("max_rows", "max_prompt_len", "max_new_tokens", "block_steps", "prefill_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompts is not None and self.max_prompts < 1:
            raise ValueError(f"EngineConfig.max_prompts must be >= 1, got {self.max_prompts}")
        if self.batch_buckets is not None:
            b = tuple(sorted(set(int(x) for x in self.batch_buckets)))
            if not b or b[0] < 1:
                raise ValueError(f"batch_buckets must be positive integers, got {self.batch_buckets}")
            if b[-1] < self.max_rows:
                b = b + (self.max_rows,)
            object.__setattr__(self, "batch_buckets", b)

    @property
    def buckets(self) -> tuple[int, ...]:
        if self.batch_buckets is not None:
            return self.batch_buckets
        b, x = [], 1
        while x < self.max_rows:
            b.append(x)
            x *= 2
        return tuple(b) + (self.max_rows,)

    @property
    def num_prefixes(self) -> int:
        return self.max_prompts if self.max_prompts is not None else self.max_rows


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

    def __iter__(self):
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

    def __init__(self, engine: RolloutEngine, n_samples: int, params: SamplingParams) -> None:
        self.engine = engine
        self.n_samples = n_samples
        self.params = params
        self._prompts: dict[int, torch.Tensor] = {}  # open group -> prompt
        self._pending: list[int] = []  # groups waiting for slots, in order
        self._next = 0
        self._owner: dict[int, tuple[int, int, int]] = {}  # row -> (group, sample, prefix slot)
        self._prefix_refs: dict[int, int] = {}  # prefix slot -> rows still reading it
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
        toks = self.engine._validate(prompts, self.n_samples, self.params)
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
        rows = {(g, j): r for r, (g, j, _) in self._owner.items()}
        for g in self.open_groups:
            if g not in self._admitted:
                out.append(GroupProgress(g, None, (0,) * self.n_samples))
                continue
            done = self._done.get(g, {})
            lengths = tuple(done[j].length if j in done else self.engine._ngen.get(rows[(g, j)], 1)
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
        rows = [r for r, (g, _, _) in self._owner.items() if g in gone]
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
        e, n = self.engine, self.n_samples
        reachable = len(self._prompts) if admit else len(self._prompts) - len(self._pending)
        if min_groups is not None and not 0 <= min_groups <= reachable:
            raise ValueError(f"min_groups ({min_groups}) must lie in [0, {reachable}]: the groups this session can "
                             "finish" + ("" if admit else " without admitting new ones"))
        finish = set(finish)
        bad = sorted(g for g in finish if g not in self._prompts or (not admit and g in self._pending))
        if bad:
            raise ValueError(f"groups {bad} cannot finish in this run: not open" + ("" if admit else " or waiting"))
        target = reachable if min_groups is None else min_groups
        e._set_params(self.params)
        stats = GenerationStats()
        finished: dict[int, list[Sample]] = {}
        per_prompt = 1 if e.config.share_prefix else n  # prefix slots a group takes
        admitted_rows = 0
        while (admit and self._pending) or self._active:
            if len(finished) >= target and not finish & self._prompts.keys():
                break
            batch = []
            while admit and self._pending and len(e._free_rows) >= n and len(e._free_prefixes) >= per_prompt:
                g = self._pending.pop(0)
                rows = [e._free_rows.pop(0) for _ in range(n)]
                slots = [e._free_prefixes.pop(0) for _ in range(per_prompt)]
                for j, r in enumerate(rows):
                    slot = slots[j % per_prompt]
                    self._owner[r] = (g, j, slot)
                    self._prefix_refs[slot] = self._prefix_refs.get(slot, 0) + 1
                self._admitted[g] = e.policy_version
                batch.append((g, rows, slots))
            if batch:
                t0 = time.perf_counter()
                e._admit(batch, self._prompts, n, stats)
                stats.prefill_s += e._elapsed(t0)
                admitted_rows += n * len(batch)
                self._active = sorted(self._active + [r for _, rows, _ in batch for r in rows])
            if not self._active:
                raise RuntimeError(
                    f"the engine has {len(e._free_rows)} free generation slots and {len(e._free_prefixes)} free "
                    f"prefix slots, too few for a group of {n}: other open rollout sessions hold the rest")
            # a block of steps on the active rows, then one host sync to retire finished rows
            t0 = time.perf_counter()
            done = e._decode_block(self._active, [self._prompts[self._owner[r][0]].numel() for r in self._active],
                                   [self._owner[r][2] for r in self._active], stats)
            stats.decode_s += e._elapsed(t0)
            if done:
                self._retire(done, finished)
        samples = [s for g in sorted(finished) for s in finished[g]]
        stats.generated_tokens = admitted_rows + sum(stats.block_tokens.values())
        return Generation(samples, stats)

    def _retire(self, rows: list[int], finished: dict[int, list[Sample]]) -> None:
        """Collect finished ``rows`` and free their slots; a group whose last sample finished moves to
        ``finished`` and leaves the session."""
        for s in self.engine._collect(rows, [self._owner[r][:2] for r in rows], self.params):
            done = self._done.setdefault(s.prompt_index, {})
            done[s.sample_index] = s
            if len(done) == self.n_samples:
                finished[s.prompt_index] = [done[j] for j in range(self.n_samples)]
                del self._done[s.prompt_index], self._prompts[s.prompt_index], self._admitted[s.prompt_index]
        self._release(rows)

    def _release(self, rows: list[int]) -> None:
        e = self.engine
        for r in rows:
            slot = self._owner.pop(r)[2]
            e._ngen.pop(r, None)
            e._free_rows.append(r)
            self._prefix_refs[slot] -= 1
            if self._prefix_refs[slot] == 0:
                del self._prefix_refs[slot]
                e._free_prefixes.append(slot)
        e._free_rows.sort()
        e._free_prefixes.sort()
        gone = set(rows)
        self._active = [r for r in self._active if r not in gone]

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this rollout session is closed")


class RolloutEngine:
    """Samples completions from a Sparrow model (see module docstring for the design).

    Args:
        model: a torchtune decoder whose attention layers are :class:`SparrowAttention` (use the
            builders in :mod:`sparrow.models` or :func:`sparrow.models.use_attention`). The engine uses
            it in place, in its current dtype and device, under ``torch.no_grad``, with its projections fused
            (``EngineConfig.fuse_projections``): build a weight-sync receiver over its parameters after the
            engine, and move or cast the model before it (``.to()`` keeps the fusion, but compiled steps and
            CUDA graphs read the tensors of the time they were made).
        config: capacity and execution options.
        drafter: enables speculative decoding (e.g. :class:`sparrow.speculative.QuantizedSelfDrafter`);
            needs ``config.max_draft >= 1``. Sampled tokens follow the target's distribution exactly and
            their log-probs are the target's.
        toggle: decides before each block whether to speculate and how far (default: always, with
            ``config.max_draft`` drafts). Draft lengths above ``config.max_draft`` are clamped.

    Raises:
        ValueError: attention backends that cannot run on the model's device and dtype, a toggle without a
            drafter, a drafter without ``config.max_draft``, or (``config.fuse_projections``) projections that
            cannot be fused (the message names the module; see :func:`sparrow.models.fuse_projections_`).
    """

    def __init__(self, model: TransformerDecoder, config: EngineConfig | None = None,
                 drafter: Drafter | None = None, toggle: ToggleController | None = None) -> None:
        self.model = model
        self.config = config or EngineConfig()
        self.attn = attention_modules(model)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.vocab_size = model.tok_embeddings.num_embeddings
        self.max_seq_len = model.max_seq_len
        reasons = [f"layer {a.backend.shape.layer_idx}: {r}" for a in self.attn
                   for r in a.backend.validate_configuration(dtype=self.dtype, device=self.device)]
        if reasons:
            raise ValueError("attention backends cannot run here: " + "; ".join(reasons))
        if drafter is None and not (toggle is None or isinstance(toggle, AlwaysOff)):
            raise ValueError(NEEDS_DRAFTER)
        if drafter is not None and self.config.max_draft < 1:
            raise ValueError("speculative decoding needs EngineConfig.max_draft >= 1 (the draft scratch length)")
        self._drafter = drafter
        self._toggle = toggle if drafter is None else (toggle or AlwaysOn(self.config.max_draft))
        # one matmul for q / k / v and one for gate / up (views keep every parameter's name and storage), or none
        (fuse_projections_ if self.config.fuse_projections else unfuse_projections_)(model)
        self.caches: list | None = None
        self.rows: RowState | None = None
        self.drafts: DraftState | None = None
        self._params: SamplingParams | None = None
        self._mode: _Mode | None = None  # the current sampling mode's compiled steps and graphs
        self._modes: dict[tuple, _Mode] = {}  # every mode seen, by its key
        self._pool = None  # one CUDA-graph memory pool: the graphs never run concurrently
        self._ngen: dict[int, int] = {}  # host view of each active row's n_gen, refreshed at every block sync
        self._alpha_seen = 0.8  # acceptance seen so far (sizes speculative blocks; decisions are the toggle's)
        self._compiled: dict[str, int] = {}  # step kind -> graphs compiled for it (every mode)
        self._setup_s: dict[str, float] = {}  # setup phase -> seconds (compilation, capture, warm-up)
        self._compile_cache = None  # the CompileCache of config.compile_cache, made on first use
        self._backed: set[str] = set()  # steps compiled with backed dynamic sizes (see _symbolic)
        spec = self.cache_spec
        self._free_rows = list(range(spec.num_rows))  # generation slots no session holds, ascending
        self._free_prefixes = list(range(spec.num_prefixes))  # prefix slots no session holds, ascending
        self._policy_version = 0

    @property
    def captured_graphs(self) -> int:
        """CUDA graphs captured so far over every sampling mode: plain steps, draft steps and speculative cycles
        (0 without CUDA graphs). A count that grows during a generation means it captured (and compiled) inside
        it; :meth:`prepare` keeps it from growing."""
        return sum(len(m.graphs) for m in self._modes.values())

    @property
    def sampling_modes(self) -> int:
        """Sampling modes seen so far (each compiles its own steps, see :meth:`_set_params`)."""
        return len(self._modes)

    @property
    def drafter(self) -> Drafter | None:
        return self._drafter

    @property
    def toggle(self) -> ToggleController | None:
        return self._toggle

    @toggle.setter
    def toggle(self, toggle: ToggleController) -> None:
        if self._drafter is None and not isinstance(toggle, AlwaysOff):
            raise ValueError(NEEDS_DRAFTER)
        self._toggle = toggle

    @property
    def scratch(self) -> int:
        """The generation slot padding rows point at (always done: nothing read back depends on it)."""
        return self.cache_spec.num_rows

    # ------------------------------------------------------------------------------------ setup
    @property
    def cache_spec(self) -> CacheSpec:
        c = self.config
        num_prefixes = c.num_prefixes if c.share_prefix else max(c.num_prefixes, c.max_rows)
        return CacheSpec(num_prefixes, c.max_prompt_len, c.max_rows, c.max_new_tokens + c.max_draft + 1)

    def _allocate(self) -> None:
        spec, dev, c = self.cache_spec, self.device, self.config
        self.caches = [a.backend.init_cache(spec, dtype=self.dtype, device=dev) for a in self.attn]
        R = spec.num_rows + 1  # + the scratch slot of padding rows
        self.rows = RowState.allocate(R, c.max_new_tokens + c.max_draft + 1, dev)
        self.rows.policy_version.fill_(self._policy_version)
        if self._drafter is not None:
            self.drafts = DraftState.allocate(R, c.max_draft, self.vocab_size, dev)

    def cache_nbytes(self) -> int:
        if self.caches is None:
            return 0
        return sum(a.backend.cache_nbytes(c) for a, c in zip(self.attn, self.caches))

    def _set_params(self, params: SamplingParams) -> None:
        """Make ``params`` current (allocating the state on first use). The compiled steps and CUDA graphs
        specialise on the processing parameters (temperature, top-p, top-k, vocabulary limit) and on the size of
        the stop-id buffer: each such mode keeps its own, so alternating modes (say, sampled rollouts and greedy
        evaluation) compiles and captures each once. The stop ids sit in a buffer of :data:`STOP_SLOTS` entries
        (more when more are given, rounded up to a power of two), padded with -1 (no token): a different stop
        set, or none, reuses the mode's graphs."""
        if self.caches is None:
            self._allocate()
        stop = params.stop_token_ids
        key = params.processing + (stop_slots(len(stop)),)
        if key not in self._modes:
            self._modes[key] = _Mode(torch.full((key[-1],), -1, dtype=torch.int64, device=self.device))
        self._mode = self._modes[key]
        padded = list(stop) + [-1] * (self._mode.stop_ids.numel() - len(stop))
        self._mode.stop_ids.copy_(torch.tensor(padded, dtype=torch.int64))  # in place: captured graphs read it
        self.rows.seed.fill_(params.seed)
        self.rows.max_new.fill_(params.max_new_tokens)
        self._params = params

    def prepare(self, params: SamplingParams | None = None, draft_lengths: Sequence[int] | None = None) -> float:
        """Compile the steps of ``params``' sampling mode and capture their CUDA graphs for every batch bucket
        (with a drafter also the draft step and the speculative cycle of every draft length the toggle can ask
        for, :meth:`ToggleController.draft_lengths`, or ``draft_lengths``), so that no block of a later
        :meth:`generate` in that mode compiles. Without it the first block at each batch size (and draft
        length) pays for compilation and capture inside the generation that meets it. Every step runs on the
        scratch row alone: nothing a generation reads changes. Kind by kind: the first bucket compiles the kind's
        step (with ``dynamic_batch``, once for all of them), the others capture their graphs from it
        (``EngineConfig.progress`` shows each). Returns the seconds it took; :attr:`setup_seconds` holds them by
        phase.

        Raises:
            TypeError: ``params`` is not :class:`SamplingParams`.
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        t0, lookups = time.perf_counter(), cache_counters()
        self._set_params(params)
        ks: tuple[int, ...] = ()
        if self._drafter is not None:
            ks = tuple(self._toggle.draft_lengths() if draft_lengths is None else draft_lengths)
            ks = tuple(sorted({min(int(k), self.config.max_draft) for k in ks if k >= 1}))
        self.rows.done[self.scratch] = True
        kinds = [("decode", 0)] + ([("draft", 0)] + [("cycle", k) for k in ks] if self._drafter is not None else [])
        plan = [(kind, b, k, apart) for kind, k in kinds for b in self.config.buckets  # a second graph: rows apart
                for apart in (False, True)[:1 + (self._graphed and self._apart_differs(b))]]
        with tqdm(plan, desc="rollout engine", disable=not self.config.progress, leave=False,
                  dynamic_ncols=True) as bar:
            for kind, b, k, apart in bar:
                bar.set_description(self._describing(kind, b, k, apart))
                self._warm(kind, b, k, torch.full((b,), self.scratch, dtype=torch.int64, device=self.device), apart)
        self._synchronize()
        self._add_lookups(lookups)
        return time.perf_counter() - t0

    def _describing(self, kind: StepKind, bucket: int, k: int, apart: bool = False) -> str:
        """What preparing ``(kind, bucket, k, apart)`` does, for the progress bar."""
        step = {"decode": "decode step", "draft": "draft step", "cycle": f"verify step (draft length {k})"}[kind]
        step += ", rows apart" if apart else ""
        name = "verify" if kind == "cycle" else kind
        if self._graphed and (kind, bucket, k, apart) in self._mode.graphs:
            return f"{step}, bucket {bucket}: captured"
        if name not in self._mode.steps or not self.config.dynamic_batch:
            return f"compiling the {step}" + ("" if self.config.dynamic_batch else f" for bucket {bucket}")
        return f"capturing the {step} graph, bucket {bucket}" if self._graphed else f"{step}, bucket {bucket}"

    def _add_lookups(self, before: dict[str, int]) -> None:
        for k, v in cache_counters().items():
            if v > before[k]:
                self._add_setup(f"setup/{k}", v - before[k])

    def time_step(self, kind: StepKind, bucket: int, *, context: int, k: int = 0, steps: int = 8,
                  params: SamplingParams | None = None) -> float:
        """Seconds per step of ``steps`` runs of one kind of step (``decode``: a plain step; ``draft``: one draft
        step; ``cycle``: ``k`` draft steps and a verify step) at batch ``bucket`` and context ``context``, through
        the same compiled step / CUDA graph a generation uses (compiled and captured before the timing, counted in
        :attr:`setup_seconds`). Rows ``0 .. bucket-1`` stand in at that context (prompt part in distinct prefix
        slots), done, so the steps change no row's length; they are left idle. For the cost model of the
        speculative toggle.

        Raises:
            ValueError: a kind the engine cannot run (a draft without a drafter, ``k`` out of ``1..max_draft``),
                ``bucket`` not one of the engine's buckets, or a context outside ``[2, max_prompt_len +
                max_new_tokens]``.
        """
        c = self.config
        if kind not in ("decode", "draft", "cycle"):
            raise ValueError(f"kind must be decode, draft or cycle, got {kind!r}")
        if kind != "decode" and self._drafter is None:
            raise ValueError(f"a {kind} step needs a drafter")
        if kind == "cycle" and not 1 <= k <= c.max_draft:
            raise ValueError(f"a cycle needs 1 <= k <= max_draft ({c.max_draft}), got {k}")
        if bucket not in c.buckets:
            raise ValueError(f"bucket {bucket} is not one of the engine's {c.buckets}")
        if not 2 <= context <= c.max_prompt_len + c.max_new_tokens:
            raise ValueError(f"context must lie in [2, {c.max_prompt_len + c.max_new_tokens}], got {context}")
        self._set_params(params or self._params or SamplingParams(max_new_tokens=1))
        r, spec = self.rows, self.cache_spec
        plen = max(1, min(context - 1, c.max_prompt_len))
        rows = torch.arange(bucket, device=self.device)
        r.prefix_slot[rows] = rows % spec.num_prefixes
        r.prefix_len[rows] = plen
        r.n_gen[rows] = max(1, min(context - plen, c.max_new_tokens))
        r.sample_id[rows] = rows
        r.last_token[rows] = 0
        r.done[rows] = True
        lookups = cache_counters()
        apart = self._apart(bucket, [i % spec.num_prefixes for i in range(bucket)])  # as a block on these rows
        run = self._warm(kind, bucket, k if kind == "cycle" else 0, rows, apart)  # compile / capture outside the timing
        if self._graphed:
            run(rows)  # a first replay, untimed too
        self._synchronize()
        self._add_lookups(lookups)
        t0 = time.perf_counter()
        for _ in range(steps):
            run(rows)
        self._synchronize()
        seconds = (time.perf_counter() - t0) / steps
        r.idle(rows)
        return seconds

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------------------ validation
    def _validate(self, prompts: Sequence, n_samples: int, params: SamplingParams) -> list[torch.Tensor]:
        self._validate_sampling(n_samples, params)
        return self._validate_prompts(prompts, params)

    def _validate_sampling(self, n_samples: int, params: SamplingParams) -> None:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        if n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {n_samples}")
        if n_samples > self.config.max_rows:
            raise ValueError(f"n_samples ({n_samples}) exceeds the engine's max_rows ({self.config.max_rows})")
        if params.max_new_tokens > self.config.max_new_tokens:
            raise ValueError(
                f"max_new_tokens ({params.max_new_tokens}) exceeds the engine's capacity "
                f"({self.config.max_new_tokens}); raise EngineConfig.max_new_tokens"
            )
        params.validate_vocab(self.vocab_size)

    def _validate_prompts(self, prompts: Sequence, params: SamplingParams) -> list[torch.Tensor]:
        if len(prompts) == 0:
            raise ValueError("no prompts given")
        out = []
        for i, p in enumerate(prompts):
            t = torch.as_tensor(p, dtype=torch.int64).flatten().cpu()
            if t.numel() == 0:
                raise ValueError(f"prompt {i} is empty")
            if int(t.min()) < 0 or int(t.max()) >= self.vocab_size:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.vocab_size})")
            if t.numel() + params.max_new_tokens > self.max_seq_len:
                raise ValueError(
                    f"prompt {i} ({t.numel()} tokens) + max_new_tokens ({params.max_new_tokens}) is longer than "
                    f"the model's context ({self.max_seq_len} tokens)"
                )
            if t.numel() > self.config.max_prompt_len:
                raise ValueError(
                    f"prompt {i} ({t.numel()} tokens) is longer than the engine's max_prompt_len "
                    f"({self.config.max_prompt_len})"
                )
            out.append(t)
        return out

    # ------------------------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(
        self, prompts: Sequence[Sequence[int] | torch.Tensor], n_samples: int = 1,
        params: SamplingParams | None = None,
    ) -> Generation:
        """Sample ``n_samples`` completions of every prompt (a :class:`RolloutSession` run to the end).

        Args:
            prompts: token id sequences (lists or 1-D tensors), each non-empty.
            n_samples: completions per prompt (a GRPO group).
            params: sampling parameters (default: ``SamplingParams()``).

        Returns:
            :class:`Generation` with ``len(prompts) * n_samples`` samples, prompt-major: sample ``j`` of
            prompt ``i`` is at ``i * n_samples + j``.

        Raises:
            ValueError: empty prompt list or prompt, token ids outside the vocabulary, a prompt longer than
                the model's context or the engine's ``max_prompt_len``, ``max_new_tokens`` above capacity,
                stop tokens outside the vocabulary, ``n_samples`` < 1 or above ``max_rows``.
            RuntimeError: open sessions hold so many slots that not one group fits beside them.
        """
        session = self.start(n_samples, params)
        try:
            session.add(prompts)
            return session.run()
        finally:
            session.close()

    def start(self, n_samples: int = 1, params: SamplingParams | None = None) -> RolloutSession:
        """A :class:`RolloutSession` sampling groups of ``n_samples`` with ``params`` (the seed is the session's:
        every group's noise stream is its id under it).

        Raises:
            TypeError / ValueError: as :meth:`generate` for ``n_samples`` and ``params``.
        """
        params = params or SamplingParams()
        self._validate_sampling(n_samples, params)
        return RolloutSession(self, n_samples, params)

    @property
    def policy_version(self) -> int:
        """The version stamped on the tokens the engine samples now (:meth:`set_policy_version`; 0 at first)."""
        return self._policy_version

    def set_policy_version(self, version: int) -> None:
        """Name the version of the weights the engine holds now (call it after each weight sync): every token
        sampled from here on carries it in :attr:`Sample.versions`. Written in place (captured graphs read it);
        the KV cached before keeps the earlier weights' values.

        Raises:
            ValueError: ``version`` not an integer in ``[0, 2**31)``.
        """
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < 2 ** 31:
            raise ValueError(f"policy version must be an integer in [0, 2**31), got {version!r}")
        self._policy_version = version
        if self.rows is not None:
            self.rows.policy_version.fill_(version)

    def _elapsed(self, t0: float) -> float:
        self._synchronize()  # deliberate host sync: the phase's wall time (after a block, its read has synced already)
        return time.perf_counter() - t0

    # ---------------------------------------------------------------------------------- prefill
    def _admit(self, admit, toks: list[torch.Tensor], n: int, stats: GenerationStats) -> None:
        """Prefill the admitted prompts (micro-batched by length) and sample each row's first token."""
        jobs = []  # (prompt index, prefix slot, rows reading this prefix, their sample indices)
        for pi, rows, slots in admit:
            if len(slots) == 1:
                jobs.append((pi, slots[0], rows, list(range(n))))
            else:  # no prefix sharing: one prefill per sample
                jobs.extend((pi, s, [r], [j]) for j, (s, r) in enumerate(zip(slots, rows)))
        jobs.sort(key=lambda j: -toks[j[0]].numel())
        i = 0
        while i < len(jobs):
            width = toks[jobs[i][0]].numel()  # the longest prompt of this micro-batch (sorted)
            m = max(1, min(len(jobs) - i, self.config.prefill_tokens // width))
            self._prefill_batch(jobs[i:i + m], toks, n, stats)
            i += m

    def _prefill_batch(self, batch, toks, n: int, stats: GenerationStats) -> None:
        dev, r = self.device, self.rows
        lens = [toks[pi].numel() for pi, _, _, _ in batch]
        tokens = torch.zeros((len(batch), max(lens)), dtype=torch.int64)  # right padding
        for b, (pi, _, _, _) in enumerate(batch):
            tokens[b, : lens[b]] = toks[pi]
        tokens = tokens.to(dev)
        slots = torch.tensor([s for _, s, _, _ in batch], dtype=torch.int64, device=dev)
        plen = torch.tensor(lens, dtype=torch.int64, device=dev)
        h = prefill_hidden(self.model, tokens, self.caches, PrefillMeta(slots, plen))
        logits = logits_from_hidden(self.model, h[torch.arange(len(batch), device=dev), plen - 1])  # [B, V]
        stats.prefill_tokens += sum(lens)

        # the first token of every row that reads these prefixes
        owner = torch.tensor([b for b, (_, _, rs, _) in enumerate(batch) for _ in rs], device=dev)
        rows = torch.tensor([r for _, _, rs, _ in batch for r in rs], dtype=torch.int64, device=dev)
        sid = torch.tensor([pi * n + j for pi, _, _, js in batch for j in js], dtype=torch.int64, device=dev)
        r.prefix_slot[rows] = slots[owner]
        r.prefix_len[rows] = plen[owner]
        r.sample_id[rows] = sid
        logprobs = process_logits(logits[owner], self._params)
        tok = sample_from_logprobs(logprobs, row_keys(r.seed, sid, torch.zeros_like(sid)), self._params.greedy)
        r.tokens[rows, 0] = tok
        r.logprobs[rows, 0] = logprobs.gather(-1, tok[:, None]).squeeze(-1)
        r.versions[rows, 0] = r.policy_version
        r.n_gen[rows] = 1
        r.last_token[rows] = tok
        r.done[rows] = is_stop(tok, self._mode.stop_ids) | (r.max_new <= 1)

    # ----------------------------------------------------------------------------------- blocks
    def _decode_block(self, active: list[int], prompt_lens: list[int], prefixes: list[int],
                      stats: GenerationStats) -> list[int]:
        """One block on the ``active`` rows (``prompt_lens``: their prompts' lengths, ``prefixes``: their prefix
        slots): plain steps, or with a drafter speculative cycles of the length the toggle picks, with the rows
        apart where they share their prompts too little (:meth:`_apart`); then the block's one host sync. Returns
        the rows that finished."""
        A, c = len(active), self.config
        bucket = self._bucket(A)
        k, st = 0, None
        if self._drafter is not None:
            ctx = [p + self._ngen.get(r, 1) for r, p in zip(active, prompt_lens)]
            st = StepStats(A, sum(ctx) / A, max(ctx), bucket)
            decision = self._toggle.decide(st)
            k = min(decision.num_draft, c.max_draft) if decision.speculate else 0
            self.drafts.counters.zero_()
        slots = torch.tensor(active + [self.scratch] * (bucket - A), dtype=torch.int64).to(self.device)
        self.rows.done[self.scratch] = True  # padding rows never change state that is read back
        # about block_steps tokens per row per block: fewer cycles when each emits several
        steps = max(1, round(c.block_steps / expected_tokens_per_cycle(self._alpha_seen, k))) if k else c.block_steps
        apart = self._apart(bucket, prefixes)
        run = self._runner("cycle" if k else "decode", bucket, k, apart)
        t0 = time.perf_counter()
        for _ in range(steps):
            run(slots)
        idx = slots[:A]
        parts = [self.rows.done[idx].long(), self.rows.n_gen[idx]]
        host = torch.cat(parts + ([self.drafts.counters] if self._drafter is not None else [])).cpu()
        seconds = time.perf_counter() - t0  # deliberate host sync above: which rows finished, how far each got
        done, n_gen = host[:A].tolist(), host[A:2 * A].tolist()
        tokens = sum(m - self._ngen.get(r, 1) for r, m in zip(active, n_gen))
        stats.decode_steps += steps
        stats.apart_steps += steps if apart else 0
        stats.row_steps += steps * bucket
        stats.active_hist[bucket] = stats.active_hist.get(bucket, 0) + steps
        stats.block_tokens[bucket] = stats.block_tokens.get(bucket, 0) + tokens
        stats.block_time_s[bucket] = stats.block_time_s.get(bucket, 0.0) + seconds
        if self._drafter is not None:
            self._toggle.observe_block(st, num_draft=k, steps=steps, seconds=seconds)
            if k:
                proposed, accepted, row_cycles = host[2 * A:].tolist()
                stats.spec_cycles += steps
                stats.spec_row_cycles += row_cycles
                stats.draft_proposed += proposed
                stats.draft_accepted += accepted
                stats.spec_hist[bucket] = stats.spec_hist.get(bucket, 0) + steps
                stats.draft_len_hist[k] = stats.draft_len_hist.get(k, 0) + steps
                if proposed > 0:
                    self._alpha_seen = 0.5 * self._alpha_seen + 0.5 * accepted / proposed
                self._toggle.observe(proposed=proposed, accepted=accepted, rows=row_cycles, seconds=seconds)
        self._ngen.update(zip(active, n_gen))  # a finished row's final length stays until its slot is released
        return [r for r, d in zip(active, done) if d]

    def _collect(self, rows: list[int], owners: list[tuple[int, int]], params: SamplingParams) -> list[Sample]:
        """The samples of finished ``rows`` (``owners``: each row's (group, sample index)), read back to the host."""
        lengths = [self._ngen[r] for r in rows]  # known since the block's sync
        width = max(lengths)
        idx = torch.tensor(rows, dtype=torch.int64, device=self.device)
        r = self.rows
        # tokens (int64), log-probs (float32) and versions (int32) as one int32 block: one copy, bits kept
        parts = (r.tokens[idx, :width].view(torch.int32), r.logprobs[idx, :width].view(torch.int32),
                 r.versions[idx, :width])
        host = torch.cat(parts, dim=1).cpu()  # deliberate host sync: the finished rows' samples, at a block boundary
        toks = host[:, :2 * width].view(torch.int64)
        lps = host[:, 2 * width:3 * width].view(torch.float32)
        vers = host[:, 3 * width:]
        stop_set = set(params.stop_token_ids)
        out = []
        for k, ((g, j), L) in enumerate(zip(owners, lengths)):
            t = toks[k, :L].clone()
            reason: FinishReason = "stop" if stop_set and int(t[-1]) in stop_set else "length"
            out.append(Sample(g, j, t, lps[k, :L].clone(), reason, vers[k, :L].clone()))
        return out

    # ------------------------------------------------------------------------------------ steps
    def _decode_step(self, row_slot: torch.Tensor) -> None:
        """One token for each row in ``row_slot`` [A] (padding rows point at the scratch slot).

        Pure device work on the engine's state: no host sync, no data-dependent Python branching.
        """
        r = self.rows
        n_gen = r.n_gen[row_slot]  # [A] tokens emitted so far; the last one is not cached yet
        h = decode_hidden(self.model, r.last_token[row_slot][:, None], self.caches, r.meta(row_slot, n_gen - 1))
        logprobs = process_logits(logits_from_hidden(self.model, h[:, 0]), self._params)  # [A, V]
        tok = sample_from_logprobs(logprobs, row_keys(r.seed, r.sample_id[row_slot], n_gen), self._params.greedy)
        lp = logprobs.gather(-1, tok[:, None])  # [A, 1]
        self._emit(row_slot, n_gen, tok[:, None], lp, torch.zeros_like(n_gen))

    def _draft_step(self, row_slot: torch.Tensor) -> None:
        """One draft token for every row of ``row_slot`` [A] at draft index ``cursor``: the drafter's forward at
        position ``n_gen - 1 + cursor`` (the cursor is a device tensor, so every draft step is the same graph),
        processed like the target's logits, drawn with the draft noise stream; advances the cursor."""
        r, d = self.rows, self.drafts
        A = row_slot.shape[0]
        i = d.cursor
        n_gen = r.n_gen[row_slot]
        ar = torch.arange(A, device=row_slot.device)
        prev = d.tokens[:A].gather(1, (i - 1).clamp(min=0).view(1, 1).expand(A, 1)).squeeze(1)
        tok_in = torch.where(i == 0, r.last_token[row_slot], prev)
        logits = self._drafter.forward_logits(tok_in[:, None], self.caches, r.meta(row_slot, n_gen - 1 + i))[:, 0]
        logq = process_logits(logits, self._params)
        idx = i.view(1).expand(A)
        if self._params.greedy:
            tok = vocab_argmax(logq)
        else:
            keys = row_keys(r.seed, r.sample_id[row_slot], n_gen + i)
            tok = vocab_argmax(logq + gumbel_noise(keys, logq.shape[-1], DRAFT_SALT))
            d.probs.index_put_((ar, idx), logq.exp())
        d.tokens.index_put_((ar, idx), tok)
        d.cursor.add_(1)

    def _verify_step(self, row_slot: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor) -> None:
        """The target over ``[last token, d_1..d_k]`` for every row of ``row_slot`` [A] (``T = k + 1`` new
        tokens: their KV overwrites the draft's), exact rejection sampling with counter-based uniforms, then the
        emitted tokens and their target log-probs; resets the cursor. ``draft_tokens`` [>=A, k] and
        ``draft_probs`` [>=A, k, V] are views of the draft buffers whose first ``A`` rows belong to the batch
        (``k`` is read from their shape: one compiled graph serves every draft length)."""
        r, d = self.rows, self.drafts
        A, k = row_slot.shape[0], draft_tokens.shape[1]
        n_gen = r.n_gen[row_slot]
        drafts = draft_tokens[:A]
        inputs = torch.cat([r.last_token[row_slot][:, None], drafts], dim=1)  # [A, k + 1]
        h = decode_hidden(self.model, inputs, self.caches, r.meta(row_slot, n_gen - 1))  # [A, k + 1, E]
        logp = process_logits(logits_from_hidden(self.model, h), self._params)  # [A, k + 1, V]
        keys = row_keys(r.seed, r.sample_id[row_slot], n_gen[:, None] + torch.arange(k + 1, device=row_slot.device))
        greedy = self._params.greedy
        tokens, accepted = accept_counter_based(logp, drafts, None if greedy else draft_probs[:A], keys, greedy)
        live = self._emit(row_slot, n_gen, tokens, logp.gather(-1, tokens[..., None]).squeeze(-1), accepted)
        n_live = live.long().sum()
        d.counters.add_(torch.stack([n_live * k, (accepted * live.long()).sum(), n_live]))
        d.cursor.zero_()

    def _emit(self, row_slot: torch.Tensor, n_gen: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor,
              accepted: torch.Tensor) -> torch.Tensor:
        """Emit for rows ``row_slot`` [A] the first ``accepted + 1`` [A] of ``tokens`` / ``logprobs`` [A, T] at
        each row's own offset ``n_gen`` [A], stamped with the current policy version, cut after the first stop
        token and at ``max_new``; a row that was already done emits nothing (its writes land in scratch columns
        nobody reads). The one place where a row's tokens, log-probs, versions, length, last token and done flag
        change. Returns which rows were live [A] bool."""
        r = self.rows
        live = ~r.done[row_slot]
        pos = torch.arange(tokens.shape[1], device=tokens.device)[None, :]
        emit = accepted + 1
        stop = is_stop(tokens, self._mode.stop_ids) & (pos < emit[:, None])
        first_stop = torch.where(stop, pos, tokens.shape[1]).min(dim=1).values
        emit = torch.minimum(torch.minimum(emit, first_stop + 1), r.max_new - n_gen)
        hit_stop = first_stop < emit
        emit = emit * live.long()
        out_idx = n_gen[:, None] + pos  # the buffers hold max_new_tokens + max_draft + 1 columns
        r.tokens[row_slot[:, None], out_idx] = tokens
        r.logprobs[row_slot[:, None], out_idx] = logprobs
        r.versions[row_slot[:, None], out_idx] = r.policy_version
        new_n = n_gen + emit
        r.n_gen[row_slot] = new_n
        new_last = tokens.gather(1, (emit - 1).clamp(min=0)[:, None]).squeeze(1)
        r.last_token[row_slot] = torch.where(live, new_last, r.last_token[row_slot])
        r.done[row_slot] = ~live | hit_stop | (new_n >= r.max_new)
        return live

    # --------------------------------------------------------------------- compiling and graphs
    @property
    def compiled_graphs(self) -> dict[str, int]:
        """Graphs compiled so far per kind of step (``decode``, ``draft``, ``verify``; every sampling mode): with
        ``dynamic_batch`` one per kind and sampling mode for every batch bucket and draft length, without it one per
        bucket (and draft length). A count that grows inside a generation means it compiled there."""
        return dict(self._compiled)

    @property
    def setup_seconds(self) -> dict[str, float]:
        """Seconds this engine has spent on setup so far, by phase: ``setup/compile_<kind>_s`` (the first runs of
        each kind of step, which compile it, or load it from the compile cache), ``setup/capture_s`` (CUDA-graph
        warm-up and capture, compilation excluded) and ``setup/warmup_s`` (without CUDA graphs: the other first
        runs), plus the lookups of Inductor's caches during :meth:`prepare` and :meth:`time_step`
        (``setup/fxgraph_cache_hit``, ``setup/fxgraph_cache_miss``, ... :func:`~sparrow.compile_cache.cache_counters`)."""
        return dict(self._setup_s)

    @property
    def compile_cache(self) -> CompileCache | None:
        """The on-disk cache of this engine's compiled code and calibrations (``EngineConfig.compile_cache``), or
        None."""
        if self.config.compile_cache is not None and self._compile_cache is None:
            self._compile_cache = CompileCache(self.config.compile_cache, self.compile_key(), self.device)
        return self._compile_cache

    def compile_key(self) -> dict[str, str]:
        """What the engine's compiled steps depend on (besides the library versions and the device, which
        :class:`~sparrow.compile_cache.CompileCache` adds): the model's architecture, every layer's attention
        backend, the drafter, the dtype and the engine options that shape the steps (all but ``block_steps``,
        ``prefill_tokens``, ``progress`` and ``compile_cache``), with the batch buckets."""
        c = {f.name: getattr(self.config, f.name) for f in dataclasses.fields(self.config)
             if f.name not in ("block_steps", "prefill_tokens", "progress", "compile_cache")}
        return {"model": module_signature(self.model), "attention": " | ".join(repr(a.backend) for a in self.attn),
                "drafter": repr(self._drafter), "dtype": str(self.dtype).replace("torch.", ""),
                "engine": json.dumps(c, sort_keys=True, default=str), "buckets": str(self.config.buckets)}

    def compile_step(self, fn: Callable, kind: str | None = None) -> Callable:
        """``fn`` compiled when the config says so (``fullgraph=True``; with ``dynamic_batch`` its marked sizes are
        symbolic, else every new size compiles a static step), run under ``no_grad`` (inference only, whatever the
        caller's grad mode), its compilations counted under ``kind`` (:attr:`compiled_graphs`) and timed
        (:attr:`setup_seconds`). ``fn`` itself is compiled, not a wrapper around it, so each kind of step keeps its
        own compile cache (wrappers share one code object, and with it one recompile limit, :data:`RECOMPILE_LIMIT`
        graphs over every engine in the process). With Inductor, compiling
        points the process at the engine's compile cache (:meth:`CompileCache.activate`). Inductor's
        coalescing-tiling analysis is switched off: it asserts on the verify step in some torch releases."""
        if not self.config.compile:
            return torch.no_grad()(fn)
        backend = self.config.compile_backend
        if self.compile_cache is not None and backend == "inductor":  # what Inductor compiles goes to the cache
            self.compile_cache.activate()
        options = ({"triton.coalesce_tiling_analysis": False, **(self.config.inductor_options or {})}
                   if backend == "inductor" else None)
        compiled = torch.compile(fn, fullgraph=True, backend=backend, options=options,
                                 dynamic=None if self.config.dynamic_batch else False)
        name = kind or getattr(fn, "__name__", "step")
        # Dynamo counts its recompile limit per code object, and the engines of a process share one per step kind
        # (engines of the same shapes share graphs too): several engines of other shapes (a benchmark's, a
        # drafter's) soon pass the default of 8. Static steps add one specialisation per bucket, length and mode.
        limit = max(RECOMPILE_LIMIT, 0 if self.config.dynamic_batch else
                    8 * len(self.config.buckets) * (self.config.max_draft + 2))

        def step(*args: torch.Tensor) -> None:
            graphs, t0 = dynamo_counters["stats"]["unique_graphs"], time.perf_counter()
            total = max(limit, ACCUMULATED_RECOMPILE_LIMIT)
            with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=limit, accumulated_recompile_limit=total):
                compiled(*args)
            new = dynamo_counters["stats"]["unique_graphs"] - graphs
            if new > 0:  # this call compiled (or loaded from the compile cache): setup work, counted and timed
                self._compiled[name] = self._compiled.get(name, 0) + new
                self._add_setup(f"setup/compile_{name}_s", time.perf_counter() - t0)

        return step

    def _add_setup(self, phase: str, value: float) -> None:
        self._setup_s[phase] = self._setup_s.get(phase, 0) + value

    def _step(self, name: str) -> Callable:
        """The current mode's compiled ``decode`` / ``draft`` / ``verify`` step (compiled on first use)."""
        steps = self._mode.steps
        if name not in steps:
            steps[name] = self.compile_step({"decode": self._decode_step, "draft": self._draft_step,
                                             "verify": self._verify_step}[name], kind=name)
        return steps[name]

    def _bucket(self, a: int) -> int:
        for b in self.config.buckets:
            if b >= a:
                return b
        raise AssertionError(f"{a} active rows exceed max_rows")  # pragma: no cover

    def _symbolic(self, name: str, slots: torch.Tensor, *drafts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Aliases of a compiled step's arguments with the sizes that vary between its runs marked symbolic
        (``dynamic_batch``): the batch dimension of ``slots`` [A] and the draft-length dimension of the draft
        buffers' views ``drafts`` ([R, k], [R, k, V]). The marks go on fresh views, never on the caller's tensors.

        Where torch bounds unbacked sizes (``mark_unbacked(min=, max=, shape_id=)``, torch >= 2.13) both are
        *unbacked* with their ranges (``1..max_rows``, ``1..max_draft``): no value is specialised, not even 1, and
        nothing guards on them, so each kind compiles once for every bucket (1 included) and every draft length
        (1 and ``max_draft`` included: a view of the whole draft buffer is contiguous, and a backed size would
        guard on that). Elsewhere, and for a step whose code cannot be traced with unbacked sizes (:meth:`_call`
        falls back), they are marked dynamic (backed): bucket 1 and draft length 1 then compile steps of their
        own (0/1 specialisation), and Inductor guards the verify step on ``k == max_draft``."""
        args = (slots,) + drafts
        if not (self.config.compile and self.config.dynamic_batch):
            return args
        slots, *drafts = (t.view(t.shape) for t in args)
        if _bounded_unbacked() and name not in self._backed:
            torch._dynamo.decorators.mark_unbacked(slots, 0, min=1, max=self.config.max_rows, shape_id="rows")
            for t in drafts:
                torch._dynamo.decorators.mark_unbacked(t, 1, min=1, max=self.config.max_draft, shape_id="drafts")
        else:
            torch._dynamo.mark_dynamic(slots, 0)
            if drafts and drafts[0].shape[1] > 1:
                for t in drafts:
                    torch._dynamo.mark_dynamic(t, 1)
        return (slots, *drafts)

    def _call(self, name: str, step: Callable, *args: torch.Tensor) -> None:
        """Run compiled step ``name`` on ``args`` with its symbolic sizes (:meth:`_symbolic`). Should compiling it
        with unbacked sizes fail (code that branches on a batch size: a data-dependent guard, in the model or in an
        Inductor lowering, e.g. CPU ``bmm`` asking whether a size is 1), the step falls back to backed dynamic
        sizes, with a warning (its compile count then shows the extra graphs)."""
        try:
            step(*self._symbolic(name, *args))
        except _TRACE_ERRORS as e:  # Dynamo's, or a lowering's inside Inductor
            if name in self._backed or not self.config.dynamic_batch or "data-dependent" not in str(e):
                raise
            self._backed.add(name)
            first = str(e).strip().splitlines()[0]
            warnings.warn(f"the {name} step cannot be compiled with unbacked batch / draft sizes ({first}); it is "
                          "compiled with backed dynamic sizes instead (bucket 1 and draft length 1 compile their own "
                          "graphs)", RuntimeWarning, stacklevel=2)
            step(*self._symbolic(name, *args))

    def _program(self, kind: StepKind, k: int) -> Callable[[torch.Tensor], None]:
        """What one run of ``kind`` does for a slot tensor: a plain step; a draft step from index 0 (calibration);
        or a cycle of ``k`` draft steps and a verify step. Compiled steps take every batch bucket (and every
        draft length) through symbolic sizes (:meth:`_symbolic`)."""
        if kind == "decode":
            decode = self._step("decode")

            def program(slots: torch.Tensor) -> None:
                self._call("decode", decode, slots)
            return program
        draft = self._step("draft")
        if kind == "draft":
            def program(slots: torch.Tensor) -> None:
                self.drafts.cursor.zero_()
                self._call("draft", draft, slots)
            return program
        verify = self._step("verify")

        def program(slots: torch.Tensor) -> None:
            self.drafts.cursor.zero_()  # verify leaves it at 0, but a draft-only run leaves it at 1
            for _ in range(k):
                self._call("draft", draft, slots)
            self._call("verify", verify, slots, self.drafts.tokens[:, :k], self.drafts.probs[:, :k])
        return program

    def _runner(self, kind: StepKind, bucket: int, k: int = 0, apart: bool = False) -> Callable[[torch.Tensor], None]:
        """A callable running one ``kind`` program (:meth:`_program`) for a ``[bucket]`` slot tensor, with ``apart``
        inside :func:`~sparrow.kernels.decode_attention.per_row_decode` (every row reads its own prompt; the same
        compiled step): a CUDA graph per ``(kind, bucket, k, apart)`` when enabled (captured on first use, from the
        compiled step every bucket shares; its seconds, compilation excluded, go to ``setup/capture_s``), the
        program itself otherwise."""
        program = self._program(kind, k)
        if apart:
            program = _rows_apart(program)
        if not self._graphed:
            return program
        graphs = self._mode.graphs
        key = (kind, bucket, k, apart)
        if key not in graphs:
            t0, compiling = time.perf_counter(), self._compile_seconds()
            static = torch.full((bucket,), self.scratch, dtype=torch.int64, device=self.device)
            # warm up (compilation, autotuning) on a side stream, on the scratch row only
            s = torch.cuda.Stream(self.device)
            s.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(s):
                for _ in range(2):
                    program(static)
            torch.cuda.current_stream(self.device).wait_stream(s)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):  # one pool: the graphs never run concurrently
                program(static)
            self._synchronize()
            graphs[key] = (graph, static)
            self._add_setup("setup/capture_s", time.perf_counter() - t0 - (self._compile_seconds() - compiling))
        graph, static = graphs[key]

        def replay(slots: torch.Tensor) -> None:
            static.copy_(slots)
            graph.replay()

        return replay

    @property
    def _graphed(self) -> bool:
        return self.config.cuda_graphs and self.device.type == "cuda"

    def _apart_differs(self, bucket: int) -> bool:
        """Whether a step at ``bucket`` rows with the rows apart runs other kernels than the shared-prefix one:
        the engine shares prompts, a layer's backend chooses its path (``shared_prefix="auto"``) on the Triton
        kernels, and on CUDA the op does not hand the batch to the per-row kernel anyway (under
        ``CASCADE_MIN_ROWS`` rows)."""
        if not self.config.share_prefix or (self.device.type == "cuda" and bucket < CASCADE_MIN_ROWS):
            return False
        return any(getattr(b, "shared_prefix", None) == "auto"
                   and decode_impl(b.impl, b.shape.head_dim, self.device) == "triton"
                   for b in (a.backend for a in self.attn))

    def _apart(self, bucket: int, prefixes: Sequence[int]) -> bool:
        """Whether a block on rows reading the prefix slots ``prefixes`` runs with the rows apart: when they share
        their prompts too little for the cascade (:func:`~sparrow.kernels.decode_attention.shares_enough`; the
        groups of a long-tailed rollout thin out as samples finish). Host lists only: no sync."""
        return self._apart_differs(bucket) and not shares_enough(prefixes)

    def _compile_seconds(self) -> float:
        return sum(v for p, v in self._setup_s.items() if p.startswith("setup/compile_"))

    def _warm(self, kind: StepKind, bucket: int, k: int, slots: torch.Tensor,
              apart: bool = False) -> Callable[[torch.Tensor], None]:
        """The runner of ``(kind, bucket, k, apart)``, compiled and (on CUDA) captured; without CUDA graphs its
        program runs once on ``slots`` here (which compiles it when needed; the rest of its time goes to
        ``setup/warmup_s``)."""
        run = self._runner(kind, bucket, k, apart)
        if not self._graphed:
            t0, compiling = time.perf_counter(), self._compile_seconds()
            run(slots)
            self._synchronize()
            self._add_setup("setup/warmup_s", time.perf_counter() - t0 - (self._compile_seconds() - compiling))
        return run


def _rows_apart(program: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """``program`` run inside :func:`~sparrow.kernels.decode_attention.per_row_decode` (read by the attention op
    when it runs, so a CUDA graph captured from this keeps the per-row kernels)."""

    def run(slots: torch.Tensor) -> None:
        with per_row_decode():
            program(slots)

    return run


def _trace_errors() -> tuple[type[BaseException], ...]:
    from torch._dynamo.exc import BackendCompilerFailed, UserError
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    errors: list[type[BaseException]] = [UserError, BackendCompilerFailed, GuardOnDataDependentSymNode]
    try:
        from torch._inductor.exc import InductorError

        errors.append(InductorError)
    except ImportError:  # pragma: no cover - older torch: lowering errors arrive as BackendCompilerFailed
        pass
    return tuple(errors)


_TRACE_ERRORS = _trace_errors()


@functools.cache
def _bounded_unbacked() -> bool:
    """Whether this torch bounds unbacked sizes (``mark_unbacked`` takes ``min``, ``max`` and ``shape_id``)."""
    params = inspect.signature(torch._dynamo.decorators.mark_unbacked).parameters
    return {"min", "max", "shape_id"} <= set(params)

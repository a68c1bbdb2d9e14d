"""The rollout engine: batched sampling with shared prompt prefixes, continuous batching and exact
self-speculative decoding.

Reading order. :meth:`RolloutSession.run <sparrow.rollout.session.RolloutSession.run>` is the host loop
(:meth:`RolloutEngine.generate` is one session run to the end): it admits groups into free slots
(:meth:`RolloutEngine.admit`: prefill the new prompts, sample their first tokens), runs blocks on the active rows
(:meth:`RolloutEngine.decode_block`: the toggle's decision, a few steps, then the block's one host read: which rows
finished) and collects the finished ones (:meth:`RolloutEngine.collect`). A block replays one of two programs, a CUDA
graph per batch bucket:

* a plain step, :func:`~sparrow.rollout.steps.decode_step`: one token for every active row;
* with a drafter, when the toggle says so, a speculative *cycle*: ``k`` :func:`~sparrow.rollout.steps.draft_step` s
  (one draft token per row, from the drafter, over the target's caches) and one
  :func:`~sparrow.rollout.steps.verify_step` (the target over ``[last token, d_1..d_k]``, exact rejection sampling:
  1..k+1 tokens per row).

The steps are free functions over an explicit :class:`~sparrow.rollout.steps.StepState` (:mod:`sparrow.rollout.steps`);
:class:`~sparrow.rollout.compiler.StepCompiler` compiles them (``fullgraph=True``, one compiled step for every batch
bucket and draft length) and captures the graphs; :class:`~sparrow.rollout.slots.SlotTable` keeps the free slots.

Layout. Every distinct prompt is prefilled once into a *prefix slot*; its ``n_samples`` rows each own a
*generation slot* and point at the shared prefix slot. Rows that finish leave the active set at the next
block boundary, and new prompts are admitted into the freed slots, so a step's cost follows the number of
active rows. Weights may change in place between session runs (:meth:`RolloutEngine.set_policy_version` names the
new version): every token carries the version that sampled it.
"""

from __future__ import annotations

import time
from typing import Mapping, Sequence

import torch
from torchtune.modules import TransformerDecoder
from tqdm import tqdm

from sparrow.attention.base import CacheSpec, PrefillMeta
from sparrow.compile_cache import CompileCache, cache_counters
from sparrow.models.attention import attention_modules
from sparrow.models.fuse import fuse_projections_, unfuse_projections_
from sparrow.rollout.compiler import StepCompiler, wait_for_device
from sparrow.rollout.config import EngineConfig, validate_prompts, validate_sampling
from sparrow.rollout.forward import logits_from_hidden, prefill_hidden
from sparrow.rollout.results import FinishReason, Generation, GenerationStats, GroupProgress, Sample
from sparrow.rollout.session import Admission, RolloutSession
from sparrow.rollout.slots import SlotTable
from sparrow.rollout.state import DraftState, RowState
from sparrow.rollout.steps import ProgramKind, StepState, first_tokens, stop_slots
from sparrow.sampling import SamplingParams
from sparrow.speculative.base import AlwaysOff, Drafter, StepStats, ToggleController
from sparrow.speculative.costs import expected_tokens_per_cycle
from sparrow.speculative.toggle import AlwaysOn

__all__ = ["EngineConfig", "FinishReason", "Generation", "GenerationStats", "GroupProgress", "RolloutEngine",
           "RolloutSession", "Sample"]

NEEDS_DRAFTER = "a toggle needs a drafter (only AlwaysOff, which never speculates, goes without one)"


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

    Attributes:
        compiler: compiles the steps and captures their graphs (:class:`~sparrow.rollout.compiler.StepCompiler`).
        slots: the free and held slots (:class:`~sparrow.rollout.slots.SlotTable`), shared by every session.
        state: what the steps read and write (:class:`~sparrow.rollout.steps.StepState`); None until the first
            generation (or :meth:`prepare`) allocates it. ``caches``, ``rows`` and ``drafts`` are its parts.

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
        self.state: StepState | None = None
        self._stop_ids: dict[tuple, torch.Tensor] = {}  # sampling mode -> its stop-id buffer (graphs read it)
        self._alpha_seen = 0.8  # acceptance seen so far (sizes speculative blocks; decisions are the toggle's)
        self._policy_version = 0
        spec = self.cache_spec
        self.compiler = StepCompiler(self.config, model, drafter, self.device, self.dtype, spec.num_rows)
        self.slots = SlotTable(spec.num_rows, spec.num_prefixes)

    # ------------------------------------------------------------------------------- properties
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

    @property
    def cache_spec(self) -> CacheSpec:
        """The caches' capacity: prefix slots, prompt length, generation slots and generation length."""
        c = self.config
        num_prefixes = c.num_prefixes if c.share_prefix else max(c.num_prefixes, c.max_rows)
        return CacheSpec(num_prefixes, c.max_prompt_len, c.max_rows, c.max_new_tokens + c.max_draft + 1)

    def cache_nbytes(self) -> int:
        """Bytes of the KV caches (0 before they are allocated)."""
        if self.caches is None:
            return 0
        return sum(a.backend.cache_nbytes(c) for a, c in zip(self.attn, self.caches))

    # the compiler's counts, timings and keys (documented there: sparrow.rollout.compiler.StepCompiler)
    @property
    def captured_graphs(self) -> int:
        """CUDA graphs captured so far (:attr:`StepCompiler.captured_graphs`); :meth:`prepare` keeps it fixed."""
        return self.compiler.captured_graphs

    @property
    def sampling_modes(self) -> int:
        """Sampling modes seen so far (:meth:`set_sampling_params`: each compiles its own steps)."""
        return self.compiler.sampling_modes

    @property
    def compiled_graphs(self) -> dict[str, int]:
        """Graphs compiled so far per step (:attr:`StepCompiler.compiled_graphs`)."""
        return self.compiler.compiled_graphs

    @property
    def setup_seconds(self) -> dict[str, float]:
        """Seconds spent on setup so far, by phase (:attr:`StepCompiler.setup_seconds`)."""
        return self.compiler.setup_seconds

    @property
    def compile_cache(self) -> CompileCache | None:
        """The on-disk cache of compiled code and calibrations, or None (:attr:`StepCompiler.compile_cache`)."""
        return self.compiler.compile_cache

    def compile_key(self) -> dict[str, str]:
        """What the compiled steps depend on (:meth:`StepCompiler.compile_key`)."""
        return self.compiler.compile_key()

    # ------------------------------------------------------------------------------------ setup
    def _allocate(self, params: SamplingParams, stop_ids: torch.Tensor) -> None:
        spec, dev, c = self.cache_spec, self.device, self.config
        self.caches = [a.backend.init_cache(spec, dtype=self.dtype, device=dev) for a in self.attn]
        R = spec.num_rows + 1  # + the scratch slot of padding rows
        self.rows = RowState.allocate(R, c.max_new_tokens + c.max_draft + 1, dev)
        self.rows.policy_version.fill_(self._policy_version)
        if self._drafter is not None:
            self.drafts = DraftState.allocate(R, c.max_draft, self.vocab_size, dev)
        self.state = StepState(self.model, self.caches, self.rows, self.drafts, self._drafter, params, stop_ids)

    def set_sampling_params(self, params: SamplingParams) -> None:
        """Make ``params`` current (allocating the state on first use). The compiled steps and CUDA graphs
        specialise on the processing parameters (temperature, top-p, top-k, vocabulary limit) and on the size of
        the stop-id buffer: each such mode keeps its own, so alternating modes (say, sampled rollouts and greedy
        evaluation) compiles and captures each once. The stop ids sit in a buffer of
        :data:`~sparrow.rollout.steps.STOP_SLOTS` entries (more when more are given, rounded up to a power of two),
        padded with -1 (no token): a different stop set, or none, reuses the mode's graphs."""
        stop = params.stop_token_ids
        mode = params.processing + (stop_slots(len(stop)),)
        if mode not in self._stop_ids:
            self._stop_ids[mode] = torch.full((mode[-1],), -1, dtype=torch.int64, device=self.device)
        stop_ids = self._stop_ids[mode]
        if self.state is None:
            self._allocate(params, stop_ids)
        self.compiler.select(mode)
        padded = list(stop) + [-1] * (stop_ids.numel() - len(stop))
        stop_ids.copy_(torch.tensor(padded, dtype=torch.int64))  # in place: captured graphs read it
        self.rows.seed.fill_(params.seed)
        self.rows.max_new.fill_(params.max_new_tokens)
        self.state.params, self.state.stop_ids = params, stop_ids

    def prepare(self, params: SamplingParams | None = None, draft_lengths: Sequence[int] | None = None) -> float:
        """Compile the steps of ``params``' sampling mode and capture their CUDA graphs for every batch bucket
        (with a drafter also the draft step and the speculative cycle of every draft length the toggle can ask
        for, :meth:`ToggleController.draft_lengths`, or ``draft_lengths``), so that no block of a later
        :meth:`generate` in that mode compiles. Without it the first block at each batch size (and draft
        length) pays for compilation and capture inside the generation that meets it. Every step runs on the
        scratch row alone: nothing a generation reads changes. Program by program: the first bucket compiles the
        program's steps (with ``dynamic_batch``, once for all of them), the others capture their graphs from it
        (``EngineConfig.progress`` shows each). Returns the seconds it took; :attr:`setup_seconds` holds them by
        phase.

        Raises:
            TypeError: ``params`` is not :class:`SamplingParams`.
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        t0, lookups, cc = time.perf_counter(), cache_counters(), self.compiler
        self.set_sampling_params(params)
        ks: tuple[int, ...] = ()
        if self._drafter is not None:
            ks = tuple(self._toggle.draft_lengths() if draft_lengths is None else draft_lengths)
            ks = tuple(sorted({min(int(k), self.config.max_draft) for k in ks if k >= 1}))
        self.rows.done[self.scratch] = True
        kinds = [("decode", 0)] + ([("draft", 0)] + [("cycle", k) for k in ks] if self._drafter is not None else [])
        plan = [(kind, b, k, apart) for kind, k in kinds for b in self.config.buckets  # a second graph: rows apart
                for apart in (False, True)[:1 + (cc.graphed and cc.apart_differs(b))]]
        with tqdm(plan, desc="rollout engine", disable=not self.config.progress, leave=False,
                  dynamic_ncols=True) as bar:
            for kind, b, k, apart in bar:
                bar.set_description(cc.describe(kind, b, k, apart))
                slots = torch.full((b,), self.scratch, dtype=torch.int64, device=self.device)
                cc.warm(self.state, kind, b, k, slots, apart)
        wait_for_device(self.device)
        cc.add_lookups(lookups)
        return time.perf_counter() - t0

    def time_step(self, kind: ProgramKind, bucket: int, *, context: int, k: int = 0, steps: int = 8,
                  params: SamplingParams | None = None) -> float:
        """Seconds per run of ``steps`` runs of one program (``decode``: a plain step; ``draft``: one draft step;
        ``cycle``: ``k`` draft steps and a verify step) at batch ``bucket`` and context ``context``, through the same
        compiled steps / CUDA graph a generation uses (compiled and captured before the timing, counted in
        :attr:`setup_seconds`). Rows ``0 .. bucket-1`` stand in at that context (prompt part in distinct prefix
        slots), done, so the steps change no row's length; they are left idle. The engine's side of the cost model's
        :class:`~sparrow.speculative.base.StepTimer`.

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
        self.set_sampling_params(params or (self.state.params if self.state is not None else
                                            SamplingParams(max_new_tokens=1)))
        r, spec = self.rows, self.cache_spec
        plen = max(1, min(context - 1, c.max_prompt_len))
        rows = torch.arange(bucket, device=self.device)
        r.stand_in(rows, rows % spec.num_prefixes, plen, max(1, min(context - plen, c.max_new_tokens)))
        lookups = cache_counters()
        apart = self.compiler.apart(bucket, [i % spec.num_prefixes for i in range(bucket)])  # as a block on these rows
        run = self.compiler.warm(self.state, kind, bucket, k if kind == "cycle" else 0, rows, apart)  # untimed
        if self.compiler.graphed:
            run(rows)  # a first replay, untimed too
        wait_for_device(self.device)
        self.compiler.add_lookups(lookups)
        t0 = time.perf_counter()
        for _ in range(steps):
            run(rows)
        wait_for_device(self.device)
        seconds = (time.perf_counter() - t0) / steps
        r.idle(rows)
        return seconds

    # ------------------------------------------------------------------------------- generation
    def validate(self, prompts: Sequence, n_samples: int, params: SamplingParams) -> list[torch.Tensor]:
        """``prompts`` as 1-D int64 CPU tensors, checked with ``n_samples`` and ``params`` against the engine and
        the model (:func:`~sparrow.rollout.config.validate_sampling`, :func:`~sparrow.rollout.config.validate_prompts`).

        Raises:
            TypeError / ValueError: as :meth:`generate`.
        """
        validate_sampling(self.config, n_samples, params, self.vocab_size)
        return validate_prompts(self.config, prompts, params, self.vocab_size, self.max_seq_len)

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
        validate_sampling(self.config, n_samples, params, self.vocab_size)
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
        wait_for_device(self.device)  # deliberate device wait: the phase's wall time (after a block's read, a no-op)
        return time.perf_counter() - t0

    # ---------------------------------------------------------------------------------- prefill
    def admit(self, groups: Sequence[Admission], prompts: Mapping[int, torch.Tensor], n_samples: int,
              stats: GenerationStats) -> None:
        """Prefill the prompts of admitted ``groups`` (each (group id, its rows, its prefix slots: one, or one per
        row without prefix sharing); ``prompts``: group id -> prompt), micro-batched by length, and sample each
        row's first token; adds to ``stats`` (prefill tokens and seconds). Needs :meth:`set_sampling_params` first."""
        t0 = time.perf_counter()
        jobs = []  # (group, prefix slot, rows reading this prefix, their sample indices)
        for g, rows, slots in groups:
            if len(slots) == 1:
                jobs.append((g, slots[0], rows, list(range(n_samples))))
            else:  # no prefix sharing: one prefill per sample
                jobs.extend((g, s, [r], [j]) for j, (s, r) in enumerate(zip(slots, rows)))
        jobs.sort(key=lambda j: -prompts[j[0]].numel())
        i = 0
        while i < len(jobs):
            width = prompts[jobs[i][0]].numel()  # the longest prompt of this micro-batch (sorted)
            m = max(1, min(len(jobs) - i, self.config.prefill_tokens // width))
            self._prefill_batch(jobs[i:i + m], prompts, n_samples, stats)
            i += m
        stats.prefill_s += self._elapsed(t0)

    def _prefill_batch(self, batch, prompts: Mapping[int, torch.Tensor], n: int, stats: GenerationStats) -> None:
        dev = self.device
        lens = [prompts[g].numel() for g, _, _, _ in batch]
        tokens = torch.zeros((len(batch), max(lens)), dtype=torch.int64)  # right padding
        for b, (g, _, _, _) in enumerate(batch):
            tokens[b, : lens[b]] = prompts[g]
        tokens = tokens.to(dev)
        slots = torch.tensor([s for _, s, _, _ in batch], dtype=torch.int64, device=dev)
        plen = torch.tensor(lens, dtype=torch.int64, device=dev)
        h = prefill_hidden(self.model, tokens, self.caches, PrefillMeta(slots, plen))
        logits = logits_from_hidden(self.model, h[torch.arange(len(batch), device=dev), plen - 1])  # [B, V]
        stats.prefill_tokens += sum(lens)
        # the first token of every row that reads these prefixes
        owner = torch.tensor([b for b, (_, _, rs, _) in enumerate(batch) for _ in rs], device=dev)
        rows = torch.tensor([r for _, _, rs, _ in batch for r in rs], dtype=torch.int64, device=dev)
        sid = torch.tensor([g * n + j for g, _, _, js in batch for j in js], dtype=torch.int64, device=dev)
        first_tokens(self.state, rows, slots[owner], plen[owner], sid, logits[owner])

    # ----------------------------------------------------------------------------------- blocks
    def decode_block(self, rows: list[int], prompt_lens: list[int], prefixes: list[int],
                     stats: GenerationStats) -> list[int]:
        """One block on the active ``rows`` (ascending; ``prompt_lens``: their prompts' lengths, ``prefixes``: their
        prefix slots): plain steps, or with a drafter speculative cycles of the length the toggle picks, with the
        rows apart where they share their prompts too little; then the block's one host read. Adds the block to
        ``stats`` and returns the rows that finished."""
        t_block = time.perf_counter()
        A, bucket = len(rows), self.compiler.bucket(len(rows))
        st, k = self._decide(rows, prompt_lens, bucket)
        slots = self.compiler.pad(rows)
        self.rows.done[self.scratch] = True  # padding rows never change state that is read back
        # about block_steps tokens per row per block: fewer cycles when each emits several
        steps = (max(1, round(self.config.block_steps / expected_tokens_per_cycle(self._alpha_seen, k))) if k
                 else self.config.block_steps)
        apart = self.compiler.apart(bucket, prefixes)
        run = self.compiler.runner(self.state, "cycle" if k else "decode", bucket, k, apart)
        t0 = time.perf_counter()
        for _ in range(steps):
            run(slots)
        done, n_gen, counters = self._read_block(slots[:A])
        seconds = time.perf_counter() - t0  # the host read above waited for the block
        tokens = sum(m - self.slots.length(r) for r, m in zip(rows, n_gen))
        stats.add_block(bucket, steps, tokens, seconds, apart=apart, num_draft=k, **counters)
        if self._drafter is not None:
            self._observe(st, k, steps, seconds, counters)
        self.slots.record_lengths(rows, n_gen)  # a finished row's final length stays until its slot is released
        stats.decode_s += self._elapsed(t_block)
        return [r for r, d in zip(rows, done) if d]

    def _decide(self, rows: list[int], prompt_lens: list[int], bucket: int) -> tuple[StepStats | None, int]:
        """The toggle's decision for the next block: (what it decided on, the draft length; 0: plain steps)."""
        if self._drafter is None:
            return None, 0
        ctx = [p + self.slots.length(r) for r, p in zip(rows, prompt_lens)]
        st = StepStats(len(rows), sum(ctx) / len(rows), max(ctx), bucket)
        decision = self._toggle.decide(st)
        self.drafts.counters.zero_()
        return st, (min(decision.num_draft, self.config.max_draft) if decision.speculate else 0)

    def _read_block(self, idx: torch.Tensor) -> tuple[list[int], list[int], dict[str, int]]:
        """The block's one host read: which of rows ``idx`` [A] are done, their lengths and (with a drafter) the
        draft counters, in one copy."""
        A, r = idx.shape[0], self.rows
        parts = [r.done[idx].long(), r.n_gen[idx]] + ([self.drafts.counters] if self._drafter is not None else [])
        host = torch.cat(parts).cpu()  # deliberate host read: which rows finished, how far each got
        counters = dict(zip(("proposed", "accepted", "row_cycles"), host[2 * A:].tolist()))
        return host[:A].tolist(), host[A:2 * A].tolist(), counters

    def _observe(self, st: StepStats, k: int, steps: int, seconds: float, counters: dict[str, int]) -> None:
        """Report a block to the toggle (and with speculation, its acceptance to the block sizing)."""
        self._toggle.observe_block(st, num_draft=k, steps=steps, seconds=seconds)
        if k:
            proposed, accepted = counters["proposed"], counters["accepted"]
            if proposed > 0:
                self._alpha_seen = 0.5 * self._alpha_seen + 0.5 * accepted / proposed
            self._toggle.observe(proposed=proposed, accepted=accepted, rows=counters["row_cycles"], seconds=seconds)

    def collect(self, rows: list[int], owners: list[tuple[int, int]], params: SamplingParams) -> list[Sample]:
        """The samples of finished ``rows`` (``owners``: each row's (group, sample index); ``params``: their sampling
        parameters, for the finish reason), read back to the host in one copy."""
        lengths = [self.slots.length(r) for r in rows]  # known since the block's host read
        width = max(lengths)
        idx = torch.tensor(rows, dtype=torch.int64, device=self.device)
        r = self.rows
        # tokens (int64), log-probs (float32) and versions (int32) as one int32 block: one copy, bits kept
        parts = (r.tokens[idx, :width].view(torch.int32), r.logprobs[idx, :width].view(torch.int32),
                 r.versions[idx, :width])
        host = torch.cat(parts, dim=1).cpu()  # deliberate host read: the finished rows' samples, at a block boundary
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

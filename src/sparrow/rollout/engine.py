"""The rollout engine: batched sampling with shared prompt prefixes and continuous batching.

Reading order: :meth:`RolloutEngine.generate` (the host loop) -> :meth:`_admit` (prefill new prompts,
sample their first tokens) -> :meth:`_decode_step` (one token for every active row; compiled with
``fullgraph=True`` and replayed as a CUDA graph per batch bucket) -> :meth:`_retire` (the one deliberate
host sync: which rows finished).

Layout. Every distinct prompt is prefilled once into a *prefix slot*; its ``n_samples`` rows each own a
*generation slot* and point at the shared prefix slot. Rows that finish leave the active set at the
next sync point (every ``sync_every`` steps), and new prompts are admitted into the freed slots, so a
decode step's cost follows the number of active rows. Device state per generation slot: emitted tokens,
their log-probs, count, done flag; the step reads and writes it in place.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Literal, NamedTuple, Sequence

import torch
from torchtune.modules import TransformerDecoder

from sparrow.attention.base import CacheSpec, DecodeMeta, PrefillMeta
from sparrow.models.attention import attention_modules
from sparrow.rollout.forward import decode_hidden, logits_from_hidden, prefill_hidden
from sparrow.rollout.sampling import SamplingParams, process_logits, row_keys, sample_from_logprobs
from sparrow.speculative.base import Drafter, ToggleController

FinishReason = Literal["stop", "length"]
STOP_SLOTS = 8  # stop-id buffer entries; a mode's compiled steps and graphs are shared by all stop sets that fit


class _Mode(NamedTuple):
    """What a sampling mode compiled, kept while another mode is current."""

    step_fn: Callable | None
    graphs: dict
    stop_ids: torch.Tensor
    spec_state: tuple | None  # SpeculativeRunner.compiled_state(): (draft_fn, verify_fn, graphs)


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
        sync_every: decode steps between host checks for finished rows.
        prefill_tokens: token budget of one prefill micro-batch (prompts padded to the longest in it).
        share_prefix: prefill each prompt once for all its samples (``False`` prefills every sample,
            for comparison).
        compile_backend: ``torch.compile`` backend (``"inductor"``; ``"eager"`` checks graph capture only).
        max_draft: longest speculative draft (0 without a drafter); generation slots keep this many extra
            positions of scratch for the verify pass.
    """

    max_rows: int = 64
    max_prompts: int | None = None
    max_prompt_len: int = 2048
    max_new_tokens: int = 512
    compile: bool = True
    cuda_graphs: bool = True
    batch_buckets: tuple[int, ...] | None = None
    sync_every: int = 8
    prefill_tokens: int = 32768
    share_prefix: bool = True
    compile_backend: str = "inductor"
    max_draft: int = 0

    def __post_init__(self) -> None:
        if self.max_draft < 0:
            raise ValueError(f"EngineConfig.max_draft must be >= 0, got {self.max_draft}")
        for name in ("max_rows", "max_prompt_len", "max_new_tokens", "sync_every", "prefill_tokens"):
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

    tokens: [L] int64 generated tokens (the stop token included when ``finish_reason == "stop"``).
    logprobs: [L] float32 log-probability of each token under the distribution it was sampled from.
    """

    prompt_index: int
    sample_index: int
    tokens: torch.Tensor
    logprobs: torch.Tensor
    finish_reason: FinishReason

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

    @property
    def decode_tokens_per_s(self) -> float:
        return self.generated_tokens / self.decode_s if self.decode_s > 0 else 0.0

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
    """Result of :meth:`RolloutEngine.generate`: samples in prompt-major order, plus timing stats."""

    samples: list[Sample]
    stats: GenerationStats

    def __len__(self) -> int:
        return len(self.samples)

    def __iter__(self):
        return iter(self.samples)

    def __getitem__(self, i: int) -> Sample:
        return self.samples[i]


class RolloutEngine:
    """Samples completions from a Sparrow model (see module docstring for the design).

    Args:
        model: a torchtune decoder whose attention layers are :class:`SparrowAttention` (use the
            builders in :mod:`sparrow.models` or :func:`sparrow.models.use_attention`). The engine uses
            it in place, in its current dtype and device, under ``torch.no_grad``.
        config: capacity and execution options.
        drafter: enables speculative decoding (e.g. :class:`sparrow.speculative.QuantizedSelfDrafter`);
            needs ``config.max_draft >= 1``. Sampled tokens follow the target's distribution exactly and
            their log-probs are the target's.
        toggle: decides at each sync point whether to speculate and how far (default: always, with
            ``config.max_draft`` drafts). Draft lengths above ``config.max_draft`` are clamped.
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
        self.caches: list | None = None
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._step_fn = None
        self._params: SamplingParams | None = None
        self._modes: dict[tuple, _Mode] = {}  # compiled steps and graphs of the other sampling modes seen
        self._spec = None
        if toggle is not None and drafter is None:
            raise ValueError("a toggle needs a drafter")
        if drafter is not None:
            if self.config.max_draft < 1:
                raise ValueError("speculative decoding needs EngineConfig.max_draft >= 1 (the draft scratch length)")
            from sparrow.speculative.runtime import SpeculativeRunner
            from sparrow.speculative.toggle import AlwaysOn

            self._spec = SpeculativeRunner(self, drafter, toggle or AlwaysOn(self.config.max_draft))

    @property
    def captured_graphs(self) -> int:
        """CUDA graphs captured so far over every sampling mode: plain decode steps, draft steps and speculative
        cycles (0 without CUDA graphs). A count that grows during a generation means it captured (and compiled)
        inside it; :meth:`prepare` keeps it from growing."""
        states = [(self._graphs, self._spec.compiled_state() if self._spec is not None else None),
                  *((m.graphs, m.spec_state) for m in self._modes.values())]
        return sum(len(graphs) + (len(spec[2]) if spec is not None else 0) for graphs, spec in states)

    @property
    def sampling_modes(self) -> int:
        """Sampling modes seen so far (each compiles its own steps, see :meth:`generate`)."""
        return len(self._modes) + (self._params is not None)

    @property
    def drafter(self) -> Drafter | None:
        return None if self._spec is None else self._spec.drafter

    @property
    def toggle(self) -> ToggleController | None:
        return None if self._spec is None else self._spec.toggle

    @toggle.setter
    def toggle(self, toggle: ToggleController) -> None:
        if self._spec is None:
            raise ValueError("a toggle needs a drafter")
        self._spec.toggle = toggle

    # ------------------------------------------------------------------------------------ setup
    @property
    def cache_spec(self) -> CacheSpec:
        c = self.config
        num_prefixes = c.num_prefixes if c.share_prefix else max(c.num_prefixes, c.max_rows)
        return CacheSpec(num_prefixes, c.max_prompt_len, c.max_rows, c.max_new_tokens + c.max_draft + 1)

    def _allocate(self) -> None:
        spec, dev = self.cache_spec, self.device
        self.caches = [a.backend.init_cache(spec, dtype=self.dtype, device=dev) for a in self.attn]
        R = spec.num_rows + 1  # + scratch slot for padding rows
        L = self.config.max_new_tokens + self.config.max_draft + 1
        self.scratch = spec.num_rows
        self.out_tokens = torch.zeros((R, L), dtype=torch.int64, device=dev)
        self.out_logprobs = torch.zeros((R, L), dtype=torch.float32, device=dev)
        self.n_gen = torch.ones(R, dtype=torch.int64, device=dev)
        self.done = torch.ones(R, dtype=torch.bool, device=dev)
        self.last_token = torch.zeros(R, dtype=torch.int64, device=dev)
        self.row_prefix_slot = torch.zeros(R, dtype=torch.int64, device=dev)
        self.row_prefix_len = torch.ones(R, dtype=torch.int64, device=dev)
        self.row_sample_id = torch.zeros(R, dtype=torch.int64, device=dev)
        self.seed = torch.zeros((), dtype=torch.int64, device=dev)
        self.max_new = torch.ones((), dtype=torch.int64, device=dev)
        if self._spec is not None:
            self._spec.allocate()

    def cache_nbytes(self) -> int:
        if self.caches is None:
            return 0
        return sum(a.backend.cache_nbytes(c) for a, c in zip(self.attn, self.caches))

    def _set_params(self, params: SamplingParams) -> None:
        """Make ``params`` current. The compiled steps and CUDA graphs specialise on the processing parameters
        (temperature, top-p, top-k, vocabulary limit) and on the size of the stop-id buffer: each such mode keeps its own, so
        alternating modes (say, sampled rollouts and greedy evaluation) compiles and captures each once. The
        stop ids sit in a buffer of :data:`STOP_SLOTS` entries (more when more are given, rounded up to a power
        of two), padded with -1 (no token): a different stop set, or none, reuses the mode's graphs."""
        stop = params.stop_token_ids
        mode = params.processing + (stop_slots(len(stop)),)
        current = None if self._params is None else self._params.processing + (self.stop_ids.numel(),)
        if mode != current:
            if current is not None:
                self._modes[current] = _Mode(self._step_fn, self._graphs, self.stop_ids,
                                             self._spec.compiled_state() if self._spec is not None else None)
            if mode in self._modes:
                self._step_fn, self._graphs, self.stop_ids, spec_state = self._modes.pop(mode)
                if self._spec is not None:
                    self._spec.restore_compiled(spec_state)
            else:
                self._step_fn, self._graphs = None, {}
                if self._spec is not None:
                    self._spec.reset_compiled()
                self.stop_ids = torch.full((mode[-1],), -1, dtype=torch.int64, device=self.device)
        padded = list(stop) + [-1] * (self.stop_ids.numel() - len(stop))
        self.stop_ids.copy_(torch.tensor(padded, dtype=torch.int64))  # in place: captured graphs read it
        self.seed.fill_(params.seed)
        self.max_new.fill_(params.max_new_tokens)
        self._params = params

    def prepare(self, params: SamplingParams | None = None, draft_lengths: Sequence[int] | None = None) -> float:
        """Compile the decode step of ``params``' sampling mode and capture its CUDA graph for every batch bucket
        (with a drafter also the draft step and the speculative cycle of every draft length the toggle can ask
        for, :meth:`ToggleController.draft_lengths`, or ``draft_lengths``), so that no block of a later
        :meth:`generate` in that mode compiles. Without it the first block at each batch size (and draft
        length) pays for compilation and capture inside the generation that meets it. Every step runs on the
        scratch row alone: nothing a generation reads changes. Returns the seconds it took.

        Raises:
            TypeError: ``params`` is not :class:`SamplingParams`.
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        t0 = time.perf_counter()
        if self.caches is None:
            self._allocate()
        self._set_params(params)
        ks: tuple[int, ...] = ()
        if self._spec is not None:
            ks = tuple(self.toggle.draft_lengths() if draft_lengths is None else draft_lengths)
            ks = tuple(sorted({min(int(k), self.config.max_draft) for k in ks if k >= 1}))
        self.done[self.scratch] = True
        for b in self.config.buckets:
            slots = torch.full((b,), self.scratch, dtype=torch.int64, device=self.device)
            runs = [self._runner(b)]  # captured here on CUDA; run once so that compilation happens here too
            if self._spec is not None:
                runs += [self._spec.draft_runner(b)] + [self._spec.cycle_runner(b, k) for k in ks]
            for run in runs:
                run(slots)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    # ------------------------------------------------------------------------------ validation
    def _validate(self, prompts: Sequence, n_samples: int, params: SamplingParams) -> list[torch.Tensor]:
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
        """Sample ``n_samples`` completions of every prompt.

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
        """
        params = params or SamplingParams()
        toks = self._validate(prompts, n_samples, params)
        if self.caches is None:
            self._allocate()
        self._set_params(params)
        self._n_samples = n_samples
        stats = GenerationStats()
        if self._spec is not None:
            self._spec.begin()
        spec = self.cache_spec
        n = n_samples
        pending = list(range(len(toks)))
        free_rows = list(range(spec.num_rows))
        free_prefixes = list(range(spec.num_prefixes))
        prefix_refs: dict[int, int] = {}  # prefix slot -> rows still reading it
        row_owner: dict[int, tuple[int, int, int]] = {}  # row -> (prompt, sample, prefix slot)
        active: list[int] = []
        results: dict[int, Sample] = {}
        per_prompt = 1 if self.config.share_prefix else n  # prefix slots a prompt takes

        while pending or active:
            # admit as many waiting prompts as free slots allow
            admit = []
            while pending and len(free_rows) >= n and len(free_prefixes) >= per_prompt:
                pi = pending.pop(0)
                rows = [free_rows.pop(0) for _ in range(n)]
                slots = [free_prefixes.pop(0) for _ in range(per_prompt)]
                for j, r in enumerate(rows):
                    slot = slots[j % per_prompt]
                    row_owner[r] = (pi, j, slot)
                    prefix_refs[slot] = prefix_refs.get(slot, 0) + 1
                admit.append((pi, rows, slots))
            if admit:
                t0 = time.perf_counter()
                self._admit(admit, toks, n, stats)
                stats.prefill_s += self._elapsed(t0)
                active = sorted(active + [r for _, rows, _ in admit for r in rows])
            if not active:  # pragma: no cover - admission always succeeds when nothing is active
                raise RuntimeError("the engine cannot admit a prompt: capacity too small")
            # a block of decode steps on the active rows, then one host sync to retire finished rows
            t0 = time.perf_counter()
            if self._spec is None:
                finished = self._decode_block(active, stats)
            else:
                plens = [toks[row_owner[r][0]].numel() for r in active]
                finished = self._spec.decode_block(active, plens, stats)
            stats.decode_s += self._elapsed(t0)
            if finished:
                self._collect(finished, row_owner, results)
                for r in finished:
                    slot = row_owner.pop(r)[2]
                    free_rows.append(r)
                    prefix_refs[slot] -= 1
                    if prefix_refs[slot] == 0:
                        del prefix_refs[slot]
                        free_prefixes.append(slot)
                free_rows.sort()
                free_prefixes.sort()
                done_set = set(finished)
                active = [r for r in active if r not in done_set]

        samples = [results[i] for i in range(len(toks) * n)]
        stats.generated_tokens = sum(s.length for s in samples)
        return Generation(samples, stats)

    def _elapsed(self, t0: float) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
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
        dev = self.device
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
        self.row_prefix_slot[rows] = slots[owner]
        self.row_prefix_len[rows] = plen[owner]
        self.row_sample_id[rows] = sid
        logprobs = process_logits(logits[owner], self._params)
        tok = sample_from_logprobs(logprobs, row_keys(self.seed, sid, torch.zeros_like(sid)), self._params.greedy)
        self.out_tokens[rows, 0] = tok
        self.out_logprobs[rows, 0] = logprobs.gather(-1, tok[:, None]).squeeze(-1)
        self.n_gen[rows] = 1
        self.last_token[rows] = tok
        self.done[rows] = torch.isin(tok, self.stop_ids) | (self.max_new <= 1)

    # ----------------------------------------------------------------------------------- decode
    def _decode_step(self, row_slot: torch.Tensor) -> None:
        """One token for each row in ``row_slot`` [A] (padding rows point at the scratch slot).

        Pure device work on the engine's state: no host sync, no data-dependent Python branching.
        """
        n_gen = self.n_gen[row_slot]  # [A] tokens emitted so far; the last one is not cached yet
        meta = DecodeMeta(row_slot, self.row_prefix_slot[row_slot], self.row_prefix_len[row_slot], n_gen - 1)
        h = decode_hidden(self.model, self.last_token[row_slot][:, None], self.caches, meta)  # [A, 1, E]
        logprobs = process_logits(logits_from_hidden(self.model, h[:, 0]), self._params)  # [A, V]
        keys = row_keys(self.seed, self.row_sample_id[row_slot], n_gen)
        tok = sample_from_logprobs(logprobs, keys, self._params.greedy)
        lp = logprobs.gather(-1, tok[:, None]).squeeze(-1)
        live = ~self.done[row_slot]
        self.out_tokens[row_slot, n_gen] = tok
        self.out_logprobs[row_slot, n_gen] = lp
        new_n = n_gen + live.long()
        self.n_gen[row_slot] = new_n
        self.last_token[row_slot] = torch.where(live, tok, self.last_token[row_slot])
        stop = torch.isin(tok, self.stop_ids)
        self.done[row_slot] = ~live | stop | (new_n >= self.max_new)

    def compile_step(self, fn):
        """``fn`` compiled when the config says so (``fullgraph=True``), run under ``no_grad`` (inference only,
        whatever the caller's grad mode). ``fn`` itself is compiled, not a wrapper around it, so each step keeps
        its own compile cache (wrappers share one code object, and with it one recompile limit). Inductor's
        coalescing-tiling analysis is switched off: it asserts on the verify step in some torch releases."""
        if self.config.compile:
            backend = self.config.compile_backend
            options = {"triton.coalesce_tiling_analysis": False} if backend == "inductor" else None
            fn = torch.compile(fn, fullgraph=True, backend=backend, options=options)
        return torch.no_grad()(fn)

    def _compiled_step(self):
        if self._step_fn is None:
            fn = self.compile_step(self._decode_step)
            self._step_fn = fn
        return self._step_fn

    def _bucket(self, a: int) -> int:
        for b in self.config.buckets:
            if b >= a:
                return b
        raise AssertionError(f"{a} active rows exceed max_rows")  # pragma: no cover

    def _runner(self, bucket: int):
        """A callable running one decode step for a ``[bucket]`` slot tensor (a CUDA graph when enabled)."""
        use_graphs = self.config.cuda_graphs and self.device.type == "cuda"
        if not use_graphs:
            step = self._compiled_step()

            def run_eager(slots: torch.Tensor) -> None:
                if self.config.compile:
                    torch._dynamo.mark_dynamic(slots, 0)  # one compiled step for every bucket
                step(slots)

            return run_eager
        if bucket not in self._graphs:
            step = self._compiled_step()
            static = torch.full((bucket,), self.scratch, dtype=torch.int64, device=self.device)
            if self.config.compile:
                torch._dynamo.mark_dynamic(static, 0)  # one compiled step for every bucket
            # warm up (compilation, autotuning) on a side stream, on the scratch row only
            s = torch.cuda.Stream(self.device)
            s.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(s):
                for _ in range(2):
                    step(static)
            torch.cuda.current_stream(self.device).wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step(static)
            self._graphs[bucket] = (graph, static)
        graph, static = self._graphs[bucket]

        def run(slots: torch.Tensor) -> None:
            static.copy_(slots)
            graph.replay()

        return run

    def _decode_block(self, active: list[int], stats: GenerationStats) -> list[int]:
        """Run ``sync_every`` decode steps on ``active`` rows; return the rows that finished."""
        A = len(active)
        bucket = self._bucket(A)
        slots = torch.tensor(active + [self.scratch] * (bucket - A), dtype=torch.int64).to(self.device)
        # scratch row: always done, so padding rows never change state that is read back
        self.done[self.scratch] = True
        run = self._runner(bucket)
        for _ in range(self.config.sync_every):
            run(slots)
        stats.decode_steps += self.config.sync_every
        stats.row_steps += self.config.sync_every * bucket
        stats.active_hist[bucket] = stats.active_hist.get(bucket, 0) + self.config.sync_every
        done = self.done[slots[:A]].cpu()  # deliberate host sync: which rows finished in this block
        return [r for r, d in zip(active, done.tolist()) if d]

    def _collect(self, rows: list[int], row_owner, results: dict[int, Sample]) -> None:
        idx = torch.tensor(rows, dtype=torch.int64, device=self.device)
        n_gen = self.n_gen[idx].cpu()
        toks = self.out_tokens[idx].cpu()
        lps = self.out_logprobs[idx].cpu()
        stop_set = set(self._params.stop_token_ids)
        for k, r in enumerate(rows):
            pi, j, _ = row_owner[r]
            L = int(n_gen[k])
            t = toks[k, :L].clone()
            reason: FinishReason = "stop" if stop_set and int(t[-1]) in stop_set else "length"
            results[pi * self._n_samples + j] = Sample(pi, j, t, lps[k, :L].clone(), reason)

"""The engine's speculative path: draft steps, the verify step, and the block loop with the toggle.

A *cycle* for the active rows (padded to a batch bucket) is ``k`` draft steps followed by one verify step:

* :meth:`SpeculativeRunner.draft_step` — one draft token per row: the drafter's forward at position
  ``n_gen - 1 + i`` (``i`` is a device-side cursor, so every draft step is the same compiled graph),
  processed with the target's temperature / top-k / top-p, sampled with the draft noise stream; token and
  probabilities go to per-batch-position scratch buffers.
* :meth:`SpeculativeRunner.verify_step` — the target's forward over ``[last token, d_1..d_k]`` (``T = k + 1``
  new tokens per row: it writes their KV over the draft's), exact rejection sampling with counter-based
  uniforms (:func:`~sparrow.speculative.rejection.accept_counter_based`), then per-row truncation at a
  stop token or ``max_new_tokens`` and a masked write of the emitted tokens and their target log-probs at
  each row's own offset.

Both are compiled with ``fullgraph=True`` (one compiled draft step for every bucket; one verify step per
draft length), and on CUDA one whole cycle (``k`` draft steps + verify) is captured as a single CUDA graph
per ``(bucket, k)``. Nothing in a cycle synchronises with the host: the block loop
(:meth:`SpeculativeRunner.decode_block`) reads done flags, lengths and acceptance counters once per block,
in one transfer, and asks the toggle what to run next.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from sparrow.attention.base import DecodeMeta
from sparrow.rollout.forward import _layers, logits_from_hidden
from sparrow.rollout.sampling import gumbel_noise, process_logits, row_keys
from sparrow.speculative.base import Drafter, StepStats, ToggleController
from sparrow.speculative.rejection import DRAFT_SALT, accept_counter_based

if TYPE_CHECKING:  # pragma: no cover
    from sparrow.rollout.engine import GenerationStats, RolloutEngine


def expected_tokens_per_cycle(alpha: float, k: int) -> float:
    """Expected tokens a row emits per cycle of ``k`` drafts with per-token acceptance ``alpha``:
    ``(1 - alpha^(k+1)) / (1 - alpha)`` (``k + 1`` when ``alpha == 1``)."""
    alpha = min(max(float(alpha), 0.0), 1.0)
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def decode_hidden_clamped(model, tokens: torch.Tensor, caches, meta: DecodeMeta) -> torch.Tensor:
    """``decode_hidden`` with positions clamped to the RoPE table: the last draft positions of a row near
    the end of the model's context are scratch (never emitted), but must not index past the table."""
    T = tokens.shape[1]
    pos = (meta.prefix_len + meta.cached_len)[:, None] + torch.arange(T, device=tokens.device)[None, :]
    pos = pos.clamp(max=model.max_seq_len - 1)
    h = model.tok_embeddings(tokens)
    return _layers(model, h, lambda attn, x, i: attn.decode(x, pos, caches[i], meta))


class SpeculativeRunner:
    """Speculative decoding state and compiled steps of one :class:`~sparrow.rollout.RolloutEngine`.

    Created by the engine when it is given a drafter; not used directly.
    """

    def __init__(self, engine: "RolloutEngine", drafter: Drafter, toggle: ToggleController) -> None:
        self.engine = engine
        self.drafter = drafter
        self.toggle = toggle
        self.max_draft = engine.config.max_draft
        self._draft_fn = None
        self._verify_fn = None
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None
        self._ngen: dict[int, int] = {}  # host view of n_gen, refreshed at each sync
        self._alpha_seen = 0.8  # acceptance seen so far (only sizes blocks; decisions are the toggle's)

    # ------------------------------------------------------------------------------------ state
    def allocate(self) -> None:
        e = self.engine
        R = e.cache_spec.num_rows + 1
        dev = e.device
        self.dtok = torch.zeros((R, self.max_draft), dtype=torch.int64, device=dev)
        self.dprobs = torch.zeros((R, self.max_draft, e.vocab_size), dtype=torch.float32, device=dev)
        self.cursor = torch.zeros((), dtype=torch.int64, device=dev)
        self.counters = torch.zeros(3, dtype=torch.int64, device=dev)  # proposed, accepted, live row-cycles

    def reset_compiled(self) -> None:
        """Start without compiled steps and graphs (a sampling mode not seen before)."""
        self._draft_fn = None
        self._verify_fn = None
        self._graphs = {}

    def compiled_state(self) -> tuple:
        """The compiled steps and graphs of the current sampling mode (the engine keeps one per mode)."""
        return self._draft_fn, self._verify_fn, self._graphs

    def restore_compiled(self, state: tuple) -> None:
        self._draft_fn, self._verify_fn, self._graphs = state

    def begin(self) -> None:
        """Start of a :meth:`RolloutEngine.generate` call."""
        self._ngen.clear()

    # ------------------------------------------------------------------------------------ steps
    def draft_step(self, row_slot: torch.Tensor) -> None:
        """One draft token for every row of ``row_slot`` [A] at draft index ``cursor``; advances the cursor."""
        e = self.engine
        A = row_slot.shape[0]
        i = self.cursor
        n_gen = e.n_gen[row_slot]
        ar = torch.arange(A, device=row_slot.device)
        prev = self.dtok[:A].gather(1, (i - 1).clamp(min=0).view(1, 1).expand(A, 1)).squeeze(1)
        tok_in = torch.where(i == 0, e.last_token[row_slot], prev)
        meta = DecodeMeta(row_slot, e.row_prefix_slot[row_slot], e.row_prefix_len[row_slot], n_gen - 1 + i)
        logits = self.drafter.forward_logits(tok_in[:, None], e.caches, meta)[:, 0]
        logq = process_logits(logits, e._params)
        idx = i.view(1).expand(A)
        if e._params.greedy:
            tok = torch.argmax(logq, dim=-1)
        else:
            keys = row_keys(e.seed, e.row_sample_id[row_slot], n_gen + i)
            tok = torch.argmax(logq + gumbel_noise(keys, logq.shape[-1], DRAFT_SALT), dim=-1)
            self.dprobs.index_put_((ar, idx), logq.exp())
        self.dtok.index_put_((ar, idx), tok)
        self.cursor.add_(1)

    def verify_step(self, row_slot: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor) -> None:
        """Verify the drafts of every row, emit 1..k+1 tokens per live row, reset the cursor.

        row_slot: [A]; draft_tokens: [>=A, k] and draft_probs: [>=A, k, V] (views of the draft buffers, whose
        first ``A`` rows belong to the batch; ``k`` is read from their shape, so one compiled graph serves
        every draft length).
        """
        e = self.engine
        A = row_slot.shape[0]
        k = draft_tokens.shape[1]
        dev = row_slot.device
        n_gen = e.n_gen[row_slot]
        last = e.last_token[row_slot]
        drafts = draft_tokens[:A]
        inputs = torch.cat([last[:, None], drafts], dim=1)  # [A, k + 1]
        meta = DecodeMeta(row_slot, e.row_prefix_slot[row_slot], e.row_prefix_len[row_slot], n_gen - 1)
        h = decode_hidden_clamped(e.model, inputs, e.caches, meta)  # [A, k + 1, E]
        logp = process_logits(logits_from_hidden(e.model, h), e._params)  # [A, k + 1, V]
        pos = torch.arange(k + 1, device=dev)[None, :]
        keys = row_keys(e.seed, e.row_sample_id[row_slot], n_gen[:, None] + pos)
        greedy = e._params.greedy
        tokens, accepted = accept_counter_based(logp, drafts, None if greedy else draft_probs[:A], keys, greedy)
        lp = logp.gather(-1, tokens[..., None]).squeeze(-1)  # the target's log-probs of the emitted tokens

        live = ~e.done[row_slot]
        emit = accepted + 1
        stop = torch.isin(tokens, e.stop_ids) & (pos < emit[:, None])
        first_stop = torch.where(stop, pos, k + 1).min(dim=1).values
        emit = torch.minimum(torch.minimum(emit, first_stop + 1), e.max_new - n_gen)
        hit_stop = first_stop < emit
        emit = emit * live.long()
        out_idx = n_gen[:, None] + pos  # the buffers hold max_new_tokens + max_draft + 1 columns
        e.out_tokens[row_slot[:, None], out_idx] = tokens
        e.out_logprobs[row_slot[:, None], out_idx] = lp
        new_n = n_gen + emit
        e.n_gen[row_slot] = new_n
        new_last = tokens.gather(1, (emit - 1).clamp(min=0)[:, None]).squeeze(1)
        e.last_token[row_slot] = torch.where(live, new_last, last)
        e.done[row_slot] = ~live | hit_stop | (new_n >= e.max_new)
        n_live = live.long().sum()
        self.counters.add_(torch.stack([n_live * k, (accepted * live.long()).sum(), n_live]))
        self.cursor.zero_()

    # ---------------------------------------------------------------------------------- running
    def _compiled_draft(self):
        if self._draft_fn is None:
            fn = self.engine.compile_step(self.draft_step)
            self._draft_fn = fn
        return self._draft_fn

    def _compiled_verify(self):
        if self._verify_fn is None:
            fn = self.engine.compile_step(self.verify_step)
            self._verify_fn = fn
        return self._verify_fn

    def cycle_runner(self, bucket: int, k: int):
        """A callable running one cycle (``k`` draft steps + verify) for a ``[bucket]`` slot tensor."""
        e = self.engine
        draft, verify = self._compiled_draft(), self._compiled_verify()

        def cycle(slots: torch.Tensor) -> None:
            dt, dp = self.dtok[:, :k], self.dprobs[:, :k]
            if e.config.compile:
                torch._dynamo.mark_dynamic(slots, 0)  # one compiled graph for every bucket ...
                if k > 1:  # ... and every draft length
                    torch._dynamo.mark_dynamic(dt, 1)
                    torch._dynamo.mark_dynamic(dp, 1)
            self.cursor.zero_()  # verify leaves it at 0, but a draft-only step (calibration) leaves it at 1
            for _ in range(k):
                draft(slots)
            verify(slots, dt, dp)

        return self._graphed((bucket, k), bucket, cycle)

    def _graphed(self, key: tuple[int, int], bucket: int, fn):
        """``fn`` as a CUDA graph over a static ``[bucket]`` slot tensor (``fn`` itself off CUDA)."""
        e = self.engine
        if not (e.config.cuda_graphs and e.device.type == "cuda"):
            return fn
        if key not in self._graphs:
            static = torch.full((bucket,), e.scratch, dtype=torch.int64, device=e.device)
            # warm up (compilation, autotuning) on a side stream, on the scratch row only
            s = torch.cuda.Stream(e.device)
            s.wait_stream(torch.cuda.current_stream(e.device))
            with torch.cuda.stream(s):
                for _ in range(2):
                    fn(static)
            torch.cuda.current_stream(e.device).wait_stream(s)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):  # these graphs never run concurrently: one pool
                fn(static)
            self._graphs[key] = (graph, static)
        graph, static = self._graphs[key]

        def run(slots: torch.Tensor) -> None:
            static.copy_(slots)
            graph.replay()

        return run

    # ------------------------------------------------------------------------------------ block
    def step_stats(self, active: list[int], prompt_lens: list[int]) -> StepStats:
        ctx = [p + self._ngen.get(r, 1) for r, p in zip(active, prompt_lens)]
        return StepStats(len(active), sum(ctx) / len(ctx), max(ctx), self.engine._bucket(len(active)))

    def decode_block(self, active: list[int], prompt_lens: list[int], stats: "GenerationStats") -> list[int]:
        """One block on ``active`` rows (speculative or not, as the toggle decides), then one host sync;
        returns the rows that finished. ``prompt_lens``: prompt length of each active row."""
        e = self.engine
        A = len(active)
        st = self.step_stats(active, prompt_lens)
        bucket = st.bucket
        decision = self.toggle.decide(st)
        k = min(decision.num_draft, self.max_draft) if decision.speculate else 0
        slots = torch.tensor(active + [e.scratch] * (bucket - A), dtype=torch.int64).to(e.device)
        e.done[e.scratch] = True
        self.counters.zero_()
        t0 = time.perf_counter()
        if k > 0:
            tau = expected_tokens_per_cycle(self._alpha_seen, k)
            steps = max(1, round(e.config.sync_every / tau))  # about sync_every tokens per row per block
            run = self.cycle_runner(bucket, k)
        else:
            steps = e.config.sync_every
            run = e._runner(bucket)
        for _ in range(steps):
            run(slots)
        idx = slots[:A]
        host = torch.cat([e.done[idx].long(), e.n_gen[idx], self.counters]).cpu()  # the block's one sync
        seconds = time.perf_counter() - t0
        done, n_gen = host[:A].tolist(), host[A:2 * A].tolist()
        proposed, accepted, row_cycles = host[2 * A:].tolist()
        tokens = sum(n - self._ngen.get(r, 1) for r, n in zip(active, n_gen))

        self.toggle.observe_block(st, num_draft=k, steps=steps, seconds=seconds)
        stats.decode_steps += steps
        stats.row_steps += steps * bucket
        stats.active_hist[bucket] = stats.active_hist.get(bucket, 0) + steps
        stats.block_tokens[bucket] = stats.block_tokens.get(bucket, 0) + tokens
        stats.block_time_s[bucket] = stats.block_time_s.get(bucket, 0.0) + seconds
        if k > 0:
            stats.spec_cycles += steps
            stats.spec_row_cycles += row_cycles
            stats.draft_proposed += proposed
            stats.draft_accepted += accepted
            stats.spec_hist[bucket] = stats.spec_hist.get(bucket, 0) + steps
            stats.draft_len_hist[k] = stats.draft_len_hist.get(k, 0) + steps
            if proposed > 0:
                self._alpha_seen = 0.5 * self._alpha_seen + 0.5 * accepted / proposed
            self.toggle.observe(proposed=proposed, accepted=accepted, rows=row_cycles, seconds=seconds)
        finished = []
        for r, d, n in zip(active, done, n_gen):
            if d:
                finished.append(r)
                self._ngen.pop(r, None)
            else:
                self._ngen[r] = n
        return finished

    # ----------------------------------------------------------------------------- measurement
    def time_block(self, bucket: int, k: int, steps: int) -> float:
        """Seconds per step of ``steps`` target decode steps (``k == 0``), draft steps (``k < 0``: ``-k`` is
        ignored, one draft step each) or speculative cycles of ``k`` drafts, on the rows currently set up in
        slots ``0..bucket-1`` (used by calibration)."""
        e = self.engine
        slots = torch.arange(bucket, dtype=torch.int64, device=e.device)
        if k > 0:
            run = self.cycle_runner(bucket, k)
        elif k == 0:
            run = e._runner(bucket)
        else:
            run = self.draft_runner(bucket)
        run(slots)  # capture / compile outside the timing
        if e.device.type == "cuda":
            torch.cuda.synchronize(e.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            run(slots)
        if e.device.type == "cuda":
            torch.cuda.synchronize(e.device)
        return (time.perf_counter() - t0) / steps

    def draft_runner(self, bucket: int):
        """One draft step (cursor reset first) for a ``[bucket]`` slot tensor; a CUDA graph on CUDA."""
        e = self.engine
        draft = self._compiled_draft()

        def step(slots: torch.Tensor) -> None:
            if e.config.compile:
                torch._dynamo.mark_dynamic(slots, 0)
            self.cursor.zero_()
            draft(slots)

        return self._graphed((bucket, -1), bucket, step)

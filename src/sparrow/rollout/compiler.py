"""Compiling the engine's steps and replaying them as CUDA graphs: everything between a step function
(:mod:`sparrow.rollout.steps`) and the block that runs it, none of the maths.

* **Compilation.** Each step function is compiled once per sampling mode with ``torch.compile(fullgraph=True)``
  (:meth:`StepCompiler.compile`); with ``dynamic_batch`` the batch and draft-length sizes are symbolic: unbacked
  where this torch bounds them, backed where it does not or where a step cannot be traced with unbacked sizes
  (:meth:`StepCompiler._symbolic`, :meth:`StepCompiler._call`).
* **Bucket padding.** A block's active rows are padded with the scratch row up to the next batch bucket
  (:meth:`StepCompiler.pad`).
* **CUDA graphs.** One graph per ``(program, bucket, draft length, rows apart)``, captured on first use from the
  compiled steps (:meth:`StepCompiler.runner`), all in one memory pool.
* **Rows apart.** A block whose rows share their prompts too little runs inside
  :func:`~sparrow.kernels.decode_attention.per_row_decode` (:meth:`StepCompiler.apart`): the same compiled step,
  a graph of its own.
* **Compile cache.** The key of everything the compiled code depends on (:meth:`StepCompiler.compile_key`) names
  the on-disk :class:`~sparrow.compile_cache.CompileCache` (``EngineConfig.compile_cache``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

import torch
from torch._dynamo.utils import counters as dynamo_counters
from torchtune.modules import TransformerDecoder

from sparrow.attention.common import decode_impl
from sparrow.compile_cache import CompileCache, cache_counters, module_signature
from sparrow.kernels.decode_attention import CASCADE_MIN_ROWS, per_row_decode, shares_enough
from sparrow.models.attention import attention_modules
from sparrow.rollout.config import EngineConfig, bounded_unbacked_sizes
from sparrow.rollout.steps import STEPS, ProgramKind, StepName, StepState, program
from sparrow.speculative.base import Drafter

RECOMPILE_LIMIT = 64  # compiled graphs of one step kind, over every engine in the process (see StepCompiler.compile)
ACCUMULATED_RECOMPILE_LIMIT = 256  # and of all kinds (Dynamo's default)
Run = Callable[[torch.Tensor], None]  # one run of a program on a [bucket] slot tensor


def wait_for_device(device: torch.device) -> None:
    """Wait until ``device`` has finished its queued work (a deliberate device wait; nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class _Mode:
    """What one sampling mode compiled and captured: compiled steps by name, CUDA graphs (with their static slot
    tensor) by ``(program, bucket, draft length, rows apart)``."""

    steps: dict[StepName, Callable[..., None]] = field(default_factory=dict)
    graphs: dict[tuple[ProgramKind, int, int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = field(
        default_factory=dict)


class StepCompiler:
    """Compiles the step functions of :mod:`sparrow.rollout.steps` for an engine and replays their programs as CUDA
    graphs (module docstring). Compiled steps and graphs specialise on the sampling mode: :meth:`select` makes one
    current, and each mode keeps its own.

    Args:
        config: the engine's options (compilation, graphs, buckets, dynamic sizes, Inductor options, cache).
        model: the target (its architecture and attention backends are part of the compile key; the backends
            decide whether rows apart run other kernels).
        drafter: the engine's drafter, or None (part of the compile key).
        device, dtype: where and in what the steps run.
        scratch: the generation slot padding rows point at.
    """

    def __init__(self, config: EngineConfig, model: TransformerDecoder, drafter: Drafter | None,
                 device: torch.device, dtype: torch.dtype, scratch: int) -> None:
        self.config, self.model, self.drafter = config, model, drafter
        self.device, self.dtype, self.scratch = device, dtype, scratch
        self.attn = attention_modules(model)
        self._modes: dict[Hashable, _Mode] = {}  # every sampling mode seen, by its key
        self._mode: _Mode | None = None  # the current one
        self._pool = None  # one CUDA-graph memory pool: the graphs never run concurrently
        self._compiled: dict[str, int] = {}  # step name -> graphs compiled for it (every mode)
        self._setup_s: dict[str, float] = {}  # setup phase -> seconds (compilation, capture, warm-up)
        self._cache: CompileCache | None = None  # the CompileCache of config.compile_cache, made on first use
        self._backed: set[str] = set()  # steps compiled with backed dynamic sizes (see _symbolic)

    # ----------------------------------------------------------------------------------- modes
    def select(self, mode: Hashable) -> None:
        """Make sampling mode ``mode`` (a key: the processing parameters and the stop-id buffer's size) current,
        with the steps and graphs it compiled and captured before."""
        self._mode = self._modes.setdefault(mode, _Mode())

    @property
    def sampling_modes(self) -> int:
        """Sampling modes seen so far."""
        return len(self._modes)

    @property
    def captured_graphs(self) -> int:
        """CUDA graphs captured so far over every sampling mode: plain steps, draft steps and speculative cycles
        (0 without CUDA graphs). A count that grows during a generation means it captured (and compiled) inside
        it; ``RolloutEngine.prepare`` keeps it from growing."""
        return sum(len(m.graphs) for m in self._modes.values())

    @property
    def compiled_graphs(self) -> dict[str, int]:
        """Graphs compiled so far per step (``decode``, ``draft``, ``verify``; every sampling mode): with
        ``dynamic_batch`` one per step and sampling mode for every batch bucket and draft length, without it one per
        bucket (and draft length). A count that grows inside a generation means it compiled there."""
        return dict(self._compiled)

    @property
    def setup_seconds(self) -> dict[str, float]:
        """Seconds spent on setup so far, by phase: ``setup/compile_<step>_s`` (the first runs of each step, which
        compile it, or load it from the compile cache), ``setup/capture_s`` (CUDA-graph warm-up and capture,
        compilation excluded) and ``setup/warmup_s`` (without CUDA graphs: the other first runs), plus the lookups
        of Inductor's caches during ``RolloutEngine.prepare`` and ``time_step`` (``setup/fxgraph_cache_hit``,
        ``setup/fxgraph_cache_miss``, ... :func:`~sparrow.compile_cache.cache_counters`)."""
        return dict(self._setup_s)

    def add_setup(self, phase: str, value: float) -> None:
        """Add ``value`` to setup phase ``phase`` (:attr:`setup_seconds`)."""
        self._setup_s[phase] = self._setup_s.get(phase, 0) + value

    def add_lookups(self, before: dict[str, int]) -> None:
        """Add the compile-cache lookups made since :func:`~sparrow.compile_cache.cache_counters` gave ``before``
        (``setup/fxgraph_cache_hit``, ...)."""
        for k, v in cache_counters().items():
            if v > before[k]:
                self.add_setup(f"setup/{k}", v - before[k])

    def _compile_seconds(self) -> float:
        return sum(v for p, v in self._setup_s.items() if p.startswith("setup/compile_"))

    # ----------------------------------------------------------------------------- compile key
    def compile_key(self) -> dict[str, str]:
        """What the compiled steps depend on (besides the library versions and the device, which
        :class:`~sparrow.compile_cache.CompileCache` adds): the model's architecture, every layer's attention
        backend, the drafter, the dtype and the engine options that shape the steps (all but ``block_steps``,
        ``prefill_tokens``, ``progress`` and ``compile_cache``), with the batch buckets."""
        c = {f.name: getattr(self.config, f.name) for f in dataclasses.fields(self.config)
             if f.name not in ("block_steps", "prefill_tokens", "progress", "compile_cache")}
        return {"model": module_signature(self.model), "attention": " | ".join(repr(a.backend) for a in self.attn),
                "drafter": repr(self.drafter), "dtype": str(self.dtype).replace("torch.", ""),
                "engine": json.dumps(c, sort_keys=True, default=str), "buckets": str(self.config.buckets)}

    @property
    def compile_cache(self) -> CompileCache | None:
        """The on-disk cache of :meth:`compile_key` (``EngineConfig.compile_cache``), or None."""
        if self.config.compile_cache is not None and self._cache is None:
            self._cache = CompileCache(self.config.compile_cache, self.compile_key(), self.device)
        return self._cache

    # ------------------------------------------------------------------------------- compiling
    def compile(self, fn: Callable[..., None], name: str) -> Callable[..., None]:
        """``fn`` compiled when the config says so (``fullgraph=True``; with ``dynamic_batch`` its marked sizes are
        symbolic, else every new size compiles a static step), run under ``no_grad`` (inference only, whatever the
        caller's grad mode), its compilations counted under ``name`` (:attr:`compiled_graphs`) and timed
        (:attr:`setup_seconds`). ``fn`` itself is compiled, not a wrapper around it, so each step keeps its own
        compile cache (wrappers share one code object, and with it one recompile limit, :data:`RECOMPILE_LIMIT`
        graphs over every engine in the process). With Inductor, compiling points the process at the compile
        cache (:meth:`CompileCache.activate`). Inductor's coalescing-tiling analysis is switched off: it asserts
        on the verify step in some torch releases."""
        if not self.config.compile:
            return torch.no_grad()(fn)
        backend = self.config.compile_backend
        if self.compile_cache is not None and backend == "inductor":  # what Inductor compiles goes to the cache
            self.compile_cache.activate()
        options = ({"triton.coalesce_tiling_analysis": False, **(self.config.inductor_options or {})}
                   if backend == "inductor" else None)
        compiled = torch.compile(fn, fullgraph=True, backend=backend, options=options,
                                 dynamic=None if self.config.dynamic_batch else False)
        # Dynamo counts its recompile limit per code object, and the engines of a process share one per step (engines
        # of the same shapes share graphs too): several engines of other shapes (a benchmark's, a drafter's) soon
        # pass the default of 8. Static steps add one specialisation per bucket, length and mode.
        limit = max(RECOMPILE_LIMIT, 0 if self.config.dynamic_batch else
                    8 * len(self.config.buckets) * (self.config.max_draft + 2))

        def step(*args: object) -> None:
            graphs, t0 = dynamo_counters["stats"]["unique_graphs"], time.perf_counter()
            total = max(limit, ACCUMULATED_RECOMPILE_LIMIT)
            with torch.no_grad(), torch._dynamo.config.patch(recompile_limit=limit, accumulated_recompile_limit=total):
                compiled(*args)
            new = dynamo_counters["stats"]["unique_graphs"] - graphs
            if new > 0:  # this call compiled (or loaded from the compile cache): setup work, counted and timed
                self._compiled[name] = self._compiled.get(name, 0) + new
                self.add_setup(f"setup/compile_{name}_s", time.perf_counter() - t0)

        return step

    def step(self, name: StepName) -> Callable[..., None]:
        """The current mode's compiled step ``name`` (compiled on first use; called as ``step(state, slots,
        *draft_views)``)."""
        steps = self._mode.steps
        if name not in steps:
            steps[name] = self.compile(STEPS[name], name)
        return steps[name]

    def _symbolic(self, name: str, slots: torch.Tensor, *drafts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Aliases of a compiled step's arguments with the sizes that vary between its runs marked symbolic
        (``dynamic_batch``): the batch dimension of ``slots`` [A] and the draft-length dimension of the draft
        buffers' views ``drafts`` ([R, k], [R, k, V]). The marks go on fresh views, never on the caller's tensors.

        Where torch bounds unbacked sizes (``mark_unbacked(min=, max=, shape_id=)``, torch >= 2.13) both are
        *unbacked* with their ranges (``1..max_rows``, ``1..max_draft``): no value is specialised, not even 1, and
        nothing guards on them, so each step compiles once for every bucket (1 included) and every draft length
        (1 and ``max_draft`` included: a view of the whole draft buffer is contiguous, and a backed size would
        guard on that). Elsewhere, and for a step whose code cannot be traced with unbacked sizes (:meth:`_call`
        falls back), they are marked dynamic (backed): bucket 1 and draft length 1 then compile steps of their
        own (0/1 specialisation), and Inductor guards the verify step on ``k == max_draft``."""
        args = (slots,) + drafts
        if not (self.config.compile and self.config.dynamic_batch):
            return args
        slots, *drafts = (t.view(t.shape) for t in args)
        if bounded_unbacked_sizes() and name not in self._backed:
            torch._dynamo.decorators.mark_unbacked(slots, 0, min=1, max=self.config.max_rows, shape_id="rows")
            for t in drafts:
                torch._dynamo.decorators.mark_unbacked(t, 1, min=1, max=self.config.max_draft, shape_id="drafts")
        else:
            torch._dynamo.mark_dynamic(slots, 0)
            if drafts and drafts[0].shape[1] > 1:
                for t in drafts:
                    torch._dynamo.mark_dynamic(t, 1)
        return (slots, *drafts)

    def _call(self, name: StepName, step: Callable[..., None], state: StepState, slots: torch.Tensor,
              *drafts: torch.Tensor) -> None:
        """Run compiled step ``name`` (``step``) on ``state`` with its symbolic sizes (:meth:`_symbolic`). Should
        compiling it with unbacked sizes fail (code that branches on a batch size: a data-dependent guard, in the
        model or in an Inductor lowering, e.g. CPU ``bmm`` asking whether a size is 1), the step falls back to
        backed dynamic sizes, with a warning (its compile count then shows the extra graphs)."""
        try:
            step(state, *self._symbolic(name, slots, *drafts))
        except _TRACE_ERRORS as e:  # Dynamo's, or a lowering's inside Inductor
            if name in self._backed or not self.config.dynamic_batch or "data-dependent" not in str(e):
                raise
            self._backed.add(name)
            first = str(e).strip().splitlines()[0]
            warnings.warn(f"the {name} step cannot be compiled with unbacked batch / draft sizes ({first}); it is "
                          "compiled with backed dynamic sizes instead (bucket 1 and draft length 1 compile their own "
                          "graphs)", RuntimeWarning, stacklevel=2)
            step(state, *self._symbolic(name, slots, *drafts))

    def _compiled_step(self, name: StepName) -> Callable[..., None]:
        """Step ``name`` as the programs call it: the current mode's compiled step, with its symbolic sizes."""
        return functools.partial(self._call, name, self.step(name))

    # ------------------------------------------------------------------------ buckets and graphs
    def bucket(self, rows: int) -> int:
        """The smallest batch bucket that holds ``rows`` active rows."""
        for b in self.config.buckets:
            if b >= rows:
                return b
        raise AssertionError(f"{rows} active rows exceed max_rows")  # pragma: no cover

    def pad(self, rows: Sequence[int]) -> torch.Tensor:
        """The slot tensor [bucket] int64 of ``rows`` (on the device), padded with the scratch row up to their
        bucket."""
        padding = [self.scratch] * (self.bucket(len(rows)) - len(rows))
        return torch.tensor(list(rows) + padding, dtype=torch.int64).to(self.device)

    @property
    def graphed(self) -> bool:
        """Whether programs replay as CUDA graphs (``EngineConfig.cuda_graphs`` on a CUDA device)."""
        return self.config.cuda_graphs and self.device.type == "cuda"

    def runner(self, state: StepState, kind: ProgramKind, bucket: int, k: int = 0, apart: bool = False) -> Run:
        """A callable running one ``kind`` program (:func:`~sparrow.rollout.steps.program` over the compiled steps)
        on ``state`` for a ``[bucket]`` slot tensor, with ``apart`` inside
        :func:`~sparrow.kernels.decode_attention.per_row_decode` (every row reads its own prompt; the same compiled
        step): a CUDA graph per ``(kind, bucket, k, apart)`` when enabled (captured on first use, over the state of
        that call, from the compiled step every bucket shares; its seconds, compilation excluded, go to
        ``setup/capture_s``), the program itself otherwise."""
        run = program(kind, k, self._compiled_step, state)
        if apart:
            run = _rows_apart(run)
        if not self.graphed:
            return run
        key = (kind, bucket, k, apart)
        if key not in self._mode.graphs:
            self._mode.graphs[key] = self._capture(run, bucket)
        graph, static = self._mode.graphs[key]

        def replay(slots: torch.Tensor) -> None:
            static.copy_(slots)
            graph.replay()

        return replay

    def _capture(self, run: Run, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """A CUDA graph of ``run`` on a static ``[bucket]`` slot tensor (of the scratch row), after a warm-up
        (compilation, autotuning) on a side stream."""
        t0, compiling = time.perf_counter(), self._compile_seconds()
        static = torch.full((bucket,), self.scratch, dtype=torch.int64, device=self.device)
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            for _ in range(2):
                run(static)
        torch.cuda.current_stream(self.device).wait_stream(s)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):  # one pool: the graphs never run concurrently
            run(static)
        wait_for_device(self.device)
        self.add_setup("setup/capture_s", time.perf_counter() - t0 - (self._compile_seconds() - compiling))
        return graph, static

    def warm(self, state: StepState, kind: ProgramKind, bucket: int, k: int, slots: torch.Tensor,
             apart: bool = False) -> Run:
        """The runner of ``(kind, bucket, k, apart)`` (:meth:`runner`), compiled and (on CUDA) captured; without
        CUDA graphs its program runs once on ``slots`` here (which compiles it when needed; the rest of its time
        goes to ``setup/warmup_s``)."""
        run = self.runner(state, kind, bucket, k, apart)
        if not self.graphed:
            t0, compiling = time.perf_counter(), self._compile_seconds()
            run(slots)
            wait_for_device(self.device)
            self.add_setup("setup/warmup_s", time.perf_counter() - t0 - (self._compile_seconds() - compiling))
        return run

    def describe(self, kind: ProgramKind, bucket: int, k: int, apart: bool = False) -> str:
        """What warming ``(kind, bucket, k, apart)`` does now, for a progress bar."""
        step = {"decode": "decode step", "draft": "draft step", "cycle": f"verify step (draft length {k})"}[kind]
        step += ", rows apart" if apart else ""
        name = "verify" if kind == "cycle" else kind
        if self.graphed and (kind, bucket, k, apart) in self._mode.graphs:
            return f"{step}, bucket {bucket}: captured"
        if name not in self._mode.steps or not self.config.dynamic_batch:
            return f"compiling the {step}" + ("" if self.config.dynamic_batch else f" for bucket {bucket}")
        return f"capturing the {step} graph, bucket {bucket}" if self.graphed else f"{step}, bucket {bucket}"

    # ------------------------------------------------------------------------------- rows apart
    def apart_differs(self, bucket: int) -> bool:
        """Whether a step at ``bucket`` rows with the rows apart runs other kernels than the shared-prefix one:
        the engine shares prompts, a layer's backend chooses its path (``shared_prefix="auto"``) on the Triton
        kernels, and on CUDA the op does not hand the batch to the per-row kernel anyway (under
        ``CASCADE_MIN_ROWS`` rows)."""
        if not self.config.share_prefix or (self.device.type == "cuda" and bucket < CASCADE_MIN_ROWS):
            return False
        return any(getattr(b, "shared_prefix", None) == "auto"
                   and decode_impl(b.impl, b.shape.head_dim, self.device) == "triton"
                   for b in (a.backend for a in self.attn))

    def apart(self, bucket: int, prefixes: Sequence[int]) -> bool:
        """Whether a block on rows reading the prefix slots ``prefixes`` runs with the rows apart: when they share
        their prompts too little for the cascade (:func:`~sparrow.kernels.decode_attention.shares_enough`; the
        groups of a long-tailed rollout thin out as samples finish). Host lists only: no device read."""
        return self.apart_differs(bucket) and not shares_enough(prefixes)


def _rows_apart(run: Run) -> Run:
    """``run`` inside :func:`~sparrow.kernels.decode_attention.per_row_decode` (read by the attention op when it
    runs, so a CUDA graph captured from this keeps the per-row kernels)."""

    def apart(slots: torch.Tensor) -> None:
        with per_row_decode():
            run(slots)

    return apart


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

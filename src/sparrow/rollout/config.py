"""What a :class:`~sparrow.rollout.RolloutEngine` is built with (:class:`EngineConfig`; :func:`batch_buckets`, a
ladder of its batch buckets) and what a request to it must satisfy (:func:`validate_sampling`,
:func:`validate_prompts`: the checks behind ``generate``, ``start`` and ``RolloutSession.add``)."""

from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from sparrow.sampling import SamplingParams


def _flat_options(options: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"triton": {"enable_pdl": True}}`` -> ``{"triton.enable_pdl": True}`` (flat names pass unchanged)."""
    flat: dict[str, Any] = {}
    for key, value in options.items():
        name = f"{prefix}{key}"
        flat.update(_flat_options(value, name + ".") if isinstance(value, Mapping) else {name: value})
    return flat


def batch_buckets(rows: int, growth: int, smallest: int = 1) -> list[int]:
    """Engine batch buckets (``EngineConfig.batch_buckets``): the powers of ``growth`` from ``smallest`` below
    ``rows``, then ``rows`` (growth 2 is the engine's default; growth 4 keeps every other power of two: about half
    the compiled steps and CUDA graphs of 2)."""
    out, b = [], 1
    while b < rows:
        if b >= smallest:
            out.append(b)
        b *= growth
    return out + [rows]


@functools.cache
def bounded_unbacked_sizes() -> bool:
    """Whether this torch bounds unbacked sizes (``mark_unbacked`` takes ``min``, ``max`` and ``shape_id``, torch
    >= 2.13): then one compiled step serves every batch bucket, 1 included (``docs/rollout.md``)."""
    params = inspect.signature(torch._dynamo.decorators.mark_unbacked).parameters
    return {"min", "max", "shape_id"} <= set(params)


def smallest_bucket(compile: bool, dynamic_batch: bool = True) -> int:
    """The smallest batch bucket worth giving an engine built with ``compile`` / ``dynamic_batch``: 1 where one
    compiled step serves it (no compilation, or :func:`bounded_unbacked_sizes`), else 2. With backed dynamic sizes
    (torch < 2.13) size 1 is specialised, so bucket 1 compiles every kind of step a second time (about a minute each
    for the 0.5B shape on an H100) for rows the next bucket holds: decode is memory-bound, its weights read once a
    step whatever the rows, so a lone row padded with the scratch row costs little more."""
    return 2 if compile and dynamic_batch and not bounded_unbacked_sizes() else 1


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
            ``max_rows``, plus ``max_rows``, from :func:`smallest_bucket`). The active set is padded up to the next
            bucket.
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
        """The batch buckets, ascending: ``batch_buckets`` (with ``max_rows``), or the powers of two from
        :func:`smallest_bucket` below ``max_rows`` and ``max_rows``."""
        if self.batch_buckets is not None:
            return self.batch_buckets
        return tuple(batch_buckets(self.max_rows, 2, smallest=smallest_bucket(self.compile, self.dynamic_batch)))

    @property
    def num_prefixes(self) -> int:
        """Prefix slots: ``max_prompts``, or ``max_rows`` when it is None."""
        return self.max_prompts if self.max_prompts is not None else self.max_rows


def validate_sampling(config: EngineConfig, n_samples: int, params: SamplingParams, vocab_size: int) -> None:
    """Check that groups of ``n_samples`` sampled with ``params`` fit an engine of ``config`` over a vocabulary of
    ``vocab_size`` ids.

    Raises:
        TypeError: ``params`` is not :class:`SamplingParams`. ValueError: ``n_samples`` < 1 or above ``max_rows``,
            ``max_new_tokens`` above the engine's, or stop tokens outside the vocabulary.
    """
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    if n_samples > config.max_rows:
        raise ValueError(f"n_samples ({n_samples}) exceeds the engine's max_rows ({config.max_rows})")
    if params.max_new_tokens > config.max_new_tokens:
        raise ValueError(
            f"max_new_tokens ({params.max_new_tokens}) exceeds the engine's capacity "
            f"({config.max_new_tokens}); raise EngineConfig.max_new_tokens"
        )
    params.validate_vocab(vocab_size)


def validate_prompts(config: EngineConfig, prompts: Sequence, params: SamplingParams, vocab_size: int,
                     max_seq_len: int) -> list[torch.Tensor]:
    """``prompts`` (token id sequences or tensors) as 1-D int64 CPU tensors, checked against the vocabulary, the
    model's context ``max_seq_len`` (with ``params.max_new_tokens``) and ``config.max_prompt_len``.

    Raises:
        ValueError: no prompts, an empty prompt, token ids outside ``[0, vocab_size)``, or a prompt too long.
    """
    if len(prompts) == 0:
        raise ValueError("no prompts given")
    out = []
    for i, p in enumerate(prompts):
        t = torch.as_tensor(p, dtype=torch.int64).flatten().cpu()
        if t.numel() == 0:
            raise ValueError(f"prompt {i} is empty")
        if int(t.min()) < 0 or int(t.max()) >= vocab_size:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size})")
        if t.numel() + params.max_new_tokens > max_seq_len:
            raise ValueError(
                f"prompt {i} ({t.numel()} tokens) + max_new_tokens ({params.max_new_tokens}) is longer than "
                f"the model's context ({max_seq_len} tokens)"
            )
        if t.numel() > config.max_prompt_len:
            raise ValueError(
                f"prompt {i} ({t.numel()} tokens) is longer than the engine's max_prompt_len "
                f"({config.max_prompt_len})"
            )
        out.append(t)
    return out

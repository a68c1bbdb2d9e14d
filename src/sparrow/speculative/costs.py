"""Measured step costs of an engine, for the cost-model toggle.

:meth:`CostModel.calibrate` times, on the engine itself (its compiled steps and CUDA graphs, its batch
buckets), a target decode step, a draft step and a speculative cycle at two draft lengths, each at two
context lengths, for every batch bucket. Per bucket every cost is modelled as linear in the mean context
length ``L`` (attention reads ``bucket * L`` cached tokens per layer, weights and launches are the
constant part):

* ``c_target(b, L) = a_t + s_t * L``
* ``c_draft(b, L)  = a_d + s_d * L``
* ``c_verify(b, L, k) = c_cycle(b, L, k) - k * c_draft(b, L)``, measured at two draft lengths and
  interpolated linearly in ``k`` (the verify pass processes ``b * (k + 1)`` tokens).

Buckets between calibrated ones are interpolated linearly. The result is cached as JSON keyed by everything the
costs depend on (:func:`cost_key`: the model's architecture, attention backends, drafter, dtype, device, library
versions, the engine's options and buckets, the sampling processing) and by the calibration's own settings, in
the engine's compile cache when it has one (``EngineConfig.compile_cache``): a second start-up of the same
configuration loads it instead of measuring, and any other configuration measures its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from tqdm import tqdm

from sparrow.compile_cache import environment_key
from sparrow.sampling import SamplingParams
from sparrow.speculative.base import StepTimer

DEFAULT_CACHE_DIR = Path(os.environ.get("SPARROW_CACHE_DIR", Path.home() / ".cache" / "sparrow")) / "spec_costs"


def expected_tokens_per_cycle(alpha: float, k: int) -> float:
    """Expected tokens a row emits per cycle of ``k`` drafts with per-token acceptance ``alpha``:
    ``(1 - alpha^(k+1)) / (1 - alpha)`` (``k + 1`` when ``alpha == 1``)."""
    alpha = min(max(float(alpha), 0.0), 1.0)
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def _lin(fit: tuple[float, float], ctx: float) -> float:
    return fit[0] + fit[1] * ctx


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear interpolation, linear extrapolation from the end segments."""
    if len(xs) == 1:
        return ys[0]
    i = 0
    while i < len(xs) - 2 and x > xs[i + 1]:
        i += 1
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class CostModel:
    """Step costs in seconds as functions of batch bucket, mean context length and draft length.

    Attributes:
        key: what the costs were measured for (see :func:`cost_key`).
        target: bucket -> (intercept s, slope s per context token) of one target decode step.
        draft: bucket -> (intercept, slope) of one draft step.
        verify: bucket -> {draft length -> (intercept, slope)} of one verify step (rejection included).
        meta: calibration details (contexts, timings, duration).
    """

    key: str
    target: dict[int, tuple[float, float]]
    draft: dict[int, tuple[float, float]]
    verify: dict[int, dict[int, tuple[float, float]]]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.target or set(self.target) != set(self.draft) or set(self.target) != set(self.verify):
            raise ValueError("CostModel.target, draft and verify must cover the same non-empty set of buckets")
        for b, ks in self.verify.items():
            if not ks:
                raise ValueError(f"CostModel.verify[{b}] has no draft lengths")

    # ------------------------------------------------------------------------------- queries
    @property
    def buckets(self) -> list[int]:
        return sorted(self.target)

    def _per_bucket(self, table: dict[int, tuple[float, float]], bucket: float, ctx: float) -> float:
        bs = self.buckets
        return max(1e-7, _interp(bs, [_lin(table[b], ctx) for b in bs], bucket))

    def target_step(self, bucket: float, ctx: float) -> float:
        """Seconds of one target decode step of ``bucket`` rows at mean context ``ctx``."""
        return self._per_bucket(self.target, bucket, ctx)

    def draft_step(self, bucket: float, ctx: float) -> float:
        """Seconds of one draft step."""
        return self._per_bucket(self.draft, bucket, ctx)

    def verify_step(self, bucket: float, ctx: float, k: int) -> float:
        """Seconds of one verify step with ``k`` drafts per row (rejection sampling included); never below a
        target step, which does a subset of its work (timing noise in ``cycle - k * draft`` could say so)."""
        bs = self.buckets

        def at(b: int) -> float:
            ks = sorted(self.verify[b])
            return _interp(ks, [_lin(self.verify[b][x], ctx) for x in ks], k)

        return max(self.target_step(bucket, ctx), _interp(bs, [at(b) for b in bs], bucket))

    def cycle(self, bucket: float, ctx: float, k: int) -> float:
        """Seconds of one speculative cycle: ``k`` draft steps and one verify step."""
        return k * self.draft_step(bucket, ctx) + self.verify_step(bucket, ctx, k)

    def speedup(self, bucket: float, ctx: float, k: int, alpha: float) -> float:
        """Predicted tokens-per-second ratio of speculative over plain decoding."""
        return expected_tokens_per_cycle(alpha, k) * self.target_step(bucket, ctx) / self.cycle(bucket, ctx, k)

    def table(self, ctx: float, lengths: Sequence[int], alphas: Sequence[float] = (0.7, 0.9)) -> list[dict[str, float]]:
        """The model at context ``ctx``, one row per calibrated bucket: ``bucket``, ``ctx`` (as an int),
        ``target_ms``, ``draft_ms``, ``verify<k>_ms`` for each distinct ``k`` of ``lengths`` (ascending) and
        ``best_speedup@a=<alpha>`` (the best :meth:`speedup` over ``lengths``) for each of ``alphas``.
        ``ValueError`` without ``lengths``."""
        if not lengths:
            raise ValueError("CostModel.table: give at least one draft length")
        return [{"bucket": b, "ctx": int(ctx), "target_ms": 1e3 * self.target_step(b, ctx),
                 "draft_ms": 1e3 * self.draft_step(b, ctx),
                 **{f"verify{k}_ms": 1e3 * self.verify_step(b, ctx, k) for k in sorted(set(lengths))},
                 **{f"best_speedup@a={a}": max(self.speedup(b, ctx, k, a) for k in lengths) for a in alphas}}
                for b in self.buckets]

    # -------------------------------------------------------------------------- persistence
    def to_json(self) -> str:
        d = asdict(self)
        d["target"] = {str(b): v for b, v in self.target.items()}
        d["draft"] = {str(b): v for b, v in self.draft.items()}
        d["verify"] = {str(b): {str(k): v for k, v in ks.items()} for b, ks in self.verify.items()}
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "CostModel":
        d = json.loads(text)
        return cls(
            key=d["key"],
            target={int(b): tuple(v) for b, v in d["target"].items()},
            draft={int(b): tuple(v) for b, v in d["draft"].items()},
            verify={int(b): {int(k): tuple(v) for k, v in ks.items()} for b, ks in d["verify"].items()},
            meta=d.get("meta", {}),
        )

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # rollout ranks of one host may save the same model at once
        tmp.write_text(self.to_json())
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path, key: str | None = None) -> "CostModel":
        """Load a saved model; ``ValueError`` if ``key`` is given and differs from the saved one."""
        m = cls.from_json(Path(path).read_text())
        if key is not None and m.key != key:
            raise ValueError(f"cost model at {path} was measured for {m.key!r}, not {key!r}")
        return m

    # --------------------------------------------------------------------------- calibration
    @classmethod
    def calibrate(
        cls,
        engine: StepTimer,
        params: SamplingParams | None = None,
        *,
        contexts: tuple[int, int] | None = None,
        draft_lengths: tuple[int, int] | None = None,
        buckets: tuple[int, ...] | None = None,
        steps: int = 8,
        cache_dir: str | Path | None = "auto",
        refresh: bool = False,
        progress: bool | None = None,
    ) -> "CostModel":
        """Measure (or load from ``cache_dir``) the step costs of ``engine`` with its drafter, through its
        :meth:`~sparrow.speculative.base.StepTimer.time_step` (for a :class:`~sparrow.rollout.RolloutEngine`: its own
        compiled steps and CUDA graphs).

        Args:
            engine: a :class:`~sparrow.speculative.base.StepTimer` (a rollout engine) built with a drafter; not
                generating.
            params: sampling parameters whose processing the steps use (default ``SamplingParams()``).
            contexts: two mean context lengths to measure at (default: about 1/16 and 3/4 of the engine's
                ``max_prompt_len + max_new_tokens``).
            draft_lengths: draft lengths for the verify fit (default ``(2, max_draft)``; with one length the
                verify cost is taken as independent of ``k``).
            buckets: batch buckets to measure (default: all of the engine's).
            steps: timed repetitions per point (after one untimed warm-up / capture).
            cache_dir: where cost models are cached: ``"auto"`` (default) the ``costs`` folder of the engine's
                compile cache (``EngineConfig.compile_cache``), or :data:`DEFAULT_CACHE_DIR` when it has none;
                ``None``: no cache. A cached model is used only when its key (:func:`cost_key`), contexts, draft
                lengths and steps are the ones asked for and it covers the buckets.
            refresh: measure even if a cached model exists.
            progress: show a progress bar over the measurements (default: ``EngineConfig.progress``).

        Raises:
            ValueError: the engine has no drafter, or contexts / draft lengths out of the engine's range.
        """
        if engine.drafter is None:
            raise ValueError("calibrate needs an engine built with a drafter")
        params = params or SamplingParams(max_new_tokens=1)
        c = engine.config
        top = c.max_prompt_len + c.max_new_tokens
        if contexts is None:
            contexts = (max(2, top // 16), max(3, (3 * top) // 4))
        draft_lengths = tuple(draft_lengths or (min(2, c.max_draft), c.max_draft))
        if len(contexts) != 2 or contexts[0] >= contexts[1] or contexts[0] < 2 or contexts[1] > top:
            raise ValueError(f"contexts must be two increasing lengths in [2, {top}], got {contexts}")
        if any(not 1 <= k <= c.max_draft for k in draft_lengths):
            raise ValueError(f"draft_lengths must lie in [1, {c.max_draft}], got {draft_lengths}")
        buckets = tuple(buckets or c.buckets)
        key = cost_key(engine, params)
        ks = sorted(set(draft_lengths))
        settings = {"contexts": list(contexts), "draft_lengths": ks, "steps": steps}
        if isinstance(cache_dir, str) and cache_dir == "auto":
            cache_dir = engine.compile_cache.costs_dir if engine.compile_cache is not None else DEFAULT_CACHE_DIR
        path = None
        if cache_dir is not None:
            name = hashlib.sha256(json.dumps([key, settings]).encode()).hexdigest()[:20]
            path = Path(cache_dir) / f"{name}.json"
            if path.exists() and not refresh:
                try:
                    m = cls.load(path, key)
                    if set(m.buckets) >= set(buckets) and all(m.meta.get(k) == v for k, v in settings.items()):
                        return m
                except (ValueError, KeyError, TypeError, json.JSONDecodeError):
                    pass  # measured for something else, or unreadable: measure again (and replace it)

        t_start = time.perf_counter()
        raw: dict[str, Any] = {}
        target, draft, verify = {}, {}, {}
        show = engine.config.progress if progress is None else progress
        bar = tqdm(total=len(buckets) * len(contexts) * (2 + len(ks)), desc="cost model", disable=not show,
                   leave=False, dynamic_ncols=True)

        def timed(what: str, kind: str, b: int, L: int, k: int = 0) -> float:
            bar.set_description(f"cost model: {what}, bucket {b}, context {L}")
            seconds = engine.time_step(kind, b, k=k, context=L, steps=steps, params=params)
            bar.update()
            return seconds

        with torch.no_grad(), bar:
            for b in buckets:
                pts: dict[str, list[float]] = {"target": [], "draft": []}
                pts.update({f"cycle{k}": [] for k in ks})
                for L in contexts:
                    pts["target"].append(timed("decode step", "decode", b, L))
                    pts["draft"].append(timed("draft step", "draft", b, L))
                    for k in ks:
                        pts[f"cycle{k}"].append(timed(f"cycle of {k} drafts", "cycle", b, L, k))
                raw[str(b)] = pts
                target[b] = _fit(contexts, pts["target"])
                draft[b] = _fit(contexts, pts["draft"])
                verify[b] = {}
                for k in ks:
                    ver = [cy - k * d for cy, d in zip(pts[f"cycle{k}"], pts["draft"])]
                    verify[b][k] = _fit(contexts, ver)
                if len(ks) == 1:  # one draft length: assume the verify cost does not depend on k
                    verify[b][ks[0] + 1] = verify[b][ks[0]]
        meta = {**settings, "timings_s": raw, "seconds": time.perf_counter() - t_start}
        m = cls(key=key, target=target, draft=draft, verify=verify, meta=meta)
        if path is not None:
            m.save(path)
        return m


def _fit(xs: tuple[int, int], ys: list[float]) -> tuple[float, float]:
    (x0, x1), (y0, y1) = xs, ys
    slope = max(0.0, (y1 - y0) / (x1 - x0))  # timing noise must not make cost fall with context
    return (y0 - slope * x0, slope)


def cost_key(engine: StepTimer, params: SamplingParams) -> str:
    """Identity of what a cost model measures: the engine's compile key (model architecture and shape, every
    layer's attention backend with its configuration, drafter, dtype, the engine options that shape a step and its
    batch buckets: :meth:`~sparrow.speculative.base.StepTimer.compile_key`), the device and the library versions,
    and the sampling processing (temperature, top-p, top-k, vocabulary limit, greedy, the number of stop ids)."""
    m = engine.model
    a = m.layers[0].attn
    parts = {
        "model": f"L{len(m.layers)}-E{m.tok_embeddings.embedding_dim}-H{a.num_heads}/{a.num_kv_heads}x{a.head_dim}"
                 f"-V{m.tok_embeddings.num_embeddings}-{type(a.backend).__name__}",
        **environment_key(engine.device),
        "processing": f"t{params.temperature}-p{params.top_p}-k{params.top_k}-v{params.vocab_limit}"
                      f"-greedy{params.greedy}-stops{len(params.stop_token_ids)}",
        **{f"compile.{k}": v for k, v in engine.compile_key().items()},
    }
    return "|".join(f"{k}={v}" for k, v in parts.items())

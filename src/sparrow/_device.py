"""The device as the library measures it: wait for it, free its cached memory, time work on it.

Imports nothing of Sparrow's and nothing heavier than torch (no Triton), so any module may use it, and so may the
benchmark harness ``sparrow.bench``, which re-exports it, before a CPU run sets Triton's interpreter up.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import torch


def synchronize() -> None:
    """Wait for the CUDA device (nothing without CUDA): call it before reading a host clock."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_memory() -> None:
    """Collect garbage and return cached CUDA memory (what an earlier, perhaps failed, run left behind)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def quantiles(samples: Sequence[float]) -> dict[str, float]:
    """``{"median_ms", "p20_ms", "p80_ms", "n"}`` of ``samples`` (milliseconds, at least one; nearest rank)."""
    s = sorted(samples)
    q = lambda f: s[min(len(s) - 1, max(0, round(f * (len(s) - 1))))]  # noqa: E731
    return {"median_ms": statistics.median(s), "p20_ms": q(0.2), "p80_ms": q(0.8), "n": len(s)}


def measure(fn: Callable[[], Any], *, warmup: int = 3, iters: int = 20, min_time_s: float = 0.0,
            setup: Callable[[], Any] | None = None) -> dict[str, float]:
    """Time ``fn()``; returns :func:`quantiles` of the calls in milliseconds.

    ``setup`` (untimed) runs before every call, e.g. to rotate inputs or reset a cache. With CUDA the
    region is bracketed by CUDA events; ``min_time_s`` keeps repeating past ``iters`` until that much
    time has been measured (at most ``10 * iters`` calls).
    """
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    samples: list[float] = []
    total = 0.0
    while len(samples) < iters or total < min_time_s * 1e3:
        if setup is not None:
            setup()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        samples.append(ms)
        total += ms
        if len(samples) >= 10 * max(iters, 1):
            break
    return quantiles(samples)

"""Which decode kernel the shared-prefix op runs: its thresholds and the per-row context. Plain Python (no Triton):
the engine reads it to choose per block, the op when it runs."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence

# below this many rows (one or two GRPO groups) the per-row kernel's finer splits beat the cascade on the H200
# (docs/benchmarks/engine_shared_prefix.json: 1 and 8 rows 0.75-0.93x, 32 rows 1.10-1.20x of the per-row kernel)
CASCADE_MIN_ROWS = 16
# fewer rows than this per live prompt, on average, and the cascade loses to the per-row kernel on the H200: one
# layer at 32-256 rows, 8K-32K prompts, one query per row (docs/benchmarks/decode_attention_cascade.json): groups
# of 1 cost 1.7-2.2x the per-row kernel, groups of 2 1.04-1.56x; groups of 4 gain 1.16-1.57x, groups of 8 1.59-2.09x
CASCADE_MIN_SHARE = 4
# more query tokens per row than this (speculative verification, k + 1) and the per-row kernel wins on the H200 at
# every group size: at T = 5 the cascade costs 1.3-3.3x the per-row kernel, groups of 1-8, 32-256 rows, 8K-32K
# prompts (the same sweep; the per-row programs of one group read its prompt's KV while the L2 cache holds it)
CASCADE_MAX_TOKENS = 1

_apart = threading.local()  # per thread: the depth of per_row_decode() contexts


@contextlib.contextmanager
def per_row_decode() -> Iterator[None]:
    """Inside this context the shared-prefix decode op (:func:`cascade_decode_attention` on Triton, dense heads)
    runs the per-row kernel at every batch size, every row reading its own prompt: the same result. For batches
    whose rows share their prompts too little to pay for the cascade's tiles (:func:`shares_enough`). The op reads
    it when it runs, not when it is traced: one compiled step serves both ways, and a CUDA graph captured inside
    keeps the per-row kernels. An explicit ``min_rows=0`` (always the cascade) and RTPurbo's local heads ignore it.
    Nests; thread-local."""
    _apart.depth = getattr(_apart, "depth", 0) + 1
    try:
        yield
    finally:
        _apart.depth -= 1


def per_row_forced() -> bool:
    """Whether the calling thread is inside :func:`per_row_decode`."""
    return getattr(_apart, "depth", 0) > 0


def shares_enough(prefixes: Sequence[int]) -> bool:
    """Whether rows reading the prompts in ``prefixes`` (one prefix slot per row) share them enough for the
    cascade: at least :data:`CASCADE_MIN_SHARE` rows per distinct prompt on average (True for no rows)."""
    return len(prefixes) >= CASCADE_MIN_SHARE * len(set(prefixes))

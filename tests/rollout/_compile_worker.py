"""Engine builds and generations with Inductor for the compile-cache tests, in the test's process (:func:`run`) or
in a fresh one: ``python _compile_worker.py CACHE_DIR MODE[,MODE...] OUT.json`` (MODE: ``dynamic`` or ``static``,
the ``EngineConfig.dynamic_batch`` setting; each mode builds its own engine over ``CACHE_DIR``, one after the other).

Each engine (a tiny one-layer model, batch buckets 1 and 2; on the GPU when there is one) is prepared and decodes three
prompts greedily on its two rows, the last one alone, so that both buckets run. OUT.json maps every mode to the graphs
compiled per kind, the setup phases, the Inductor cache lookups of the build, the buckets visited and every
sample's tokens and log-prob bit patterns.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from sparrow.compile_cache import cache_counters
from sparrow.models import tiny_qwen2
from sparrow.rollout import EngineConfig, RolloutEngine, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=tuple(range(8)))  # greedy: the smallest graph
PROMPTS = [[9, 17, 30, 11], [40, 12], [33, 21, 8]]


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = tiny_qwen2(vocab_size=48, num_layers=1, embed_dim=32, num_heads=2, num_kv_heads=1, intermediate_dim=64,
                   max_seq_len=64)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.1)
    return m.eval()


def run(cache_dir: str | None, dynamic: bool) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = EngineConfig(max_rows=2, max_prompt_len=8, max_new_tokens=10, block_steps=1, batch_buckets=(1, 2),
                       compile=True, dynamic_batch=dynamic, compile_cache=cache_dir)  # bucket 1 whatever the torch
    engine = RolloutEngine(model().to(device), cfg)
    before = cache_counters()
    engine.prepare(PARAMS)
    lookups = {k: v - before[k] for k, v in cache_counters().items()}
    out = engine.generate(PROMPTS, 1, PARAMS)
    return {"compiled_graphs": engine.compiled_graphs, "setup_seconds": engine.setup_seconds, "lookups": lookups,
            "buckets": sorted(out.stats.active_hist),
            "tokens": [s.tokens.tolist() for s in out], "logprob_bits": [s.logprobs.view(torch.int32).tolist()
                                                                       for s in out]}


if __name__ == "__main__":
    torch.set_num_threads(1)
    cache, modes, path = sys.argv[1:4]
    Path(path).write_text(json.dumps({m: run(cache, m == "dynamic") for m in modes.split(",")}))

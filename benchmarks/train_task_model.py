"""Train a small Qwen2-architecture model on the synthetic long-context tasks, for the accuracy benchmarks.

The RTPurbo accuracy benchmark (``bench_rtpurbo_accuracy.py``) and the speculative / end-to-end benchmarks
need a model that actually solves multi-key retrieval and variable tracking at long context. This script
trains one from scratch in a fixed time budget:

* **Model**: ``sparrow.models.qwen2`` with the character vocabulary of :class:`~sparrow.rl.CharTokenizer`
  (default 6 layers, width 384, 6 query / 2 kv heads of 64 dims, MLP 1152: 10M parameters), dense attention.
* **Data**, generated on the fly (``task.example(seed, index)``, a few worker processes, batches prefetched):
  a mixture of :class:`~sparrow.rl.KVRetrieval` (all pairs; and ``vary_pairs=True``, fewer pairs in filler,
  as an easier curriculum share) and :class:`~sparrow.rl.VariableTracking`, every sequence
  ``<bos> prompt answer <eos>``, mostly as :class:`MultiQuery` examples: the same context asked several
  questions in turn, every answer supervised (one question per sequence leaves a model on the plateau of
  copying *some* value). All sequences of a step have one context length; the step's token budget is fixed
  (8192 tokens by default: many small steps), so short steps carry many examples.
* **Curriculum**: the longest context doubles from ``--min-context`` up to ``--max-context``. With
  ``--curriculum auto`` (default) it doubles as soon as the held-out accuracy of every ``--eval-tasks`` task
  (default: both evaluation tasks; ``kv_retrieval`` alone for a retrieval model) at the current longest
  context reaches ``--advance-acc`` (checked every ``--eval-every`` seconds), and after ``--ramp / (levels - 1)`` of the time budget once that accuracy has passed ``--min-advance-acc`` (the
  model has begun to solve the level: pushing an unsolved model to longer contexts leaves it unsolved at
  every length); so the maximum is reached by ``--ramp`` of the budget when learning keeps pace.
  ``--curriculum time`` grows it geometrically in time over ``--ramp``. Each step draws its length
  log-uniformly below the current longest, or that longest itself with probability 1/2.
* **Loss**: mean cross-entropy of the answer and ``<eos>`` plus ``--prompt-weight`` times the mean over the
  prompt tokens (separate means, so a long prompt does not drown the answer). AdamW, linear warm-up then
  cosine decay in time (``--lr-schedule constant`` keeps the peak), bf16 autocast on CUDA, gradient clipping.
* **Accuracy**: exact match of the greedy answer on held-out examples (another seed). It is measured by
  teacher forcing: the answer and ``<eos>`` are all the argmax tokens exactly when greedy decoding emits
  them, so one forward pass gives the greedy result. Progress lines print it every ``--eval-every`` seconds;
  the final table is measured on the saved (bf16) weights.

Output (``--out DIR``): ``model-0000i-of-0000n.safetensors`` (bf16, each at most ``--shard-mb`` MB) and
``task_model.json`` (builder arguments, shard list, parameters, tokens seen, accuracy per task and context
length, progress). :func:`load_task_model` rebuilds the model from them::

    sys.path.insert(0, "benchmarks")
    from train_task_model import load_task_model
    model = load_task_model("DIR", device="cuda", dtype=torch.bfloat16)

Usage: ``python benchmarks/train_task_model.py --minutes 6 --out DIR`` (H200), ``--seeds 0,1,2`` to train one
model per seed at once (on one GPU, or spread over several) and keep the best (leaving the plateau is partly
luck), ``--quick`` (CPU, seconds).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection

import numpy as np
import torch
import torch.nn.functional as F

from sparrow.attention.dense import DenseAttention
from sparrow.models import qwen2
from sparrow.rl.tasks import KVListRetrieval, KVRetrieval, VariableTracking
from sparrow.rl.tokenizer import CHARS, CharTokenizer

FORMAT = "sparrow-task-model"
REPORT_FILE = "task_model.json"
EVAL_SEED = 1_000_003  # held-out examples (training uses --seed, 0 by default)

# -- tasks -------------------------------------------------------------------------------------------
# Training families (name -> task at a context length) and the evaluation tasks. The knobs are the tasks'
# defaults; the benchmarks evaluate on EVAL_TASKS, so training and evaluation agree.
@dataclass(frozen=True)
class TrainExample:
    """A training sequence's text: ``prompt`` then ``answer``; the character spans of ``prompt`` supervised
    like the answer (the earlier answers of a multi-question example) and the characters left out of the
    loss (the separator after an earlier answer: where the evaluation's single question ends with ``<eos>``,
    a multi-question example goes on, and the model cannot know which)."""

    prompt: str
    answer: str
    spans: tuple[tuple[int, int], ...] = ()
    ignore: tuple[int, ...] = ()


_STATEMENT = re.compile(r"([a-z]+)=([a-z0-9]+);")


@dataclass(frozen=True)
class MultiQuery:
    """Training only: an example of ``base`` with up to ``queries - 1`` more questions about the same context
    answered before the final one (``?key=value;`` each, the values supervised). One context then carries
    several supervised look-ups instead of one, which is what gets a model past the copy-any-value plateau
    (a single question per sequence gives one informative token per example). The final question and the
    answer are the base example's, in the evaluation's format; the sequence grows by at most
    ``(queries - 1) * 9`` characters over ``base.context_len``.

    kv_retrieval bases ask other keys; variable_tracking bases ask the last variable of the other chains.
    """

    base: Any
    queries: int = 4

    def example(self, seed: int, index: int) -> TrainExample:
        ex = self.base.example(seed, index)
        body, question = ex.prompt.rsplit("?", 1)
        asked = question[:-1]
        assign = dict(_STATEMENT.findall(body))
        if isinstance(self.base, VariableTracking):
            rhs = set(assign.values())
            candidates = [v for v in assign if v not in rhs and v != asked]  # the other chains' last names

            def value(v: str) -> str:
                while not assign[v].isdigit():
                    v = assign[v]
                return assign[v]
        else:
            candidates = [k for k in assign if k != asked]
            value = assign.__getitem__
        r = random.Random(f"mq:{seed}:{index}")
        picked = r.sample(candidates, min(len(candidates), self.queries - 1))
        text, spans, ignore = body, [], []
        for k in picked:
            text += f"?{k}="
            spans.append((len(text), len(text) + len(value(k))))
            text += value(k)
            ignore.append(len(text))
            text += ";"
        return TrainExample(f"{text}?{question}", ex.answer, tuple(spans), tuple(ignore))


TRAIN_FAMILIES: dict[str, Callable[[int], Any]] = {
    "kv": lambda n: KVRetrieval(n),
    "kv_vary": lambda n: KVRetrieval(n, vary_pairs=True),
    "vt": lambda n: VariableTracking(n),
    "kv_mq": lambda n: MultiQuery(KVRetrieval(n)),
    "kv_vary_mq": lambda n: MultiQuery(KVRetrieval(n, vary_pairs=True)),
    "vt_mq": lambda n: MultiQuery(VariableTracking(n)),
    "vt1_mq": lambda n: MultiQuery(VariableTracking(n, hops=1)),  # one hop fewer: a variable-tracking curriculum
    "kvl": lambda n: KVListRetrieval(n),  # several keys asked at once: the long-tailed responses of bench_e2e
    "kvl_long": lambda n: KVListRetrieval(n, max_asked=256),  # responses up to 1K tokens (bench_e2e --max-asked 256)
}
# Multi-question families carry most of the signal: with one question per sequence no run of ours left the
# copy-any-value plateau (H200: four 5-minute runs, CPU: a dozen); with them a 6-layer model of width 384
# reached 0.94 kv_retrieval accuracy at 64 tokens (0.86 at 128) within a minute on the H200 (8192 tokens per
# step). Variable tracking was not learned in that run.
DEFAULT_MIX = {"kv_mq": 0.3, "kv_vary_mq": 0.1, "vt_mq": 0.3, "kv": 0.15, "vt": 0.15}
EVAL_TASKS: dict[str, Callable[[int], Any]] = {
    "kv_retrieval": lambda n: KVRetrieval(n),
    "variable_tracking": lambda n: VariableTracking(n),
}
# every task the progress evaluations and the final table can measure; ``--eval-tasks`` picks the ones that
# move the curriculum (the final table adds EVAL_TASKS, and kv_list when ``kvl`` is in the mix)
ALL_EVAL_TASKS: dict[str, Callable[[int], Any]] = {**EVAL_TASKS, "kv_list": TRAIN_FAMILIES["kvl"],
                                                   "kv_list_long": TRAIN_FAMILIES["kvl_long"]}

_TOK = CharTokenizer()
_LUT = np.full(256, 255, dtype=np.uint8)
for _c, _i in zip(CHARS, _TOK.encode(CHARS, add_bos=False)):
    _LUT[ord(_c)] = _i


def encode_text(text: str) -> np.ndarray:
    """CharTokenizer ids of ``text`` (no bos / eos), vectorised; ValueError on a character outside it."""
    try:
        raw = text.lower().encode("ascii")
    except UnicodeEncodeError:
        raise ValueError("text has characters outside the synthetic tokenizer's alphabet") from None
    ids = _LUT[np.frombuffer(raw, dtype=np.uint8)]
    if (ids == 255).any():
        raise ValueError("text has characters outside the synthetic tokenizer's alphabet")
    return ids


def example_tokens(task, seed: int, index: int) -> tuple[np.ndarray, int]:
    """``<bos> prompt answer <eos>`` as int64 ids, and the prompt length in tokens (bos included)."""
    ex = task.example(seed, index)
    return _sequence_ids(ex), len(ex.prompt) + 1


def longest_sequence(mix: dict, context: int, samples: int = 64) -> int:
    """The longest training sequence (tokens, ``<bos>`` and ``<eos>`` included) of the families in ``mix``
    at ``context``: a prompt of at most ``context + 9 * (queries - 1)`` characters (:class:`MultiQuery`) and
    the longest answer (``most_asked * (value_len + 1)`` for kv_list, the longest of ``samples`` examples
    otherwise: fixed-length values), and at least the longest of those examples."""
    return _longest_sequence(tuple(sorted(n for n, share in mix.items() if share > 0)), context, samples)


@functools.lru_cache(maxsize=None)
def _longest_sequence(families: tuple[str, ...], context: int, samples: int) -> int:
    bound = context + 2
    for name in families:
        task = TRAIN_FAMILIES[name](context)
        base = getattr(task, "base", task)
        exs = [task.example(0, i) for i in range(samples)]
        prompt = context + (9 * (task.queries - 1) if isinstance(task, MultiQuery) else 0)
        answer = (base.most_asked * (base.value_len + 1) if isinstance(base, KVListRetrieval)
                  else max(len(e.answer) for e in exs))
        bound = max(bound, prompt + answer + 2, *(len(e.prompt) + len(e.answer) + 2 for e in exs))
    return bound


def _sequence_ids(ex) -> np.ndarray:
    """``<bos> prompt answer <eos>`` as int64 ids."""
    return np.concatenate([[_TOK.bos_id], encode_text(ex.prompt), encode_text(ex.answer), [_TOK.eos_id]]).astype(
        np.int64)


PROMPT, ANSWER, IGNORED = 0, 1, 2  # the loss role of each token


def train_tokens(task, seed: int, index: int) -> tuple[np.ndarray, np.ndarray]:
    """``<bos> prompt answer <eos>`` as int64 ids, and each token's loss role: ``ANSWER`` for the answer,
    ``<eos>`` and a multi-question example's earlier answers, ``IGNORED`` for the separators after those,
    ``PROMPT`` for the rest."""
    ex = task.example(seed, index)
    ids = _sequence_ids(ex)
    role = np.full(len(ids), PROMPT, dtype=np.int8)
    role[len(ex.prompt) + 1:] = ANSWER
    for a, b in getattr(ex, "spans", ()):
        role[a + 1:b + 1] = ANSWER
    for i in getattr(ex, "ignore", ()):
        role[i + 1] = IGNORED
    return ids, role


def make_rows(job: tuple[str, int, int, int, int]) -> tuple[str, np.ndarray, np.ndarray]:
    """Worker job ``(family, context, seed, first index, count)`` -> (family, ids [count, T], loss roles
    [count, T]; padding is ``IGNORED``)."""
    fam, n, seed, start, count = job
    task = TRAIN_FAMILIES[fam](n)
    rows = [train_tokens(task, seed, i) for i in range(start, start + count)]
    width = max(len(r) for r, _ in rows)
    out = np.full((count, width), _TOK.pad_id, dtype=np.int64)
    roles = np.full((count, width), IGNORED, dtype=np.int8)
    for j, (r, m) in enumerate(rows):
        out[j, :len(r)] = r
        roles[j, :len(m)] = m
    return fam, out, roles


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T] int64, right-padded
    prompt_mask: torch.Tensor  # [B, T-1] bool: targets inside the prompt
    answer_mask: torch.Tensor  # [B, T-1] bool: answer and <eos> targets
    family: list[str]
    context: int


def assemble(parts: list[tuple[str, np.ndarray, np.ndarray]], context: int) -> Batch:
    width = max(p[1].shape[1] for p in parts)
    toks = np.concatenate([np.pad(p[1], ((0, 0), (0, width - p[1].shape[1])), constant_values=_TOK.pad_id)
                           for p in parts])
    roles = np.concatenate([np.pad(p[2], ((0, 0), (0, width - p[2].shape[1])), constant_values=IGNORED)
                            for p in parts])[:, 1:]  # target t predicts tokens[:, t + 1]
    answer, prompt = roles == ANSWER, roles == PROMPT
    fams = [p[0] for p in parts for _ in range(p[1].shape[0])]
    return Batch(torch.from_numpy(toks), torch.from_numpy(prompt), torch.from_numpy(answer), fams, context)


class BatchStream:
    """Batches of about ``tokens_per_step`` tokens, made by ``workers`` processes ``prefetch`` steps ahead.

    ``next(context)`` returns the oldest pending batch and queues one at ``context`` (so a batch's context is
    the one asked for ``prefetch`` calls earlier). Example indices are consecutive per family: no example
    is seen twice.
    """

    def __init__(self, mix: dict[str, float], seed: int, tokens_per_step: int, workers: int = 0,
                 prefetch: int = 4, chunk: int = 16, min_examples: int = 1) -> None:
        self.mix = {k: v for k, v in mix.items() if v > 0}
        self.seed, self.tokens_per_step, self.chunk = seed, tokens_per_step, chunk
        self.min_examples = min_examples
        self.prefetch = prefetch if workers else 0
        self.next_index = {k: 0 for k in self.mix}
        self.pending: deque = deque()
        self.pool = None
        if workers:
            import multiprocessing as mp

            methods = mp.get_all_start_methods()
            # workers run pure Python / numpy: fork is safe and fast (no re-import)
            self.pool = mp.get_context("fork" if "fork" in methods else "spawn").Pool(workers)

    def batch_size(self, context: int) -> int:
        return max(1, self.min_examples, self.tokens_per_step // (context + 8))

    def counts(self, B: int) -> dict[str, int]:
        w = sum(self.mix.values())
        raw = {k: B * v / w for k, v in self.mix.items()}
        out = {k: int(x) for k, x in raw.items()}
        for k in sorted(raw, key=lambda k: out[k] - raw[k])[:B - sum(out.values())]:
            out[k] += 1  # largest remainders
        return out

    def _submit(self, context: int) -> None:
        jobs = []
        for fam, n in self.counts(self.batch_size(context)).items():
            while n > 0:
                c = min(n, self.chunk)
                jobs.append((fam, context, self.seed, self.next_index[fam], c))
                self.next_index[fam] += c
                n -= c
        if self.pool is None:
            self.pending.append((context, [make_rows(j) for j in jobs]))
        else:
            self.pending.append((context, [self.pool.apply_async(make_rows, (j,)) for j in jobs]))

    def next(self, context: int) -> Batch:
        while len(self.pending) < 1 + self.prefetch:
            self._submit(context)
        ctx, parts = self.pending.popleft()
        if self.pool is not None:
            parts = [p.get() for p in parts]
        return assemble(parts, ctx)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
            self.pool = None


# -- model --------------------------------------------------------------------------------------------

@dataclass
class ModelConfig:
    """Arguments of :func:`sparrow.models.qwen2` (``vocab_size`` is the CharTokenizer's)."""

    num_layers: int = 6
    num_heads: int = 6
    num_kv_heads: int = 2
    embed_dim: int = 384
    intermediate_dim: int = 1152
    max_seq_len: int = 8192 + 64
    rope_base: float = 1_000_000.0
    tie_word_embeddings: bool = False
    vocab_size: int = _TOK.vocab_size

    def build(self, attention=DenseAttention):
        return qwen2(attention=attention, **asdict(self))


def init_weights(model: torch.nn.Module, std: float = 0.02, residual_scaling: bool = True) -> None:
    """Normal(0, std) for matrices and embeddings, residual output projections scaled by 1/sqrt(2 layers)
    (unless ``residual_scaling`` is false)."""
    n_layers = len(model.layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                residual = residual_scaling and name.endswith(("output_proj.weight", "w2.weight"))
                s = std / math.sqrt(2 * n_layers) if residual else std
                p.normal_(0.0, s)
            elif name.endswith("bias"):
                p.zero_()


def count_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# -- save / load --------------------------------------------------------------------------------------

def save_shards(model: torch.nn.Module, out: Path, shard_bytes: int) -> list[dict]:
    """The model's state dict in bf16 as safetensors shards of at most ``shard_bytes`` bytes each."""
    from safetensors.torch import save_file

    state = {k: v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in model.state_dict().items()}
    meta_bytes = 1024  # the header's metadata and padding
    groups: list[list[str]] = [[]]
    size = meta_bytes
    for k, v in state.items():
        nb = v.numel() * v.element_size() + len(k) + 128  # data + a generous header entry
        if nb + meta_bytes > shard_bytes:
            raise ValueError(f"tensor {k} ({nb} bytes) does not fit in a {shard_bytes}-byte shard")
        if groups[-1] and size + nb > shard_bytes:
            groups.append([])
            size = meta_bytes
        groups[-1].append(k)
        size += nb
    for old in out.glob("model-*-of-*.safetensors"):
        old.unlink()
    shards = []
    for i, keys in enumerate(groups):
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: state[k] for k in keys}, str(out / name), metadata={"format": FORMAT})
        shards.append({"file": name, "bytes": (out / name).stat().st_size, "tensors": len(keys)})
        if shards[-1]["bytes"] > shard_bytes:
            raise AssertionError(f"{name} is {shards[-1]['bytes']} bytes, over {shard_bytes}")
    return shards


def read_report(directory: str | Path) -> dict:
    """The ``task_model.json`` of a trained model directory."""
    path = Path(directory) / REPORT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: train with benchmarks/train_task_model.py first")
    doc = json.loads(path.read_text())
    if doc.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} report")
    return doc


def load_shards(directory: str | Path, report: dict | None = None) -> dict[str, torch.Tensor]:
    """The saved (bf16) state dict: every shard listed in the report (``task_model.json``), merged."""
    from safetensors.torch import load_file

    doc = report if report is not None else read_report(directory)
    state: dict[str, torch.Tensor] = {}
    for shard in doc["shards"]:
        state.update(load_file(str(Path(directory) / shard["file"])))
    return state


def load_task_model(directory: str | Path, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32, attention=DenseAttention) -> torch.nn.Module:
    """Rebuild a model saved by this script: builder arguments from ``task_model.json``, weights from its
    shards (stored in bf16; cast to ``dtype``). RoPE tables stay float32. Returns the model in eval mode."""
    doc = read_report(directory)
    model = ModelConfig(**doc["model"]).build(attention)
    model.load_state_dict(load_shards(directory, doc), strict=True)
    model.to(device=device)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model.eval()


# -- evaluation -----------------------------------------------------------------------------------------

def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    import contextlib

    return contextlib.nullcontext()


@torch.no_grad()
def teacher_forced_hits(model, seqs: list[tuple[np.ndarray, int]], *, batch_tokens: int = 65536) -> list[bool]:
    """For each ``(ids, prompt_len)``: are all of ``ids[prompt_len:]`` the argmax of the model given what
    precedes them? Exactly when greedy decoding from the prompt emits those tokens."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    hits: list[bool] = []
    i = 0
    while i < len(seqs):
        per = max(1, batch_tokens // max(len(seqs[i][0]), 1))
        chunk = seqs[i:i + per]
        width = max(len(r) for r, _ in chunk)
        x = torch.full((len(chunk), width), _TOK.pad_id, dtype=torch.int64)
        for j, (r, _) in enumerate(chunk):
            x[j, :len(r)] = torch.as_tensor(r)
        x = x.to(device)
        with _autocast(device):
            pred = model(x[:, :-1]).argmax(-1)
        for j, (r, plen) in enumerate(chunk):
            hits.append(bool((pred[j, plen - 1:len(r) - 1] == x[j, plen:len(r)]).all()))
        i += len(chunk)
    model.train(was_training)
    return hits


def greedy_accuracy(model, task_name: str, context: int, n: int, *, seed: int = EVAL_SEED,
                    batch_tokens: int = 65536) -> tuple[float, int]:
    """Exact-match greedy accuracy (answer then ``<eos>``) on ``n`` held-out examples, by teacher forcing."""
    task = ALL_EVAL_TASKS[task_name](context)
    seqs = [example_tokens(task, seed, i) for i in range(n)]
    hits = teacher_forced_hits(model, seqs, batch_tokens=batch_tokens)
    return sum(hits) / n, n


def binomial_se(p: float, n: int) -> float:
    return math.sqrt(max(p * (1 - p), 0.0) / n) if n else float("nan")


# -- training -------------------------------------------------------------------------------------------

@dataclass
class TrainConfig:
    out: str = "task_model"
    minutes: float = 6.0
    seed: int = 0
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    model: ModelConfig = field(default_factory=ModelConfig)
    min_context: int = 64  # ~7 pairs: 0.2-0.3 greedy within a minute on the H200; at 256, chance for 6 min
    max_context: int = 8192
    ramp: float = 0.6
    curriculum: str = "auto"
    advance_acc: float = 0.8
    min_advance_acc: float = 0.3
    tokens_per_step: int = 8192
    min_examples: int = 8  # per step, whatever the context: long-context steps are not single examples
    mix: dict = field(default_factory=lambda: dict(DEFAULT_MIX))
    eval_tasks: list = field(default_factory=lambda: list(EVAL_TASKS))  # the tasks that move the curriculum
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0
    prompt_weight: float = 0.05
    lr_schedule: str = "cosine"  # or "constant" after the warm-up
    beta2: float = 0.95
    residual_init_scaling: bool = True
    init_std: float = 0.02
    workers: int = 4
    eval_every_s: float = 20.0
    eval_examples: int = 64
    final_eval_examples: int = 128
    eval_lengths: list = field(default_factory=list)  # default: powers of two from min to max context
    shard_mb: float = 15.0
    log_every_s: float = 15.0
    quick: bool = False

    def levels(self) -> list[int]:
        """The curriculum's longest contexts: powers of two times ``min_context``, then ``max_context``."""
        out, n = [], self.min_context
        while n < self.max_context:
            out.append(n)
            n *= 2
        return out + [self.max_context]

    def table_tasks(self) -> list[str]:
        """The tasks of the final accuracy table."""
        extra = [t for f, t in (("kvl", "kv_list"), ("kvl_long", "kv_list_long")) if self.mix.get(f, 0) > 0]
        return list(dict.fromkeys([*self.eval_tasks, *EVAL_TASKS, *extra]))

    def lengths(self) -> list[int]:
        """Contexts of the final accuracy table (default: :meth:`levels`)."""
        return sorted(int(x) for x in self.eval_lengths) if self.eval_lengths else self.levels()


class Curriculum:
    """The longest training context over time (see the module docstring) and each step's context."""

    def __init__(self, cfg: TrainConfig, budget_s: float) -> None:
        self.cfg = cfg
        self.levels = cfg.levels()
        self.stage = 0
        self.stage_cap_s = cfg.ramp * budget_s / max(1, len(self.levels) - 1)
        self.stage_start = 0.0
        self.budget_s = budget_s
        self.events: list[dict] = []
        self.rng = random.Random(cfg.seed)
        self.last_accuracy: dict[str, float] | None = None  # held-out accuracy at the current level

    @property
    def top(self) -> int:
        return self.levels[self.stage]

    def update(self, elapsed: float, accuracy: dict[str, float] | None = None) -> bool:
        """Advance one level when ``accuracy`` (task -> held-out accuracy at :attr:`top`) is high enough or
        the level's time is up and the level is partly solved; True when it advanced."""
        if self.cfg.curriculum == "time":
            lo, hi = math.log(self.cfg.min_context), math.log(self.cfg.max_context)
            top = math.exp(lo + (hi - lo) * min(1.0, elapsed / max(self.cfg.ramp * self.budget_s, 1e-9)))
            stage = max(i for i, n in enumerate(self.levels) if n <= max(top, self.levels[0]) * 1.0001)
            moved, self.stage = stage != self.stage, stage
            return moved
        if self.stage == len(self.levels) - 1:
            return False
        if accuracy:
            self.last_accuracy = dict(accuracy)
        acc = min(self.last_accuracy.values()) if self.last_accuracy else 0.0
        why = None
        if accuracy and acc >= self.cfg.advance_acc:
            why = "accuracy"
        elif elapsed - self.stage_start >= self.stage_cap_s and acc >= self.cfg.min_advance_acc:
            why = "time"
        if why is None:
            return False
        self.stage += 1
        self.stage_start = elapsed
        self.last_accuracy = None
        self.events.append({"elapsed_s": round(elapsed, 1), "max_context": self.top, "reason": why,
                            "accuracy": accuracy if why == "accuracy" else None})
        return True

    def sample(self) -> int:
        top, lo = self.top, self.cfg.min_context
        n = top if self.rng.random() < 0.5 else int(math.exp(self.rng.uniform(math.log(lo), math.log(top))))
        if lo >= 64:
            n = n // 64 * 64
        return max(lo, min(n, top))


def _lr(cfg: TrainConfig, step: int, frac: float) -> float:
    warm = min(1.0, (step + 1) / max(1, cfg.warmup_steps))
    if cfg.lr_schedule == "constant":
        return cfg.lr * warm
    cos = 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return cfg.lr * warm * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cos)


def _log(msg: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)


def train(cfg: TrainConfig) -> dict:
    """Train, save shards + report into ``cfg.out``, return the report."""
    t0 = time.perf_counter()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(cfg.device)
    for n in (cfg.min_context, cfg.max_context):
        for f in TRAIN_FAMILIES.values():
            f(n)  # validates the knobs at both ends of the curriculum
    longest = longest_sequence(cfg.mix, cfg.max_context)
    if cfg.model.max_seq_len < longest:
        raise ValueError(f"max_seq_len {cfg.model.max_seq_len} is too short: the mix {sorted(cfg.mix)} makes "
                         f"sequences of up to {longest} tokens at context {cfg.max_context}")
    torch.manual_seed(cfg.seed)
    stream = BatchStream(cfg.mix, cfg.seed, cfg.tokens_per_step, workers=cfg.workers, min_examples=cfg.min_examples)
    model = cfg.model.build().to(device)
    init_weights(model, cfg.init_std, residual_scaling=cfg.residual_init_scaling)
    n_params = count_params(model)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, cfg.beta2),
                            **({"fused": True} if device.type == "cuda" else {}))
    _log(f"model: {n_params / 1e6:.1f}M parameters ({cfg.model.num_layers} layers, d={cfg.model.embed_dim}, "
         f"{cfg.model.num_heads}q/{cfg.model.num_kv_heads}kv heads), device {device}, "
         f"{cfg.tokens_per_step} tokens/step, contexts {cfg.min_context}->{cfg.max_context}, "
         f"{cfg.minutes:g} min, {cfg.workers} data workers", t0)

    budget = cfg.minutes * 60.0
    step = tokens = examples = 0
    progress: list[dict] = []
    loss_acc = {"prompt": [], **{f: [] for f in TRAIN_FAMILIES}}
    data_wait = 0.0
    t_train = time.perf_counter()
    t_log = t_eval = t_train
    tok_at_log = 0
    cur = Curriculum(cfg, budget)
    model.train()
    try:
        while True:
            elapsed = time.perf_counter() - t_train
            frac = elapsed / budget if budget > 0 else 1.0
            if frac >= 1.0:
                break
            if cur.update(elapsed):
                _log(f"curriculum: longest context -> {cur.top} ({cfg.curriculum} schedule)", t0)
            n_ctx = cur.sample()
            tw = time.perf_counter()
            b = stream.next(n_ctx)
            data_wait += time.perf_counter() - tw
            x, pm, am = (t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
                         for t in (b.tokens, b.prompt_mask, b.answer_mask))
            for g in opt.param_groups:
                g["lr"] = _lr(cfg, step, frac)
            with _autocast(device):
                logits = model(x[:, :-1])
            nll = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="none").view(am.shape)
            ans_rows = (nll * am).sum(1) / am.sum(1).clamp_min(1)  # [B] per-example answer loss
            loss_ans = ans_rows.mean()
            loss_prompt = (nll * pm).sum() / pm.sum().clamp_min(1)
            loss = loss_ans + cfg.prompt_weight * loss_prompt
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            opt.step()
            step += 1
            tokens += int(b.tokens.numel())
            examples += len(b.family)
            fam_idx = {f: [i for i, g in enumerate(b.family) if g == f] for f in TRAIN_FAMILIES}
            for f, idx in fam_idx.items():
                if idx:
                    loss_acc[f].append(ans_rows.detach()[idx].mean())
            loss_acc["prompt"].append(loss_prompt.detach())
            now = time.perf_counter()
            if now - t_log >= cfg.log_every_s:
                means = {k: (float(torch.stack(v).mean()) if v else float("nan")) for k, v in loss_acc.items()}
                _log(f"step {step:5d} ctx<={cur.top:5d} L={b.context:5d} B={len(b.family):4d} "
                     f"tokens {tokens / 1e6:7.1f}M  answer loss "
                     + " ".join(f"{f} {means[f]:.3f}" for f in cfg.mix if cfg.mix[f] > 0)
                     + f" prompt {means['prompt']:.3f}  lr {_lr(cfg, step, frac):.1e}  "
                     f"{(tokens - tok_at_log) / (now - t_log) / 1e3:6.0f}k tok/s  data wait "
                     f"{100 * data_wait / max(now - t_train, 1e-9):.0f}%", t0)
                loss_acc = {k: [] for k in loss_acc}
                t_log, tok_at_log = now, tokens
            if now - t_eval >= cfg.eval_every_s and budget - (now - t_train) > 0.5 * cfg.eval_every_s:
                top = cur.top
                row = {"elapsed_s": round(now - t_train, 1), "step": step, "tokens": tokens, "max_context": top}
                msg, at_top = [], {}
                for name in cfg.eval_tasks:
                    for n_ev in sorted({cfg.min_context, top}):
                        acc, _ = greedy_accuracy(model, name, n_ev, cfg.eval_examples,
                                                 batch_tokens=cfg.tokens_per_step)
                        row[f"{name}@{n_ev}"] = acc
                        msg.append(f"{name}@{n_ev} {acc:.2f}")
                        if n_ev == top:
                            at_top[name] = acc
                progress.append(row)
                _log("eval (greedy, held out): " + "  ".join(msg), t0)
                t_eval = time.perf_counter()
                if cfg.curriculum == "auto" and cur.update(t_eval - t_train, at_top):
                    _log(f"curriculum: longest context -> {cur.top} ({cur.events[-1]['reason']}; accuracy at {top} "
                         f"{min(at_top.values()):.2f})", t0)
    finally:
        stream.close()
    train_s = time.perf_counter() - t_train
    _log(f"trained {step} steps, {tokens / 1e6:.1f}M tokens, {examples} examples in {train_s:.0f} s", t0)

    shards = save_shards(model, out, int(cfg.shard_mb * 1e6))
    report: dict[str, Any] = {
        "format": FORMAT, "version": 1, "model": asdict(cfg.model), "weights_dtype": "bfloat16",
        "shards": shards, "tokenizer": "sparrow.rl.CharTokenizer", "params": n_params,
        "train": {**{k: v for k, v in asdict(cfg).items() if k not in ("model", "out")},
                  "steps": step, "tokens_seen": tokens, "examples_seen": examples, "train_s": round(train_s, 1),
                  "final_max_context": cur.top, "curriculum_events": cur.events,
                  "data_wait_frac": round(data_wait / max(train_s, 1e-9), 3)},
        "tasks": {"train_families": {f: repr(TRAIN_FAMILIES[f](cfg.max_context)) for f in TRAIN_FAMILIES},
                  "eval_tasks": {t: repr(ALL_EVAL_TASKS[t](cfg.max_context)) for t in cfg.table_tasks()},
                  "train_seed": cfg.seed, "eval_seed": EVAL_SEED},
        "progress": progress, "accuracy": [],
        "environment": {"torch": torch.__version__,
                        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"},
    }
    _write_report(out, report)

    # the final table is measured on the saved weights, as a user of the shards sees them
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    loaded = load_task_model(out, device, dtype)
    same = all(torch.equal(a.detach().to(torch.bfloat16).cpu().view(torch.int16),
                           b.detach().to(torch.bfloat16).cpu().view(torch.int16))
               for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    report["reload_matches_bf16_weights"] = same
    del model
    rows = []
    for name in cfg.table_tasks():
        for n_ev in cfg.lengths():
            acc, n = greedy_accuracy(loaded, name, n_ev, cfg.final_eval_examples, batch_tokens=cfg.tokens_per_step)
            rows.append({"task": name, "context": n_ev, "accuracy": acc, "n": n, "se": binomial_se(acc, n)})
            _log(f"final greedy accuracy {name:>17} @ {n_ev:5d}: {acc:.3f} +- {binomial_se(acc, n):.3f} (n={n})", t0)
    report["accuracy"] = rows
    report["eval_weights_dtype"] = str(dtype).replace("torch.", "")
    report["total_s"] = round(time.perf_counter() - t0, 1)
    _write_report(out, report)
    sizes = ", ".join(f"{s['bytes'] / 1e6:.1f} MB" for s in shards)
    _log(f"wrote {len(shards)} shards ({sizes}) and {REPORT_FILE} to {out}", t0)
    return report


def _write_report(out: Path, report: dict) -> None:
    tmp = out / (REPORT_FILE + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(out / REPORT_FILE)


def quick_config(out: str, minutes: float = 0.1) -> TrainConfig:
    """A CPU smoke configuration: 2 layers of width 64, contexts 128-256, a few seconds."""
    return TrainConfig(out=out, minutes=minutes, device="cpu",
                       model=ModelConfig(num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64,
                                         intermediate_dim=128, max_seq_len=320),
                       min_context=128, max_context=256, tokens_per_step=4096, lr=3e-3, warmup_steps=10,
                       workers=0, eval_every_s=3.0, eval_examples=8, final_eval_examples=16, log_every_s=2.0,
                       quick=True)


def batch_timing(cfg: TrainConfig, contexts=(256, 1024, 4096, 8192), repeats: int = 2) -> list[dict]:
    """Seconds to make one batch (``cfg.tokens_per_step`` tokens) in this process, per context length."""
    rows = []
    for n in contexts:
        s = BatchStream(cfg.mix, cfg.seed, cfg.tokens_per_step, workers=0)
        s.next(n)
        t = time.perf_counter()
        for _ in range(repeats):
            b = s.next(n)
        rows.append({"context": n, "batch": len(b.family), "seconds": (time.perf_counter() - t) / repeats})
    return rows


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="output folder (shards + task_model.json)")
    p.add_argument("--minutes", type=float, default=None, help=f"training time budget (default {d.minutes})")
    p.add_argument("--quick", action="store_true", help="tiny CPU model, a few seconds (smoke run)")
    p.add_argument("--device", default=d.device)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--seeds", default="", help="comma list: train one model per seed at once, keep the best")
    p.add_argument("--layers", type=int, default=d.model.num_layers)
    p.add_argument("--dim", type=int, default=d.model.embed_dim)
    p.add_argument("--heads", type=int, default=d.model.num_heads)
    p.add_argument("--kv-heads", type=int, default=d.model.num_kv_heads)
    p.add_argument("--mlp", type=int, default=d.model.intermediate_dim)
    p.add_argument("--rope-base", type=float, default=d.model.rope_base)
    p.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction, default=d.model.tie_word_embeddings,
                   help="share the input embedding and the output projection")
    p.add_argument("--min-context", type=int, default=d.min_context)
    p.add_argument("--max-context", type=int, default=d.max_context)
    p.add_argument("--ramp", type=float, default=d.ramp, help="fraction of the budget to reach --max-context")
    p.add_argument("--curriculum", choices=["auto", "time"], default=d.curriculum)
    p.add_argument("--advance-acc", type=float, default=d.advance_acc,
                   help="held-out accuracy (both tasks) at which the auto curriculum doubles the context")
    p.add_argument("--min-advance-acc", type=float, default=d.min_advance_acc,
                   help="accuracy a level needs before its time cap may double the context (0: time alone)")
    p.add_argument("--tokens-per-step", type=int, default=d.tokens_per_step)
    p.add_argument("--min-examples", type=int, default=d.min_examples,
                   help="examples per step at least (long contexts exceed --tokens-per-step)")
    p.add_argument("--mix", default=",".join(f"{k}={v}" for k, v in DEFAULT_MIX.items()),
                   help="training families and weights")
    p.add_argument("--eval-tasks", default=",".join(d.eval_tasks),
                   help="comma list of the tasks whose held-out accuracy moves the curriculum: "
                        + ", ".join(ALL_EVAL_TASKS))
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--prompt-weight", type=float, default=d.prompt_weight)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--lr-schedule", choices=["cosine", "constant"], default=d.lr_schedule)
    p.add_argument("--beta2", type=float, default=d.beta2)
    p.add_argument("--residual-init-scaling", action=argparse.BooleanOptionalAction, default=d.residual_init_scaling)
    p.add_argument("--workers", type=int, default=None, help="data worker processes (default 4 on CUDA, 0 on CPU)")
    p.add_argument("--eval-every", type=float, default=d.eval_every_s, help="seconds between progress evals")
    p.add_argument("--eval-examples", type=int, default=d.eval_examples)
    p.add_argument("--final-eval-examples", type=int, default=d.final_eval_examples)
    p.add_argument("--eval-lengths", default="", help="comma-separated contexts of the final table")
    p.add_argument("--shard-mb", type=float, default=d.shard_mb)
    p.add_argument("--time-batches", action="store_true", help="only measure how long a batch takes to make")
    return p


def config_from_args(args) -> TrainConfig:
    if args.quick:
        cfg = quick_config(args.out or "task_model_quick", args.minutes if args.minutes is not None else 0.1)
        cfg.shard_mb = args.shard_mb
        return cfg
    mix = {k: float(v) for k, v in (kv.split("=") for kv in args.mix.split(",") if kv)}
    unknown = set(mix) - set(TRAIN_FAMILIES)
    if unknown:
        raise SystemExit(f"unknown training families {sorted(unknown)} (known: {sorted(TRAIN_FAMILIES)})")
    eval_tasks = [t for t in args.eval_tasks.split(",") if t]
    unknown = set(eval_tasks) - set(ALL_EVAL_TASKS)
    if unknown or not eval_tasks:
        raise SystemExit(f"--eval-tasks: unknown or none {sorted(unknown)} (known: {sorted(ALL_EVAL_TASKS)})")
    device = torch.device(args.device)
    return TrainConfig(
        out=args.out or "task_model", minutes=args.minutes if args.minutes is not None else TrainConfig.minutes,
        seed=args.seed, device=str(device),
        model=ModelConfig(num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                          embed_dim=args.dim, intermediate_dim=args.mlp,
                          max_seq_len=max(args.max_context + 64, longest_sequence(mix, args.max_context)),
                          rope_base=args.rope_base, tie_word_embeddings=args.tie_embeddings),
        min_context=args.min_context, max_context=args.max_context, ramp=args.ramp, curriculum=args.curriculum,
        advance_acc=args.advance_acc, min_advance_acc=args.min_advance_acc,
        tokens_per_step=args.tokens_per_step, min_examples=args.min_examples, mix=mix, eval_tasks=eval_tasks,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        prompt_weight=args.prompt_weight, weight_decay=args.weight_decay, lr_schedule=args.lr_schedule,
        beta2=args.beta2, residual_init_scaling=args.residual_init_scaling,
        workers=args.workers if args.workers is not None else (min(4, max(0, (os.cpu_count() or 1) - 2))
                                                               if device.type == "cuda" else 0),
        eval_every_s=args.eval_every, eval_examples=args.eval_examples, final_eval_examples=args.final_eval_examples,
        eval_lengths=[int(x) for x in args.eval_lengths.split(",") if x], shard_mb=args.shard_mb)


def longest_handled(report: dict, bar: float, tasks: Collection[str] | None = None) -> int | None:
    """The longest context of a report's accuracy table at which every task of ``tasks`` (default: all)
    reaches ``bar``; None if there is none."""
    by_ctx: dict[int, list[float]] = {}
    for r in report["accuracy"]:
        if tasks is None or r["task"] in tasks:
            by_ctx.setdefault(r["context"], []).append(r["accuracy"])
    return max([c for c, a in by_ctx.items() if min(a) >= bar], default=None)


def model_score(report: dict, bar: float = 0.8) -> tuple[int, float]:
    """How good a trained model is: (longest context at which every task that moved its curriculum reaches
    ``bar``, mean accuracy over the whole table)."""
    tasks = report.get("train", {}).get("eval_tasks")
    accs = [r["accuracy"] for r in report["accuracy"]]
    return longest_handled(report, bar, tasks) or 0, sum(accs) / max(1, len(accs))


def _without(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """``argv`` without the options ``names`` (``--x v`` and ``--x=v`` forms)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in names:
            skip = True
        elif not a.startswith(tuple(n + "=" for n in names)):
            out.append(a)
    return out


def seed_devices(n_seeds: int, device: str, n_gpus: int) -> list[str | None]:
    """The ``CUDA_VISIBLE_DEVICES`` of each seed's process: round-robin over the GPUs when training on CUDA
    with several of them (None: inherit the caller's)."""
    if not device.startswith("cuda") or n_gpus < 2 or ":" in device:
        return [None] * n_seeds
    return [str(i % n_gpus) for i in range(n_seeds)]


def train_seeds(argv: list[str], seeds: list[int], out: Path, workers: int | None, device: str = "cuda") -> dict:
    """Train one model per seed at once (subprocesses sharing the device, or spread over the GPUs when there are
    several), keep the best (:func:`model_score`) in ``out``; the report lists every candidate. Leaving the
    tasks' plateau is partly luck: several seeds in one budget make a usable model far more likely."""
    out.mkdir(parents=True, exist_ok=True)
    per = workers if workers is not None else max(1, ((os.cpu_count() or 2) - 2) // len(seeds))
    base = _without(argv, ("--seeds", "--seed", "--out", "--workers"))
    visible = seed_devices(len(seeds), device, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    procs = {}
    for seed, gpu in zip(seeds, visible):
        d = out / f"seed_{seed}"
        d.mkdir(exist_ok=True)
        log = (d / "train.log").open("w")
        env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {}))
        procs[seed] = (subprocess.Popen([sys.executable, __file__, *base, "--seed", str(seed), "--out", str(d),
                                         "--workers", str(per)], stdout=log, stderr=subprocess.STDOUT, env=env),
                       d, log)
    candidates = []
    for seed, (proc, d, log) in procs.items():
        proc.wait()
        log.close()
        if proc.returncode != 0 or not (d / REPORT_FILE).is_file():
            candidates.append({"seed": seed, "returncode": proc.returncode, "dir": d.name})
            continue
        rep = read_report(d)
        handled, mean = model_score(rep)
        candidates.append({"seed": seed, "returncode": 0, "dir": d.name, "handled_context": handled,
                           "mean_accuracy": mean, "accuracy": rep["accuracy"]})
    good = [c for c in candidates if c["returncode"] == 0]
    if not good:
        raise SystemExit(f"every seed failed: see {out}/seed_*/train.log")
    best = max(good, key=lambda c: (c["handled_context"], c["mean_accuracy"]))
    src = out / best["dir"]
    report = read_report(src)
    for old in out.glob("model-*-of-*.safetensors"):
        old.unlink()
    for shard in report["shards"]:
        shutil.copy2(src / shard["file"], out / shard["file"])
    report["chosen_seed"], report["candidates"] = best["seed"], candidates
    _write_report(out, report)
    print(f"kept seed {best['seed']} (longest context handled {best['handled_context']}, mean accuracy "
          f"{best['mean_accuracy']:.3f}) of {len(seeds)}: {out}", flush=True)
    return report


def main(argv=None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    seeds = [int(x) for x in args.seeds.split(",") if x] if args.seeds else []
    if len(seeds) > 1:
        if args.quick or args.time_batches:
            raise SystemExit("--seeds trains full runs: not with --quick or --time-batches")
        return train_seeds(argv, seeds, Path(args.out or "task_model"), args.workers, args.device)
    if seeds:
        args.seed = seeds[0]
    cfg = config_from_args(args)
    if args.time_batches:
        for r in batch_timing(cfg, contexts=(128, 256) if cfg.quick else (256, 1024, 4096, 8192)):
            print(f"context {r['context']:5d}: batch of {r['batch']:4d} examples ({cfg.tokens_per_step} tokens) "
                  f"in {r['seconds'] * 1e3:.1f} ms")
        return None
    return train(cfg)


if __name__ == "__main__":
    main()

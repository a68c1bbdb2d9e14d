"""Held-out accuracy of a task model, and what a trained model's report says it handles.

Greedy accuracy is measured by teacher forcing: the answer and ``<eos>`` are all the argmax tokens exactly when
greedy decoding emits them, so one forward pass gives the greedy result (:func:`teacher_forced_hits`).
Sampled accuracy (temperature 1) goes through the rollout engine.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Collection, Mapping, Sequence

import numpy as np
import torch

from sparrow.training.data import TOKENIZER, sequence_ids
from sparrow.training.tasks import Task, TaskFamily

EVAL_SEED = 1_000_003  # the held-out examples of a task model (training draws from its own seed)


def autocast(device: torch.device):
    """bf16 autocast on CUDA, nothing elsewhere."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


@torch.no_grad()
def teacher_forced_hits(model: torch.nn.Module, seqs: Sequence[tuple[np.ndarray, int]], *,
                        batch_tokens: int = 65536) -> list[bool]:
    """For each ``(ids, prompt_len)``: are all of ``ids[prompt_len:]`` the argmax of the model given what precedes
    them? Exactly when greedy decoding from ``ids[:prompt_len]`` emits them. Runs about ``batch_tokens`` tokens
    per forward; leaves the model's train / eval mode as it was."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    hits: list[bool] = []
    i = 0
    while i < len(seqs):
        chunk = seqs[i:i + max(1, batch_tokens // max(len(seqs[i][0]), 1))]
        x = torch.full((len(chunk), max(len(r) for r, _ in chunk)), TOKENIZER.pad_id, dtype=torch.int64)
        for j, (r, _) in enumerate(chunk):
            x[j, :len(r)] = torch.as_tensor(r)
        x = x.to(device)
        with autocast(device):
            pred = model(x[:, :-1]).argmax(-1)
        hits += [bool((pred[j, plen - 1:len(r) - 1] == x[j, plen:len(r)]).all()) for j, (r, plen) in enumerate(chunk)]
        i += len(chunk)
    model.train(was_training)
    return hits


def greedy_accuracy(model: torch.nn.Module, task: Task, n: int, *, seed: int = EVAL_SEED,
                    batch_tokens: int = 65536) -> float:
    """Exact-match greedy accuracy (answer then ``<eos>``) on examples ``0 .. n-1`` of ``task`` at ``seed``."""
    seqs = [(sequence_ids(ex), len(ex.prompt) + 1) for ex in (task.example(seed, i) for i in range(n))]
    return sum(teacher_forced_hits(model, seqs, batch_tokens=batch_tokens)) / n


@torch.no_grad()
def sampled_accuracy(model: torch.nn.Module, task: Task, n: int, *, seed: int = EVAL_SEED,
                     sample_seed: int = 0) -> float:
    """Exact-match accuracy of one sample per prompt at temperature 1 (the rollout engine, uncompiled, sampling
    with ``sample_seed``) on examples ``0 .. n-1`` of ``task`` at ``seed``."""
    from sparrow.rollout import EngineConfig, RolloutEngine, SamplingParams

    exs = [task.example(seed, i) for i in range(n)]
    prompts = [TOKENIZER.encode(e.prompt) for e in exs]
    new = max(len(e.answer) for e in exs) + 1
    engine = RolloutEngine(model, EngineConfig(max_rows=max(8, n), compile=False, max_prompt_len=max(map(len, prompts)),
                                               max_new_tokens=new))
    out = engine.generate(prompts, 1, SamplingParams(temperature=1.0, max_new_tokens=new,
                                                     stop_token_ids=(TOKENIZER.eos_id,), seed=sample_seed))
    return sum(TOKENIZER.decode(s.tokens.tolist()) == e.answer for s, e in zip(out, exs)) / n


def binomial_se(p: float, n: int) -> float:
    """Standard error of an accuracy ``p`` measured on ``n`` examples."""
    return math.sqrt(max(p * (1 - p), 0.0) / n) if n else float("nan")


def accuracy_table(model: torch.nn.Module, tasks: Mapping[str, TaskFamily], contexts: Sequence[int], n: int, *,
                   seed: int = EVAL_SEED, sampled: bool = False, sample_seed: int = 0, batch_tokens: int = 65536,
                   log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Rows ``{task, context, n, accuracy, se}`` (greedy, by teacher forcing; ``sampled_accuracy`` too when
    ``sampled``, see :func:`sampled_accuracy`) for every task of ``tasks`` at every context; ``log(msg)`` is
    called per row."""
    rows = []
    for name, family in tasks.items():
        for context in contexts:
            task = family(context)
            acc = greedy_accuracy(model, task, n, seed=seed, batch_tokens=batch_tokens)
            rows.append({"task": name, "context": context, "accuracy": acc, "n": n, "se": binomial_se(acc, n)})
            if sampled:
                rows[-1]["sampled_accuracy"] = sampled_accuracy(model, task, n, seed=seed, sample_seed=sample_seed)
            if log is not None:
                log(f"greedy accuracy {name:>17} @ {context:5d}: {acc:.3f} +- {rows[-1]['se']:.3f} (n={n})"
                    + (f", sampled {rows[-1]['sampled_accuracy']:.3f}" if sampled else ""))
    return rows


def longest_handled(report: dict[str, Any], bar: float, tasks: Collection[str] | None = None) -> int | None:
    """The longest context of a report's accuracy table at which every task of ``tasks`` (default: all) reaches
    ``bar``; None if there is none."""
    by_ctx: dict[int, list[float]] = {}
    for r in report["accuracy"]:
        if tasks is None or r["task"] in tasks:
            by_ctx.setdefault(r["context"], []).append(r["accuracy"])
    return max([c for c, a in by_ctx.items() if min(a) >= bar], default=None)


def model_score(report: dict[str, Any], bar: float = 0.8) -> tuple[int, float]:
    """How good a trained model is: (the longest context at which every task that moved its curriculum reaches
    ``bar``, the mean accuracy over the whole table)."""
    tasks = report.get("train", {}).get("config", {}).get("eval", {}).get("tasks")
    accs = [r["accuracy"] for r in report["accuracy"]]
    return longest_handled(report, bar, tasks) or 0, sum(accs) / max(1, len(accs))

"""Held-out accuracy of a task model, and what a trained model's report says it handles.

Greedy accuracy is measured by teacher forcing: the answer and ``<eos>`` are all the argmax tokens exactly when
greedy decoding emits them, so one forward pass gives the greedy result (:func:`teacher_forced_hits`).
Sampled accuracy (temperature 1) goes through the rollout engine.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable, Collection, Mapping, NamedTuple, Sequence

import numpy as np
import torch

from sparrow.rl.logprobs import hidden_states
from sparrow.rollout.forward import logits_from_hidden
from sparrow.training.data import TOKENIZER, sequence_ids
from sparrow.training.tasks import Task, TaskFamily

EVAL_SEED = 1_000_003  # the held-out examples of a task model (training draws from its own seed)


def autocast(device: torch.device):
    """bf16 autocast on CUDA, nothing elsewhere."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


@torch.no_grad()
def teacher_forced_hits(model: torch.nn.Module, seqs: Sequence[tuple[np.ndarray, int]], *,
                        batch_tokens: int = 65536, logits_chunk: int = 4096) -> list[bool]:
    """For each ``(ids, prompt_len)``: are all of ``ids[prompt_len:]`` the argmax of the model (a torchtune decoder)
    given what precedes them? Exactly when greedy decoding from ``ids[:prompt_len]`` emits them. Runs about
    ``batch_tokens`` tokens per forward and projects onto the vocabulary only the positions that predict an answer
    token, ``logits_chunk`` at a time (a 151,936-id vocabulary over every position of a 32K-token batch would be
    tens of GB of logits); leaves the model's train / eval mode as it was."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    hits: list[bool] = []
    i = 0
    while i < len(seqs):
        chunk = seqs[i:i + max(1, batch_tokens // max(len(seqs[i][0]), 1))]
        x = torch.full((len(chunk), max(len(r) for r, _ in chunk)), TOKENIZER.pad_id, dtype=torch.int64)
        scored = torch.zeros(len(chunk), x.shape[1] - 1, dtype=torch.bool)  # positions that predict an answer token
        for j, (r, plen) in enumerate(chunk):
            x[j, :len(r)] = torch.as_tensor(r)
            scored[j, plen - 1:len(r) - 1] = True
        x, scored = x.to(device), scored.to(device)
        with autocast(device):
            h = hidden_states(model, x[:, :-1])[scored]  # [n, E]
            pred = torch.cat([logits_from_hidden(model, h[s:s + logits_chunk]).argmax(-1)
                              for s in range(0, h.shape[0], logits_chunk)])
        wrong = torch.zeros(len(chunk), dtype=torch.int64, device=device).index_add_(
            0, scored.nonzero()[:, 0], (pred != x[:, 1:][scored]).long())
        hits += (wrong == 0).tolist()  # host sync: the hits are the result
        i += len(chunk)
    model.train(was_training)
    return hits


def greedy_accuracy(model: torch.nn.Module, task: Task, n: int, *, seed: int = EVAL_SEED,
                    batch_tokens: int = 65536) -> float:
    """Exact-match greedy accuracy (answer then ``<eos>``) on examples ``0 .. n-1`` of ``task`` at ``seed``."""
    seqs = [(sequence_ids(ex), len(ex.prompt) + 1) for ex in (task.example(seed, i) for i in range(n))]
    return sum(teacher_forced_hits(model, seqs, batch_tokens=batch_tokens)) / n


def _engine_generate(model: torch.nn.Module, exs: Sequence, *, rows: int, temperature: float, seed: int = 0,
                     prefill_tokens: int | None = None):
    """One answer per example of ``exs`` (answer and ``<eos>`` room) through the uncompiled rollout engine."""
    from sparrow.rollout import EngineConfig, RolloutEngine, SamplingParams

    prompts = [TOKENIZER.encode(e.prompt) for e in exs]
    new = max(len(e.answer) for e in exs) + 1
    extra = {"prefill_tokens": prefill_tokens} if prefill_tokens else {}
    # uncompiled, and no graphs either: a short evaluation would spend more capturing than it saves
    engine = RolloutEngine(model, EngineConfig(max_rows=rows, compile=False, cuda_graphs=False,
                                               max_prompt_len=max(map(len, prompts)), max_new_tokens=new, **extra))
    return engine.generate(prompts, 1, SamplingParams(temperature=temperature, max_new_tokens=new,
                                                      stop_token_ids=(TOKENIZER.eos_id,), seed=seed))


@torch.no_grad()
def sampled_accuracy(model: torch.nn.Module, task: Task, n: int, *, seed: int = EVAL_SEED,
                     sample_seed: int = 0) -> float:
    """Exact-match accuracy of one sample per prompt at temperature 1 (the rollout engine, uncompiled, sampling
    with ``sample_seed``) on examples ``0 .. n-1`` of ``task`` at ``seed``."""
    exs = [task.example(seed, i) for i in range(n)]
    out = _engine_generate(model, exs, rows=max(8, n), temperature=1.0, seed=sample_seed)
    return sum(TOKENIZER.decode(s.tokens.tolist()) == e.answer for s, e in zip(out, exs)) / n


@torch.no_grad()
def engine_answers(model: torch.nn.Module, family: TaskFamily, context: int, n: int, *, rows: int = 64,
                   prefill_tokens: int = 32768, jitter: int = 0,
                   seed: int = EVAL_SEED) -> tuple[list[bool], list[bool]]:
    """Greedy answers of examples ``0 .. n-1`` (at ``seed``) of ``family`` through the uncompiled rollout engine
    (``rows`` at once, prefill chunks of at least ``context + 1`` tokens); example ``i`` has ``context - (37 i mod
    jitter)`` characters, so that with ``jitter`` > 1 questions end at every offset inside a selection block.
    Returns the exact-match hits and the hits of the first answer token alone (what the prefill produced)."""
    exs = [family(context - (37 * i) % jitter if jitter > 1 else context).example(seed, i) for i in range(n)]
    out = _engine_generate(model, exs, rows=min(rows, n), temperature=0.0, prefill_tokens=max(prefill_tokens,
                                                                                               context + 1))
    hits = [TOKENIZER.decode(s.tokens.tolist()) == e.answer for s, e in zip(out, exs)]
    first = [int(s.tokens[0]) == TOKENIZER.encode(e.answer, add_bos=False)[0] for s, e in zip(out, exs)]
    return hits, first


class Answers(NamedTuple):
    """What :func:`answers_with_fallback` returns: the hits, the first-token hits, the model that answered, the
    seconds its answering took, and the error (``"Type: message"``) that made it the fallback (None: it was not)."""

    hits: list[bool]
    first: list[bool]
    model: torch.nn.Module
    seconds: float
    error: str | None


def answers_with_fallback(model: torch.nn.Module, family: TaskFamily, context: int, n: int, *,
                          fallback: Callable[[], torch.nn.Module | None] | None = None, **kw: Any) -> Answers:
    """:func:`engine_answers` of ``model`` (``kw``: its options); when that raises and ``fallback()`` gives a model
    (e.g. the same sparse attention on its PyTorch reference kernels; None: there is none), that model's answers,
    with the error. Raises the original error when there is no fallback model (or the fallback's own error)."""
    t = time.perf_counter()
    try:
        hits, first = engine_answers(model, family, context, n, **kw)
        return Answers(hits, first, model, time.perf_counter() - t, None)
    except Exception as e:  # a kernel that fails on this device or shape
        other = fallback() if fallback is not None else None
        if other is None:
            raise
        error = f"{type(e).__name__}: {e}"
    t = time.perf_counter()
    hits, first = engine_answers(other, family, context, n, **kw)
    return Answers(hits, first, other, time.perf_counter() - t, error)


def paired_accuracy(dense_hits: Sequence[bool], dense_first: Sequence[bool], hits: Sequence[bool],
                    first: Sequence[bool]) -> dict[str, float]:
    """Dense vs sparse answers of the same examples: ``n``, ``dense_acc`` / ``sparse_acc`` with their
    :func:`binomial_se` (``dense_se`` / ``sparse_se``), the :func:`paired` difference, and the first answer
    token's accuracies (``dense_first_acc`` / ``sparse_first_acc``). ``ValueError`` unless all four have one
    equal, non-zero length."""
    n = len(hits)
    if not n or {len(dense_hits), len(dense_first), len(first)} != {n}:
        raise ValueError(f"answers of unequal or zero length: {len(dense_hits)}, {len(dense_first)}, {n}, "
                         f"{len(first)}")
    dacc, sacc = sum(dense_hits) / n, sum(hits) / n
    return dict(n=n, dense_acc=dacc, dense_se=binomial_se(dacc, n), sparse_acc=sacc, sparse_se=binomial_se(sacc, n),
                **paired(dense_hits, hits), dense_first_acc=sum(dense_first) / n, sparse_first_acc=sum(first) / n)


def paired_delta_se(b: int, c: int, n: int) -> float:
    """Standard error of a paired accuracy difference over ``n`` examples, ``b`` right only in the first
    measurement and ``c`` only in the second."""
    return math.sqrt(max((b + c) / n - ((c - b) / n) ** 2, 0.0) / n)


def paired(first: Sequence[bool], second: Sequence[bool]) -> dict[str, float]:
    """Two measurements of the same examples (hits, equal lengths): ``dense_only`` / ``sparse_only`` (right only in
    the first / the second), ``both``, and the paired difference ``delta`` (second minus first accuracy) with its
    standard error ``delta_se``."""
    n = len(first)
    b = sum(d and not s for d, s in zip(first, second))
    c = sum(s and not d for d, s in zip(first, second))
    return {"dense_only": b, "sparse_only": c, "both": sum(d and s for d, s in zip(first, second)),
            "delta": (c - b) / n, "delta_se": paired_delta_se(b, c, n)}


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


def handled_context(report: dict[str, Any], task: str, bar: float = 0.5) -> int:
    """The longest context of a trained model's accuracy table (``report["accuracy"]``) at which ``task``'s
    accuracy reaches ``bar``, the shortest measured one if none does; ``variable_tracking`` is read as itself, any
    other task as ``kv_retrieval``. ``ValueError`` when the table has no row of that task."""
    name = "variable_tracking" if task == "variable_tracking" else "kv_retrieval"
    contexts = [r["context"] for r in report["accuracy"] if r["task"] == name]
    if not contexts:
        raise ValueError(f"the model's report has no {name} accuracy")
    return longest_handled(report, bar, [name]) or min(contexts)


def model_score(report: dict[str, Any], bar: float = 0.8) -> tuple[int, float]:
    """How good a trained model is: (the longest context at which every task that moved its curriculum reaches
    ``bar``, the mean accuracy over the whole table)."""
    tasks = report.get("train", {}).get("config", {}).get("eval", {}).get("tasks")
    accs = [r["accuracy"] for r in report["accuracy"]]
    return longest_handled(report, bar, tasks) or 0, sum(accs) / max(1, len(accs))


def accuracy_summary(rows: Sequence[Mapping[str, Any]], threshold: float,
                     calibration: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """Per configuration and task, and both tasks pooled (``task="both"``, at contexts both were measured at): the
    longest context whose dense accuracy is at least ``threshold`` (``longest_handled``, None if none) and there
    the pooled ``n``, ``dense_acc``, ``sparse_acc``, their paired difference ``delta`` with ``delta_se``,
    ``within_1pt`` and the mean ``decode_density``; ``indexer_recall`` and ``window`` from ``calibration``
    (:func:`~sparrow.calibrate.variants.calibrate_variants`' record) where it names the configuration.

    ``rows``: one per (``config``, ``task``, ``context``) with ``n``, ``dense_acc``, ``sparse_acc``, ``dense_only``,
    ``sparse_only`` (:func:`paired`) and ``decode_density``."""
    out = []
    for cfg in sorted({r["config"] for r in rows}):
        for task in sorted({r["task"] for r in rows if r["config"] == cfg}) + ["both"]:
            by_ctx: dict[int, list[Mapping[str, Any]]] = {}
            for r in rows:
                if r["config"] == cfg and task in ("both", r["task"]):
                    by_ctx.setdefault(r["context"], []).append(r)
            total = lambda rs, k: sum(r[k] * (r["n"] if k.endswith("acc") else 1) for r in rs)  # noqa: E731
            ok = [c for c, rs in by_ctx.items() if len(rs) >= (2 if task == "both" else 1)
                  and total(rs, "dense_acc") / total(rs, "n") >= threshold]
            cal = ((calibration or {}).get("configs") or {}).get(cfg, {})
            row = {"config": cfg, "task": task, "threshold": threshold, "indexer_recall": cal.get("indexer_recall"),
                   "window": (cal.get("rtpurbo_config") or {}).get("window"), "longest_handled": max(ok, default=None)}
            if ok:
                rs = by_ctx[max(ok)]
                n, dense, sparse = total(rs, "n"), total(rs, "dense_acc"), total(rs, "sparse_acc")
                row.update(n=n, dense_acc=dense / n, sparse_acc=sparse / n, delta=(sparse - dense) / n,
                           delta_se=paired_delta_se(total(rs, "dense_only"), total(rs, "sparse_only"), n),
                           within_1pt=abs(sparse - dense) / n <= 0.01,
                           decode_density=sum(r["decode_density"] for r in rs) / len(rs))
            out.append(row)
    return out

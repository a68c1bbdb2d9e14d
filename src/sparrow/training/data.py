"""Teacher-forced training batches from task mixes: token ids, each target's loss role, worker processes.

Every sequence is ``<bos> prompt answer <eos>`` in the ids of :class:`~sparrow.rl.CharTokenizer`. Each target
token has a role (:data:`PROMPT`, :data:`ANSWER`, :data:`EOS`, :data:`IGNORED`); the loss
(:func:`~sparrow.training.teacher_forced_loss`) decides which roles each of its terms reads.

:class:`TaskMixStream` draws a step's examples from several families in fixed shares; all sequences of a step
have one context length, and the step's token budget is fixed, so short steps carry many examples. Example
indices are consecutive per family: no example is seen twice. A trainer reads any :class:`BatchSource`.
"""

from __future__ import annotations

import multiprocessing as mp
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

import numpy as np
import torch

from sparrow.rl.tasks import KVListRetrieval
from sparrow.rl.tokenizer import CHARS, CharTokenizer
from sparrow.training.tasks import MultiQuery, Task, TaskFamily

PROMPT, ANSWER, IGNORED, EOS = 0, 1, 2, 3  # the loss role of a target token
TOKENIZER = CharTokenizer()
WORKER_TIMEOUT_S = 600.0  # the longest wait for one chunk of rows from the workers (seconds at 32K, normally)
_LUT = np.full(256, 255, dtype=np.uint8)
for _c, _i in zip(CHARS, TOKENIZER.encode(CHARS, add_bos=False)):
    _LUT[ord(_c)] = _i


def encode_text(text: str) -> np.ndarray:
    """CharTokenizer ids of ``text`` (no ``<bos>`` / ``<eos>``) as uint8, vectorised.

    Raises:
        ValueError: a character outside the tokenizer's alphabet.
    """
    try:
        ids = _LUT[np.frombuffer(text.lower().encode("ascii"), dtype=np.uint8)]
    except UnicodeEncodeError:
        ids = np.full(1, 255, dtype=np.uint8)
    if (ids == 255).any():
        raise ValueError(f"text {text[:40]!r}... has characters outside the synthetic tokenizer's alphabet")
    return ids


def sequence_ids(example) -> np.ndarray:
    """``<bos> prompt answer <eos>`` of an example as int64 ids."""
    return np.concatenate([[TOKENIZER.bos_id], encode_text(example.prompt), encode_text(example.answer),
                           [TOKENIZER.eos_id]]).astype(np.int64)


def train_tokens(task: Task, seed: int, index: int) -> tuple[np.ndarray, np.ndarray]:
    """Example ``index`` as ids ``[T]`` int64 and each token's role ``[T]`` int8: :data:`ANSWER` for the answer and
    a multi-question example's earlier answers, :data:`EOS` for the final ``<eos>``, :data:`IGNORED` for the
    separators after earlier answers, :data:`PROMPT` for the rest (``<bos>`` included)."""
    ex = task.example(seed, index)
    ids = sequence_ids(ex)
    role = np.full(len(ids), PROMPT, dtype=np.int8)
    role[len(ex.prompt) + 1:] = ANSWER
    role[-1] = EOS
    for a, b in getattr(ex, "spans", ()):
        role[a + 1:b + 1] = ANSWER
    for i in getattr(ex, "ignore", ()):
        role[i + 1] = IGNORED
    return ids, role


def longest_sequence(tasks: Mapping[str, Task], samples: int = 64) -> int:
    """The longest sequence (tokens, ``<bos>`` and ``<eos>`` included) any of ``tasks`` can make: a prompt of at
    most ``context_len + 9 * (queries - 1)`` characters (:class:`MultiQuery`), the longest answer
    (``most_asked * (value_len + 1)`` for :class:`~sparrow.rl.KVListRetrieval`, else the longest of ``samples``
    examples: fixed-length values), and at least the longest of those examples."""
    bound = 0
    for task in tasks.values():
        base = getattr(task, "base", task)
        exs = [task.example(0, i) for i in range(samples)]
        prompt = base.context_len + (9 * (task.queries - 1) if isinstance(task, MultiQuery) else 0)
        answer = (base.most_asked * (base.value_len + 1) if isinstance(base, KVListRetrieval)
                  else max(len(e.answer) for e in exs))
        bound = max(bound, prompt + answer + 2, *(len(e.prompt) + len(e.answer) + 2 for e in exs))
    return bound


def make_rows(job: tuple[str, Task, int, int, int]) -> tuple[str, np.ndarray, np.ndarray]:
    """Worker job ``(family, task, seed, first index, count)`` -> (family, ids ``[count, T]``, roles
    ``[count, T]``), right-padded with ``<pad>`` / :data:`IGNORED`."""
    name, task, seed, start, count = job
    rows = [train_tokens(task, seed, i) for i in range(start, start + count)]
    width = max(len(r) for r, _ in rows)
    ids = np.full((count, width), TOKENIZER.pad_id, dtype=np.int64)
    roles = np.full((count, width), IGNORED, dtype=np.int8)
    for j, (r, m) in enumerate(rows):
        ids[j, :len(r)] = r
        roles[j, :len(m)] = m
    return name, ids, roles


@dataclass
class Batch:
    """One training step's sequences.

    Attributes:
        tokens: ``[B, T]`` int64, right-padded; the model reads ``tokens[:, :-1]``.
        roles: ``[B, T-1]`` int8, the role of each target ``tokens[:, 1:]``.
        family: the family of each row.
        context: the step's context length.
    """

    tokens: torch.Tensor
    roles: torch.Tensor
    family: list[str]
    context: int


def assemble(parts: list[tuple[str, np.ndarray, np.ndarray]], context: int) -> Batch:
    """One :class:`Batch` from :func:`make_rows` outputs (padded to the widest)."""
    width = max(p[1].shape[1] for p in parts)
    pad = lambda a, value: np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=value)  # noqa: E731
    ids = np.concatenate([pad(p[1], TOKENIZER.pad_id) for p in parts])
    roles = np.concatenate([pad(p[2], IGNORED) for p in parts])[:, 1:]
    return Batch(torch.from_numpy(ids), torch.from_numpy(roles), [p[0] for p in parts for _ in range(len(p[1]))],
                 context)


class BatchSource(Protocol):
    """What a trainer reads: ``next(context)`` gives a step's :class:`Batch`."""

    def next(self, context: int) -> Batch: ...

    def longest_sequence(self, context: int) -> int:
        """The longest sequence (tokens) a batch at ``context`` can hold."""

    def close(self) -> None: ...


class TaskMixStream:
    """Batches from a mix of task families, made by ``workers`` processes ``prefetch`` steps ahead.

    ``next(context)`` returns the oldest pending batch and queues one at ``context`` (so with workers a batch's
    context is the one asked for ``prefetch`` calls earlier). A step holds ``batch_size`` examples, or, when
    that is None, ``tokens_per_step // (context + 8)`` (at least ``min_examples``), split over the families in
    proportion to ``mix`` (largest remainders).

    Args:
        families: family name -> ``context -> task``.
        mix: family name -> share (> 0 to be drawn).
        seed: the examples' seed.

    Raises:
        ValueError: a mix share naming no family, a negative share, no positive share, a step size below 1.
    """

    def __init__(self, families: Mapping[str, TaskFamily], mix: Mapping[str, float], seed: int, *,
                 tokens_per_step: int = 8192, batch_size: int | None = None, min_examples: int = 1,
                 workers: int = 0, prefetch: int = 4, chunk: int = 16) -> None:
        unknown = sorted(set(mix) - set(families))
        if unknown:
            raise ValueError(f"mix names unknown families {unknown} (known: {sorted(families)})")
        if any(v < 0 for v in mix.values()) or not any(v > 0 for v in mix.values()):
            raise ValueError(f"mix shares must be >= 0 and one of them > 0, got {dict(mix)}")
        if (batch_size if batch_size is not None else tokens_per_step) < 1 or min_examples < 1 or workers < 0:
            raise ValueError(f"need batch_size or tokens_per_step >= 1, min_examples >= 1 and workers >= 0, got "
                             f"{batch_size}, {tokens_per_step}, {min_examples}, {workers}")
        self.families = families
        self.mix = {k: v for k, v in mix.items() if v > 0}
        self.seed, self.tokens_per_step, self.batch_size, self.chunk = seed, tokens_per_step, batch_size, chunk
        self.min_examples = min_examples
        self.prefetch = prefetch if workers else 0
        self.next_index = {k: 0 for k in self.mix}
        self.pending: deque = deque()
        self.pool = None
        if workers:
            # Workers start from a fork server (a clean process that imported this module once), never as forks of
            # this process: a fork of a process whose threads (OpenMP, compile workers) hold locks can die or hang,
            # and a Pool then waits for its rows forever.
            method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
            ctx = mp.get_context(method)
            if method == "forkserver":
                ctx.set_forkserver_preload([__name__])
            self.pool = ctx.Pool(workers)

    def tasks(self, context: int) -> dict[str, Task]:
        """The mix's tasks at ``context`` (building them checks their knobs)."""
        return {name: self.families[name](context) for name in self.mix}

    def longest_sequence(self, context: int) -> int:
        return longest_sequence(self.tasks(context))

    @property
    def vocab_size(self) -> int:
        """Every id of the batches is below this (:class:`~sparrow.rl.CharTokenizer`'s)."""
        return TOKENIZER.vocab_size

    def examples_per_step(self, context: int) -> int:
        if self.batch_size is not None:
            return self.batch_size
        return max(self.min_examples, self.tokens_per_step // (context + 8))

    def counts(self, examples: int) -> dict[str, int]:
        """Examples per family for a step of ``examples`` (largest remainders)."""
        total = sum(self.mix.values())
        raw = {k: examples * v / total for k, v in self.mix.items()}
        out = {k: int(x) for k, x in raw.items()}
        for k in sorted(raw, key=lambda k: out[k] - raw[k])[:examples - sum(out.values())]:
            out[k] += 1
        return out

    def _submit(self, context: int) -> None:
        jobs, tasks, start = [], self.tasks(context), dict(self.next_index)
        for name, n in self.counts(self.examples_per_step(context)).items():
            while n > 0:
                c = min(n, self.chunk)
                jobs.append((name, tasks[name], self.seed, self.next_index[name], c))
                self.next_index[name] += c
                n -= c
        if self.pool is None:
            self.pending.append((context, start, [make_rows(j) for j in jobs]))
        else:
            self.pending.append((context, start, [self.pool.apply_async(make_rows, (j,)) for j in jobs]))

    def next(self, context: int) -> Batch:
        while len(self.pending) < 1 + self.prefetch:
            self._submit(context)
        ctx, _, parts = self.pending.popleft()
        if self.pool is not None:
            try:
                parts = [p.get(timeout=WORKER_TIMEOUT_S) for p in parts]
            except mp.TimeoutError:
                raise RuntimeError(f"the data workers made no rows in {WORKER_TIMEOUT_S:.0f} s "
                                   "(a worker died?)") from None
        return assemble(parts, ctx)

    def state_dict(self) -> dict[str, Any]:
        """Where the stream stands (JSON-able): the first example index of each family not yet returned, and the
        contexts of the batches already queued. :meth:`load_state_dict` on a stream of the same families, mix,
        seed and step size makes the same batches from there on."""
        first = self.pending[0][1] if self.pending else self.next_index
        return {"next_index": dict(first), "queued_contexts": [ctx for ctx, _, _ in self.pending]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s ``state`` (the queued batches are made again).

        Raises:
            ValueError: the state's families are not this stream's mix (nothing is changed then).
        """
        index = {str(k): int(v) for k, v in state["next_index"].items()}
        if set(index) != set(self.mix):
            raise ValueError(f"stream state of families {sorted(index)} does not fit this mix {sorted(self.mix)}")
        contexts = [int(c) for c in state["queued_contexts"]]
        self.pending.clear()  # batches queued before are dropped (a worker's result is ignored)
        self.next_index = index
        for ctx in contexts:
            self._submit(ctx)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
            self.pool = None

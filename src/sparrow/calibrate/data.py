"""RTPurbo calibration data from the synthetic tasks, and an indexer cut to a smaller head set.

The task sequences hold spans that really are repeated: multi-key retrieval's ``key=value`` pair in the context
and ``?key=`` + answer at the end; variable tracking's asked statement and the question, the chain's number and
the answer. :func:`calibration_sequences` marks them for head profiling
(:func:`~sparrow.calibrate.head_scores`, :func:`~sparrow.calibrate.ablation_scores`); :func:`fit_sequences`
gives prompt + answer sequences to distil the indexer on (:func:`~sparrow.calibrate.fit_indexer`).
"""

from __future__ import annotations

import torch

from sparrow.attention.rtpurbo import HeadProfile, IndexerWeights
from sparrow.calibrate import CalibrationSequence
from sparrow.rl.tasks import KVRetrieval, VariableTracking
from sparrow.rl.tokenizer import CharTokenizer

CALIBRATION_SEED = 2_000_003  # neither a task model's training seed nor its evaluation seed
_TOK = CharTokenizer()


def _tokens(prompt: str, answer: str) -> torch.Tensor:
    """``<bos> prompt answer`` (no ``<eos>``) as int64 ids."""
    return torch.tensor(_TOK.encode(prompt + answer))


def calibration_sequences(context: int, n: int, seed: int = CALIBRATION_SEED) -> list[CalibrationSequence]:
    """``3 n`` task sequences (prompt + answer, ``<bos>`` first, no ``<eos>``) of about ``context`` tokens, each
    with the positions of a span that occurs twice: per index, multi-key retrieval (the pair in the context and
    the question + answer), then variable tracking twice (the asked variable's statement and the question; the
    chain's number and the answer).

    Raises:
        ValueError: ``n < 1``, or a context too short for the tasks.
    """
    if n < 1:
        raise ValueError(f"calibration_sequences: n must be >= 1, got {n}")
    out = []
    kv, vt = KVRetrieval(context), VariableTracking(context)
    for i in range(n):
        out.append(kv_calibration_sequence(kv, seed, i))
        ex = vt.example(seed, i)
        p = ex.prompt
        var = p[p.rindex("?") + 1:-1]
        toks = _tokens(p, ex.answer)
        out.append(CalibrationSequence(toks, 1 + p.index(var + "="), len(p) - len(var), len(var) + 1))
        out.append(CalibrationSequence(toks, 2 + p.index("=" + ex.answer + ";"), 1 + len(p), len(ex.answer)))
    return out


def kv_calibration_sequence(task: KVRetrieval, seed: int, index: int) -> CalibrationSequence:
    """Example ``index`` of a multi-key retrieval task (any key / value lengths) as ``<bos> prompt answer`` with
    its repeated span marked: the asked ``key=value`` pair in the context, and ``key=`` + the answer at the end."""
    ex = task.example(seed, index)
    p = ex.prompt
    key = p[p.rindex("?") + 1:-1]
    span = len(key) + 1 + len(ex.answer)
    return CalibrationSequence(_tokens(p, ex.answer), 1 + p.index(key + "="), len(p) - len(key), span)


def fit_sequences(context: int, n: int, seed: int = CALIBRATION_SEED + 1) -> list[torch.Tensor]:
    """``n`` task sequences (``<bos>`` prompt answer, int64), alternating multi-key retrieval and variable
    tracking, to fit the indexer on.

    Raises:
        ValueError: ``n < 1``, or a context too short for the tasks.
    """
    if n < 1:
        raise ValueError(f"fit_sequences: n must be >= 1, got {n}")
    tasks = (KVRetrieval(context), VariableTracking(context))
    return [_tokens(ex.prompt, ex.answer) for ex in (tasks[i % 2].example(seed, i) for i in range(n))]


def subset_indexer(big: HeadProfile, small: HeadProfile, weights: IndexerWeights) -> IndexerWeights:
    """The indexer of ``small``'s retrieval heads (weights and temperatures), taken from ``weights`` fitted for
    ``big``'s (a superset).

    Raises:
        ValueError: a retrieval head of ``small`` that ``big`` does not have.
    """
    out = IndexerWeights()
    for layer in range(small.num_layers):
        hs, hb = small.retrieval_heads(layer), big.retrieval_heads(layer)
        if not hs:
            continue
        if not set(hs) <= set(hb):
            raise ValueError(f"layer {layer}: heads {hs} are not among the fitted {hb}")
        idx = torch.tensor([hb.index(h) for h in hs])
        out.q[layer], out.k[layer] = weights.q[layer][idx], weights.k[layer][idx]
        if layer in weights.temperature:
            out.temperature[layer] = weights.temperature[layer][idx]
    return out

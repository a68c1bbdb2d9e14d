"""Held-out accuracy: teacher forcing agrees with greedy decoding; what a report says a model handles."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sparrow.models import qwen2
from sparrow.rl import CharTokenizer, VariableTracking
from sparrow.rollout import EngineConfig, RolloutEngine, SamplingParams
from sparrow.training import (
    EVAL_TASKS, accuracy_table, binomial_se, greedy_accuracy, longest_handled, model_score, teacher_forced_hits,
)


def _peaked_model():
    """A random model with peaked logits, so that greedy decoding has no near-ties."""
    torch.manual_seed(0)
    model = qwen2(vocab_size=48, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, intermediate_dim=128,
                  max_seq_len=256).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model


def test_teacher_forced_check_agrees_with_greedy_decoding():
    tok, model = CharTokenizer(), _peaked_model()
    prompts = [tok.encode(VariableTracking(128).example(3, i).prompt) for i in range(6)]
    engine = RolloutEngine(model, EngineConfig(max_rows=6, max_prompt_len=129, max_new_tokens=5, compile=False))
    out = engine.generate(prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=5))
    greedy = [(np.asarray(p + s.tokens.tolist()), len(p)) for p, s in zip(prompts, out)]
    assert teacher_forced_hits(model, greedy, batch_tokens=300) == [True] * 6  # two forwards of 2 rows, one of 2
    wrong = [(np.concatenate([ids[:-1], [(ids[-1] + 1) % tok.vocab_size]]), n) for ids, n in greedy]
    assert teacher_forced_hits(model, wrong) == [False] * 6
    assert not model.training


def _largest_projection(model, fn) -> int:
    """The most positions ``model.output`` projected at once while ``fn()`` ran."""
    rows = []
    hook = model.output.register_forward_hook(lambda m, args, out: rows.append(args[0][..., 0].numel()))
    try:
        fn()
    finally:
        hook.remove()
    return max(rows)


def test_teacher_forced_hits_projects_only_the_answer_positions():
    """A large vocabulary's logits exist only for the positions that predict an answer token, a chunk at a time,
    and every chunking gives the same hits row by row; the whole-sequence forward (the negative control) projects
    every position."""
    tok, model = CharTokenizer(), _peaked_model()
    prompts = torch.stack([torch.as_tensor(tok.encode(VariableTracking(200).example(5, i).prompt)) for i in range(5)])
    with torch.no_grad():  # the model's own greedy continuation: rows of 3 .. 19 answer tokens it gets right
        full = torch.cat([prompts, model(prompts).argmax(-1)[:, -1:]], 1)
        for _ in range(18):
            full = torch.cat([full, model(full).argmax(-1)[:, -1:]], 1)
    seqs = [(full[i, :201 + 3 + 4 * i].numpy().copy(), 201) for i in range(5)]
    for i in (1, 3):  # a wrong token late in rows 1 and 3: only those rows miss
        seqs[i][0][-2] = (seqs[i][0][-2] + 1) % tok.vocab_size
    answers = sum(len(ids) - plen for ids, plen in seqs)
    hits = lambda **kw: teacher_forced_hits(model, seqs, **kw)  # noqa: E731
    assert hits() == [True, False, True, False, True]
    assert _largest_projection(model, hits) == answers  # one forward, every answer position, nothing else
    assert _largest_projection(model, lambda: hits(logits_chunk=7)) == 7
    assert hits(logits_chunk=7) == hits(logits_chunk=1) == hits()
    assert _largest_projection(model, lambda: model(full[:, :200])) == 5 * 200 > answers


def test_accuracy_table_rows():
    model = _peaked_model()
    rows = accuracy_table(model, {"kv_retrieval": EVAL_TASKS["kv_retrieval"]}, [64, 128], 4)
    assert [(r["task"], r["context"], r["n"]) for r in rows] == [("kv_retrieval", 64, 4), ("kv_retrieval", 128, 4)]
    assert rows[0]["accuracy"] == greedy_accuracy(model, EVAL_TASKS["kv_retrieval"](64), 4)
    sampled = accuracy_table(model, {"kv_retrieval": EVAL_TASKS["kv_retrieval"]}, [64], 3, sampled=True)
    assert 0 <= sampled[0]["sampled_accuracy"] <= 1
    assert binomial_se(0.5, 100) == pytest.approx(0.05) and binomial_se(1.0, 10) == 0.0


def test_longest_handled_and_model_score():
    acc = [{"task": t, "context": c, "accuracy": a} for t, c, a in (
        ("kv_retrieval", 64, 1.0), ("variable_tracking", 64, 0.9), ("kv_retrieval", 128, 0.85),
        ("variable_tracking", 128, 0.5), ("kv_retrieval", 256, 0.2), ("variable_tracking", 256, 0.1))]
    rep = {"accuracy": acc}
    assert longest_handled(rep, 0.8) == 64 and longest_handled(rep, 0.8, ["kv_retrieval"]) == 128
    assert longest_handled(rep, 0.95) is None
    assert model_score(rep) == (64, pytest.approx(3.55 / 6))
    # a retrieval model's score counts the tasks that moved its curriculum only
    rep["train"] = {"config": {"eval": {"tasks": ["kv_retrieval"]}}}
    assert model_score(rep) == (128, pytest.approx(3.55 / 6))


def test_paired_difference():
    from sparrow.training import paired, paired_delta_se

    dense = [True, True, False, False, True]
    sparse = [True, False, True, True, True]
    p = paired(dense, sparse)
    assert (p["dense_only"], p["sparse_only"], p["both"]) == (1, 2, 2)
    assert p["delta"] == pytest.approx(0.2)
    assert p["delta_se"] == pytest.approx(math.sqrt((3 / 5 - 0.2 ** 2) / 5)) == paired_delta_se(1, 2, 5)
    assert paired(dense, dense)["delta_se"] == 0.0


def test_handled_context():
    from sparrow.training import handled_context

    report = {"accuracy": [{"task": "kv_retrieval", "context": c, "accuracy": a} for c, a in ((512, 0.9), (1024, 0.6),
                                                                                              (2048, 0.2))]}
    assert handled_context(report, "kv_list") == 1024 and handled_context(report, "kv_retrieval", 0.95) == 512
    with pytest.raises(ValueError):
        handled_context(report, "variable_tracking")


def test_accuracy_summary_longest_handled_context_and_pooling():
    from sparrow.training import accuracy_summary, paired_delta_se

    def row(task, context, dense, sparse, n=10, density=0.5):
        return dict(config="r", task=task, context=context, n=n, dense_acc=dense, sparse_acc=sparse,
                    dense_only=round(n * max(0.0, dense - sparse)), sparse_only=round(n * max(0.0, sparse - dense)),
                    decode_density=density)

    rows = [row("kv", 512, 1.0, 0.9), row("kv", 1024, 0.9, 0.9, density=0.3), row("kv", 2048, 0.5, 0.5),
            row("vt", 512, 0.8, 0.8), row("vt", 1024, 1.0, 1.0, density=0.1)]
    cal = {"configs": {"r": {"indexer_recall": 0.97, "rtpurbo_config": {"window": 64}}}}
    out = {s["task"]: s for s in accuracy_summary(rows, 0.9, cal)}
    assert list(out) == ["kv", "vt", "both"]
    assert out["kv"]["longest_handled"] == 1024 and out["kv"]["delta"] == 0.0 and out["kv"]["within_1pt"]
    assert out["vt"]["longest_handled"] == 1024 and out["vt"]["indexer_recall"] == 0.97 and out["vt"]["window"] == 64
    both = out["both"]  # 2048 has one task only; 1024: (0.9 + 1.0) / 2 >= 0.9
    assert both["longest_handled"] == 1024 and both["n"] == 20
    assert both["dense_acc"] == pytest.approx(0.95) and both["decode_density"] == pytest.approx(0.2)
    assert accuracy_summary(rows, 0.9)[0]["indexer_recall"] is None
    low = accuracy_summary([row("kv", 512, 1.0, 0.8)], 0.9)[0]
    assert low["delta"] == pytest.approx(-0.2) and low["delta_se"] == pytest.approx(paired_delta_se(2, 0, 10))
    assert not low["within_1pt"]
    none = accuracy_summary([row("kv", 512, 0.5, 0.5)], 0.9)[0]
    assert none["longest_handled"] is None and "dense_acc" not in none


def test_answers_with_fallback_and_paired_accuracy(monkeypatch):
    from sparrow.training import evaluate

    broken, reference = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)
    calls = []

    def fake(model, family, context, n, **kw):
        calls.append((model, kw))
        if model is broken:
            raise RuntimeError("kernel failed")
        return [True] * n, [False] * n

    monkeypatch.setattr(evaluate, "engine_answers", fake)
    a = evaluate.answers_with_fallback(reference, EVAL_TASKS["kv_retrieval"], 64, 3, rows=2)
    assert (a.hits, a.model, a.error, calls[-1][1]) == ([True] * 3, reference, None, {"rows": 2})
    a = evaluate.answers_with_fallback(broken, EVAL_TASKS["kv_retrieval"], 64, 2, fallback=lambda: reference)
    assert a.model is reference and a.error == "RuntimeError: kernel failed" and a.first == [False, False]
    with pytest.raises(RuntimeError):  # no fallback model: the error itself
        evaluate.answers_with_fallback(broken, EVAL_TASKS["kv_retrieval"], 64, 2, fallback=lambda: None)

    r = evaluate.paired_accuracy([True, True, False, False], [True] * 4, [True, False, True, True], [False] * 4)
    assert (r["n"], r["dense_acc"], r["sparse_acc"], r["delta"]) == (4, 0.5, 0.75, 0.25)
    assert (r["dense_only"], r["sparse_only"], r["both"], r["dense_first_acc"], r["sparse_first_acc"]) == (1, 2, 1, 1.0, 0.0)
    assert r["sparse_se"] == pytest.approx(binomial_se(0.75, 4))
    with pytest.raises(ValueError):
        evaluate.paired_accuracy([True], [True], [True, False], [True, False])

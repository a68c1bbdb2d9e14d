"""Training batches from task mixes: multi-question examples, loss roles, step sizes, workers, sequence bounds."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from sparrow.rl import CharTokenizer, KVRetrieval
from sparrow.training import (
    ANSWER, DEFAULT_MIX, EOS, FAMILIES, IGNORED, PROMPT, MultiQuery, TaskMixStream, encode_text, longest_sequence,
    sequence_ids, train_tokens,
)


@pytest.mark.parametrize("family,context", [("kv_mq", 64), ("kv_vary_mq", 200), ("vt_mq", 128), ("vt_mq", 301)])
def test_multi_question_examples_ask_true_values_and_end_like_the_evaluation(family, context):
    task = FAMILIES[family](context)
    for i in range(20):
        ex, base = task.example(5, i), task.base.example(5, i)
        body = base.prompt.rsplit("?", 1)[0]
        assert ex.prompt.startswith(body) and ex.prompt.endswith(base.prompt[len(body):])
        assert ex.answer == base.answer  # the final question is the evaluation's
        assign = dict(re.findall(r"([a-z]+)=([a-z0-9]+);", body))

        def value(v):
            while not assign[v].isdigit():
                v = assign[v]
            return assign[v]

        asked = re.findall(r"\?([a-z]+)=([0-9]+);", ex.prompt[len(body):])
        assert len(asked) == len(ex.spans) >= 1 and len({k for k, _ in asked}) == len(asked)
        assert all(value(k) == v for k, v in asked)
        assert [ex.prompt[a:b] for a, b in ex.spans] == [v for _, v in asked]
        assert all(ex.prompt[j] == ";" and ex.prompt[j - 1].isdigit() for j in ex.ignore)
        ids, role = train_tokens(task, 5, i)
        assert (role == ANSWER).sum() == sum(len(v) for _, v in asked) + len(ex.answer)
        assert (role == IGNORED).sum() == len(asked) and role[0] == PROMPT
        assert role[-1] == EOS and ids[-1] == CharTokenizer.eos_id and (role == EOS).sum() == 1


def test_multi_query_refuses_bad_knobs():
    with pytest.raises(ValueError, match="queries must be >= 1, got 0"):
        MultiQuery(KVRetrieval(64), queries=0)
    with pytest.raises(ValueError, match="base must be"):
        MultiQuery(FAMILIES["kvl"](64))


def test_ids_are_the_tokenizers():
    tok = CharTokenizer()
    ex = KVRetrieval(64).example(0, 3)
    assert sequence_ids(ex).tolist() == tok.encode(ex.prompt + ex.answer, add_eos=True)
    assert encode_text("A=1;").tolist() == tok.encode("a=1;", add_bos=False)
    for bad in ("a#b", "é"):
        with pytest.raises(ValueError, match="outside the synthetic tokenizer's alphabet"):
            encode_text(bad)


@pytest.mark.parametrize("mix", [{"kvl": 1.0}, {"kvl_long": 1.0}, {"kv_mq": 0.5, "vt_mq": 0.5}, dict(DEFAULT_MIX)],
                         ids=["kv_list", "kv_list_long", "multi_query", "default"])
def test_longest_sequence_covers_every_training_sequence(mix):
    # kv_list answers reach most_asked * 4 tokens past the context: a model sized context + 64 failed on them
    tasks = {f: FAMILIES[f](600) for f in mix}
    bound = longest_sequence(tasks)
    assert max(len(sequence_ids(t.example(7, i))) for t in tasks.values() for i in range(400)) <= bound
    assert TaskMixStream(FAMILIES, mix, seed=0).longest_sequence(600) == bound


def test_a_step_splits_its_examples_over_the_mix_and_never_repeats_one():
    stream = TaskMixStream(FAMILIES, {"kv": 2.0, "vt": 1.0, "kvl": 0.0}, seed=3, tokens_per_step=30 * 136)
    assert stream.examples_per_step(128) == 30 and stream.counts(30) == {"kv": 20, "vt": 10}
    assert stream.counts(7) == {"kv": 5, "vt": 2}  # largest remainders
    a, b = stream.next(128), stream.next(128)
    assert a.family == ["kv"] * 20 + ["vt"] * 10 and a.context == 128
    assert a.tokens.shape[0] == 30 and a.roles.shape == (30, a.tokens.shape[1] - 1)
    first = sequence_ids(FAMILIES["kv"](128).example(3, 0))
    assert a.tokens[0, :len(first)].tolist() == first.tolist()
    second = sequence_ids(FAMILIES["kv"](128).example(3, 20))  # the next step goes on from index 20
    assert b.tokens[0, :len(second)].tolist() == second.tolist()
    assert (a.tokens[:, 0] == CharTokenizer.bos_id).all()
    pad = a.tokens[:, 1:] == CharTokenizer.pad_id
    assert (a.roles[pad] == IGNORED).all()  # padding is never a target
    assert TaskMixStream(FAMILIES, {"kv": 1.0}, seed=0, batch_size=5, tokens_per_step=1).examples_per_step(4096) == 5
    assert TaskMixStream(FAMILIES, {"kv": 1.0}, seed=0, min_examples=8).examples_per_step(8192) == 8


def test_worker_processes_make_the_same_batches():
    here = TaskMixStream(FAMILIES, {"kv_mq": 1.0, "vt": 1.0}, seed=1, tokens_per_step=2048)
    pool = TaskMixStream(FAMILIES, {"kv_mq": 1.0, "vt": 1.0}, seed=1, tokens_per_step=2048, workers=2, prefetch=2)
    try:
        for _ in range(3):
            a, b = here.next(128), pool.next(128)
            assert torch.equal(a.tokens, b.tokens) and torch.equal(a.roles, b.roles) and a.family == b.family
    finally:
        pool.close()
    assert pool.pool is None


def test_rows_a_worker_never_returns_raise_instead_of_hanging(monkeypatch):
    """A chunk of rows lost with its worker (a Pool never hands it to another) is an error after
    ``WORKER_TIMEOUT_S``, not a wait without end; the timeout reaches the Pool's ``get``."""
    import multiprocessing as mp

    import sparrow.training.data as data

    asked = []

    class Lost:
        def get(self, timeout=None):
            asked.append(timeout)
            raise mp.TimeoutError

    class LostPool:
        def apply_async(self, fn, args):
            return Lost()

        def terminate(self):
            pass

        def join(self):
            pass

    stream = TaskMixStream(FAMILIES, {"kv_mq": 1.0}, seed=1, tokens_per_step=2048)
    stream.pool = LostPool()
    monkeypatch.setattr(data, "WORKER_TIMEOUT_S", 0.5)
    with pytest.raises(RuntimeError, match="no rows in 0 s"):
        stream.next(128)
    assert asked == [0.5]


@pytest.mark.parametrize("kwargs,match", [
    pytest.param({"mix": {"nope": 1.0}}, r"unknown families \['nope'\]", id="unknown"),
    pytest.param({"mix": {"kv": 0.0}}, "one of them > 0", id="no-share"),
    pytest.param({"mix": {"kv": -1.0, "vt": 1.0}}, ">= 0", id="negative"),
    pytest.param({"mix": {"kv": 1.0}, "batch_size": 0}, "batch_size or tokens_per_step >= 1", id="batch"),
])
def test_stream_refuses_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TaskMixStream(FAMILIES, seed=0, **kwargs)


def test_roles_of_a_single_question_example():
    ids, role = train_tokens(KVRetrieval(64, key_len=1, value_len=2), 0, 0)
    assert np.array_equal(role[:-3], np.full(len(ids) - 3, PROMPT)) and role[-3:].tolist() == [ANSWER, ANSWER, EOS]

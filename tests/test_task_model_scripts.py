"""The task-model trainer and the RTPurbo accuracy benchmark, end to end on CPU (their ``--quick`` paths)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_rtpurbo_accuracy  # noqa: E402
import train_task_model  # noqa: E402


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("task_model")
    report = train_task_model.main(["--quick", "--minutes", "0.03", "--out", str(out), "--shard-mb", "0.05"])
    return out, report


def test_training_writes_small_shards_and_a_report(trained):
    out, report = trained
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 2  # 0.05 MB shards split the 0.16 MB of bf16 weights
    assert all(p.stat().st_size <= 0.05e6 for p in shards)
    doc = json.loads((out / train_task_model.REPORT_FILE).read_text())
    assert doc == json.loads(json.dumps(report))
    assert doc["format"] == "sparrow-task-model" and doc["weights_dtype"] == "bfloat16"
    assert [s["file"] for s in doc["shards"]] == [p.name for p in shards]
    assert doc["params"] == sum(p.numel() for p in train_task_model.load_task_model(out).parameters())
    assert doc["train"]["tokens_seen"] > 0 and doc["train"]["steps"] >= 1
    assert doc["reload_matches_bf16_weights"] is True
    cells = {(r["task"], r["context"]) for r in doc["accuracy"]}
    assert cells == {(t, n) for t in ("kv_retrieval", "variable_tracking") for n in (128, 256)}
    assert all(0 <= r["accuracy"] <= 1 and r["n"] == 16 for r in doc["accuracy"])


def test_loader_rebuilds_the_saved_weights_bit_for_bit(trained):
    from safetensors.torch import load_file

    out, _ = trained
    saved = {}
    for p in sorted(out.glob("model-*-of-*.safetensors")):
        saved.update(load_file(str(p)))
    model = train_task_model.load_task_model(out, "cpu", torch.bfloat16)
    state = model.state_dict()
    assert set(state) == set(saved)
    for k, v in saved.items():
        assert v.dtype == torch.bfloat16 and torch.equal(state[k].view(torch.int16), v.view(torch.int16)), k
    f32 = train_task_model.load_task_model(out, "cpu", torch.float32).state_dict()
    assert all(torch.equal(f32[k].to(torch.bfloat16).view(torch.int16), v.view(torch.int16)) for k, v in saved.items())
    # RoPE tables stay float32 whatever the weights' dtype
    assert model.layers[0].attn.pos_embeddings.cache.dtype == torch.float32


def test_teacher_forced_check_agrees_with_greedy_decoding():
    """The trainer's one-pass accuracy: a target passes the teacher-forced check exactly when it is what the
    rollout engine decodes greedily (a random model with peaked logits, so there are no near-ties)."""
    from sparrow.rl.tokenizer import CharTokenizer
    from sparrow.rollout import EngineConfig, RolloutEngine, SamplingParams

    tok = CharTokenizer()
    torch.manual_seed(0)
    model = train_task_model.ModelConfig(num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64,
                                         intermediate_dim=128, max_seq_len=256).build().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    task = train_task_model.EVAL_TASKS["variable_tracking"](128)
    prompts = [tok.encode(task.example(3, i).prompt) for i in range(6)]
    engine = RolloutEngine(model, EngineConfig(max_rows=6, max_prompt_len=129, max_new_tokens=5, compile=False))
    out = engine.generate(prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=5))
    greedy = [(np.asarray(p + s.tokens.tolist()), len(p)) for p, s in zip(prompts, out)]
    assert train_task_model.teacher_forced_hits(model, greedy, batch_tokens=300) == [True] * 6
    wrong = [(np.concatenate([ids[:-1], [(ids[-1] + 1) % tok.vocab_size]]), n) for ids, n in greedy]
    assert train_task_model.teacher_forced_hits(model, wrong) == [False] * 6


def test_calibration_sequences_mark_real_repeats():
    for s in bench_rtpurbo_accuracy.calibration_sequences(256, 2, seed=5):
        t = s.tokens
        assert s.second + s.span <= t.numel()
        assert torch.equal(t[s.first:s.first + s.span], t[s.second:s.second + s.span])
        assert s.first + s.span <= s.second


def test_accuracy_benchmark_quick_pipeline(trained, tmp_path):
    out, _ = trained
    res = bench_rtpurbo_accuracy.main(["--quick", "--model", str(out), "--out", str(tmp_path), "--examples", "6",
                                       "--configs", "ratio=0.5;ratio=0.25,top_p=0.8"])
    doc = json.loads((tmp_path / "rtpurbo_accuracy.json").read_text())
    assert doc["benchmark"] == "rtpurbo_accuracy" and doc["complete"] is True
    assert {(r["config"], r["task"], r["context"]) for r in doc["rows"]} == {
        (c, t, n) for c in ("ratio=0.5", "ratio=0.25,top_p=0.8") for t in ("kv_retrieval", "variable_tracking")
        for n in (128, 256)}
    for r in doc["rows"]:
        assert r["n"] == 6 and 0 <= r["dense_acc"] <= 1 and 0 <= r["sparse_acc"] <= 1
        assert r["dense_only"] + r["sparse_only"] + r["both"] <= 6
        assert 0 < r["decode_density"] <= 1 and 0 < r["prefill_density"] <= 1
        assert r["window"] == 32  # 256 / 16 is below two 16-token blocks: the floor
    cal = doc["calibration"]["configs"]
    assert cal["ratio=0.5"]["num_retrieval_heads"] == 2 and cal["ratio=0.25,top_p=0.8"]["num_retrieval_heads"] == 1
    small, big = (set(map(tuple, cal[c]["retrieval_heads"])) for c in ("ratio=0.25,top_p=0.8", "ratio=0.5"))
    assert small <= big
    assert all(0 <= c["indexer_recall"] <= 1 for c in cal.values())
    assert {s["task"] for s in doc["summary"]} == {"kv_retrieval", "variable_tracking", "both"}
    assert len(doc["dense"]) == 4 and res["rows"] == doc["rows"]
    import matplotlib

    matplotlib.use("Agg")
    bench_rtpurbo_accuracy.plot(doc, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_curriculum_holds_an_unsolved_level_past_its_time_cap():
    from train_task_model import Curriculum, TrainConfig

    cfg = TrainConfig(min_context=256, max_context=1024, ramp=0.5, advance_acc=0.8, min_advance_acc=0.3)
    cur = Curriculum(cfg, budget_s=100.0)  # 3 levels: a level's time cap is 25 s
    assert not cur.update(30.0, {"kv": 0.1, "vt": 0.9})  # time is up, but kv is unsolved: hold
    assert not cur.update(40.0) and cur.top == 256
    assert cur.update(41.0, {"kv": 0.35, "vt": 0.5}) and cur.top == 512  # partly solved: the cap applies
    assert not cur.update(60.0)  # no accuracy measured at 512 yet
    assert cur.update(61.0, {"kv": 0.85, "vt": 0.81}) and cur.top == 1024  # solved: advance at once
    assert [e["reason"] for e in cur.events] == ["time", "accuracy"]
    old = Curriculum(TrainConfig(min_context=256, max_context=1024, ramp=0.5, min_advance_acc=0.0), budget_s=100.0)
    assert old.update(26.0)  # min_advance_acc=0: the time cap alone


@pytest.mark.parametrize("family,context", [("kv_mq", 64), ("kv_vary_mq", 200), ("vt_mq", 128), ("vt_mq", 300)])
def test_multi_question_examples_ask_true_values_and_end_like_the_evaluation(family, context):
    import re

    task = train_task_model.TRAIN_FAMILIES[family](context)
    for i in range(20):
        ex = task.example(5, i)
        base = task.base.example(5, i)
        body = base.prompt.rsplit("?", 1)[0]
        assert ex.prompt.startswith(body) and ex.prompt.endswith(base.prompt[len(body):])
        assert ex.answer == base.answer  # the final question is the evaluation's
        assign = dict(re.findall(r"([a-z]+)=([a-z0-9]+);", body))

        def value(v):
            while not assign[v].isdigit():
                v = assign[v]
            return assign[v]

        asked = re.findall(r"\?([a-z]+)=([0-9]+);", ex.prompt[len(body):])
        assert len(asked) == len(ex.spans) >= 1 and len(set(k for k, _ in asked)) == len(asked)
        assert all(value(k) == v for k, v in asked)
        assert [ex.prompt[a:b] for a, b in ex.spans] == [v for _, v in asked]
        assert all(ex.prompt[j] == ";" and ex.prompt[j - 1].isdigit() for j in ex.ignore)
        ids, role = train_task_model.train_tokens(task, 5, i)
        n_ans = sum(len(v) for _, v in asked) + len(ex.answer) + 1
        assert (role == train_task_model.ANSWER).sum() == n_ans
        assert (role == train_task_model.IGNORED).sum() == len(asked)
        assert role[-1] == train_task_model.ANSWER and ids[-1] == train_task_model._TOK.eos_id


@pytest.mark.slow
def test_seeds_trains_several_and_keeps_the_best(tmp_path, monkeypatch):
    out = tmp_path / "best"
    small = ["--device", "cpu", "--layers", "1", "--dim", "32", "--heads", "2", "--kv-heads", "1", "--mlp", "64",
             "--min-context", "64", "--max-context", "128", "--minutes", "0.03", "--tokens-per-step", "1024",
             "--eval-examples", "4", "--final-eval-examples", "8", "--eval-every", "2", "--out", str(out)]
    # models this small all score zero: rank the candidates by seed instead, the middle one best
    monkeypatch.setattr(train_task_model, "model_score", lambda rep: (0, -abs(rep["train"]["seed"] - 4)))
    report = train_task_model.main([*small, "--seeds", "3,4,5"])
    assert report["chosen_seed"] == 4 and [c["seed"] for c in report["candidates"]] == [3, 4, 5]
    assert report["train"]["seed"] == 4
    model = train_task_model.load_task_model(out)  # the kept shards load with the report beside them
    kept = train_task_model.load_task_model(out / "seed_4")
    other = train_task_model.load_task_model(out / "seed_3")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), kept.state_dict().values()))
    assert not all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    assert train_task_model._without(["--seeds", "1,2", "--lr=3", "--out", "x", "--minutes", "1"],
                                     ("--seeds", "--lr", "--out")) == ["--minutes", "1"]


def test_seed_processes_spread_over_the_gpus():
    assert train_task_model.seed_devices(5, "cuda", 2) == ["0", "1", "0", "1", "0"]
    assert train_task_model.seed_devices(3, "cuda", 1) == [None] * 3  # one GPU: all share it
    assert train_task_model.seed_devices(2, "cuda:1", 2) == [None] * 2  # a device named: respected
    assert train_task_model.seed_devices(2, "cpu", 4) == [None] * 2


def test_longest_handled_and_model_score():
    acc = [{"task": t, "context": c, "accuracy": a} for t, c, a in (
        ("kv_retrieval", 64, 1.0), ("variable_tracking", 64, 0.9), ("kv_retrieval", 128, 0.85),
        ("variable_tracking", 128, 0.5), ("kv_retrieval", 256, 0.2), ("variable_tracking", 256, 0.1))]
    rep = {"accuracy": acc}
    assert train_task_model.longest_handled(rep, 0.8) == 64
    assert train_task_model.longest_handled(rep, 0.8, ["kv_retrieval"]) == 128
    assert train_task_model.longest_handled(rep, 0.95) is None
    assert train_task_model.model_score(rep) == (64, pytest.approx(3.55 / 6))
    # a retrieval model's score counts the tasks that moved its curriculum only
    rep["train"] = {"eval_tasks": ["kv_retrieval"]}
    assert train_task_model.model_score(rep) == (128, pytest.approx(3.55 / 6))


@pytest.mark.parametrize("mix", [{"kvl": 1.0}, {"kvl_long": 1.0}, {"kv_mq": 0.5, "vt_mq": 0.5},
                                 dict(train_task_model.DEFAULT_MIX)],
                         ids=["kv_list", "kv_list_long", "multi_query", "default"])
def test_model_length_covers_every_training_sequence(mix):
    # kv_list answers reach most_asked * 4 tokens past the context: a model sized context + 64 failed on them
    bound = train_task_model.longest_sequence(mix, 600)
    seen = max(len(train_task_model._sequence_ids(train_task_model.TRAIN_FAMILIES[f](600).example(7, i)))
               for f in mix for i in range(400))
    assert seen <= bound
    args = train_task_model.build_parser().parse_args(
        ["--max-context", "600", "--mix", ",".join(f"{k}={v}" for k, v in mix.items()), "--device", "cpu"])
    assert train_task_model.config_from_args(args).model.max_seq_len >= bound


def test_training_refuses_a_model_too_short_for_its_sequences(tmp_path):
    cfg = train_task_model.quick_config(str(tmp_path))
    cfg.mix = {"kvl": 1.0}
    cfg.model.max_seq_len = cfg.max_context + 16
    with pytest.raises(ValueError, match="max_seq_len .* too short"):
        train_task_model.train(cfg)
    assert not list(tmp_path.glob("*.safetensors"))


def test_eval_tasks_move_the_curriculum_and_fill_the_table():
    args = train_task_model.build_parser().parse_args(
        ["--eval-tasks", "kv_retrieval", "--mix", "kv_mq=0.5,kvl=0.5", "--device", "cpu"])
    cfg = train_task_model.config_from_args(args)
    assert cfg.eval_tasks == ["kv_retrieval"]
    assert cfg.table_tasks() == ["kv_retrieval", "variable_tracking", "kv_list"]
    bad = train_task_model.build_parser().parse_args(["--eval-tasks", "kv_retrieval,nope", "--device", "cpu"])
    with pytest.raises(SystemExit, match="nope"):
        train_task_model.config_from_args(bad)

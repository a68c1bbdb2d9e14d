"""The end-to-end GRPO benchmark on CPU (its ``--quick`` path): five recipe runs, the JSON and the plot."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_e2e  # noqa: E402


@pytest.fixture
def one_thread():
    """Intra-op threads only contend on 2 shared cores (the recipe tests run with OMP_NUM_THREADS=1 too)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.mark.slow
def test_e2e_quick_pipeline(tmp_path, one_thread):
    bench_e2e.main(["--quick", "--out", str(tmp_path), "--work-dir", str(tmp_path / "work"), "--density-probe"])
    doc = json.loads((tmp_path / "e2e.json").read_text())
    assert doc["benchmark"] == "e2e" and doc["complete"] is True
    assert doc["failed"] == [] and doc["skipped"] == []
    rows = {r["config"]: r for r in doc["rows"]}
    assert set(rows) == set(bench_e2e.CONFIGS) and len(doc["rows"]) == 5
    for r in rows.values():
        assert r["steps"] == 2 and r["timed_steps"] == 1
        for k in ("median_step_s", "prefill_s", "decode_s", "train_s", "sync_s", "rollout_s", "wall_s", "wall_s_all"):
            assert math.isfinite(r[k]) and r[k] >= 0, (r["config"], k)
        assert r["median_step_s"] > 0 and r["wall_s_all"] >= r["wall_s"]
        for k in ("reward_mean", "reward_last_half", "eval_start", "eval_final"):
            assert math.isfinite(r[k]) and 0 <= r[k] <= 1, (r["config"], k)
        assert math.isfinite(r["mismatch_kl"]) and 0 <= r["is_clip_frac"] <= 1
        assert r["sync_wire_mb"] > 0 and r["sync_dense_mb"] > 0
    base_step = rows["all_off"]["median_step_s"]  # speedup: all_off's median step time over the run's
    assert all(r["speedup"] == pytest.approx(base_step / r["median_step_s"]) for r in rows.values())
    # each technique shows up exactly where it is switched on
    for name, on in bench_e2e.CONFIGS.items():
        r = rows[name]
        assert (r["spec_acceptance"] is not None) == on["spec"], name
        assert (r["decode_density"] is not None) == on["rtpurbo"], name  # compile is off: density is recorded
        if on["rtpurbo"]:
            assert 0 < r["decode_density"] <= 1
    assert rows["sparse_sync_only"]["sync_wire_mb"] <= rows["all_off"]["sync_wire_mb"]
    steps = doc["steps"]
    assert len(steps) == 10 and {s["config"] for s in steps} == set(bench_e2e.CONFIGS)
    assert all(math.isfinite(s["time/step_s"]) and math.isfinite(s["reward/mean"]) for s in steps)
    assert {s["config"] for s in doc["summary"]} == set(bench_e2e.CONFIGS)
    assert 0 < doc["density_probe"]["attention/decode_density"] <= 1
    assert doc["calibration"]["retrieval_heads"]
    import matplotlib

    matplotlib.use("Agg")
    bench_e2e.plot(doc, tmp_path / "e2e.png")
    assert (tmp_path / "e2e.png").stat().st_size > 0


@pytest.mark.slow
def test_e2e_quick_runs_the_long_tailed_task(tmp_path, one_thread):
    """``--task kv_list`` (several keys asked at once, long-tailed responses) through the all-on run."""
    bench_e2e.main(["--quick", "--task", "kv_list", "--configs", "all_on", "--max-asked", "3", "--out", str(tmp_path),
                    "--work-dir", str(tmp_path / "work"), "--context", "auto"])
    doc = json.loads((tmp_path / "e2e.json").read_text())
    assert doc["complete"] is True and doc["failed"] == [] and [r["config"] for r in doc["rows"]] == ["all_on"]
    assert doc["config"]["task"] == "kv_list"
    # --max-asked reaches the task, and max_new defaults to the longest answer it allows (3 x 4 tokens) + <eos>
    assert doc["config"]["recipe_base"]["task"]["max_asked"] == 3 and doc["config"]["max_new"] == 13
    with pytest.raises(SystemExit, match="--max-asked"):
        bench_e2e.main(["--quick", "--max-asked", "3"])  # kv_retrieval asks one key
    assert doc["config"]["context"] in (128, 256)  # the quick model's accuracy table
    assert math.isfinite(doc["rows"][0]["reward_mean"])


def test_handled_context_is_the_longest_context_the_model_solves():
    acc = [{"task": t, "context": c, "accuracy": a} for t, c, a in (
        ("kv_retrieval", 64, 1.0), ("kv_retrieval", 1024, 0.8), ("kv_retrieval", 2048, 0.3),
        ("variable_tracking", 64, 0.4), ("variable_tracking", 1024, 0.1))]
    report = {"accuracy": acc}
    assert bench_e2e.handled_context(report, "kv_retrieval") == 1024
    assert bench_e2e.handled_context(report, "kv_list") == 1024
    assert bench_e2e.handled_context(report, "variable_tracking") == 64  # none reaches 0.5: the shortest
    with pytest.raises(SystemExit, match="--context"):
        bench_e2e.handled_context({"accuracy": []}, "kv_retrieval")
    with pytest.raises(SystemExit):
        bench_e2e.build_parser().parse_args(["--context", "long"])


def _result_with_seed(seed: int) -> dict:
    """The committed end-to-end result, its runs relabelled as ``seed``."""
    doc = json.loads((Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "e2e.json").read_text())
    for r in doc["rows"] + doc["steps"]:
        r["seed"] = seed
    doc["config"]["seeds"] = [seed]
    return doc


def test_merge_joins_seeds_and_refuses_what_does_not_belong_together(tmp_path):
    a, b = _result_with_seed(0), _result_with_seed(1)
    paths = {}
    for name, doc in {"a": a, "b": b}.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(doc))
    out = bench_e2e.main(["--merge", str(paths["a"]), str(paths["b"]), "--out", str(tmp_path / "m")])["out"]
    doc = json.loads(out.read_text())
    assert doc["config"]["seeds"] == [0, 1] and len(doc["rows"]) == 2 * len(a["rows"])
    assert len(doc["steps"]) == 2 * len(a["steps"]) and [s["file"] for s in doc["sources"]] == ["a.json", "b.json"]
    assert doc["environment"] == a["environment"]  # the runs' machine, not the one that merged them
    for r in doc["rows"]:  # each seed against the all_off run of its own process
        base = next(x for x in doc["rows"] if x["seed"] == r["seed"] and x["config"] == "all_off")
        assert r["speedup"] == pytest.approx(base["median_step_s"] / r["median_step_s"])
    assert all(s["seeds"] == 2 for s in doc["summary"])

    def refused(doc: dict, match: str) -> None:
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(doc))
        with pytest.raises(SystemExit, match=match):
            bench_e2e.main(["--merge", str(paths["a"]), str(bad), "--out", str(tmp_path / "x")])
        assert not (tmp_path / "x").exists()  # nothing written

    refused(a, "given twice")
    refused(dict(b, config=dict(b["config"], context=b["config"]["context"] * 2)), "settings differ.*context")
    refused(dict(b, complete=False), "incomplete")
    refused(dict(b, rows=[r for r in b["rows"] if r["config"] != "all_off"]), "no all_off")
    refused(dict(b, environment=dict(b["environment"], device="another GPU")), "device")


def test_steps_that_compile_are_flagged():
    """A step after which the compile or graph counts grew is marked; the first step has nothing to compare."""
    recs = [{"step": 0, "eval/accuracy": 0.5}]
    counts = [(3, 4), (3, 4), (4, 4), (4, 6), (4, 6)]
    for i, (c, g) in enumerate(counts, start=1):
        recs.append({"step": i, "time/step_s": 0.5, "compile/graphs": float(c), "engine/captured_graphs": float(g)})
    steps = bench_e2e.step_records("all_off", 0, recs, warmup=1)
    assert [s["compiled"] for s in steps] == [None, False, True, True, False]
    row = bench_e2e.run_row("all_off", 0, steps, recs, {"setup_s": 1.0, "run_s": 3.0})
    assert row["compiled_timed_steps"] == 2
    bare = bench_e2e.step_records("all_off", 0, [{"step": 1, "time/step_s": 0.5}, {"step": 2, "time/step_s": 0.5}], 1)
    assert [s["compiled"] for s in bare] == [None, None]

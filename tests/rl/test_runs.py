"""Run comparison: per-step rows, per-run medians, speedups against the baseline of the same seed."""

from __future__ import annotations

import pytest

from sparrow.rl.runs import add_speedups, compare, plot_runs, run_line, run_summary, step_rows


def records(step_s: list[float], rollout_s: list[float], graphs: list[int], reward: float = 0.5) -> list[dict]:
    out = [{"step": 0, "eval/accuracy": 0.25}]  # the start-of-run evaluation has no step time
    for i, (s, r, g) in enumerate(zip(step_s, rollout_s, graphs), start=1):
        out.append({"step": i, "time/step_s": s, "time/rollout_s": r, "time/train_s": s - r, "reward/mean": reward,
                    "compile/graphs": g, "sync/wire_bytes": 1e6, "sync/dense_bytes": 4e6})
    out.append({"step": len(step_s), "eval/accuracy": 0.75})
    return out


def test_step_rows_mark_warmup_and_compiling_steps():
    rows = step_rows("all_off", 0, records([5.0, 2.0, 2.0, 3.0], [4.0, 1.0, 1.0, 2.0], [3, 3, 3, 4]), warmup=1)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["timed"] for r in rows] == [False, True, True, True]
    assert [r["compiled"] for r in rows] == [None, False, False, True]  # the graph count grew at step 4
    assert rows[-1]["wall_s"] == pytest.approx(12.0) and rows[-1]["timed_wall_s"] == pytest.approx(7.0)


def test_run_summary_medians_over_timed_steps():
    recs = records([9.0, 2.0, 4.0, 3.0], [8.0, 1.0, 3.0, 2.0], [1, 1, 1, 1])
    row = run_summary("all_off", 0, step_rows("all_off", 0, recs, warmup=1), recs, setup_s=1.5)
    assert row["median_step_s"] == pytest.approx(3.0)  # the warm-up step (9 s) is left out
    assert row["rollout_s"] == pytest.approx(2.0)
    assert (row["eval_start"], row["eval_final"]) == (0.25, 0.75)
    assert row["sync_ratio"] == pytest.approx(4.0) and row["setup_s"] == 1.5
    assert row["compiled_timed_steps"] == 0


def test_speedups_pair_runs_of_one_seed_and_report_the_spread():
    rows, steps = [], []
    for seed, (off, on) in enumerate([(4.0, 2.0), (6.0, 2.0)]):
        for name, t in (("all_off", off), ("all_on", on)):
            recs = records([t] * 3, [t / 2] * 3, [0] * 3)
            for r in recs[1:-1]:
                r["rollout/tokens_per_s"] = (300.0 if name == "all_on" else 100.0) / t  # all_on: 3x the tokens
            st = step_rows(name, seed, recs, warmup=1)
            steps += st
            rows.append(run_summary(name, seed, st))
    rows[1]["fixed_rollout_s"], rows[0]["fixed_rollout_s"] = 1.0, 3.0
    add_speedups(rows)
    assert [r["speedup"] for r in rows] == pytest.approx([1.0, 2.0, 1.0, 3.0])
    assert [r["rollout_speedup"] for r in rows] == pytest.approx([1.0, 2.0, 1.0, 3.0])
    assert rows[1]["fixed_rollout_speedup"] == pytest.approx(3.0) and "fixed_rollout_speedup" not in rows[3]
    assert rows[1]["per_token_rollout_speedup"] == pytest.approx(6.0)  # 2x the rollout speed, 3x the tokens
    summary = {s["config"]: s for s in compare(rows, steps)}
    assert summary["all_on"]["speedup"] == pytest.approx(5.0 / 2.0)  # pooled medians: 5 s (4 and 6) vs 2 s
    assert (summary["all_on"]["speedup_min"], summary["all_on"]["speedup_max"]) == pytest.approx((2.0, 3.0))
    assert summary["all_off"]["rollout_speedup"] == pytest.approx(1.0)


def test_a_seed_without_baseline_gets_no_speedup():
    st = step_rows("all_on", 7, records([2.0, 2.0], [1.0, 1.0], [0, 0]), warmup=0)
    rows = [run_summary("all_on", 7, st)]
    add_speedups(rows)
    assert rows[0]["speedup"] is None and compare(rows, st)[0]["speedup"] is None


def test_plot_runs_writes_a_png(tmp_path):
    steps = step_rows("all_off", 0, records([2.0, 2.0, 2.0], [1.0, 1.0, 1.0], [0, 0, 0]), warmup=1)
    plot_runs(steps, tmp_path / "runs.png", title="t")
    assert (tmp_path / "runs.png").read_bytes()[:4] == b"\x89PNG"


def test_partial_costs():
    from sparrow.rl.runs import partial_costs

    assert partial_costs([{"step": 1}]) == {"stale_token_frac": None, "dropped_groups": 0.0}
    steps = [{"partial/staleness_0": 1.0}, {"partial/staleness_0": 0.5, "partial/dropped_groups": 2.0}]
    assert partial_costs(steps) == {"stale_token_frac": 0.25, "dropped_groups": 2.0}


def test_merge_results_joins_seeds_and_refuses_mismatches():
    from sparrow.rl.runs import merge_results

    def doc(seed, **config):
        rows = [{"config": c, "seed": seed, "median_step_s": s, "rollout_s": s, "rollout_ms_per_token": s} for c, s in (("all_off", 4.0), ("all_on", 2.0 + seed))]
        return {"benchmark": "e2e", "complete": True, "environment": {"device": "x"}, "rows": rows,
                "steps": [{"config": "all_off", "seed": seed}], "config": {"configs": ["all_off", "all_on"],
                                                                        "seeds": [seed], "steps": 4, **config}}

    config, rows, steps = merge_results([doc(0), doc(1)], "e2e")
    assert config["seeds"] == [0, 1] and config["configs"] == ["all_off", "all_on"] and len(steps) == 2
    assert [r["speedup"] for r in rows if r["config"] == "all_on"] == [pytest.approx(2.0), pytest.approx(4 / 3)]
    for bad in ([doc(0), doc(1, steps=8)], [doc(0), doc(0)], [doc(0) | {"complete": False}]):
        with pytest.raises(ValueError):
            merge_results(bad, "e2e")


def test_run_line():
    r = dict(median_step_s=1.23456, prefill_s=0.1, decode_s=0.2, train_s=0.3, sync_s=0.04, reward_mean=0.5,
             eval_start=0.25, eval_final=0.75, run_s=12.34, setup_s=2.0)
    assert run_line(r) == ("median step 1.235 s (prefill 0.100, decode 0.200, train 0.300, sync 0.040), reward "
                           "0.500, eval 0.25 -> 0.75, run 12.3 s (setup 2.0)")
    with pytest.raises(KeyError):
        run_line({k: v for k, v in r.items() if k != "sync_s"})


def test_merge_files_reads_joins_and_keeps(tmp_path):
    import json

    from sparrow.rl.runs import merge_files

    def write(seed, **extra):
        rows = [{"config": c, "seed": seed, "median_step_s": s, "rollout_s": s, "rollout_ms_per_token": s}
                for c, s in (("all_off", 4.0), ("all_on", 2.0))]
        steps = [{"config": c, "seed": seed, "timed": True, "time/step_s": s, "time/rollout_s": s / 2}
                 for c, s in (("all_off", 4.0), ("all_on", 2.0))]
        doc = {"benchmark": "e2e", "complete": True, "environment": {"device": "x", "git_revision": f"r{seed}"},
               "rows": rows, "steps": steps, "seconds": 10.0 + seed, "calibration": {"seed": seed},
               "config": {"configs": ["all_off", "all_on"], "seeds": [seed], "work_dir": f"w{seed}"}, **extra}
        path = tmp_path / f"s{seed}.json"
        path.write_text(json.dumps(doc))
        return path

    paths = [write(0), write(1)]
    config, rows, extra = merge_files(paths, "e2e", free=("configs", "seeds", "work_dir"), keep=("calibration", "x"))
    assert config["seeds"] == [0, 1] and len(rows) == 4 and len(extra["steps"]) == 4
    assert list(extra) == ["summary", "steps", "calibration", "x", "complete", "seconds", "sources"]
    assert extra["calibration"] == {"seed": 0} and extra["x"] is None and extra["complete"] is True
    assert extra["seconds"] == 21.0
    assert extra["sources"] == [{"file": "s0.json", "git_revision": "r0"}, {"file": "s1.json", "git_revision": "r1"}]
    (on,) = [s for s in extra["summary"] if s["config"] == "all_on"]
    assert on["seeds"] == 2 and on["speedup"] == pytest.approx(2.0)
    with pytest.raises(ValueError):  # work_dir differs and is not free
        merge_files(paths, "e2e")
    # a kept key comes from the first document that holds it (an all-off part has no calibration)
    _, _, extra = merge_files([write(2, calibration=None), write(3)], "e2e", free=("configs", "seeds", "work_dir"),
                              keep=("calibration",))
    assert extra["calibration"] == {"seed": 3}

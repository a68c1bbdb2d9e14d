"""``bench_startup.py --merge`` and ``bench_hf_model.py --merge``: launches measured in separate calls joined into
one result, refused when the runs' settings differ or a launch appears twice. One merge goes through the command
line; the refusals run the scripts' ``main`` in this process (a subprocess costs seconds of start-up each)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "bench_startup.py"
SETTINGS = {"config_file": "qwen2_5_0_5b_long_context.yaml", "steps": 3, "overrides": ["prompts_per_step=8"],
            "quick": False}


def _result(path: Path, configs: list[str], device: str, steps: int = 3) -> Path:
    rows = [{"config": c, "cache": cache, "first_step_s": 10.0 + i, "steady_step_s": 1.0, "first_step_time_s": 2.0,
             "target_s": None, **{f"{p}_s": 0.5 for p in ("compile_decode", "compile_draft", "compile_verify",
                                                            "capture", "warmup", "calibrate", "sync_warmup")}}
            for c in configs for i, cache in enumerate(("cold", "warm"))]
    doc = {"benchmark": "startup", "environment": {"device": device, "git_revision": "abc123"},
           "config": SETTINGS | {"steps": steps, "configs": configs}, "rows": rows}
    path.mkdir(parents=True, exist_ok=True)
    (path / "startup.json").write_text(json.dumps(doc))
    return path / "startup.json"


def _merge(*paths: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--merge", *map(str, paths), "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO, timeout=300)


def _main(script: Path, argv: list[str], monkeypatch, capsys) -> tuple[int, str]:
    """``script``'s ``main()`` in this process with ``argv``: its exit status and what it wrote to stderr (a
    ``SystemExit`` message included, as the interpreter would print it)."""
    spec = importlib.util.spec_from_file_location(script.stem, script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(sys, "argv", [str(script), *argv])
    capsys.readouterr()
    try:
        mod.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) or e.code is None else 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    return code or 0, capsys.readouterr().err


def test_merge_joins_the_launches_of_two_calls_and_keeps_each_rows_device(tmp_path):
    a = _result(tmp_path / "a", ["all_off"], "NVIDIA H200")
    b = _result(tmp_path / "b", ["all_on"], "NVIDIA H100 80GB HBM3")
    r = _merge(a, b, out=tmp_path / "out")
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads((tmp_path / "out" / "startup.json").read_text())
    assert [(row["config"], row["cache"]) for row in doc["rows"]] == [
        ("all_off", "cold"), ("all_off", "warm"), ("all_on", "cold"), ("all_on", "warm")]
    assert [row["device"] for row in doc["rows"]] == ["NVIDIA H200"] * 2 + ["NVIDIA H100 80GB HBM3"] * 2
    assert doc["config"]["configs"] == ["all_off", "all_on"]
    assert (tmp_path / "out" / "startup.png").stat().st_size > 0


def test_merge_refuses_other_settings_and_a_launch_twice(tmp_path, monkeypatch, capsys):
    a = _result(tmp_path / "a", ["all_off"], "NVIDIA H200")
    other = _result(tmp_path / "b", ["all_on"], "NVIDIA H200", steps=5)
    def merge(*paths: Path) -> tuple[int, str]:
        return _main(SCRIPT, ["--merge", *map(str, paths), "--out", str(tmp_path / "out")], monkeypatch, capsys)

    code, err = merge(a, other)
    assert code != 0 and "other settings" in err and "steps" in err, err
    twice = _result(tmp_path / "c", ["all_off"], "NVIDIA H200")
    code, err = merge(a, twice)
    assert code != 0 and "all_off (cold)" in err, err
    assert not (tmp_path / "out" / "startup.json").exists()


HF_SCRIPT = REPO / "benchmarks" / "bench_hf_model.py"


def _hf_result(path: Path, config: str, toggle: str = "cost_model") -> Path:
    steps = [{"config": config, "seed": 0, "step": s, "timed": s > 1, "timed_wall_s": 2.0 * (s - 1),
              "time/step_s": 2.0, "time/train_s": 1.5, "reward/mean": 0.5} for s in (1, 2)]
    doc = {"benchmark": "hf_model", "environment": {"device": "NVIDIA H100 80GB HBM3", "git_revision": "abc123"},
           "config": {"steps": 2, "toggle": toggle, "configs": [config], "title": "t"},
           "rows": [{"config": config, "median_step_s": 2.0, "step_records": steps}]}
    path.mkdir(parents=True, exist_ok=True)
    (path / "hf_model.json").write_text(json.dumps(doc))
    return path / "hf_model.json"


def test_hf_model_merge_joins_two_calls_and_refuses_other_settings(tmp_path, monkeypatch, capsys):
    off, on = _hf_result(tmp_path / "a", "all_off"), _hf_result(tmp_path / "b", "all_on")
    code, err = _main(HF_SCRIPT, ["--merge", str(off), str(on), "--out", str(tmp_path / "out")], monkeypatch, capsys)
    assert code == 0, err[-2000:]
    doc = json.loads((tmp_path / "out" / "hf_model.json").read_text())
    assert [row["config"] for row in doc["rows"]] == ["all_off", "all_on"]
    assert doc["config"]["configs"] == ["all_off", "all_on"] and doc["environment"]["device"].startswith("NVIDIA")
    assert (tmp_path / "out" / "hf_model.png").stat().st_size > 0
    other = _hf_result(tmp_path / "c", "all_on", toggle="threshold")
    code, err = _main(HF_SCRIPT, ["--merge", str(off), str(other), "--out", str(tmp_path / "x")], monkeypatch, capsys)
    assert code != 0 and "other settings" in err and "toggle" in err, err
    assert not (tmp_path / "x" / "hf_model.json").exists()


def test_caches_option_refuses_another_order_or_name(tmp_path, monkeypatch, capsys):
    for bad in ("warm,cold", "hot", "cold,cold"):
        code, err = _main(SCRIPT, ["--model", str(tmp_path), "--caches", bad], monkeypatch, capsys)
        assert code == 2 and "--caches" in err, (bad, err[-500:])

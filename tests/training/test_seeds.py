"""Several runs at once, one per seed, the best kept (runs stood in for by tiny scripts that write a report)."""

from __future__ import annotations

import sys

import pytest

from sparrow.training import MODEL_FILE, best_of_seeds, read_report, seed_devices

FAKE = """
import json, pathlib, sys
out, seed, acc = pathlib.Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
if acc < 0: sys.exit(3)
(out / "model.safetensors").write_text(f"weights of seed {seed}")
rows = [{"task": "kv_retrieval", "context": c, "accuracy": acc} for c in (64, 128)]
(out / "report.json").write_text(json.dumps({"format": "sparrow-task-model", "accuracy": rows,
                                             "train": {"config": {"seed": seed}}}))
"""


def test_the_best_seed_is_kept(tmp_path):
    dirs = {s: tmp_path / f"seed_{s}" for s in (3, 4, 5, 6)}
    acc = {3: 0.5, 4: 0.9, 5: 0.85, 6: -1.0}  # seed 6 fails
    cmds = {s: [sys.executable, "-c", FAKE, str(dirs[s]), str(s), str(acc[s])] for s in dirs}
    report = best_of_seeds(cmds, dirs, tmp_path)
    assert report["chosen_seed"] == 4 and report["train"]["config"]["seed"] == 4
    assert (tmp_path / MODEL_FILE).read_text() == "weights of seed 4"
    assert read_report(tmp_path)["chosen_seed"] == 4
    assert [(c["seed"], c["returncode"]) for c in report["candidates"]] == [(3, 0), (4, 0), (5, 0), (6, 3)]
    assert report["candidates"][1]["handled_context"] == 128  # 0.9 >= 0.8 everywhere
    assert all((d / "train.log").exists() for d in dirs.values())


def test_every_seed_failing_is_an_error(tmp_path):
    dirs = {1: tmp_path / "seed_1"}
    with pytest.raises(RuntimeError, match="every seed failed"):
        best_of_seeds({1: [sys.executable, "-c", FAKE, str(dirs[1]), "1", "-1"]}, dirs, tmp_path)


def test_seed_processes_spread_over_the_gpus():
    assert seed_devices(5, "cuda", 2) == ["0", "1", "0", "1", "0"]
    assert seed_devices(3, "cuda", 1) == [None] * 3  # one GPU: all share it
    assert seed_devices(2, "cuda:1", 2) == [None] * 2  # a device named: respected
    assert seed_devices(2, "cpu", 4) == [None] * 2

"""The speculative-rollout benchmark on CPU (its ``--quick`` path): the three policies on a long-tailed batch,
then at each batch size held fixed; the JSON and the plot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_speculative  # noqa: E402


@pytest.mark.slow
def test_speculative_quick_pipeline(tmp_path):
    bench_speculative.main(["--quick", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "speculative_quick.json").read_text())
    runs = [r["run"] for r in result["rows"]]
    assert runs[0] == "AR" and any(r.startswith("SD toggle") for r in runs) and any("always" in r for r in runs)
    sd = [r for r in result["rows"] if r["run"] != "AR"]
    assert all(r["acceptance"] is not None and 0 < r["acceptance"] <= 1 for r in sd if r["spec_cycles"])
    per_batch = result["per_batch"]
    assert [r["batch"] for r in per_batch] == sorted(r["batch"] for r in per_batch) and len(per_batch) >= 2
    for r in per_batch:  # each batch size held fixed, every policy timed against AR
        assert r["prompts"] * r["samples"] == r["batch"]
        assert all(r[f"{name} /AR"] > 0 for name in ("SD toggle+adaptive", "SD always k=3"))
        # timed without compiling: the stop-free params reuse the rollout's compiled mode
        assert all(r[f"{name} compiled"] == 0 for name in ("AR", "SD toggle+adaptive", "SD always k=3"))
    bench_speculative.plot(result, tmp_path / "speculative.png")
    assert (tmp_path / "speculative.png").stat().st_size > 10_000

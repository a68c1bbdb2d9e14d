"""The multi-GPU benchmark's --quick path: two CPU processes (gloo), one trainer and one rollout rank, sparse
and dense sync, the bit check after every sync, the JSON and the plot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_multi_gpu  # noqa: E402


@pytest.mark.slow
def test_multi_gpu_quick(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_multi_gpu.py", "--quick", "--out", str(tmp_path),
                                      "--work-dir", str(tmp_path / "work")])
    bench_multi_gpu.main()
    doc = json.loads((tmp_path / "multi_gpu.json").read_text())
    assert doc["failed"] == [] and {r["codec"] for r in doc["rows"]} == {"auto", "dense"}
    for r in doc["rows"]:
        assert r["returncode"] == 0 and r["steps"] == 3 and r["bitwise_checks_passed"] == 3
        assert r["sync_total_s"] > 0 and r["dense_mb"] > 0 and 0 < r["density"] < 1
    sparse, dense = (next(r for r in doc["rows"] if r["codec"] == c) for c in ("auto", "dense"))
    assert sparse["wire_mb"] < dense["wire_mb"] / 5  # a few percent changed: the sparse payload is far smaller
    assert doc["summary"][0]["payload_ratio"] == pytest.approx(dense["wire_mb"] / sparse["wire_mb"])
    import matplotlib

    matplotlib.use("Agg")
    bench_multi_gpu.plot(doc, tmp_path / "multi_gpu.png")
    assert (tmp_path / "multi_gpu.png").stat().st_size > 1000

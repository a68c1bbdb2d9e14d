"""The decode-attention benchmark on CPU (its ``--quick`` path, under the Triton interpreter): JSON and plot."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_decode_attention  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the quick path pretends a 2-SM device under the Triton "
                    "interpreter; on a GPU the benchmark itself runs")
def test_decode_attention_quick(tmp_path):
    from sparrow.kernels.decode_attention import triton_decode

    bench_decode_attention.main(["--quick", "--out", str(tmp_path), "--iters", "1", "--sweep"])
    assert triton_decode.INTERPRETER_SM_COUNT is None  # the quick run's pretend device does not outlive it
    doc = json.loads((tmp_path / "decode_attention.json").read_text())
    rows = doc["rows"]
    assert {(r["A"], r["T"]) for r in rows} == {(a, t) for a in (1, 3) for t in (1, 3)}
    for r in rows:
        assert r["rel_err_batch_vs_length"] < 1e-4 and r["rel_err_vs_reference"] < 1e-4
        assert 1 <= r["batch_splits"] <= r["length_splits"]
    assert any(r["batch_splits"] < r["length_splits"] for r in rows)  # the quick run exercises the batch cut
    bench_decode_attention.plot(doc, tmp_path / "decode_attention.png")
    assert (tmp_path / "decode_attention.png").stat().st_size > 10_000
    for r in doc["sweep"]:  # every power of two up to the length bound timed, and the chosen count
        cap = next(x["length_splits"] for x in rows if (x["A"], x["T"]) == (r["A"], r["T"]))
        timed = sorted(int(k[:-3]) for k in r if k.endswith("_ms"))
        assert timed == sorted({2 ** i for i in range(cap.bit_length()) if 2 ** i <= cap} | {r["chosen"], cap})

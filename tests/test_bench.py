"""The benchmark harness (``sparrow.bench``): timing, tables, paths scrubbed from results, argument rows, plots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparrow import bench


def test_quantiles_and_measure():
    q = bench.quantiles([5.0, 1.0, 3.0, 2.0, 4.0])
    assert q == {"median_ms": 3.0, "p20_ms": 2.0, "p80_ms": 4.0, "n": 5}
    calls = []
    t = bench.measure(lambda: calls.append(1), warmup=2, iters=4, setup=lambda: calls.append(0))
    assert t["n"] == 4 and calls == [0, 1] * 6 and t["p20_ms"] <= t["median_ms"] <= t["p80_ms"]


def test_scrub_paths_leaves_no_machine_path():
    doc = {"a": str(bench.REPO / "recipes" / "x.yaml"), "b": ["/usr/lib/python3/site-packages/torch/x.py"],
           "c": Path("/tmp/run_42/out"), "d": "tokens/s at https://example.org/a/b", "e": 3}
    assert bench.scrub_paths(doc) == {"a": "recipes/x.yaml", "b": ["site-packages/torch/x.py"], "c": "out",
                                      "d": "tokens/s at https://example.org/a/b", "e": 3}


def test_write_json_round_trip(tmp_path):
    path = bench.write_json("demo", {"where": str(tmp_path / "w")}, [{"x": 1}], out_dir=tmp_path, extra={"k": 2})
    doc = bench.load_json(path)
    assert path == tmp_path / "demo.json" and doc["benchmark"] == "demo" and doc["rows"] == [{"x": 1}]
    assert doc["k"] == 2 and doc["config"] == {"where": "w"} and {"torch", "device"} <= set(doc["environment"])
    assert not list(tmp_path.glob("*.tmp"))


def test_the_library_helpers_it_re_exports():
    """What the library measures and draws with lives in the library; the harness hands out the same objects."""
    from sparrow import _checkout, _device, _numerics, _report

    for module, names in ((_device, ("synchronize", "free_memory", "quantiles", "measure")), (_numerics, ("rel_err",)),
                          (_report, ("format_table", "subplots", "save_figure")), (_checkout, ("REPO",))):
        for name in names:
            assert getattr(bench, name) is getattr(module, name), name


def test_density_arg(tmp_path):
    assert bench.density_arg(None, "k") == [] and bench.density_arg("0.5,0.25", "k") == [0.5, 0.25]
    f = tmp_path / "acc.json"
    f.write_text(json.dumps({"summary": [{"context": 8, "k": 0.4}, {"context": 16, "k": 0.2}, {"context": 16, "k": 0.3}]}))
    assert bench.density_arg(str(f), "k") == [0.3]  # the largest at the longest context
    with pytest.raises(SystemExit):
        bench.density_arg(str(f), "missing")


def test_base_parser_rows():
    p = bench.base_parser("q", [("--n", int, 3, None), ("--mode", ["a", "b"], "a", None),
                                ("--model", dict(type=Path, required=True))])
    args = p.parse_args(["--model", "m", "--n", "5", "--quick"])
    assert (args.n, args.mode, args.model, args.quick, args.out) == (5, "a", Path("m"), True, None)
    with pytest.raises(SystemExit):
        p.parse_args(["--model", "m", "--mode", "c"])


def test_format_table_and_pick():
    rows = [{"a": 1, "b": 0.123456}, {"a": 22}]
    assert bench.format_table(rows, ["a", "b"]).splitlines() == [" a       b", " 1  0.1235", "22    None"]
    assert bench.pick(rows, "a", a=5) is None
    assert bench.pick(rows, "b", 0.0, a=22) == 0.0 and bench.pick(rows, "a", a=22) == 22


def test_rel_err_and_device():
    x = torch.tensor([3.0, 4.0])
    assert bench.rel_err(x, x) == 0.0 and bench.rel_err(torch.zeros(2), x) == pytest.approx(1.0)
    dev, dtype = bench.device_dtype()
    assert (dev.type, dtype) == (("cuda", torch.bfloat16) if torch.cuda.is_available() else ("cpu", torch.float32))


def test_plot_series_and_bar_groups(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [{"n": 2, "x": 4, "y": 1.0}, {"n": 1, "x": 2, "y": 3.0}, {"n": 1, "x": 1, "y": 2.0}, {"n": 2, "x": 1, "y": None}]
    fig, (a, b) = plt.subplots(1, 2)
    lines = bench.plot_series(a, rows, "x", "y", "n", label="{} rows")
    assert [ln.get_label() for ln in lines] == ["1 rows", "2 rows"]
    assert list(lines[0].get_xdata()) == [1, 2] and list(lines[1].get_ydata()) == [1.0]  # sorted, None left out
    assert len(bench.plot_series(a, rows, "x", lambda r: r["x"] * 2)) == 1  # no grouping: one line
    bench.bar_groups(b, ["p", "q"], {"s": [1, 2], "t": [3, 4]}, width=0.5)
    assert [round(r.get_x() + r.get_width() / 2, 3) for r in b.patches] == [-0.125, 0.875, 0.125, 1.125]
    bench.save_figure(fig, tmp_path / "f.png", title="t")
    assert (tmp_path / "f.png").stat().st_size > 0


def test_plot_series_error_bars_and_stacked_bars():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [{"x": 2, "y": 0.5, "se": 0.1}, {"x": 1, "y": 0.25, "se": 0.2}, {"x": 3, "y": None, "se": 9.0}]
    fig, (a, b) = plt.subplots(1, 2)
    (line,) = bench.plot_series(a, rows, "x", "y", yerr="se", label="acc", capsize=3)
    assert list(line.get_xdata()) == [1, 2] and list(line.get_ydata()) == [0.25, 0.5]
    (bars,) = [c for c in a.containers if hasattr(c, "has_yerr")]
    assert bars.get_label() == "acc" and bars.lines[0] is line
    segs = bars.lines[2][0].get_segments()  # the vertical bars, in x order: y -/+ se
    assert [(round(s[0][1], 6), round(s[1][1], 6)) for s in segs] == [(0.05, 0.45), (0.4, 0.6)]
    with pytest.raises(KeyError):
        bench.plot_series(a, [{"x": 1, "y": 1.0}], "x", "y", yerr="se")

    tops = bench.stacked_bars(b, ["p", "q"], {"u": [1.0, 2.0], "v": [3.0, 0.5]}, colors=["r", "g"])
    assert tops == [4.0, 2.5]
    assert [(r.get_y(), r.get_height()) for r in b.patches] == [(0, 1), (0, 2), (1, 3), (2, 0.5)]
    assert bench.stacked_bars(b, ["p", "q"], {"w": [1.0, 1.0]}, bottom=tops) == [5.0, 3.5]
    assert [t.get_text() for t in b.get_xticklabels()] == ["p", "q"]
    with pytest.raises(ValueError):
        bench.stacked_bars(b, ["p", "q"], {"u": [1.0]})
    plt.close(fig)


def test_kernel_times_groups_by_name():
    """CPU operators without CUDA (``aten::mm``); with it, the GEMM kernels (names vary with cuBLAS): at least one
    kernel per product, the per-run figures divided by ``runs``."""
    cuda = torch.cuda.is_available()
    x = torch.randn(64, 64, device="cuda" if cuda else "cpu")
    out = bench.kernel_times(lambda: [x @ x for _ in range(6)], runs=2)
    names = {k["name"] for k in out["kernels"]}
    assert out["kernel_us_per_step"] > 0
    assert out["calls_per_step"] >= sum(k["calls"] for k in out["kernels"]) >= 3  # 6 products over 2 runs
    if not cuda:
        assert any("mm" in n for n in names)
        assert next(k["calls"] for k in out["kernels"] if "mm" in k["name"]) == 3


def test_step_shares_sort_kernels_by_kind_and_sum_to_the_step():
    """Names from an H200 decode step land in their kinds; kernels past the named ``top`` count as "other kernels",
    the wall time no kernel covers as idle, and the shares sum to the step. Negative control: a step whose kernels
    take longer than its wall time (overlap) gets no negative idle time."""
    step = {"step_ms": 1.0, "kernel_us_per_step": 900.0, "kernels": [
        {"name": "nvjet_sm90_tst_128x8_64x12_4x1_v_bz_TNT", "us": 300.0, "calls": 24},
        {"name": "void cublasLt::splitKreduce_kernel<32, 16, int, float>", "us": 40.0, "calls": 24},
        {"name": "_cascade_kernel", "us": 200.0, "calls": 24},
        {"name": "triton_red_fused___rshift____log_softmax__to_copy_add_arange_argmax", "us": 90.0, "calls": 1},
        {"name": "triton_poi_fused__unsafe_view_mul_silu_split_8", "us": 70.0, "calls": 24},
        {"name": "Memcpy DtoD (Device -> Device)", "us": 100.0, "calls": 2}]}
    us = bench.step_shares(step)
    assert list(us) == list(bench.KERNEL_KINDS)
    assert us == {"matmul": 340.0, "attention": 200.0, "sampling": 90.0, "other Inductor kernels": 70.0,
                  "other kernels": 100.0 + 100.0, "idle (launch gaps)": 100.0}
    assert sum(us.values()) == pytest.approx(1000.0)
    assert bench.kernel_kind("aten::mm") == "other kernels"  # a CPU operator: no CUDA kind
    assert bench.step_shares(dict(step, step_ms=0.5))["idle (launch gaps)"] == 0.0


def test_first_working_tries_variants_in_order(capsys):
    tried = []

    def build(v):
        tried.append(v)
        if v < 3:
            raise ValueError(f"variant {v}")
        return v * 10

    assert bench.first_working([1, 2, 3, 4], build, "drafter") == (3, 30)
    assert tried == [1, 2, 3] and "ValueError: variant 2" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="no drafter worked"):
        bench.first_working([1, 2], build, "drafter")


def test_triton_interpreter_only_when_asked(monkeypatch):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import os, sys, sparrow.bench; print(os.environ.get('TRITON_INTERPRET'), 'triton' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split()[-2:] == ["None", "False"]  # importing the harness leaves the environment alone, and Triton
    # unimported: a script imports the harness, then points Triton at its interpreter
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    bench.triton_interpreter_without_cuda()
    assert os.environ["TRITON_INTERPRET"] == "1"


def test_fill_defaults_keeps_given_options():
    p = bench.base_parser("q", [("--n", int, None, None), ("--lr", float, None, None), ("--name", str, "x", None)])
    args = bench.fill_defaults(p.parse_args(["--n", "7"]), False, n=(1, 2), lr=(1e-3, 1e-5), name=("q", "f"))
    assert (args.n, args.lr, args.name) == (7, 1e-5, "x")  # given / filled with the full value / not None: kept
    quick = bench.fill_defaults(p.parse_args(["--quick"]), True, n=(1, 2), lr=(1e-3, 1e-5))
    assert (quick.n, quick.lr) == (1, 1e-3)
    with pytest.raises(AttributeError):
        bench.fill_defaults(p.parse_args([]), False, steps=(1, 2))


def test_keyword_args_passes_a_function_its_options():
    def configure(model, *, steps: int = 1, lr: float = 0.1, name: str = "a"):
        return steps, lr, name

    args = bench.base_parser("q", [("--steps", int, 5, None), ("--lr", float, 0.5, None), ("--model", str, "m", None)]
                             ).parse_args([])
    kw = bench.keyword_args(configure, args, name="b")
    assert kw == {"steps": 5, "lr": 0.5, "name": "b"}  # --model is positional there: not passed; over added
    assert bench.keyword_args(configure, args, lr=0.01)["lr"] == 0.01  # over wins
    assert configure(args.model, **kw) == (5, 0.5, "b")


def test_option_types(monkeypatch):
    import argparse

    assert bench.int_or_auto("auto") == "auto" and bench.int_or_auto("4096") == 4096
    with pytest.raises(argparse.ArgumentTypeError, match="'4k'"):
        bench.int_or_auto("4k")
    p = bench.base_parser("q", [("--context", bench.int_or_auto, None, None), ("--device", bench.device_arg, "auto",
                                                                              None)])
    with pytest.raises(SystemExit):
        p.parse_args(["--context", "many"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert p.parse_args([]).device == "cpu" and p.parse_args(["--device", "cuda:1"]).device == "cuda:1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert p.parse_args([]).device == "cuda"  # the string default goes through the type too


def test_out_or_temp(tmp_path):
    assert bench.out_or_temp(tmp_path, "x_") == tmp_path and bench.out_or_temp(None, "x_", temporary=False) is None
    made = bench.out_or_temp(None, "benchtest_")
    try:
        assert made.is_dir() and made.name.startswith("benchtest_") and not any(made.iterdir())
        assert bench.out_or_temp(None, "benchtest_") != made  # a new one each time
    finally:
        for d in Path(made).parent.glob("benchtest_*"):
            d.rmdir()


def test_subplots_and_free_memory(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    fig, axes = bench.subplots(1, 2, figsize=(4, 2), squeeze=False)
    assert axes.shape == (1, 2) and fig.get_size_inches().tolist() == [4.0, 2.0]
    bench.save_figure(fig, tmp_path / "f.png", "t")
    assert (tmp_path / "f.png").stat().st_size > 0
    bench.free_memory()  # nothing to free: returns


def test_planted_and_measured(tmp_path):
    assert bench.planted_and_measured([0.1, 0.2], None, "k") == [(0.1, "planted"), (0.2, "planted")]
    assert bench.planted_and_measured([0.1], "0.5,0.6", "k") == [(0.1, "planted"), (0.5, "measured"),
                                                                 (0.6, "measured")]
    f = tmp_path / "acc.json"
    f.write_text(json.dumps({"k": 0.7}))
    assert bench.planted_and_measured([], str(f), "k") == [(0.7, "measured")]


def test_decode_split_table_compares_counts_of_the_same_case_only():
    """``bench_rtpurbo_decode.py --ret-splits``: per (L, B, density), the fused one-retrieval-head time at the
    kernel's own split count beside each fixed count, and the best of those; rows of another case never mix in."""
    import importlib.util

    path = bench.REPO / "benchmarks" / "bench_rtpurbo_decode.py"
    spec = importlib.util.spec_from_file_location("bench_rtpurbo_decode", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def row(config, density, ms, **kw):
        return dict(L=1024, B=1, config=config, pipeline="fused", n_ret=1, density=density, density_source="planted",
                    ret_density=density, eager_ms=2 * ms, graph_ms=ms, **kw)

    rows = [row("rtpurbo", 0.1, 5.0), row("rtpurbo_splits", 0.1, 4.0, ret_splits=64),
            row("rtpurbo_splits", 0.1, 3.0, ret_splits=128), row("rtpurbo", 0.7, 9.0),
            row("rtpurbo_splits", 0.7, 1.0, ret_splits=256),  # the fastest row: must not win the 0.1 case
            row("rtpurbo_splits", 0.7, 8.0, ret_splits=64), dict(row("rtpurbo", 0.1, 0.5), n_ret=0)]
    table = mod.split_table(rows)
    assert table == [dict(L=1024, B=1, density=0.1, heuristic_ms=5.0, s64_ms=4.0, s128_ms=3.0, best_splits=128,
                          best_ms=3.0),
                     dict(L=1024, B=1, density=0.7, heuristic_ms=9.0, s256_ms=1.0, s64_ms=8.0, best_splits=256,
                          best_ms=1.0)]
    assert mod.split_table([r for r in rows if r["config"] == "rtpurbo"]) == []  # no sweep: no table

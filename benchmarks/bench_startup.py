"""Time to the first GRPO step: the shipped recipe launched all off and all on, with a cold and a warm compile cache.

Question: how long does ``tune run sparrow_grpo`` take from launch to its first finished step, where does that time
go (compilation per kind of step, CUDA-graph capture, the cost model's calibration), how much does the compile cache
save on a second launch of the same configuration, and does the faster start cost anything per step?

Per configuration, two launches of the real command line sharing one ``engine.compile_cache`` directory: ``cold``
(the directory is empty) and ``warm`` (the same directory again). ``all_off``: dense attention, no speculation, the
dense sync codec. ``all_on``: RTPurbo attention from a ``sparrow calibrate`` of the model (done once, before, not
timed in the launches), an int8 self-drafter with the cost-model toggle over draft lengths 2, 4, 8, and the sparse
sync codec. Every launch gets empty Inductor and Triton cache directories of its own, so nothing but Sparrow's
compile cache carries over. ``first_step_s``: from the launch to the moment the first step's record appears in the
run's metric log (polled); the ``setup/*`` phases come from that record; ``steady_step_s`` is the median step time
after the first.

Usage (GPU): ``python benchmarks/bench_startup.py --model DIR`` (a Qwen2.5-0.5B-shaped Hugging Face directory) ->
``docs/benchmarks/startup.json``. CPU smoke run: ``--quick`` with ``--model`` a tiny directory and ``--set`` the
overrides of a CPU run (device, precision, sizes); its JSON goes to a temporary folder unless ``--out`` is given.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from runner import REPO, base_parser, log, print_table, save_figure, write_json  # noqa: E402

CONFIG = REPO / "recipes" / "configs" / "qwen2_5_0_5b_long_context.yaml"
PHASES = ["compile_decode", "compile_draft", "compile_verify", "capture", "warmup", "calibrate", "sync_warmup"]
TARGETS = {("all_on", "cold"): 60.0, ("all_on", "warm"): 15.0, ("all_off", "cold"): 30.0}  # seconds (DESIGN.md)


def overrides(name: str, calibration: Path | None) -> list[str]:
    if name == "all_off":
        return ["attention._component_=sparrow.attention.dense", "sync.codec=dense", "speculative=null"]
    spec = {"drafter": {"_component_": "sparrow.speculative.DrafterConfig", "weight": "int8"},
            "toggle": {"_component_": "sparrow.speculative.cost_model", "draft_lengths": [2, 4, 8]}}
    return ["attention._component_=sparrow.attention.rtpurbo", f"attention.path={calibration}", "sync.codec=auto",
            "speculative=" + json.dumps(spec).replace('"', "")]


def launch(args, name: str, cache: str, work: Path, calibration: Path | None) -> dict[str, Any]:
    """One launch of the recipe; returns its row."""
    out = work / f"{name}_{cache}"
    cmd = [sys.executable, "-m", "torchtune._cli.tune", "run", "sparrow_grpo", "--config", str(args.config),
           f"model_dir={args.model}", f"output_dir={out}", f"total_steps={args.steps}", "eval.every=0",
           "checkpoint_every=0", "plot=false", "metric_logger._component_=sparrow.rl.JsonlLogger",
           f"metric_logger.log_dir={out / 'logs'}", f"engine.compile_cache={work / (name + '_compile_cache')}",
           *overrides(name, calibration), *args.set]
    scratch = Path(tempfile.mkdtemp(prefix="startup_", dir=work))  # nothing cached outside the compile cache
    env = dict(_env(), TORCHINDUCTOR_CACHE_DIR=str(scratch / "inductor"), TRITON_CACHE_DIR=str(scratch / "triton"))
    log(f"{name} ({cache}): $ tune {shlex.join(cmd[3:])}")
    metrics, first = out / "logs" / "metrics.jsonl", None
    with open(work / f"{name}_{cache}.log", "w") as out_log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out_log, stderr=subprocess.STDOUT, env=env)
        while proc.poll() is None:
            if first is None and metrics.is_file() and '"time/step_s"' in metrics.read_text():
                first = time.perf_counter() - t0
            time.sleep(0.05)
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        print((work / f"{name}_{cache}.log").read_text()[-4000:], file=sys.stderr)
        raise SystemExit(f"{name} ({cache}): the recipe failed (exit {proc.returncode})")
    steps = [json.loads(line) for line in metrics.read_text().splitlines() if '"time/step_s"' in line]
    rec = steps[0]
    row: dict[str, Any] = {"config": name, "cache": cache, "first_step_s": first if first is not None else wall,
                           "steady_step_s": statistics.median(s["time/step_s"] for s in steps[1:] or steps),
                           "first_step_time_s": rec["time/step_s"], "wall_s": wall, "steps_run": len(steps),
                           "compiled_after_setup": steps[-1]["compile/graphs"] - rec["compile/graphs"],
                           "command": "tune " + shlex.join(cmd[3:])}
    row.update({f"{p}_s": rec.get(f"setup/{p}_s", 0.0) for p in PHASES})
    row.update({k[len("setup/"):]: v for k, v in rec.items() if k.startswith("setup/") and not k.endswith("_s")})
    row["rollout_setup_s"] = rec.get("setup/rollout_s")
    row["target_s"] = TARGETS.get((name, cache))
    return row


def _env() -> dict[str, str]:
    """The launches' environment: the recipe and the library importable whether or not they are installed."""
    path = os.pathsep.join([str(REPO / "recipes"), str(REPO / "src"), os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path)


def calibrate(args, work: Path) -> tuple[Path, float]:
    out = work / "rtpurbo"
    cmd = [sys.executable, "-m", "sparrow.cli", "calibrate", "--checkpoint", str(args.model), "--out",
           str(out), "--seq-len", str(args.calib_seq_len), "--steps", str(args.calib_steps), "--no-progress"]
    log(f"$ {shlex.join(cmd)}")
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=_env())
    if r.returncode != 0:
        print(r.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"sparrow calibrate failed (exit {r.returncode})")
    return out, time.perf_counter() - t0


def plot(doc: dict[str, Any], png: Path) -> None:
    import matplotlib.pyplot as plt

    rows = doc["rows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    for i, r in enumerate(rows):
        bottom = 0.0
        for j, p in enumerate(PHASES):
            a.bar(i, r[f"{p}_s"], bottom=bottom, color=f"C{j}", label=p if i == 0 else None)
            bottom += r[f"{p}_s"]
        a.bar(i, r["first_step_time_s"], bottom=bottom, color="0.45", label="first step" if i == 0 else None)
        bottom += r["first_step_time_s"]
        a.bar(i, max(0.0, r["first_step_s"] - bottom), bottom=bottom, color="0.8",
              label="other (start, load, trainer)" if i == 0 else None)
        if r.get("target_s"):
            a.plot([i - 0.4, i + 0.4], [r["target_s"]] * 2, "k--", lw=1, label="target" if i == 0 else None)
    a.set_xticks(range(len(rows)), [f"{r['config']}\n{r['cache']}" for r in rows])
    a.set(ylabel="seconds from launch to the first finished step", title="time to the first step, by phase")
    a.legend(fontsize=7)
    names = sorted({r["config"] for r in rows})
    for k, cache in enumerate(("cold", "warm")):
        vals = [next((r["steady_step_s"] for r in rows if r["config"] == n and r["cache"] == cache), 0.0) for n in names]
        b.bar([x + 0.4 * k for x in range(len(names))], vals, width=0.4, label=cache)
    b.set_xticks([x + 0.2 for x in range(len(names))], names)
    b.set(ylabel="median seconds per step after the first", title="steady-state step")
    b.legend(fontsize=8)
    save_figure(fig, png, title=f"start-up of the shipped recipe ({doc['environment'].get('device')})")


def main() -> None:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="a Hugging Face model directory")
    p.add_argument("--config", type=Path, default=CONFIG)
    p.add_argument("--configs", default="all_off,all_on")
    p.add_argument("--steps", type=int, default=4, help="GRPO steps per launch (the first one is the timed start)")
    p.add_argument("--calibration", type=Path, default=None, help="an existing sparrow calibrate output")
    p.add_argument("--calib-seq-len", type=int, default=4096)
    p.add_argument("--calib-steps", type=int, default=200)
    p.add_argument("--set", nargs="*", default=[], help="recipe overrides for every launch (key=value)")
    args = p.parse_args()
    if args.quick:
        args.steps, args.calib_seq_len, args.calib_steps = 2, 256, 5
        args.out = args.out or Path(tempfile.mkdtemp(prefix="startup_quick_"))  # never the committed results
    names = args.configs.split(",")
    config = {"model": json.loads((args.model / "config.json").read_text()), "config_file": args.config.name,
              "configs": names, "steps": args.steps, "overrides": args.set, "quick": args.quick}
    rows, extra = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        calibration = args.calibration
        if "all_on" in names and calibration is None:
            calibration, extra["rtpurbo_calibrate_s"] = calibrate(args, work)
        for name in names:
            for cache in ("cold", "warm"):
                rows.append(launch(args, name, cache, work, calibration))
                path = write_json("startup", config, rows, out_dir=args.out, extra=extra)  # after every launch
    plot(json.loads(path.read_text()), path.with_suffix(".png"))
    print_table(rows, ["config", "cache", "first_step_s", "target_s", *(f"{p}_s" for p in PHASES), "steady_step_s",
                       "compiled_after_setup"])


if __name__ == "__main__":
    main()

"""A user's Hugging Face model directory through the shipped recipe, all off and all on.

Question: does ``tune run sparrow_grpo`` work on a real checkpoint layout (config.json, safetensors, a
byte-level BPE tokenizer whose vocabulary is smaller than the embedding), and what does a step cost per phase
at the real shape, with the three techniques off and on?

Runs, each the real command line in its own process, as a user types it:

* ``all_off``: ``tune run sparrow_grpo --config <--config> model_dir=<--model>`` with dense attention, no
  speculation, the dense sync codec;
* ``all_on``: first ``sparrow calibrate --checkpoint <--model>`` (retrieval heads and indexer, timed), then the
  same recipe with RTPurbo attention from that calibration, speculative decoding (an int8 self-drafter,
  ``--toggle``) and the sparse sync codec (``auto``).

Both take the overrides of ``--set`` (e.g. fewer prompts per step) and log through
:class:`sparrow.rl.JsonlLogger`. Reported per run: every step's metrics (phase times ``time/*``, reward,
mismatch, sync bytes, acceptance, compile counts), the process's wall clock and its setup (wall clock minus
the steps: start, loading, compiling and capturing, calibration of the cost model), and the run's summary
(:func:`sparrow.rl.runs.run_summary`: medians over the steps after the first). With random weights the rewards mean nothing: this shows the path works and
what the phases cost at the shape.

Usage (GPU): ``python benchmarks/bench_hf_model.py --model DIR --steps 10 --set prompts_per_step=8``.
CPU smoke run on a tiny directory: ``--quick`` (2 steps; the caller gives ``--model``, e.g. a tiny Qwen2.5
directory, and ``--config`` a CPU config).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from runner import REPO, base_parser, print_table, write_json  # noqa: E402

from sparrow.rl import read_metrics  # noqa: E402
from sparrow.rl.runs import mean, plot_runs, run_summary, step_rows  # noqa: E402

CONFIG = REPO / "recipes" / "configs" / "qwen2_5_0_5b_long_context.yaml"


def run_overrides(name: str, calibration: Path | None, toggle: str) -> list[str]:
    if name == "all_off":
        return ["attention._component_=sparrow.attention.dense", "sync.codec=dense"]
    # no draft window: a windowed drafter needs dense caches, and RTPurbo's local heads are windowed already
    settings = {"always_on": {"num_draft": 4}, "threshold": {"max_active": 64, "num_draft": 4},
                "cost_model": {"draft_lengths": [2, 4]}}[toggle]
    spec = {"drafter": {"_component_": "sparrow.speculative.DrafterConfig", "weight": "int8"},
            "toggle": {"_component_": f"sparrow.speculative.{toggle}", **settings}}
    return ["attention._component_=sparrow.attention.rtpurbo", f"attention.path={calibration}",
            "sync.codec=auto", "speculative=" + json.dumps(spec).replace('"', "")]


def tune_run(args, name: str, work: Path, calibration: Path | None) -> dict[str, Any]:
    out = work / name
    cmd = [str(Path(sys.executable).parent / "tune"), "run", "sparrow_grpo", "--config", str(args.config),
           f"model_dir={args.model}", f"output_dir={out}", f"total_steps={args.steps}", "eval.every=0",
           "checkpoint_every=0", "plot=false", "metric_logger._component_=sparrow.rl.JsonlLogger",
           f"metric_logger.log_dir={out / 'logs'}", *run_overrides(name, calibration, args.toggle), *args.set]
    print("$", shlex.join(cmd), flush=True)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    wall = time.perf_counter() - t0
    (work / f"{name}.log").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        print(r.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"{name}: the recipe failed (exit {r.returncode})")
    steps = step_rows(name, 0, read_metrics(out / "logs"), warmup=1)  # the first step pays every first touch
    row = run_summary(name, 0, steps, command=shlex.join(cmd[1:]), process_s=wall,
                      setup_s=wall - sum(s["time/step_s"] for s in steps),
                      compiled_after_setup=steps[-1].get("compile/graphs", 0) - steps[0].get("compile/graphs", 0),
                      outside_support_frac=mean(s.get("outside_support_frac") for s in steps))
    return row | {"step_records": steps}


def calibrate(args, work: Path) -> tuple[Path, float]:
    out = work / "rtpurbo"
    cmd = [str(Path(sys.executable).parent / "sparrow"), "calibrate", "--checkpoint", str(args.model),
           "--out", str(out), "--seq-len", str(args.calib_seq_len), "--steps", str(args.calib_steps), "--no-progress"]
    print("$", shlex.join(cmd), flush=True)
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    (work / "calibrate.log").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        print(r.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"sparrow calibrate failed (exit {r.returncode})")
    return out, time.perf_counter() - t0


def plot(doc: dict[str, Any], png: Path) -> None:
    plot_runs([s for r in doc["rows"] for s in r["step_records"]], png, title=doc["config"].get("title", ""))


def main() -> None:
    p = base_parser(__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="a Hugging Face model directory")
    p.add_argument("--config", type=Path, default=CONFIG)
    p.add_argument("--configs", default="all_off,all_on")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--toggle", default="threshold", choices=["always_on", "threshold", "cost_model"])
    p.add_argument("--calibration", type=Path, default=None, help="an existing sparrow calibrate output")
    p.add_argument("--calib-seq-len", type=int, default=4096)
    p.add_argument("--calib-steps", type=int, default=200)
    p.add_argument("--set", nargs="*", default=[], help="recipe overrides for every run (key=value)")
    p.add_argument("--name", default="hf_model")
    args = p.parse_args()
    if args.quick:
        args.steps, args.calib_seq_len, args.calib_steps = 2, 256, 5
    names = args.configs.split(",")
    config = {"model": json.loads((args.model / "config.json").read_text()), "steps": args.steps,
              "overrides": args.set, "toggle": args.toggle, "calib_seq_len": args.calib_seq_len,
              "calib_steps": args.calib_steps, "title": f"{args.name}: the shipped recipe on a Hugging Face directory"}
    rows, extra = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        calibration = args.calibration
        for name in names:
            if name == "all_on" and calibration is None:
                calibration, extra["calibrate_s"] = calibrate(args, work)
            rows.append(tune_run(args, name, work, calibration))
            path = write_json(args.name, config, rows, out_dir=args.out, extra=extra)  # after every run
            plot(json.loads(path.read_text()), path.with_suffix(".png"))
    print_table(rows, ["config", "steps", "process_s", "setup_s", "median_step_s", "rollout_s", "prefill_s",
                       "decode_s", "logprob_s", "train_s", "sync_s", "compiled_after_setup"])


if __name__ == "__main__":
    main()

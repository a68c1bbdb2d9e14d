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

Usage (GPU): ``python benchmarks/bench_hf_model.py --model DIR --steps 10 --set prompts_per_step=8`` (with
``--compile-cache WORK``, a ``bench_startup.py --work`` folder, the launches start from the compiled steps there:
the step times are the same, the setup is a warm one).
Where one call cannot hold both configurations: ``--configs all_off`` and ``--configs all_on`` in two calls
(``--out A``, ``--out B``), then ``--merge A/hf_model.json B/hf_model.json``.
CPU smoke run on a tiny directory: ``--quick`` (2 steps; the caller gives ``--model``, e.g. a tiny Qwen2.5
directory, and ``--config`` a CPU config).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from sparrow.bench import (REPO, base_parser, merge_results, print_table, result_devices,
                           triton_interpreter_without_cuda, write_json)

triton_interpreter_without_cuda()  # the CPU smoke runs: Triton through its interpreter, before it is imported

from sparrow.rl.launch import (TOGGLES, calibrate, launch_options, launch_recipe, log_overrides, require_model,
                               technique_overrides)
from sparrow.rl.runs import mean, plot_runs, run_summary, step_rows

CONFIG = REPO / "recipes" / "configs" / "qwen2_5_0_5b_long_context.yaml"
DRAFT_LENGTHS = {"always_on": (4,), "threshold": (4,), "cost_model": (2, 4, 8)}  # cost_model: the shipped config's


def tune_run(args, name: str, work: Path, calibration: Path | None) -> dict[str, Any]:
    out = work / name
    cache = [f"engine.compile_cache={args.compile_cache / (name + '_compile_cache')}"] if args.compile_cache else []
    run = launch_recipe(args.config, [f"model_dir={args.model}", *log_overrides(out, args.steps), *cache,
                                      *technique_overrides(name, calibration, toggle=args.toggle,
                                                           lengths=DRAFT_LENGTHS[args.toggle]), *args.set], out=out)
    print("$", run.command, flush=True)
    steps = step_rows(name, 0, run.records, warmup=1)  # the first step pays every first touch
    row = run_summary(name, 0, steps, command=run.command[len("tune "):], process_s=run.wall_s,
                      setup_s=run.wall_s - sum(s["time/step_s"] for s in steps),
                      compiled_after_setup=steps[-1].get("compile/graphs", 0) - steps[0].get("compile/graphs", 0),
                      outside_support_frac=mean(s.get("outside_support_frac") for s in steps))
    return row | {"step_records": steps}


def plot(doc: dict[str, Any], png: Path) -> None:
    plot_runs([s for r in doc["rows"] for s in r["step_records"]], png,
              title=f"{doc['config'].get('title', '')} ({result_devices(doc)})")


def main() -> None:
    p = base_parser(__doc__.split("\n\n")[0], launch_options(CONFIG, 10) + [
        ("--toggle", list(TOGGLES), "cost_model", None), ("--name", str, "hf_model", None),
        ("--compile-cache", dict(type=Path, default=None, help="a bench_startup.py --work folder: each configuration "
                                                               "starts from the compile cache its launches left there "
                                                               "(default: the run's own, empty)"))])
    args = p.parse_args()
    if args.merge:
        out = merge_results(args.name, args.merge, identity=("config",), parts={"configs": "config"}, out_dir=args.out)
        plot(json.loads(out.read_text()), out.with_suffix(".png"))
        print(out)
        return
    require_model(p, args)
    if args.quick:
        args.steps, args.calib_seq_len, args.calib_steps = 2, 256, 5
    names = args.configs.split(",")
    config = {"model": json.loads((args.model / "config.json").read_text()), "configs": names, "steps": args.steps,
              "overrides": args.set, "toggle": args.toggle, "calib_seq_len": args.calib_seq_len,
              "calib_steps": args.calib_steps, "compile_cache": "bench_startup's" if args.compile_cache else "empty",
              "title": f"{args.name}: the shipped recipe on a Hugging Face directory"}
    rows, extra = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        calibration = args.calibration
        for name in names:
            if name == "all_on" and calibration is None:
                calibration = work / "rtpurbo"
                extra["calibrate_s"] = calibrate(args.model, calibration, seq_len=args.calib_seq_len,
                                                 steps=args.calib_steps)
            rows.append(tune_run(args, name, work, calibration))
            path = write_json(args.name, config, rows, out_dir=args.out, extra=extra)  # after every run
            plot(json.loads(path.read_text()), path.with_suffix(".png"))
    print_table(rows, ["config", "steps", "process_s", "setup_s", "median_step_s", "rollout_s", "prefill_s",
                       "decode_s", "logprob_s", "train_s", "sync_s", "compiled_after_setup"])


if __name__ == "__main__":
    main()

"""Time to the first GRPO step: the shipped recipe launched all off and all on, with a cold and a warm compile cache.

Question: how long does ``tune run sparrow_grpo`` take from launch to its first finished step, where does that time
go (compilation per kind of step, CUDA-graph capture, the cost model's calibration), how much does the compile cache
save on a second launch of the same configuration, and does the faster start cost anything per step?

Per configuration, two launches of the real command line sharing one ``engine.compile_cache`` directory: ``cold``
(the directory is empty) and ``warm`` (the same directory again). ``all_off``: dense attention, no speculation, the
dense sync codec. ``all_on``: RTPurbo attention from a ``sparrow calibrate`` of the model (done once, before, not
timed in the launches), an int8 self-drafter with the cost-model toggle over draft lengths 2, 4, 8, and the sparse
sync codec. Every launch gets empty Inductor and Triton cache directories of its own, so nothing but Sparrow's
compile cache carries over; the Triton directory lies inside the Inductor one, as Inductor itself places it, so the
compile cache takes the Triton kernels over as it does for a user who set no ``TRITON_CACHE_DIR``.
``first_step_s``: from the launch to the moment the first step's record appears in the
run's metric log (polled); the ``setup/*`` phases come from that record; ``steady_step_s`` is the median step time
after the first.

Usage (GPU): ``python benchmarks/bench_startup.py --model DIR`` (a Qwen2.5-0.5B-shaped Hugging Face directory) ->
``docs/benchmarks/startup.json``. Where one call cannot hold all four launches: ``--configs all_off`` and
``--configs all_on`` in two calls, then ``--merge A/startup.json B/startup.json``; where one call cannot hold
a configuration's two launches: ``--caches cold`` and ``--caches warm`` in two calls on the same machine with the same
``--work DIR`` (the compile cache survives between them), then ``--merge``. CPU smoke run: ``--quick`` with
``--model`` a tiny directory and ``--set`` the overrides of a CPU run (device, precision, sizes); its JSON goes to a temporary folder unless ``--out`` is given.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

from sparrow.bench import (REPO, bar_groups, base_parser, log, merge_results, out_or_temp, pick, print_table,
                           result_devices, save_figure, stacked_bars, subplots, triton_interpreter_without_cuda,
                           write_json)

triton_interpreter_without_cuda()  # the CPU smoke runs: Triton through its interpreter, before it is imported

from sparrow.rl.launch import (
    calibrate, launch_options, launch_recipe, log_overrides, recipe_env, require_model, technique_overrides,
)

CONFIG = REPO / "recipes" / "configs" / "qwen2_5_0_5b_long_context.yaml"
PHASES = ["compile_decode", "compile_draft", "compile_verify", "capture", "warmup", "calibrate", "sync_warmup"]
TARGETS = {("all_on", "cold"): 60.0, ("all_on", "warm"): 15.0, ("all_off", "cold"): 30.0}  # seconds (DESIGN.md)


def compile_cache(work: Path, name: str) -> Path:
    """The compile-cache root of configuration ``name``'s launches in ``work`` (one per configuration, so a cold
    launch of one never empties another's)."""
    return work / f"{name}_compile_cache"


def launch(args, name: str, cache: str, work: Path, calibration: Path | None) -> dict[str, Any]:
    """One launch of the recipe; returns its row."""
    out = work / f"{name}_{cache}"
    scratch = Path(tempfile.mkdtemp(prefix="startup_", dir=work))  # nothing cached outside the compile cache
    run = launch_recipe(args.config, [f"model_dir={args.model}", *log_overrides(out, args.steps),
                                      f"engine.compile_cache={compile_cache(work, name)}",
                                      *technique_overrides(name, calibration), *args.set],
                        out=out, env=recipe_env(TORCHINDUCTOR_CACHE_DIR=str(scratch / "inductor"),
                                                TRITON_CACHE_DIR=str(scratch / "inductor" / "triton")))
    steps = run.steps
    rec = steps[0]
    row: dict[str, Any] = {"config": name, "cache": cache, "first_step_s": run.first_step_s,
                           "steady_step_s": statistics.median(s["time/step_s"] for s in steps[1:] or steps),
                           "first_step_time_s": rec["time/step_s"], "wall_s": run.wall_s, "steps_run": len(steps),
                           "compiled_after_setup": steps[-1]["compile/graphs"] - rec["compile/graphs"],
                           "command": run.command}
    log(f"{name} ({cache}): $ {row['command']}")
    row.update({f"{p}_s": rec.get(f"setup/{p}_s", 0.0) for p in PHASES})
    row.update({k[len("setup/"):]: v for k, v in rec.items() if k.startswith("setup/") and not k.endswith("_s")})
    row["rollout_setup_s"] = rec.get("setup/rollout_s")
    row["target_s"] = TARGETS.get((name, cache))
    if bool(row.get("cache_warm")) != (cache == "warm"):  # e.g. --caches warm without a cold launch in --work before
        raise SystemExit(f"{name} ({cache}): the recipe found its compile cache "
                         f"{'warm' if row.get('cache_warm') else 'empty'}")
    return row


def plot(doc: dict[str, Any], png: Path) -> None:
    rows = doc["rows"]
    fig, (a, b) = subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    layers = {p: [r[f"{p}_s"] for r in rows] for p in PHASES} | {"first step": [r["first_step_time_s"] for r in rows]}
    labels = [f"{r['config']}\n{r['cache']}" for r in rows]
    tops = stacked_bars(a, labels, layers, colors=[f"C{j}" for j in range(len(PHASES))] + ["0.45"])
    stacked_bars(a, labels, {"other (start, load, trainer)": [max(0.0, r["first_step_s"] - t) for r, t in
                                                               zip(rows, tops)]}, colors=["0.8"], bottom=tops)
    for i, r in enumerate(rows):
        if r.get("target_s"):
            a.plot([i - 0.4, i + 0.4], [r["target_s"]] * 2, "k--", lw=1, label="target" if i == 0 else None)
    a.set(ylabel="seconds from launch to the first finished step", title="time to the first step, by phase")
    a.legend(fontsize=7)
    names = sorted({r["config"] for r in rows})
    bar_groups(b, names, {c: [pick(rows, "steady_step_s", 0.0, config=n, cache=c) for n in names]
                          for c in ("cold", "warm")})
    b.set(ylabel="median seconds per step after the first", title="steady-state step")
    b.legend(fontsize=8)
    save_figure(fig, png, title=f"start-up of the shipped recipe ({result_devices(doc)})")


def merge(paths: list[Path], out_dir: Path | None = None) -> Path:
    """One result from runs of this script over disjoint configurations or caches with the same settings
    (:func:`~sparrow.bench.merge_results`), and its plot."""
    out = merge_results("startup", paths, identity=("config", "cache"), parts={"configs": "config", "caches": "cache"},
                        out_dir=out_dir)
    plot(json.loads(out.read_text()), out.with_suffix(".png"))
    return out


def main() -> None:
    p = base_parser(__doc__.split("\n\n")[0], launch_options(
        CONFIG, 4, "GRPO steps per launch (the first one is the timed start)") + [
        ("--caches", dict(default="cold,warm", help="the launches per configuration: cold (an empty compile cache, "
                                                    "emptied first), warm (the cache of --work as an earlier launch "
                                                    "left it), or both in that order")),
        ("--work", dict(type=Path, default=None, help="the launches' folder (compile cache, calibration, logs), kept "
                                                      "for a later call's --caches warm (default: a temporary one)"))])
    args = p.parse_args()
    if args.merge:
        print(merge(args.merge, args.out))
        return
    require_model(p, args)
    if args.quick:
        args.steps, args.calib_seq_len, args.calib_steps = 2, 256, 5
        args.out = out_or_temp(args.out, "startup_quick_")  # never the committed results
    names, caches = args.configs.split(","), args.caches.split(",")
    if not caches or any(c not in ("cold", "warm") for c in caches) or caches != sorted(set(caches)):
        p.error(f"--caches {args.caches!r}: cold, warm or cold,warm")
    config = {"model": json.loads((args.model / "config.json").read_text()), "config_file": args.config.name,
              "configs": names, "caches": caches, "steps": args.steps, "overrides": args.set, "quick": args.quick}
    rows, extra = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work if args.work is not None else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        calibration = args.calibration
        if "all_on" in names and calibration is None:
            calibration = work / "rtpurbo"
            log(f"sparrow calibrate --checkpoint {args.model}")
            extra["rtpurbo_calibrate_s"] = calibrate(args.model, calibration, seq_len=args.calib_seq_len,
                                                     steps=args.calib_steps)
        for name in names:
            for cache in caches:
                if cache == "cold":  # nothing an earlier launch of this configuration compiled
                    shutil.rmtree(compile_cache(work, name), ignore_errors=True)
                rows.append(launch(args, name, cache, work, calibration))
                path = write_json("startup", config, rows, out_dir=args.out, extra=extra)  # after every launch
    plot(json.loads(path.read_text()), path.with_suffix(".png"))
    print_table(rows, ["config", "cache", "first_step_s", "target_s", *(f"{p}_s" for p in PHASES), "steady_step_s",
                       "compiled_after_setup"])


if __name__ == "__main__":
    main()

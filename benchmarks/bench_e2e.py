"""End to end: GRPO with and without Sparrow's techniques, same model, data, seeds and steps, in one process.

Question: how much faster does a GRPO step run with RTPurbo sparse rollout attention, self-speculative decoding
and sparse weight sync switched on, what does each technique contribute on its own, and does the training signal
(reward, held-out accuracy, the rollout/trainer mismatch) stay the same? The model: ``--model DIR``, a task model
(``tune run sparrow_sft --config recipes/configs/task_model_8k_sft.yaml``; its ``model.safetensors`` is the
recipe's ``checkpoint``). The GRPO recipe (setup, train, cleanup) runs once per configuration
(``sparrow.rl.launch.CONFIGS``) and seed, all in this process, from the same checkpoint, data order and sampling
seeds; compiled code is dropped between runs and the first ``--warmup-steps`` steps (which compile) are left out of
the timed figures. RTPurbo is calibrated once, before the runs, on task sequences at ``--context`` (heads by
ablation). The JSON is rewritten after every finished run; ``--merge`` joins runs of other seeds;
``--deadline-minutes`` skips what would not finish. The summaries and the figure come from :mod:`sparrow.rl.runs`.
See docs/benchmarks.md for the workload, the reported figures and the commands.
``--partial`` adds each configuration's partial-rollout twin (``all_off_partial``: the same recipe with
``partial_rollout`` on, ``--overprovision`` groups in flight beyond a step's, ``--max-staleness``) and writes
``partial_rollout.json``: step and rollout time against the synchronous run of the same seed, reward per step
and per second, and the share of trained tokens an older policy sampled (``stale_token_frac``).

Usage (H200): ``python benchmarks/bench_e2e.py --model DIR --steps 6 --deadline-minutes 8.5``;
CPU smoke run (a tiny model trained for seconds; figures mean nothing): ``python benchmarks/bench_e2e.py --quick``.
"""

from __future__ import annotations

import functools
import json
import sys
import time
import traceback
from pathlib import Path

import torch
from omegaconf import OmegaConf

from sparrow.bench import (REPO, base_parser, device_arg, fill_defaults, int_or_auto, keyword_args, log, out_or_temp,
                           print_table, task_model, triton_interpreter_without_cuda, write_json)

triton_interpreter_without_cuda()  # the CPU smoke runs: Triton through its interpreter, before it is imported

from sparrow.attention.rtpurbo import RTPurboConfig
from sparrow.calibrate.variants import CALIBRATION_DEFAULTS, calibrate_and_save, calibration_options
from sparrow.profiling import profile_path
from sparrow.rl import KVListRetrieval
from sparrow.rl.recipe_config import RECIPE_KEYS, check_config
from sparrow.rl.launch import (CONFIGS, GRPO_DEFAULTS, configuration, configuration_names, fixed_rollout,
                               grpo_base_config, grpo_options, run_in_process)
from sparrow.rl.runs import (
    SIGNAL_COLUMNS, SUMMARY_COLUMNS, TIME_COLUMNS, add_speedups, compare, merge_files, partial_costs, plot_runs,
    run_line, run_summary, step_rows,
)
from sparrow.training import MODEL_FILE, handled_context, load_trained_model, read_report

NAME = "e2e"


def calibrate_rtpurbo(model_dir: str, args, device: torch.device, out: Path) -> dict:
    """Retrieval heads by ablation and the indexer fitted on task sequences at ``--context``, saved to ``out``."""
    model = load_trained_model(model_dir, device, torch.bfloat16 if device.type == "cuda" else torch.float32)
    blocks = dict(decode_block=16, prefill_block=16, ret_window=16) if args.quick else {}
    cfg = RTPurboConfig.for_context(args.context, retrieval_ratio=args.ratio, top_p=args.top_p,
                                    dense_prefill_below=args.dense_prefill_below,
                                    impl=args.decode_impl, prefill_impl=args.prefill_impl, **blocks)
    return calibrate_and_save(model, cfg, args.context, out, profile_seqs=args.profile_seqs, fit_seqs=args.fit_seqs,
                              fit_steps=args.fit_steps, queries_per_seq=args.queries_per_seq, lr=args.fit_lr)


def run_dir(work: Path, name: str, seed: int) -> Path:
    """The recipe output folder of configuration ``name``'s run for ``seed``."""
    return work / f"{name}_seed{seed}"


def run_config(base: dict, name: str, seed: int, args, rtpurbo_dir: Path, work: Path) -> dict:
    """``base`` with configuration ``name``'s techniques switched on, for ``seed`` (``sparrow.rl.launch``)."""
    lengths = [int(x) for x in args.draft_lengths.split(",") if x]
    return configuration(base, name, run_dir(work, name, seed), seed=seed, rtpurbo=rtpurbo_dir,
                         **keyword_args(configuration, args, draft_lengths=lengths))


def run_recipe(cfg_dict: dict, fixed_length: int = 0, stop_at: float | None = None) -> dict:
    """setup -> train -> cleanup of one recipe config (:func:`~sparrow.rl.launch.run_in_process`; ``stop_at``: no
    step starts that would end after that ``time.perf_counter()`` moment). With
    ``fixed_length``, after training: the next step's prompts decoded to exactly that many tokens (no stop token)
    twice, the second timed (``fixed_rollout_s``): equal work whatever lengths the configuration samples."""
    sys.path.insert(0, str(REPO / "recipes"))  # the recipe file itself when it is not installed
    from sparrow_grpo import GRPORecipe

    return run_in_process(GRPORecipe, cfg_dict, functools.partial(fixed_rollout, length=fixed_length)
                          if fixed_length else None, stop_at=stop_at)


def build_parser():
    p = base_parser(__doc__.splitlines()[0], [
        ("--model", str, None, "a trained model's folder (tune run sparrow_sft ... output_dir=DIR)"),
        ("--work-dir", str, None, "calibration, metric logs, the quick model (default: a temp dir)"),
        ("--device", device_arg, "auto", None),
        ("--configs", str, ",".join(c for c in CONFIGS if not CONFIGS[c].get("partial")),
         "comma list of " + ", ".join(CONFIGS)), ("--seeds", str, "0", "comma list, e.g. 0,1"), *grpo_options(),
        ("--warmup-steps", int, 1, "first steps left out of the timed figures"),
        ("--context", int_or_auto, None, "prompt characters = tokens (default 8192; quick 256), or 'auto': the longest "
         "context at which the model's held-out accuracy on the task (kv_retrieval for kv_list) reaches 0.5"),
        ("--spec-toggle", ["always", "threshold", "cost_model"], None, "default cost_model; quick always"),
        ("--draft-lengths", str, None, "comma list (default 2,4; quick 2)"),
        ("--draft-weight", ["int8", "int4", "fp8", "none"], "int8", None),
        ("--draft-window", int, 0, "windowed draft in spec_only (dense caches only)"),
        ("--max-active", int, 32, "threshold toggle: speculate at or below this many rows"),
        ("--ratio", float, None, "RTPurbo retrieval-head ratio (default 0.25; quick 0.5)"),
        ("--dense-prefill-below", int, 0, "RTPurbo prefills shorter prompts densely (0: always sparse)"),
        *calibration_options(200),
        ("--indexer-refresh-every", int, 0, "RTPurbo indexer refresh every N steps (0: off)"),
        ("--fixed-length", int, 0, "after training, time a rollout of this many tokens per row (no stop token)"),
        ("--profile-step", int, 0, "run this step of every run under the PyTorch profiler (its op table in the run's "
         "folder, profile/; the step is left out of the timed ones); 0: none"),
        ("--deadline-minutes", float, None, "skip runs that would end past this many minutes after the start, "
         "and end a run's steps early where the next would"),
        ("--run-reserve-s", float, 60.0, "with --deadline-minutes: seconds kept after a run's last step for its "
         "fixed-length rollout and clean-up"),
        ("--overprovision", int, None, "partial rollout: groups in flight beyond a step's (default: a step's)"),
        ("--max-staleness", int, 1, "partial rollout: policy versions a group may span"),
        ("--partial", dict(action="store_true", help="add each configuration's partial-rollout twin (all_off, all_on); "
                           "the JSON is partial_rollout.json")),
        ("--merge", dict(nargs="+", type=Path, default=None, metavar="JSON", help="join finished results of this "
                         "script (same settings, other seeds) into one, then stop"))])
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.merge:
        return {"out": merge(args.merge, args.out)}
    q = args.quick
    fill_defaults(args, q, **GRPO_DEFAULTS, **CALIBRATION_DEFAULTS, context=(256, 8192),
                  max_new=(None, None) if args.task == "kv_list" else (4, 8), spec_toggle=("always", "cost_model"),
                  draft_lengths=("2", "2,4"), ratio=(0.5, 0.25), fit_steps=(20, 200))
    if args.max_asked is not None and (args.task != "kv_list" or args.max_asked < 1):
        raise SystemExit("--max-asked takes a positive number, with --task kv_list")
    device = torch.device(args.device)
    if args.compile is None:
        args.compile = device.type == "cuda" and not q
    try:
        names = configuration_names(args.configs, args.partial)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.warmup_steps >= args.steps:
        raise SystemExit(f"--warmup-steps ({args.warmup_steps}) leaves no timed step of --steps {args.steps}")
    if not 0 <= args.profile_step <= args.steps:
        raise SystemExit(f"--profile-step {args.profile_step} is not a step of --steps {args.steps} (0: none)")
    return run(args, names, seeds, device)


def run(args, names: list[str], seeds: list[int], device: torch.device) -> dict:
    t_start = time.perf_counter()
    out_dir = out_or_temp(args.out, "e2e_quick_", args.quick)  # never overwrite the committed results
    work = Path(out_or_temp(args.work_dir, "sparrow_e2e_"))
    work.mkdir(parents=True, exist_ok=True)
    deadline = t_start + args.deadline_minutes * 60 if args.deadline_minutes else None

    # -- setup
    model_dir = task_model(args.model, work, args.quick)
    report, train_s = read_report(model_dir), time.perf_counter() - t_start
    if args.context == "auto":
        try:
            args.context = handled_context(report, args.task)
        except ValueError as e:
            raise SystemExit(f"{e}: give --context explicitly") from None
        log(f"--context auto: {args.context} tokens (the longest the model handles)")
    if args.max_new is None:  # kv_list: room for the longest answer the task can ask for, and <eos>
        kvl = KVListRetrieval(args.context, **({"max_asked": args.max_asked} if args.max_asked else {}))
        args.max_new = kvl.most_asked * (kvl.value_len + 1) + 1
    if args.fixed_length > args.max_new:
        raise SystemExit(f"--fixed-length {args.fixed_length} exceeds the engine's max_new_tokens {args.max_new}")
    need = args.context + 1 + args.max_new
    if need > report["model"]["max_seq_len"]:
        raise SystemExit(f"context {args.context} + <bos> + {args.max_new} new tokens does not fit the model's "
                         f"max_seq_len {report['model']['max_seq_len']}")
    log(f"model {model_dir}: {report['params'] / 1e6:.1f}M parameters, trained to "
        f"{report['train']['final_max_context']} tokens")
    checkpoint = Path(model_dir).resolve() / MODEL_FILE
    calibration = None
    rtpurbo_dir = work / "rtpurbo"
    if any(CONFIGS[n]["rtpurbo"] for n in names):
        calibration = calibrate_rtpurbo(model_dir, args, device, rtpurbo_dir)
        log(f"RTPurbo calibrated in {calibration['seconds']} s: retrieval kv heads {calibration['retrieval_heads']}, "
            f"indexer recall {calibration['indexer']['recall']:.3f}, density {calibration['indexer']['density']:.3f}")
    base = grpo_base_config(report["model"], checkpoint, str(device), **keyword_args(grpo_base_config, args))
    if args.profile_step:
        base["profile_steps"] = [args.profile_step]
    for seed in seeds:  # every run's config is valid before any run starts
        for name in names:
            check_config(OmegaConf.create(run_config(base, name, seed, args, rtpurbo_dir, work)), RECIPE_KEYS)
    config_doc = dict(
        model_dir=Path(model_dir).name, params=report["params"], model=report["model"], device=str(device),
        configs=names, seeds=seeds, switches={n: CONFIGS[n] for n in names}, steps=args.steps,
        warmup_steps=args.warmup_steps, task=args.task, context=args.context, group=args.group,
        prompts_per_step=args.prompts_per_step, max_new=args.max_new, compile=args.compile, quick=args.quick,
        spec_toggle=args.spec_toggle, draft_lengths=args.draft_lengths, draft_weight=args.draft_weight,
        draft_window=args.draft_window, indexer_refresh_every=args.indexer_refresh_every, reward=args.reward,
        recipe_base=base, work_dir=str(work), partial=args.partial, overprovision=args.overprovision,
        max_staleness=args.max_staleness, profile_step=args.profile_step,
        note="times in seconds: medians over the timed steps (after the warm-up steps, which compile); wall_s sums "
             "the timed steps, wall_s_all every step; evaluation (start and end) is outside the step times; "
             "attention density is recorded only with compile off; single process: sync goes "
             "through an in-process queue, so the sparse codec's saving shows in bytes, not in time")

    # -- run
    rows: list[dict] = []
    steps: list[dict] = []
    skipped: list[str] = []
    cut: list[str] = []  # runs the deadline ended before --steps
    failed: list[dict] = []
    durations: list[float] = []

    def save(final: bool) -> Path:
        add_speedups(rows)
        extra = {"summary": compare(rows, steps), "steps": steps, "calibration": calibration, "skipped": skipped, "cut": cut, "failed": failed, "train_s": round(train_s, 1),
                 "seconds": round(time.perf_counter() - t_start, 1), "complete": final}
        return write_json("partial_rollout" if args.partial else NAME, config_doc, rows, out_dir=out_dir, extra=extra)

    for seed in seeds:
        for name in names:
            tag = f"{name}:seed{seed}"
            if deadline is not None and time.perf_counter() + max(durations, default=0.0) > deadline:
                skipped.append(tag)
                log(f"{tag}: skipped (deadline)")
                continue
            log(f"{tag}: start")
            t = time.perf_counter()
            try:
                stop_at = None if deadline is None else deadline - args.run_reserve_s
                out = run_recipe(run_config(base, name, seed, args, rtpurbo_dir, work), args.fixed_length, stop_at)
            except Exception as e:  # one failing configuration must not lose the others
                failed.append({"run": tag, "error": f"{type(e).__name__}: {str(e)[:1000]}",
                               "traceback": traceback.format_exc()[-4000:]})
                log(f"{tag}: FAILED {type(e).__name__}: {str(e)[:300]}")
                save(final=False)
                continue
            durations.append(time.perf_counter() - t)
            st = step_rows(name, seed, out["records"], args.warmup_steps)
            steps.extend(st)
            done = sum("time/step_s" in r for r in out["records"])
            if done < args.steps:
                cut.append(f"{tag}: {done} of {args.steps} steps")
                log(f"{tag}: the deadline ended it after {done} of {args.steps} steps")
            on = CONFIGS[name]
            rows.append(run_summary(name, seed, st, out["records"], rtpurbo=on["rtpurbo"], speculative=on["spec"],
                                    sparse_sync=on["sparse_sync"], setup_s=out["setup_s"], run_s=out["run_s"],
                                    partial=bool(on.get("partial")), **partial_costs(st),
                                    **{k: v for k, v in out.items() if k.startswith("fixed_")}))
            r = rows[-1]
            table = profile_path(run_dir(work, name, seed), args.profile_step) if args.profile_step else None
            if table is not None and table.is_file():  # the op table travels with the results
                r["profile"] = table.read_text()
            log(f"{tag}: {run_line(r)}")
            if r["compiled_timed_steps"]:
                log(f"{tag}: WARNING {r['compiled_timed_steps']} timed step(s) compiled or captured graphs "
                    "(see 'compiled' in the steps)")
            save(final=False)
    path = save(final=True)
    if args.partial:  # make_plots.py looks for bench_partial_rollout.py: this figure is drawn here
        plot(json.loads(path.read_text()), path.with_suffix(".png"))

    # -- summarise
    print()
    print_table(rows, TIME_COLUMNS)
    print()
    print_table(rows, SIGNAL_COLUMNS)
    print()
    summary = compare(rows, steps)
    print_table(summary, SUMMARY_COLUMNS + (("wall_s", "stale_token_frac") if args.partial else ()))
    if skipped:
        print(f"skipped at the deadline: {skipped}")
    if cut:
        print(f"cut short by the deadline: {cut}")
    if failed:
        print(f"failed: {[f['run'] for f in failed]}")
    return {"rows": rows, "summary": summary, "steps": steps, "out": out_dir, "skipped": skipped, "cut": cut,
            "failed": failed}


def merge(paths: list[Path], out_dir: Path | None = None) -> Path:
    """One result from complete runs of this script with the same settings and other seeds or configurations: each
    seed's speedups compare its runs against its all_off, so a part holds all_off for its seeds, or the
    configurations of a seed ran one after another on one machine with one ``--work-dir`` (the same model; the
    calibration is the first part's that has one). The runs the deadline cut are listed from every part."""
    try:
        config, rows, extra = merge_files(paths, NAME, free=("configs", "seeds", "switches", "work_dir", "recipe_base"),
                                          keep=("calibration",))
    except ValueError as e:
        raise SystemExit(f"{[str(p) for p in paths]}: {e}") from None
    config["switches"] = {n: CONFIGS[n] for n in config["configs"]}
    extra["cut"] = [c for p in paths for c in json.loads(Path(p).read_text()).get("cut", [])]
    return write_json(NAME, config, rows, out_dir=out_dir, extra=extra)


def plot(result: dict, png_path: Path) -> None:
    cfg, device = result.get("config", {}), result.get("environment", {}).get("device")
    plot_runs(result.get("steps") or [], png_path, warmup=cfg.get("warmup_steps", 1),
              title=f"GRPO end to end: {cfg.get('task')} at {cfg.get('context')} tokens, "
                    f"{cfg.get('prompts_per_step')}x{cfg.get('group')} samples/step ({device})")


if __name__ == "__main__":
    main()

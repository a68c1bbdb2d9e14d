"""RTPurbo vs dense accuracy on the synthetic long-context tasks, with a model trained on them.

The model: ``--model DIR`` (``tune run sparrow_sft --config recipes/configs/task_model_8k_sft.yaml``). Dense
greedy accuracy (through the :class:`~sparrow.rollout.RolloutEngine`, compile off) on held-out multi-key
retrieval and variable tracking at every context first; then calibration at the longest context a task handles
(``--handled``): retrieval heads by ablation (``--head-scores``) on task spans that really repeat
(:func:`sparrow.calibrate.data.calibration_sequences`), one indexer fitted per (block, top_p) for the largest head
set and cut for the smaller ones; then each ``--configs`` variant, longest context first (past
``--deadline-minutes`` the rest are skipped), with the paired comparison against dense and the density the
RTPurbo backends measure. Prompts of a row spread over the ``--jitter`` characters below its context, so a
question ends at every offset inside a selection block. Beside the calibration, on held-out sequences: how sparse
the dense attention's own top-p set is against the indexer's, at token, decode-block and prefill granularity, with
the recall of the dense set (:func:`sparrow.calibrate.selection.measure_selection`; the indexer at its calibrated
temperature and at 1, over every query and over the last ``--decode-queries`` positions). ``--selection-only
--model-config YAML`` measures only that, on the model, checkpoint and task of a recipe config (e.g. the tiny GRPO
model: ``recipes/configs/tiny_kv_retrieval.yaml``). See docs/benchmarks.md.

Usage: ``python benchmarks/bench_rtpurbo_accuracy.py --model DIR``; ``--quick`` (CPU: a tiny model trained for
seconds, accuracies mean nothing; it checks the pipeline).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path

import torch

from sparrow.bench import (base_parser, device_arg, device_dtype, fill_defaults, keyword_args, log, out_or_temp,
                           plot_series, print_table, save_figure, subplots, task_model, triton_interpreter_without_cuda,
                           write_json)

triton_interpreter_without_cuda()  # the CPU smoke runs: Triton through its interpreter, before it is imported

from sparrow.attention.rtpurbo import RTPurboConfig, collect_selection_stats
from sparrow.calibrate.variants import (CALIBRATION_DEFAULTS, VARIANT_KEYS, calibrate_variants, calibration_options,
                                       plot_selection, rtpurbo_model, selection_rows, variant_configs,
                                       variant_densities)
from sparrow.training import (
    EVAL_SEED, EVAL_TASKS, accuracy_summary, answers_with_fallback, binomial_se, engine_answers, load_recipe_model,
    load_trained_model, paired_accuracy, read_report)

NAME = "rtpurbo_accuracy"
TASKS = ("kv_retrieval", "variable_tracking")


def calibrate(model, rt_configs: dict[str, RTPurboConfig], context: int, args, kv_task=None):
    """:func:`~sparrow.calibrate.variants.calibrate_variants` with this script's options."""
    return calibrate_variants(model, rt_configs, context, **keyword_args(
        calibrate_variants, args, lr=args.fit_lr, scores=args.head_scores, kv_task=kv_task, log=log))


def selection_only(args) -> dict:
    """``--model-config``: the model (``model:`` + ``checkpoint:``) and multi-key retrieval task (``task:``) of a
    recipe config, calibrated at the task's context; the selection measurement only, no accuracy."""
    model, task, cfg = load_recipe_model(args.model_config)
    c = RTPurboConfig.for_context(task.context_len, retrieval_ratio=args.ratio, top_p=args.top_p,
                                  decode_block=args.decode_block, prefill_block=args.prefill_block,
                                  ret_window=args.ret_window, **({"window": args.window} if args.window else {}))
    _, record = calibrate(model, {f"ratio={args.ratio}": c}, task.context_len, args, kv_task=task)
    rows = selection_rows(record)
    config_doc = dict(selection_only=True, model=dict(cfg.model), task=repr(task), context=task.context_len,
                      top_p=c.top_p, decode_block=c.decode_block, prefill_block=c.prefill_block,
                      decode_queries=args.decode_queries, head_scores=args.head_scores, ratio=args.ratio,
                      held_out_sequences=args.selection_seqs)
    write_json(NAME, config_doc, rows, out_dir=out_or_temp(args.out, "rtpurbo_selection_"),
               extra={"calibration": record})
    return {"rows": rows, "calibration": record}


def run(args) -> dict:
    if args.selection_only:
        return selection_only(args)
    t_start = time.perf_counter()
    device, dtype = device_dtype() if args.device != "cpu" else (torch.device("cpu"), torch.float32)
    out_dir = out_or_temp(args.out, "rtpurbo_accuracy_quick_", args.quick)  # never the committed results
    deadline = t_start + args.deadline_minutes * 60 if args.deadline_minutes else None
    model_dir = task_model(args.model, Path(out_dir or "."), args.quick)
    train_s = time.perf_counter() - t_start
    report = read_report(model_dir)
    model = load_trained_model(model_dir, device, dtype)
    trained_to = int(report["train"]["final_max_context"])
    if args.lengths:
        lengths = [int(x) for x in args.lengths.split(",")]
    elif args.quick:
        lengths = [128, int(report["train"]["config"]["curriculum"]["max_context"])]
    else:
        lengths = [512 * 2**i for i in range(max(0, math.ceil(math.log2(max(trained_to, 512) / 512))))] + [trained_to]
    lengths = sorted(set(lengths))
    if lengths[-1] + 8 > model.max_seq_len:
        raise SystemExit(f"context {lengths[-1]} does not fit the model's max_seq_len {model.max_seq_len}")
    log(f"model {model_dir}: {report['params'] / 1e6:.1f}M parameters, trained up to {trained_to} tokens "
        f"({report['train']['steps']} steps, {report['train']['tokens_seen'] / 1e6:.0f}M tokens); contexts {lengths}")
    eval_kw = dict(rows=args.rows, prefill_tokens=args.prefill_tokens, jitter=args.jitter)

    # -- dense accuracy everywhere first (cheap); calibrate at the longest context the model handles
    dense = {}
    for L in sorted(lengths, reverse=True):
        for task in TASKS:
            t = time.perf_counter()
            hits, first = engine_answers(model, EVAL_TASKS[task], L, args.examples, **eval_kw)
            dense[(task, L)] = (hits, first, time.perf_counter() - t)
            log(f"dense {task:>17} @ {L:5d}: {sum(hits) / len(hits):.3f} (n={len(hits)})")
    handled = [L for L in lengths if max(sum(dense[(t, L)][0]) / args.examples for t in TASKS) >= args.handled]
    calib_len = args.calibration_context or (max(handled) if handled else lengths[-1])
    log(f"longest context where a task's dense accuracy is >= {args.handled}: {max(handled, default=None)}; "
        f"calibrating at {calib_len}")

    # -- RTPurbo configurations: defaults scaled to the calibration context (local window = 1/16 of it)
    q = args.quick
    base = dict(top_p=args.top_p, decode_block=16 if q else args.decode_block, prefill_block=16 if q else args.prefill_block,
                ret_window=16 if q else args.ret_window, **({"window": args.window} if args.window is not None else {}))
    try:
        rt_configs = variant_configs(args.configs or ("ratio=0.5" if q else "ratio=0.15;ratio=0.25"), calib_len,
                                     impl=args.decode_impl, prefill_impl=args.prefill_impl, **base)
    except ValueError as e:  # a bad --configs stops the script
        raise SystemExit(str(e)) from None
    variants, calibration = calibrate(model, rt_configs, calib_len, args)

    # -- RTPurbo accuracy and density, longest context first (what matters most is measured before a deadline)
    rows, skipped, fallbacks = [], [], []
    sparse = {name: rtpurbo_model(model, *v) for name, v in variants.items()}
    config_doc = dict(
        model_dir=Path(model_dir).name, dtype=str(dtype).replace("torch.", ""), device=str(device), lengths=lengths,
        examples=args.examples, jitter=args.jitter, tasks={t: repr(EVAL_TASKS[t](lengths[-1])) for t in TASKS},
        eval_seed=EVAL_SEED, handled_threshold=args.handled, calibration_context=calib_len,
        decode_impl=args.decode_impl, prefill_impl=args.prefill_impl, quick=q, heads=model.layers[0].attn.num_heads,
        kv_heads=model.layers[0].attn.num_kv_heads, layers=len(model.layers),
        note="greedy exact match through the RolloutEngine (compile off); density: fraction of the visible KV read "
             "per query (decode: measured per query; prefill: retrieval heads' kept/causal blocks, all heads adds the "
             "local heads' sinks + window exactly); first_acc: the first answer token alone (produced by prefill); "
             "context: the longest prompt of a row, its examples spread over the jitter below it")
    dense_rows = [dict(task=t, context=L, n=len(h), accuracy=sum(h) / len(h), se=binomial_se(sum(h) / len(h), len(h)),
                       first_acc=sum(f) / len(f), seconds=round(s, 2)) for (t, L), (h, f, s) in sorted(dense.items())]

    def save(final: bool) -> None:
        extra = {"summary": accuracy_summary(rows, args.handled, calibration), "dense": dense_rows, "calibration": calibration,
                 "model": {k: report[k] for k in ("model", "params", "train", "accuracy") if k in report},
                 "skipped": skipped, "kernel_fallbacks": fallbacks, "train_s": round(train_s, 1),
                 "seconds": round(time.perf_counter() - t_start, 1), "complete": final}
        write_json(NAME, config_doc, rows, out_dir=out_dir, extra=extra)

    def reference(name: str):  # a variant on the PyTorch reference kernels, unless it already runs on them
        prof, w, c = variants[name]
        if c.impl == "reference" and c.prefill_impl == "reference":
            return None
        variants[name] = (prof, w, replace(c, impl="reference", prefill_impl="reference"))
        return rtpurbo_model(model, *variants[name])

    for L in sorted(lengths, reverse=True):
        for task in TASKS:
            d_hits, d_first, _ = dense[(task, L)]
            dacc = sum(d_hits) / len(d_hits)
            for name in list(sparse):
                if deadline is not None and time.perf_counter() > deadline:
                    skipped.append(f"{name}:{task}@{L}")
                    continue
                collect_selection_stats(sparse[name], reset=True)
                a = answers_with_fallback(sparse[name], EVAL_TASKS[task], L, args.examples,
                                          fallback=lambda: reference(name), **eval_kw)
                if a.error:
                    log(f"{name}: {a.error[:300]} -- retried with the reference kernels")
                    fallbacks.append({"config": name, "task": task, "context": L, "error": a.error[:500]})
                sparse[name], (prof, _, c) = a.model, variants[name]
                st = collect_selection_stats(sparse[name], reset=True)
                hits, sacc = a.hits, sum(a.hits) / len(a.hits)
                rows.append(dict(config=name, task=task, context=L, **paired_accuracy(d_hits, d_first, a.hits, a.first),
                                 **variant_densities(st, prof, c, L), impl=c.impl, prefill_impl=c.prefill_impl,
                                 sparse_s=round(a.seconds, 2)))
                r = rows[-1]
                log(f"{task:>17} @ {L:5d}  dense {dacc:.3f}  {name} {sacc:.3f}  (n={len(hits)}, delta {r['delta']:+.3f} "
                    f"+- {r['delta_se']:.3f}; first token {r['dense_first_acc']:.3f} -> {r['sparse_first_acc']:.3f})  "
                    f"decode density {r['decode_density']:.3f} (retrieval heads {r['decode_ret_density']:.3f}), "
                    f"prefill {r['prefill_density']:.3f}")
        save(final=False)
    save(final=True)
    print_table(rows, ["config", "task", "context", "n", "dense_acc", "sparse_acc", "delta", "delta_se",
                       "sparse_first_acc", "decode_density", "decode_ret_density", "prefill_density"])
    summary = accuracy_summary(rows, args.handled, calibration)
    print_table(summary, ["config", "task", "longest_handled", "n", "dense_acc", "sparse_acc", "delta", "delta_se",
                          "within_1pt", "decode_density", "indexer_recall", "window"])
    if skipped:
        print(f"skipped at the deadline: {skipped}")
    return {"rows": rows, "summary": summary, "calibration": calibration, "dense": dense_rows, "out": out_dir}


def plot(result: dict, png_path: Path) -> None:
    c = result["config"]
    if c.get("selection_only"):
        return plot_selection(result["rows"], png_path, f"RTPurbo selection vs the dense top-{c['top_p']} set "
                                                        f"({c['context']}-token context)")
    rows = result["rows"]
    tasks = sorted({r["task"] for r in rows})
    fig, axes = subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        rs = [r for r in rows if r["task"] == task]
        first = {c: next(r for r in rs if r["context"] == c) for c in sorted({r["context"] for r in rs})}
        plot_series(ax, first.values(), "context", "dense_acc", yerr="dense_se", label="dense", color="black",
                    capsize=3)
        plot_series(ax, rs, "context", "sparse_acc", "config", yerr="sparse_se", label="RTPurbo {}", style="s-",
                    capsize=3)
        ax2 = ax.twinx()
        plot_series(ax2, rs, "context", "decode_density", "config", style=".--", alpha=0.6)
        ax.set_xscale("log", base=2)
        ax.set(ylim=(-0.02, 1.02), xlabel="context (tokens)", ylabel="greedy exact-match accuracy", title=task)
        ax2.set(ylim=(0, 1), ylabel="decode density (dashed)")
        ax.legend(fontsize=7, loc="lower left")
    save_figure(fig, png_path, "RTPurbo vs dense on a model trained on the tasks")


def build_parser():
    p = base_parser(__doc__.splitlines()[0], [
        ("--model", str, None, "a trained model's folder (tune run sparrow_sft ... output_dir=DIR)"),
        ("--device", device_arg, "auto", None), ("--lengths", str, "", "comma-separated contexts (default 512, 1024, ... trained max)"),
        ("--examples", int, None, "held-out examples per task and context (default 200; quick 8)"),
        ("--configs", str, "", "';'-separated RTPurbo variants, e.g. 'ratio=0.15;ratio=0.25,top_p=0.95' (keys: "
         + ", ".join(VARIANT_KEYS) + ")"),
        *calibration_options(300, prefill_impl="reference"), ("--decode-block", int, 64, None),
        ("--prefill-block", int, 128, None), ("--ret-window", int, 128, None),
        ("--window", int, None, "local window (default 1/16 of the calibration context)"),
        ("--jitter", int, None, "example i of context L has L - (37 i mod JITTER) characters (default 128; 0: L)"),
        ("--rows", int, 64, "engine rows (prompts decoded at once)"), ("--prefill-tokens", int, 32768, None),
        ("--handled", float, 0.9, "dense accuracy that counts as handling a context"),
        ("--calibration-context", int, None, "calibrate (and scale the window) here (default: the longest handled)"),
        ("--deadline-minutes", float, None, "past this many minutes the remaining RTPurbo rows are skipped"),
        ("--head-scores", ["ablation", "attention"], "ablation", "retrieval heads by the loss when a head is made "
         "local, or by attention mass"),
        ("--selection-seqs", int, None, "held-out sequences of the selection measurement (default 8; quick 2)"),
        ("--decode-queries", int, 16, "the selection's decode region: each sequence's last N positions"),
        ("--model-config", str, None, "with --selection-only: a recipe config naming model, checkpoint and task"),
        ("--ratio", float, 0.25, "with --selection-only: retrieval-head ratio"),
        ("--selection-only", dict(action="store_true", help="measure the selection only (no accuracy)"))])
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    fill_defaults(args, args.quick, examples=(8, 200), fit_steps=(20, 300), selection_seqs=(2, 8), jitter=(16, 128),
                  **CALIBRATION_DEFAULTS)
    if args.selection_only and not args.model_config:
        raise SystemExit("--selection-only needs --model-config (a recipe config with model, checkpoint and task)")
    return run(args)


if __name__ == "__main__":
    main()

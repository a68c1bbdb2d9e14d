"""Speculative rollout: autoregressive vs SD always-on vs SD + cost-model toggle + adaptive draft length.

Question: on a GRPO rollout batch with long-tailed response lengths and long prompts, how much does the engine's
speculative path (quantized self-drafter over the shared KV cache, exact rejection sampling) cut rollout latency,
and does the cost-model toggle keep it from ever being slower than plain decoding at any active batch size?
A Qwen2.5-0.5B-shaped model (``--model 1.5b``), bf16, trained *in this run* for ``--train-seconds`` on
:class:`~sparrow.training.MarkovEpisodes` (so that acceptance comes from peaked, structured distributions). One engine for all runs (compiled steps and
CUDA graphs shared): AR, SD with the cost-model toggle, SD always-on; then the three at each batch bucket held
fixed (``per_batch``); then plain decoding through the engine as it was before fused projections and shared-prefix
decode (``--engine-before``: phase ``engine_before``, ``per_batch_before``, ratios in ``engine_before``), compiled
and captured before its clock as the first (``--weight off``: no drafter, AR alone). JSON rewritten after every run.

Run (H200): ``python benchmarks/bench_speculative.py``; CPU smoke run: ``python benchmarks/bench_speculative.py --quick``.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from sparrow.bench import (T0, base_parser, first_working, free_memory, log, plot_series, print_table, save_figure,
                           subplots, triton_interpreter_without_cuda, write_json)

triton_interpreter_without_cuda()  # the CPU smoke runs: Triton through its interpreter, before it is imported

import sparrow.models as sm
from sparrow.rollout import EngineConfig, RolloutEngine, SamplingParams, batch_buckets
from sparrow.rollout.summary import engine_before, engine_speedups, fixed_batch_runs, phase_tables, policy_runs
from sparrow.speculative import (AdaptiveDraft, AlwaysOff, AlwaysOn, CostModel, CostModelToggle, DrafterConfig,
                                 QuantizedSelfDrafter)
from sparrow.training import MarkovEpisodes, init_weights, train_on_episodes

NAME = "speculative"
EOS = MarkovEpisodes.EOS


def build_model(args, device, dtype):
    max_len = args.max_prompt + args.max_new + args.max_draft + 8
    torch.manual_seed(0)
    if args.quick:
        model = sm.tiny_qwen2(vocab_size=256, max_seq_len=max_len)
    else:
        model = (sm.qwen2_5_1_5b if args.model == "1.5b" else sm.qwen2_5_0_5b)(max_seq_len=max_len)
    init_weights(model, 0.02, zero_bias=True)
    return model.to(device=device, dtype=dtype).eval()


def toggles(args, costs):
    """The three decoding policies compared: (name, toggle), a fresh toggle each time (AR alone without a drafter)."""
    if costs is None:
        return [("AR", AlwaysOff())]
    adaptive = AdaptiveDraft(lengths=tuple(args.lengths), prior=args.prior)
    return [("AR", AlwaysOff()),
            ("SD toggle+adaptive", CostModelToggle(costs, margin=args.margin, hysteresis=args.hysteresis,
                                                   adaptive=adaptive, probe_every=args.probe_every)),
            (f"SD always k={args.always_k}", AlwaysOn(args.always_k))]


def build_parser():
    p = base_parser(__doc__.split("\n")[0], [
        ("--prompts", int, 32, None), ("--samples", int, 8, None),
        ("--min-prompt", int, 2048, None), ("--max-prompt", int, 32768, None), ("--max-new", int, 8192, None),
        ("--max-draft", int, 8, None), ("--min-mean", float, 128, "mean response length of the shortest class"),
        ("--max-mean", float, 8192, "mean response length of the longest class"), ("--always-k", int, 4, None),
        ("--window", int, 1024, "draft attention window (0: full)"), ("--sink", int, 4, None),
        ("--margin", float, 0.05, None), ("--hysteresis", float, 0.03, None),
        ("--per-batch-tokens", int, 512, "tokens per row at each fixed batch size after the rollouts (0: skip)"),
        ("--probe-every", int, 8, "cost-model toggle: while off, speculate one block in this many"),
        ("--prior", float, 0.8, "acceptance assumed before any is measured"), ("--block-steps", int, 16, None),
        ("--bucket-growth", int, 2, "batch buckets are powers of this (4: half the CUDA graphs)"),
        ("--train-seconds", float, 60.0, None), ("--train-seq", int, 2048, None), ("--train-batch", int, 8, None),
        ("--lr", float, 3e-4, "AdamW peak (1e-3 stalled a 0.5B model at loss ~7.3 against a floor of 1.76)"),
        ("--warmup-steps", int, 50, None), ("--deadline-minutes", float, None, "skip runs that would end past it"),
        ("--calib-steps", int, 6, None), ("--model", ["0.5b", "1.5b"], "0.5b", None),
        ("--weight", ["int8", "int4", "fp8", "none", "off"], "int8", "drafter weights (off: AR alone)"),
        ("--lengths", dict(type=int, nargs="+", default=[2, 4, 8], help="adaptive draft-length ladder")),
        ("--engine-before", ["on", "off"], "on", "also decode through the engine before fused projections and "
                                                 "shared-prefix decode"),
        ("--compile-cache", str, None, "directory for the compiled steps (EngineConfig.compile_cache): a later run "
                                       "of the same shapes loads them"),
        ("--compile", dict(action="store_true", help="compile the steps off CUDA too (a slow smoke test)"))])
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.quick:
        args.prompts, args.samples, args.min_prompt, args.max_prompt, args.max_new = 4, 2, 48, 192, 96
        args.train_seconds, args.train_seq, args.train_batch, args.window, args.max_draft = 6.0, 256, 4, 32, 4
        args.lengths, args.always_k, args.block_steps, args.calib_steps, args.lr, args.warmup_steps = [2, 4], 3, 4, 2, 3e-3, 5
        torch.set_num_threads(1)
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    task = MarkovEpisodes(**(dict(n_classes=4, per_class=32, min_mean=8, max_mean=64) if args.quick else
                             dict(min_mean=args.min_mean, max_mean=args.max_mean)), device=device)
    model = build_model(args, device, dtype)
    assert task.vocab_needed <= model.tok_embeddings.num_embeddings
    prompts, classes = task.prompts(args.prompts, args.min_prompt, args.max_prompt, seed=7)
    log(f"model: {'tiny' if args.quick else args.model} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M "
        f"params), {args.prompts} prompts x {args.samples} samples, prompt tokens {sum(map(len, prompts))} "
        f"(min {min(map(len, prompts))}, max {max(map(len, prompts))})")
    rows = args.prompts * args.samples
    buckets = tuple(batch_buckets(rows, args.bucket_growth, smallest=2))  # no bucket 1: one compile less
    cfg = EngineConfig(max_rows=rows, max_prompts=args.prompts, max_prompt_len=args.max_prompt,
                       max_new_tokens=args.max_new, max_draft=args.max_draft, block_steps=args.block_steps,
                       compile=cuda or args.compile, cuda_graphs=cuda, prefill_tokens=max(32768, args.max_prompt),
                       batch_buckets=buckets, compile_cache=args.compile_cache)
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new, stop_token_ids=(EOS,), seed=0)
    results: list[dict] = []
    extra: dict = {"classes": classes, "class_mean_lengths": task.means, "task_entropy_nats": task.entropy()}
    # drafter variants in order: a failure to compile / capture one falls back to the next
    variants = [("off", None)] if args.weight == "off" else list(dict.fromkeys([
        (args.weight, args.window or None), ("none", args.window or None), (args.weight, None), ("none", None)]))
    def build(variant):  # a drafter variant compiled, captured and its costs calibrated (off: no drafter)
        drafter = None if variant[0] == "off" else QuantizedSelfDrafter(
            model, DrafterConfig(weight=variant[0], window=variant[1], sink=args.sink))
        engine = RolloutEngine(model, cfg, drafter=drafter)
        t = time.perf_counter()
        prep = engine.prepare(params, draft_lengths=tuple(args.lengths) + (args.always_k,))
        log(f"drafter {drafter!r}: compiled and captured every step in {prep:.1f}s (KV cache "
            f"{engine.cache_nbytes() / 2**30:.1f} GiB)")
        costs = None if drafter is None else CostModel.calibrate(
            engine, params, draft_lengths=(min(args.lengths), max(args.lengths)), steps=args.calib_steps,
            cache_dir=None if args.quick else Path.home() / ".cache" / "sparrow")
        extra.update(prepare_s=prep, calibration_s=time.perf_counter() - t - prep, setup_s=engine.setup_seconds)
        return engine, drafter, costs

    _, (engine, drafter, costs) = first_working(variants, build, "drafter variant (weight, window)")
    extra["drafter"] = repr(drafter)
    ctx = (args.min_prompt + args.max_prompt) / 2
    if costs is not None:
        extra["calibration"] = cal = costs.table(ctx, args.lengths)
        print("\nCost model (calibrated on this engine; ms per step at the middle context):")
        print_table(cal, list(cal[0]))
    deadline = T0 + 60 * args.deadline_minutes if args.deadline_minutes else None
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()} | {
        "model_shape": "tiny" if args.quick else f"qwen2.5-{args.model}", "drafter": repr(drafter), "dtype": str(dtype)}

    def save(phase_rows: list[dict]) -> None:
        done = [r for r in results if r["phase"] != phase_rows[0]["phase"]] + phase_rows
        write_json(NAME + ("_quick" if args.quick else ""), config, done, args.out, extra=extra)

    log(f"training for {args.train_seconds:.0f}s (loss floor inside episodes ~{task.entropy():.2f} nats)")
    extra["training"] = train_on_episodes(model, task, seq_len=args.train_seq, batch=args.train_batch, lr=args.lr,
                                          warmup_steps=args.warmup_steps, minutes=args.train_seconds / 60,
                                          device=device, log=log)
    free_memory()
    if drafter is not None:
        drafter.refresh()  # a weight sync happened: re-quantize in place (graphs stay valid)
        drafter.refresh()  # again, for the time of a warm refresh (the first pays one-off kernel compiles)
        extra["refresh_s"] = drafter.last_refresh_s
        log(f"drafter.refresh(): {drafter.last_refresh_s * 1e3:.1f} ms; phase 'trained'")
    results += policy_runs("trained", engine, prompts, args.samples, params, toggles(args, costs), save=save,
                           deadline=deadline, log=log)
    print(phase_tables(results, ["run", "latency_s", "prefill_s", "decode_s", "tokens", "decode_tok_s", "speedup_vs_ar",
                                 "latency_reduction", "acceptance", "tokens_per_cycle", "len_p50", "len_max"]))
    if args.per_batch_tokens:
        log(f"phase 'per_batch' ({args.per_batch_tokens} tokens per row, the batch held fixed)")
        fixed = SamplingParams(temperature=1.0, max_new_tokens=min(args.per_batch_tokens, args.max_new),
                               stop_token_ids=(), seed=1)  # no stop token: the batch never shrinks
        extra["per_batch"] = fixed_batch_runs(engine, cfg.buckets, prompts, args.samples, fixed,
                                              lambda: toggles(args, costs), deadline=deadline, log=log)
        if results:
            save([r for r in results if r["phase"] == results[-1]["phase"]])  # rewrites the JSON with the table
        if extra["per_batch"]:
            print_table(extra["per_batch"], list(extra["per_batch"][0]))
    if args.engine_before == "on" and (deadline is None or time.perf_counter() < deadline):
        log("phase 'engine_before': plain decoding through the engine before fused projections and shared prefix")
        old = engine_before(model, cfg)
        old.prepare(params)  # compiled and captured outside the clock, as the engine above
        ar = [("AR", AlwaysOff())]
        results += policy_runs("engine_before", old, prompts, args.samples, params, ar, save=save, log=log)
        if args.per_batch_tokens:  # (past the deadline, buckets are skipped, as above)
            extra["per_batch_before"] = fixed_batch_runs(old, cfg.buckets, prompts, args.samples, fixed, lambda: ar,
                                                         deadline=deadline, log=log)
        now = next(r for r in results if r["phase"] == "trained" and r["run"] == "AR")
        extra["engine_before"] = engine_speedups(now, results[-1], extra.get("per_batch") or [],
                                                 extra.get("per_batch_before") or [])
        save([r for r in results if r["phase"] == "engine_before"])
        print("engine now over before (AR):", extra["engine_before"])


def plot(result: dict, png: Path) -> None:
    rows = [r for r in result["rows"] if r.get("phase") == "trained"] or result["rows"]
    before = [dict(r, run=f"{r['run']} (engine before)") for r in result["rows"] if r.get("phase") == "engine_before"]
    per_batch = result.get("per_batch") or []
    fig, ax = subplots(1, 3 if per_batch else 2, figsize=(16 if per_batch else 11, 4))
    for r in rows + before:
        pts = [{"bucket": int(b), "tok_s": v} for b, v in r["bucket_tok_s"].items()]
        plot_series(ax[0], pts, "bucket", "tok_s", label=r["run"])
    ax[0].set(xscale="log", xlabel="active batch bucket", ylabel="decode tokens/s")
    ax[0].set_xscale("log", base=2)
    ax[0].legend()
    ax[1].bar([r["run"] for r in rows + before], [r["latency_s"] for r in rows + before])
    ax[1].set_ylabel("rollout latency (s)")
    if per_batch:  # speculation over AR at each batch held fixed, and the engine now over before (AR)
        series = [(per_batch, k, k.replace(" /AR", "")) for k in per_batch[0] if k.endswith("/AR")]
        series += [((result.get("engine_before") or {}).get("fixed") or [], "speedup", "AR, engine now / before")]
        for pts, key, label in (s for s in series if s[0]):
            plot_series(ax[2], pts, "batch", key, label=label)
        ax[2].axhline(1.0, color="grey", lw=0.8)
        ax[2].set_xscale("log", base=2)
        ax[2].set(xlabel="active batch (held fixed)", ylabel="decode speed ratio (x)")
        ax[2].legend()
    save_figure(fig, png, "Speculative rollout (" + result["config"].get("model_shape", "") + ")")


if __name__ == "__main__":
    main()

"""Rollout engine vs Hugging Face ``transformers.generate``: decode tokens/s and prefill time.

Question: how fast does Sparrow's engine sample GRPO groups (P prompts x G samples) from a
Qwen2.5-0.5B-shaped model, against ``transformers`` ``generate`` (what TRL uses without vLLM) on the same
weights, prompts and shapes, in the same run?

Workload per point: batch B = P x G rows (G = 8 samples per prompt when B >= 8, else G = B), random prompts
of L tokens, N new tokens per row, sampling at temperature 1 with no stop token (every row runs N steps).
Prefill time = time of ``generate`` with one new token; decode tokens/s = B x (N - 1) / (time with N new
tokens - prefill time). Sparrow's engine prefills each prompt once for its G rows (its prefix sharing);
``transformers`` prefills all B rows. Prefix sharing is also measured on its own (Sparrow with and
without it). Correctness in the same run: greedy tokens and first-step logits of both on one prompt, and,
teacher-forced on the engine's greedy tokens, the gap from each pick to ``transformers``' top logit (a near-tie in
bf16 can flip a pick).

Shared-prefix decode (``--shared-prefix both``): the same points through a second engine whose attention reads
every row's prompt itself (``DenseAttention(shared_prefix=False)``, the kernel before shared-prefix decode), keys
``off_*``. Each decode step is put against its roofline (:mod:`sparrow.rollout.roofline`: bf16 weights once, each
group's prompt KV once, each row's generated KV, 2 x parameters FLOPs per row, at ``--bandwidth-tbs`` and
``--tflops``): ``*_roofline_fraction``. ``breakdown``: one decode step at 1 and 64 rows (8 groups of 8, prompts of
``--breakdown-len``) under ``torch.profiler``, kernel time per step grouped by kernel name (CPU operators on CPU).
Fused projections (``--fused-projections both``): a third engine with ``EngineConfig(fuse_projections=False)``
(q / k / v and gate / up as separate matmuls, as before the fusion), keys ``unfused_*``, ``fused_speedup``. Inductor
settings (``--tuned triton.enable_pdl=True ...``): a fourth engine with ``EngineConfig(inductor_options=...)``, keys
``tuned_*``, ``tuned_speedup`` (its tokens/s over the default engine's). The baseline (``--before on``): the engine
before fused projections and shared-prefix decode (:func:`sparrow.rollout.summary.engine_before`), keys
``before_*``, ``before_speedup`` (the default engine's tokens/s over it).

Run (H200): ``python benchmarks/bench_engine.py``; smoke run on CPU: ``python benchmarks/bench_engine.py --quick``.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import time
from functools import partial
from pathlib import Path

import torch

from sparrow.bench import (KERNEL_KINDS, base_parser, copy_bandwidth_gbs, device_dtype, free_memory, kernel_times,
                           plot_series, print_table, save_figure, stacked_bars, step_shares, subplots, synchronize,
                           triton_interpreter_without_cuda, write_json)

triton_interpreter_without_cuda()  # the CPU smoke runs: Triton through its interpreter, before it is imported

from sparrow.rl.runs import median

import sparrow.models as sm
from sparrow.attention import DenseAttention
from sparrow.rollout import EngineConfig, RolloutEngine, SamplingParams, generate_reference
from sparrow.rollout.roofline import DecodeFootprint, decode_step_roofline
from sparrow.rollout.summary import engine_before
from sparrow.training import init_weights

NAME = "engine"


def build_models(max_len: int, device: str, quick: bool):
    """Sparrow's model (random weights) and its ``transformers`` twin (``sparrow.models.hf_twin``), and the vocab."""
    torch.manual_seed(0)
    if quick:
        model = sm.qwen2(vocab_size=512, num_layers=2, num_heads=14, num_kv_heads=2, embed_dim=896,
                         intermediate_dim=1024, max_seq_len=max_len, tie_word_embeddings=True)
    else:
        model = sm.qwen2_5_0_5b(max_seq_len=max_len)
    init_weights(model, 0.02)
    model = model.to(device=device, dtype=device_dtype()[1]).eval()
    return model, sm.hf_twin(model), model.tok_embeddings.num_embeddings


def hf_generate(hf, input_ids, new_tokens):
    synchronize()
    t0 = time.perf_counter()
    hf.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True, temperature=1.0,
                top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, eos_token_id=None,
                pad_token_id=0)
    synchronize()
    return time.perf_counter() - t0


def kernel_breakdown(model, L: int, group: int, new_tokens: int, device: str, steps: int = 5, **settings) -> dict:
    """One plain decode step at 1 and 64 rows (``64 // group`` prompts of ``L`` tokens, ``new_tokens // 2``
    generated) under ``torch.profiler``: per step, the wall time and the time of each kernel name (CUDA kernels;
    CPU operators' self time without CUDA), largest first (:func:`sparrow.bench.kernel_times`)."""
    cfg = EngineConfig(max_rows=64, max_prompts=64 // group, batch_buckets=(1, 64), max_prompt_len=L,
                       max_new_tokens=new_tokens, compile=device == "cuda", **settings)
    engine, out = RolloutEngine(model, cfg), {}
    for rows in (1, 64):
        ctx = L + new_tokens // 2
        engine.time_step("decode", rows, context=ctx, steps=2)  # compile and capture outside the profile
        step_s = []
        k = kernel_times(lambda: step_s.append(engine.time_step("decode", rows, context=ctx, steps=steps)),
                         runs=steps + 1)  # steps + 1 runs
        out[str(rows)] = {"step_ms": step_s[0] * 1e3, **k}
    return out


def main() -> None:
    ap = base_parser(__doc__.split("\n\n")[0], [
        ("--group", int, 8, None), ("--new-tokens", int, 128, None), ("--repeats", int, 3, None),
        ("--hf-max-tokens", int, 2_200_000, "skip transformers above B*(L+N)"),
        ("--shared-prefix", ["both", "auto"], "both", "also measure an engine without shared-prefix decode"),
        ("--fused-projections", ["both", "on"], "both", "also measure an engine with separate projections"),
        ("--tuned", dict(nargs="*", default=[], metavar="KEY=VALUE", help="a fourth engine's Inductor options")),
        ("--before", ["on", "off"], "on", "also measure the engine before fused projections and shared-prefix decode"),
        ("--bandwidth-tbs", float, 4.2, "roofline copy bandwidth"), ("--tflops", float, 778.0, "roofline bf16 FLOP/s"),
        ("--breakdown-len", int, 8192, "prompt length of the per-kernel breakdown (0: skip it)"),
        ("--prompt-lens", dict(type=int, nargs="+", default=[1024, 8192, 32768])),
        ("--batches", dict(type=int, nargs="+", default=[1, 8, 32, 128, 256]))])
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.quick:
        args.prompt_lens, args.batches, args.new_tokens, args.repeats = [64, 256], [1, 8], 16, 1
        args.breakdown_len = min(args.breakdown_len, 64)
    max_len = max(args.prompt_lens + [args.breakdown_len]) + args.new_tokens + 8
    model, hf, vocab = build_models(max_len, device, args.quick)
    models = {"auto": model}  # shared-prefix decode as the engine chooses it; "off": every row reads its prompt
    if args.shared_prefix == "both":
        models["off"] = sm.use_attention(copy.deepcopy(model), partial(DenseAttention, shared_prefix=False))
    if args.fused_projections == "both":
        models["unfused"] = copy.deepcopy(model)
    tuned = {k: ast.literal_eval(v) for k, v in (a.split("=", 1) for a in args.tuned)}
    if tuned:
        models["tuned"] = copy.deepcopy(model)
    settings = {"auto": {}, "off": {}, "unfused": {"fuse_projections": False}, "tuned": {"inductor_options": tuned}}
    max_b = max(args.batches)
    cfg = EngineConfig(max_rows=max_b, max_prompts=max(1, max_b // args.group) * 2, max_prompt_len=max(args.prompt_lens),
                       max_new_tokens=args.new_tokens, block_steps=16, compile=device == "cuda", prefill_tokens=65536)
    engines = {mode: RolloutEngine(m, dataclasses.replace(cfg, **settings[mode]))
               for mode, m in models.items()}
    if args.before == "on":
        engines["before"] = engine_before(model, cfg)
    engine = engines["auto"]
    footprint = DecodeFootprint.of(model, torch.bfloat16 if device == "cuda" else None)
    rates = dict(bandwidth=args.bandwidth_tbs * 1e12, flops=args.tflops * 1e12)
    extra = {"copy_tbs_measured": copy_bandwidth_gbs() / 1e3 if device == "cuda" else None}
    gen = torch.Generator().manual_seed(0)

    # -- correctness in the same run: greedy tokens and first-step logits on one prompt
    prompt = torch.randint(0, vocab, (1, 200), generator=gen)
    g = engine.generate([prompt[0].tolist()], 1, SamplingParams(temperature=0.0, max_new_tokens=16))
    with torch.no_grad():
        hf_out = hf.generate(input_ids=prompt.to(device), do_sample=False, max_new_tokens=16, min_new_tokens=16,
                             eos_token_id=None, pad_token_id=0)[0, 200:].cpu()
        ours_logits = model(prompt.to(device))[0, -1].float()
        hf_logits = hf(prompt.to(device)).logits[0, -1].float()
        # teacher-forced on the engine's tokens: how far each pick is from transformers' top logit (0: the argmax)
        forced = hf(torch.cat([prompt[0], g[0].tokens]).to(device)[None]).logits[0, 199:-1].float()
        own = generate_reference(model, [prompt[0].tolist()], 1, SamplingParams(temperature=0.0, max_new_tokens=16))
    top2 = forced.topk(2).values
    gap = top2[:, 0] - forced.gather(-1, g[0].tokens.to(device)[:, None])[:, 0]
    agree = int((g[0].tokens == hf_out).long().cumprod(0).sum())
    check = {"greedy_prefix_agreement": agree, "greedy_tokens": 16,
             "greedy_prefix_agreement_eager_sparrow": int((g[0].tokens == own[0].tokens).long().cumprod(0).sum()),
             "greedy_max_gap_to_hf_top": float(gap.max()), "hf_top2_margin_min": float((top2[:, 0] - top2[:, 1]).min()),
             "first_logits_max_abs_diff": float((ours_logits - hf_logits).abs().max()),
             "first_logits_scale": float(hf_logits.abs().max())}
    print("correctness:", check)

    rows = []
    for L in args.prompt_lens:
        for B in args.batches:
            G = args.group if B >= args.group else B
            P = B // G
            prompts = [torch.randint(0, vocab, (L,), generator=gen).tolist() for _ in range(P)]
            row = {"prompt_len": L, "batch": B, "prompts": P, "group": G, "new_tokens": args.new_tokens}
            sp = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, seed=1)
            floor = decode_step_roofline(footprint, [L] * P, [args.new_tokens / 2] * B, **rates)
            row["roofline_step_ms"] = floor.seconds * 1e3
            tokens = {}
            for mode, eng in engines.items():
                key = "sparrow" if mode == "auto" else mode
                eng.generate(prompts, G, sp)  # warm-up: compile / capture this bucket
                pre, dec, step = [], [], []
                for r in range(args.repeats):
                    out = eng.generate(prompts, G, SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens,
                                                                  seed=2 + r))
                    assert all(s.length == args.new_tokens for s in out)
                    tokens[mode] = [s.tokens.tolist() for s in out]
                    pre.append(out.stats.prefill_s)
                    dec.append(out.stats.decode_s)
                    step.append(out.stats.decode_s / out.stats.decode_steps)
                row |= {f"{key}_prefill_s": median(pre), f"{key}_decode_s": median(dec),
                        f"{key}_decode_tok_s": B * (args.new_tokens - 1) / median(dec),
                        f"{key}_step_ms": median(step) * 1e3, f"{key}_roofline_fraction": floor.fraction(median(step))}
            for name, a, b in (("fused", "sparrow", "unfused"), ("tuned", "tuned", "sparrow"),
                               ("before", "sparrow", "before"), ("shared_prefix", "sparrow", "off")):
                if f"{a}_decode_tok_s" in row and f"{b}_decode_tok_s" in row:  # tokens/s ratios
                    row[f"{name}_speedup"] = row[f"{a}_decode_tok_s"] / row[f"{b}_decode_tok_s"]
            if "off" in engines:
                # bf16 sums in another order: a near-tie may flip a token (and the rest of that sample)
                row["samples_same_as_off"] = sum(a == b for a, b in zip(tokens["auto"], tokens["off"])) / B
            # prefix sharing on its own: the same rows prefilled once per sample (G identical prompts)
            if P * G <= cfg.num_prefixes and G > 1:
                out = engine.generate([p for p in prompts for _ in range(G)], 1,
                                      SamplingParams(temperature=1.0, max_new_tokens=1, seed=9))
                row["sparrow_prefill_unshared_s"] = out.stats.prefill_s
            if B * (L + args.new_tokens) <= args.hf_max_tokens:
                ids = torch.tensor([p for p in prompts for _ in range(G)], device=device)
                try:
                    hf_generate(hf, ids, 2)  # warm-up
                    hp = median([hf_generate(hf, ids, 1) for _ in range(args.repeats)])
                    ht = median([hf_generate(hf, ids, args.new_tokens) for _ in range(args.repeats)])
                    row["hf_prefill_s"] = hp
                    row["hf_decode_s"] = ht - hp
                    row["hf_decode_tok_s"] = B * (args.new_tokens - 1) / (ht - hp)
                    row["decode_speedup"] = row["sparrow_decode_tok_s"] / row["hf_decode_tok_s"]
                    row["prefill_speedup"] = hp / row["sparrow_prefill_s"]
                    row["end_to_end_speedup"] = ht / (row["sparrow_prefill_s"] + row["sparrow_decode_s"])
                except torch.OutOfMemoryError:
                    row["hf"] = "out of memory"
                del ids
                free_memory()
            else:
                row["hf"] = "skipped (memory)"
            rows.append(row)
            print_table([row], list(row))
            extra |= {"correctness": check, "cache_gib": engine.cache_nbytes() / 2**30}
            write_json(NAME, vars(args) | {"model": "qwen2_5_0_5b shape, random weights, bf16"}, rows, args.out, extra)
    print_table(rows, ["prompt_len", "batch", "sparrow_prefill_s", "hf_prefill_s", "sparrow_decode_tok_s",
                       "hf_decode_tok_s", "decode_speedup", "end_to_end_speedup", "sparrow_prefill_unshared_s",
                       "roofline_step_ms", "sparrow_roofline_fraction", "off_roofline_fraction"])
    if args.breakdown_len:
        del engine, eng
        engines.clear()
        free_memory()
        extra["breakdown"] = {mode: kernel_breakdown(m, args.breakdown_len, args.group, args.new_tokens, device,
                                                     **settings[mode])
                              for mode, m in models.items()}
        for mode, b in extra["breakdown"].items():
            for n, r in b.items():
                print(f"{mode} {n} rows: step {r['step_ms']:.3f} ms, kernels {r['kernel_us_per_step']:.0f} us/step, "
                      f"{r['calls_per_step']:.0f} launches/step")
                print_table(r["kernels"][:8], ["us", "calls", "name"])
        write_json(NAME, vars(args) | {"model": "qwen2_5_0_5b shape, random weights, bf16"}, rows, args.out, extra)


def plot(result: dict, png: Path) -> None:
    rows = result["rows"]
    breakdown = result.get("breakdown") or {}
    fig, axes = subplots(1, 3 + bool(breakdown), figsize=(16 + 5 * bool(breakdown), 4))
    # a result joined from several runs (rows with a "run" field, e.g. two revisions) draws one series per run
    for L, run in sorted({(r["prompt_len"], r.get("run", "")) for r in rows}):
        rs = [r for r in rows if r["prompt_len"] == L and r.get("run", "") == run]
        at = f"{L // 1024}K" + (f" ({run})" if run else "")
        c = plot_series(axes[0], rs, "batch", "sparrow_decode_tok_s", label=f"Sparrow {at}")[0].get_color()
        plot_series(axes[0], rs, "batch", "hf_decode_tok_s", style="x--", color=c, label=f"transformers {at}")
        plot_series(axes[1], rs, "batch", "sparrow_prefill_s", color=c, label=f"Sparrow {at}")
        plot_series(axes[1], rs, "batch", "hf_prefill_s", style="x--", color=c, label=f"transformers {at}")
        for key, style, name in (("sparrow", "o-", "default"), ("off", "s:", "per-row kernel"),
                                 ("unfused", "^-.", "unfused projections"), ("tuned", "d--", "tuned"),
                                 ("before", "v:", "engine before")):
            plot_series(axes[2], rs, "batch", f"{key}_roofline_fraction", style=style, color=c,
                        label=f"{at} {name}")
    axes[0].set(xscale="log", yscale="log", xlabel="batch (rows)", ylabel="decode tokens/s",
                title="Decode throughput")
    axes[1].set(xscale="log", yscale="log", xlabel="batch (rows)", ylabel="prefill time (s)",
                title="Prefill (G=8 rows share a prompt)")
    axes[2].set(xscale="log", xlabel="batch (rows)", ylabel="roofline time / step time", title="Decode step vs roofline")
    if breakdown:  # one bar per engine and row count, stacked by kind of kernel
        bars = {f"{'default' if mode == 'auto' else mode}, {n} row{'s' * (n != '1')}": step_shares(step)
                for mode, steps in breakdown.items() for n, step in steps.items()}
        stacked_bars(axes[3], list(bars), {kind: [us[kind] for us in bars.values()] for kind in KERNEL_KINDS})
        axes[3].set(ylabel="microseconds per decode step",
                    title=f"One decode step, {result['config']['breakdown_len'] // 1024}K prompts")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, png, f"Qwen2.5-0.5B shape, {result['environment']['device']}")


if __name__ == "__main__":
    main()

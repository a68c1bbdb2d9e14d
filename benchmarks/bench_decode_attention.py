"""Dense decode / verify attention over the engine's two-level KV cache: split count by cache length alone
against split count fitted to the batch, and both against the bandwidth floor.

Question: how close does the split-KV Triton kernel (``sparrow.kernels.decode_attention``) come to reading
the KV cache at memory speed, for one decode token per row (``T = 1``) and for speculative verification
(``T = k + 1`` queries per row), at the active batch sizes of a long-tailed rollout? Every split writes a
partial output of all its queries (fp32) that a merge kernel reads back: with as many splits as the cache
length allows (``length``: up to 64) that traffic grows with ``T`` and the batch, and at 256 rows of verify
queries it rivals the KV bytes themselves. ``batch`` (the default launch) keeps only the splits needed to
fill the GPU (:func:`~sparrow.kernels.decode_attention.triton_decode.splits_for_batch`).

Workload: one attention layer of Qwen2.5-0.5B (14 q heads, 2 kv heads, head_dim 64) and -1.5B (12 / 2 / 128),
bf16; ``A`` rows, each with its own prompt slot (lengths uniform in ``[--min-prompt, --max-prompt]``) and
generation slot (``--generated`` tokens cached); random q / K / V. Each launch is replayed as a CUDA graph,
median of CUDA events. ``floor_ms``: the KV bytes the rows attend to, read once at the device-to-device copy
bandwidth measured in the same run. Correctness: the batch-fitted output against the length-split one, and
both against the eager reference on a few rows.

Usage: ``python benchmarks/bench_decode_attention.py`` (H200: ~1 min), ``--quick`` (CPU, interpreter).
"""

from __future__ import annotations

from pathlib import Path

import torch

from sparrow.bench import (base_parser, copy_bandwidth_gbs, device_dtype, graphed, measure, plot_series, print_table,
                           rel_err, save_figure, subplots, triton_interpreter_without_cuda, write_json)

triton_interpreter_without_cuda()  # the CPU smoke runs: Triton through its interpreter, before it is imported

from sparrow.kernels.decode_attention import decode_attention, prefix_groups
from sparrow.kernels.decode_attention import triton_cascade as tc
from sparrow.kernels.decode_attention import triton_decode as td

NAME = "decode_attention"
MODELS = {"qwen2.5-0.5b": (14, 2, 64), "qwen2.5-1.5b": (12, 2, 128)}  # q heads, kv heads, head_dim


def inputs(A, Hq, Hkv, D, T, min_prompt, max_prompt, generated, dev, dtype, g):
    """Random caches made on the device (``g``: a generator there) and prompt lengths drawn on the host."""
    Lp, Lg = max_prompt, generated + T
    rand = lambda *shape: torch.randn(*shape, generator=g, device=dev, dtype=dtype)  # noqa: E731
    q, pk, pv, gk, gv = rand(A, Hq, T, D), rand(A, Hkv, Lp, D), rand(A, Hkv, Lp, D), rand(A, Hkv, Lg, D), rand(A, Hkv, Lg, D)
    slots = torch.arange(A, device=dev)
    host = torch.Generator().manual_seed(A * 1000 + T)
    plen = torch.randint(min_prompt, max_prompt + 1, (A,), generator=host).to(dev)
    clen = torch.full((A,), generated, device=dev)
    return q, pk, pv, gk, gv, slots, slots, plen, clen


def splits(x, T: int, dev: torch.device) -> tuple[int, int]:
    """(splits by cache length, splits the default launch fits to the batch) for inputs ``x``."""
    cap = td.num_splits_for(x[1].shape[2] + x[3].shape[2])
    return cap, td.splits_for_batch(cap, x[0].shape[0], x[1].shape[1], td._sm_count(dev), T)


def run(args) -> None:
    saved = td.INTERPRETER_SM_COUNT
    td.INTERPRETER_SM_COUNT = 2 if args.quick else saved  # so the batch fit cuts splits under the interpreter
    try:
        _run(args)
    finally:
        td.INTERPRETER_SM_COUNT = saved


def _run(args) -> None:
    cuda = torch.cuda.is_available()
    dev, dtype = device_dtype()
    models = {"tiny": (4, 2, 16)} if args.quick else MODELS
    batches = [1, 3] if args.quick else [1, 4, 16, 64, 256]
    Ts = [1, 3] if args.quick else [1, 3, 5, 9]
    min_p, max_p, gen = (40, 700, 20) if args.quick else (args.min_prompt, args.max_prompt, args.generated)
    gbps = copy_bandwidth_gbs() if cuda else None
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for model, (Hq, Hkv, D) in models.items():
        for A in batches:
            for T in Ts:
                x = inputs(A, Hq, Hkv, D, T, min_p, max_p, gen, dev, dtype, g)
                length_splits, batch_splits = splits(x, T, dev)
                calls = {"length": lambda: td.decode_attention_triton(*x, num_splits=length_splits),
                         "batch": lambda: td.decode_attention_triton(*x)}
                outs = {k: fn() for k, fn in calls.items()}
                err = rel_err(outs["batch"], outs["length"])
                n = min(A, 2)  # the eager reference on a few rows
                ref = decode_attention(*(t[:n] for t in x[:1]), *x[1:5], *(t[:n] for t in x[5:]), impl="reference")
                ref_err = rel_err(outs["batch"][:n], ref)
                t = {k: measure(graphed(fn), warmup=3, iters=args.iters)["median_ms"] for k, fn in calls.items()}
                kv_bytes = int((x[7] + x[8] + T).sum()) * Hkv * D * 2 * x[1].element_size()
                row = {"model": model, "A": A, "T": T, "length_splits": length_splits, "batch_splits": batch_splits,
                       "length_ms": t["length"], "batch_ms": t["batch"], "speedup": t["length"] / t["batch"],
                       "kv_mb": kv_bytes / 1e6, "floor_ms": kv_bytes / (gbps * 1e6) if gbps else None,
                       "batch_vs_floor": (kv_bytes / (gbps * 1e6)) / t["batch"] if gbps else None,
                       "rel_err_batch_vs_length": err, "rel_err_vs_reference": ref_err}
                rows.append(row)
                print_table([row], list(row))
                tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
                assert err < tol and ref_err < tol, f"outputs disagree: {err:.3g}, {ref_err:.3g} (A={A}, T={T})"
    sweep = split_sweep(args, dev, dtype, g, min_p, max_p, gen) if args.sweep else []
    cascade = cascade_sweep(args, dev, dtype, g, gbps) if args.cascade else []
    print()
    print_table(rows, ["model", "A", "T", "length_splits", "batch_splits", "length_ms", "batch_ms", "speedup",
                       "floor_ms", "batch_vs_floor"])
    write_json(NAME, {"models": models, "batches": batches, "T": Ts, "min_prompt": min_p, "max_prompt": max_p,
                      "generated": gen, "dtype": str(dtype), "iters": args.iters, "copy_GBps": gbps,
                      "programs_per_sm": td.PROGRAMS_PER_SM, "decode_programs_per_sm": td.DECODE_PROGRAMS_PER_SM,
                      "longest_cut": td.LONGEST_CUT}, rows, args.out,
               extra={k: v for k, v in (("sweep", sweep), ("cascade", cascade)) if v} or None)


def split_sweep(args, dev, dtype, g, min_p, max_p, gen) -> list[dict]:
    """Every power-of-two split count at a few (rows, T) of the first model: where the optimum lies, and
    what the batch-fitted choice costs against it."""
    Hq, Hkv, D = next(iter(MODELS.values())) if not args.quick else (4, 2, 16)
    out = []
    for A in ([3] if args.quick else [16, 64, 256]):
        for T in ([1, 3] if args.quick else [1, 5]):
            x = inputs(A, Hq, Hkv, D, T, min_p, max_p, gen, dev, dtype, g)
            cap, chosen = splits(x, T, dev)
            counts = sorted({2 ** i for i in range(cap.bit_length()) if 2 ** i <= cap} | {chosen, cap})
            row = {"A": A, "T": T, "chosen": chosen}
            for n in counts:
                fn = lambda n=n: td.decode_attention_triton(*x, num_splits=n)  # noqa: E731
                row[f"{n}_ms"] = measure(graphed(fn), warmup=3, iters=args.iters)["median_ms"]
            best = min(counts, key=lambda n: row[f"{n}_ms"])
            row.update(best=best, chosen_vs_best=row[f"{best}_ms"] / row[f"{chosen}_ms"])
            out.append(row)
            print_table([row], list(row))
    return out


def cascade_sweep(args, dev, dtype, g, gbps) -> list[dict]:
    """Shared-prefix decode (``G`` rows on each prompt of ``L`` tokens, 64 generated each; G = 8 a full group, 1-4
    the thinned groups of a long-tailed rollout's tail) at each least prefix split length (``triton_cascade.PREFIX_MIN_CHUNK`` by default), against the per-row kernel on
    the same cache and against each prompt's KV read once at copy speed (``floor_ms``)."""
    Hq, Hkv, D = (4, 2, 16) if args.quick else MODELS["qwen2.5-0.5b"]
    out, suffix = [], tc.SUFFIX_MIN_CHUNK
    for L, A, T, G in [(L, A, T, G) for L in ([200] if args.quick else [8192, 32768])
                       for A in ([16] if args.quick else [32, 64, 256]) for T in ([1, 3] if args.quick else [1, 5])
                       for G in ([2, 8] if args.quick else [1, 2, 4, 8])]:
        x = list(inputs(A, Hq, Hkv, D, T, L, L, 64, dev, dtype, g))  # then G rows per prompt slot, all of L tokens
        x[1:3], x[6:8] = [t[:A // G] for t in x[1:3]], [torch.arange(A, device=dev) // G, torch.full_like(x[8], L)]
        groups = prefix_groups(x[6], x[7])
        calls = {"per_row": lambda: td.decode_attention_triton(*x)} | {
            f"chunk{c}": lambda c=c: tc.cascade_attention_triton(*x, *groups, min_rows=0, min_chunk=(c, suffix))
            for c in ([16, 64] if args.quick else [128, 256, 512, 1024])}
        kv_bytes = (A // G * L + A * (64 + T)) * Hkv * D * 2 * x[0].element_size()
        ref = calls["per_row"]()
        row = {"prompt_len": L, "A": A, "T": T, "group": G, "floor_ms": kv_bytes / (gbps * 1e6) if gbps else None,
               "max_rel_err": max(rel_err(fn(), ref) for fn in calls.values())}
        row |= {f"{k}_ms": measure(graphed(fn), warmup=3, iters=args.iters)["median_ms"] for k, fn in calls.items()}
        out.append(row)
        print_table([row], list(row))
        assert row["max_rel_err"] < (2e-2 if dtype == torch.bfloat16 else 1e-4), row
    return out


def plot(result: dict, png_path: Path) -> None:
    rows, cascade = result["rows"], result.get("cascade", [])
    models = sorted({r["model"] for r in rows})
    n = len(models) + bool(cascade)
    fig, axes = subplots(1, n, figsize=(5.5 * n, 4), squeeze=False)
    if cascade:  # the cascade's gain over the per-row kernel by group size, per (prompt, rows, T)
        ax = axes[0][-1]
        plot_series(ax, cascade, "group", lambda r: r["per_row_ms"] / r[f"chunk{tc.PREFIX_MIN_CHUNK}_ms"],
                    by=lambda r: (r["T"], r["prompt_len"], r["A"]), label=lambda k: "T=%d, %d x %d rows" % k, ms=3)
        ax.axhline(1, color="k", lw=0.8)
        ax.set(xscale="log", yscale="log", xlabel="rows per prompt (group)", ylabel="per-row ms / cascade ms",
               title="shared-prefix decode (0.5B shape)")
        ax.legend(fontsize=5, ncol=2)
    for ax, model in zip(axes[0], models):
        for i, T in enumerate(sorted({r["T"] for r in rows})):
            rs = [r for r in rows if r["model"] == model and r["T"] == T]
            plot_series(ax, rs, "A", "length_ms", style="s--", color=f"C{i}", ms=4, label=f"T={T}: splits by length")
            plot_series(ax, rs, "A", "batch_ms", color=f"C{i}", ms=4, label=f"T={T}: fitted to the batch")
            if all(r.get("floor_ms") for r in rs) and i == 0:
                plot_series(ax, rs, "A", "floor_ms", style=":", color="k", label="KV read at copy speed (T=1)")
        ax.set(xscale="log", yscale="log", xlabel="rows (active batch)", ylabel="ms per launch", title=model)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    save_figure(fig, png_path, f"Decode / verify attention, one layer ({result['environment'].get('device', '')})")


def main(argv: list[str] | None = None) -> None:
    p = base_parser(__doc__.splitlines()[0], [
        ("--iters", int, 30, None), ("--min-prompt", int, 2048, None), ("--max-prompt", int, 28672, None),
        ("--generated", int, 2048, None),
        ("--sweep", dict(action="store_true", help="also time every power-of-two split count at a few shapes")),
        ("--cascade", dict(action="store_true", help="also time shared-prefix decode over its prefix split length"))])
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()

"""Top-p block selection: the Triton bisection kernel against the reference sort, per selection call.

``N`` selection rows (a decode step has one per row x retrieval head x new token, a prefill one per prompt x
retrieval head x query block) of ``NB`` key blocks of 64 tokens each (``NB = 2048`` is a 128K-token context),
random peaked block log-masses, top-p 0.9 plus one sink block and a 128-token local window, every block
visible. Both sides are :func:`sparrow.kernels.topp.topp_select` (``impl="triton"`` / ``"reference"``: sort,
cumulative sum, then the kept ids in order), replayed as CUDA graphs, median of CUDA-event timings. The
selections are compared in the same run (``same_rows``: fraction of rows whose kept block lists are equal).

Usage: ``python benchmarks/bench_topp.py`` (H200: ~1 min) or ``--quick`` (CPU smoke run).
"""

from __future__ import annotations

from pathlib import Path

import torch

from sparrow.bench import (base_parser, device_dtype, graphed, measure, plot_series, print_table, save_figure, subplots,
                           triton_interpreter_without_cuda, write_json)

triton_interpreter_without_cuda()  # the CPU smoke runs: Triton through its interpreter, before it is imported

from sparrow.kernels.topp import topp_select_dense

NAME = "topp"
BLOCK, TOP_P, SINK_BLOCKS, LOCAL_WINDOW = 64, 0.9, 1, 128


def run(args) -> None:
    dev = device_dtype()[0]
    rows_list = [2, 5] if args.quick else [1, 16, 256, 1024]
    blocks_list = [24, 70] if args.quick else [512, 2048, 4096, 16384]  # 4096: the last row held in registers
    iters = 2 if args.quick else args.iters
    g = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    for n in rows_list:
        for nb in blocks_list:
            scores = (torch.randn(n, nb, generator=g) * 3.0).to(dev)
            q_hi = torch.full((n,), nb * BLOCK - 1, device=dev)
            kw = dict(block=BLOCK, sink_blocks=SINK_BLOCKS, local_window=LOCAL_WINDOW)
            tri = topp_select_dense(scores, q_hi, q_hi, TOP_P, impl="triton", **kw)
            ref = topp_select_dense(scores, q_hi, q_hi, TOP_P, impl="reference", **kw)
            same = float((tri == ref).all(-1).float().mean())
            t = {}
            for impl in ("triton", "reference"):
                call = graphed(lambda impl=impl: topp_select_dense(scores, q_hi, q_hi, TOP_P, impl=impl, **kw))
                t[impl] = measure(call, warmup=1 if args.quick else 3, iters=iters)["median_ms"]
            row = dict(N=n, NB=nb, tokens=nb * BLOCK, triton_ms=t["triton"], reference_ms=t["reference"],
                       speedup=t["reference"] / t["triton"], same_rows=same, kept_density=float(ref.float().mean()))
            rows.append(row)
            print_table([row], list(row))
            assert same >= 0.99, f"Triton and reference selections differ in {1 - same:.1%} of the rows " \
                                 f"(N={n}, NB={nb})"
    print()
    print_table(rows, ["N", "NB", "tokens", "triton_ms", "reference_ms", "speedup", "same_rows", "kept_density"])
    write_json(NAME, dict(block=BLOCK, top_p=TOP_P, sink_blocks=SINK_BLOCKS, local_window=LOCAL_WINDOW,
                          score_scale=3.0, iters=iters, quick=args.quick), rows, args.out)


def plot(result: dict, png_path: Path) -> None:
    rows = result["rows"]
    fig, ax = subplots(figsize=(6, 4))
    plot_series(ax, rows, "tokens", "speedup", "N", label="{} rows")
    ax.axhline(1.0, color="gray", lw=0.5)
    ax.set_xscale("log", base=2)
    ax.set(xlabel=f"context tokens ({BLOCK}-token blocks)", ylabel="speedup over the sort (x)")
    ax.legend()
    device = result["environment"].get("device", "")
    save_figure(fig, png_path, f"Top-p block selection, Triton bisection vs sort ({device})")


def main(argv=None) -> None:
    options = [("--iters", int, 50, "timed calls per size (--quick: 2)")]
    run(base_parser(__doc__.splitlines()[0], options).parse_args(argv))


if __name__ == "__main__":
    main()

"""RTPurbo decode vs dense decode, one attention layer of Qwen3-30B-A3B shape, per generated token.

One layer: 32 query heads, 4 kv heads, head_dim 128, bf16; ``B`` rows (distinct prompts, no prefix sharing)
each with ``L`` cached tokens, one new token per row. Baselines in the same run: SDPA over the full cache
(``F.scaled_dot_product_attention``, q_len 1) and Sparrow's dense split-KV Triton decode kernel over the
two-level cache.

RTPurbo (Triton): indexer query projection, indexer block scores over the cached indexer keys, bisection
top-p (0.9) selection, split-KV attention over the kept 64-token blocks for the retrieval head, sinks (4) +
window (8192) from ring buffers for the other heads, and the split merge — two pipelines in the same run:
``staged`` (the projection in PyTorch, then four launches: scores, top-p, attention, merge) and ``fused`` (two:
scores with the projection; selection, attention and merge). Retrieval-head density is set as in
``bench_rtpurbo_prefill.py`` (a random ``density / top_p`` fraction of blocks carries the indexer mass), rows say
whether ``planted`` (1-10%) or ``measured`` (``--density``: numbers or the accuracy JSON, key
``decode_ret_density``), and the density the selection kept is measured. ``rtpurbo@15%`` is a model with
15% retrieval heads: ``0.6 t(1 retrieval head) + 0.4 t(0)``.

Every callable is timed as a replayed CUDA graph (as the engine runs decode) and eagerly. ``step`` rows time
the whole backend decode (cache writes + attention) of :class:`RTPurboAttention` and :class:`DenseAttention`.

``--ret-splits 64,128,256`` also times the fused pipeline at each of those retrieval split counts (the kernel's
own count comes from the cache length and the batch: 64 per row and head, more at batch 1-2, see
``ret_splits_for``): rows ``rtpurbo_splits``, and a ``splits`` table of the one-retrieval-head time per count beside
the kernel's own, to check the count the kernel chooses by batch.

Usage: ``python benchmarks/bench_rtpurbo_decode.py [--density 0.55] [--ret-splits 64,128,256]`` (H200) or
``--quick`` (CPU smoke run).
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sparrow.bench import (base_parser, free_memory, graphed, measure, planted_and_measured, plot_series, print_table,
                           save_figure, subplots, triton_interpreter_without_cuda, write_json)

triton_interpreter_without_cuda()  # the CPU smoke runs: Triton through its interpreter, before it is imported

from sparrow.attention.base import DecodeMeta, LayerShape
from sparrow.attention.dense import DenseAttention, DenseKVCache
from sparrow.attention.rtpurbo_synthetic import (SyntheticDecodeLayer, decode_speedups, hot_indexer_keys,
                                                triton_vs_reference)
from sparrow.kernels.decode_attention.triton_decode import decode_attention_triton
from sparrow.kernels.sparse_decode.triton_sparse_decode import sparse_decode_triton

NAME = "rtpurbo_decode"
TOP_P = 0.9


def bench_case(c: SyntheticDecodeLayer, densities, rows, use_graphs: bool, ret_splits=()) -> None:
    L, B = c.L, c.B
    reps = dict(warmup=3, iters=30 if torch.cuda.is_available() else 2)

    def add(config, fn, n_ret=0, density=1.0, source="-", kept=1.0, pipeline="-", **extra):
        eager = measure(fn, **reps)["median_ms"]
        graph = measure(graphed(fn), **reps)["median_ms"] if use_graphs else float("nan")
        rows.append(dict(L=L, B=B, config=config, pipeline=pipeline, n_ret=n_ret, density=density,
                         density_source=source, ret_density=kept, eager_ms=eager, graph_ms=graph, **extra))

    add("sdpa", lambda: F.scaled_dot_product_attention(c.q, c.pk, c.pv, enable_gqa=True))
    add("dense_triton", lambda: decode_attention_triton(c.q, c.pk, c.pv, c.gk, c.gv, c.rs, c.ps, c.plen, c.cl))
    dense_backend = DenseAttention(LayerShape(0, c.hq, c.hkv, c.d), impl="triton")
    dense_cache = DenseKVCache(c.pk, c.pv, c.gk, c.gv)
    meta = DecodeMeta(c.rs, c.ps, c.plen, c.cl)
    add("dense_step", lambda: dense_backend.decode(c.q, c.k_new, c.v_new, dense_cache, meta))

    kw = dict(top_p=TOP_P, block=c.block, num_sinks=4, window=c.window, ret_window=128)
    for n_ret in (0, 1):
        b = c.backend(n_ret)
        ret, loc, is_ret = b.ret_idx, b.loc_idx, b.head_is_ret
        wq, qs = b.indexer_q.detach(), b.score_scale
        for dens, source in (densities if n_ret else [(0.0, "-")]):
            ik = hot_indexer_keys(B, L, dens, c.block, c.u, seed=2, top_p=TOP_P) if n_ret else None
            cache = c.cache(n_ret, ik)
            args = (cache, c.rs, c.ps, c.plen, c.cl, ret, loc, is_ret)

            def staged():  # the indexer query projection in PyTorch, then the four launches
                return sparse_decode_triton(c.q, b.index(c.q, c.k_new)[0], *args, fused=False, **kw)

            def fused(ret_splits=None):  # the projection inside the score kernel, then one launch
                return sparse_decode_triton(c.q, None, *args, q_pre=c.q, indexer_q=wq, q_scale=qs,
                                            ret_splits=ret_splits, **kw)

            kept = 0.0
            if n_ret:
                cnt = sparse_decode_triton(c.q, None, *args, q_pre=c.q, indexer_q=wq, q_scale=qs,
                                           return_selection=True, **kw)[1][1]
                kept = float((cnt.double() * c.block - (c.block - 1 - (L - 1) % c.block)).mean() / L)
            for pipeline, fn in (("staged", staged), ("fused", fused)):
                add("rtpurbo", fn, n_ret, dens, source, kept, pipeline)
            for ns in (ret_splits if n_ret else ()):  # the fused pipeline at a fixed retrieval split count
                add("rtpurbo_splits", functools.partial(fused, ns), n_ret, dens, source, kept, "fused",
                    ret_splits=ns)
            add("rtpurbo_step", lambda: b.decode(c.q, c.k_new, c.v_new, cache, meta, q_pre=c.q, k_pre=c.k_new),
                n_ret, dens, source, kept, "library")
            del cache


def split_table(rows: list[dict]) -> list[dict]:
    """Per (L, B, density) of the one-retrieval-head rows: the fused pipeline's time at its own split count
    (``heuristic``) and at each ``--ret-splits`` count, with the best."""
    out = []
    for r in (r for r in rows if r["config"] == "rtpurbo" and r["n_ret"] == 1 and r["pipeline"] == "fused"):
        same = [x for x in rows if x["config"] == "rtpurbo_splits" and
                (x["L"], x["B"], x["density"]) == (r["L"], r["B"], r["density"])]
        if same:
            key = "graph_ms" if r["graph_ms"] == r["graph_ms"] else "eager_ms"  # eager where no graph ran (CPU)
            best = min(same, key=lambda x: x[key])
            out.append(dict(L=r["L"], B=r["B"], density=r["density"], heuristic_ms=r[key],
                            **{f"s{x['ret_splits']}_ms": x[key] for x in same},
                            best_splits=best["ret_splits"], best_ms=best[key]))
    return out


@torch.no_grad()
def run(args) -> None:
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if args.quick:
        lengths, batches, hq, hkv, d, window, planted = [1024], [1, 2], 8, 4, 32, 128, [0.1]
        dtype = torch.bfloat16 if cuda else torch.float32
    else:
        lengths, batches, hq, hkv, d, window, planted = [131072, 1048576], [1, 4, 8, 16], 32, 4, 128, 8192, \
            [0.01, 0.02, 0.05, 0.10]
        dtype = torch.bfloat16
    densities = planted_and_measured(planted, args.density, "decode_ret_density")
    if args.batches:
        batches = [int(x) for x in args.batches.split(",")]
    ret_splits = [int(x) for x in args.ret_splits.split(",")] if args.ret_splits else []
    block = 64
    rows: list[dict] = []
    t_start = time.perf_counter()
    check = triton_vs_reference(dev, dtype, hq, hkv, d, window, top_p=TOP_P)
    print(f"Triton vs reference, relative error {check:.2e}" + ("" if check < 2e-2 else "  <-- TOO LARGE"), flush=True)
    for L in lengths:
        for B in batches:
            try:
                c = SyntheticDecodeLayer(L, B, hq, hkv, d, window, block, dtype, dev)
                bench_case(c, densities, rows, use_graphs=cuda, ret_splits=ret_splits)
                del c
            except torch.cuda.OutOfMemoryError as e:
                rows.append(dict(L=L, B=B, config="error", error=f"out of memory: {str(e)[:200]}"))
            free_memory()
            print(f"L={L} B={B} done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    ok = [r for r in rows if r["config"] != "error"]
    summary = decode_speedups(ok)
    config = dict(heads=hq, kv_heads=hkv, head_dim=d, dtype=str(dtype), window=window, sinks=4, block=block,
                  top_p=TOP_P, indexer_dim=16, quick=args.quick, seconds=time.perf_counter() - t_start,
                  triton_vs_reference_rel_err=check, density_json=args.density,
                  note="rtpurbo@15% = 0.6 t(1 retrieval kv head) + 0.4 t(0); times per layer per decode step; "
                       "density: the retrieval head's target kept fraction (ret_density: measured)")
    splits = split_table(ok)
    extra = {"summary": summary} | ({"splits": splits} if splits else {})
    write_json(NAME, config, rows, out_dir=args.out, extra=extra)
    print()
    print_table(summary, ["L", "B", "pipeline", "density", "density_source", "ret_density", "sdpa_ms", "rtpurbo15_ms",
                          "vs_sdpa", "vs_triton", "step_speedup"])
    if splits:
        print()
        print_table(splits, list(splits[0]))


def plot(result: dict, png_path: Path) -> None:
    summ = result.get("summary", [])
    fig, axes = subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, L in zip(axes, sorted({r["L"] for r in summ})[:2]):
        for p in ("staged", "fused"):
            plot_series(ax, [r for r in summ if r["L"] == L and r.get("pipeline", "staged") == p], "B", "vs_sdpa",
                        "density", label=f"{{:.0%}} density, {p}", style="o-" if p == "fused" else "o:")
        ax.set_xscale("log", base=2)
        ax.set(title=f"context {L // 1024}K", xlabel="batch (rows)")
        ax.axhline(1.0, color="gray", lw=0.5)
    axes[0].set_ylabel("speedup over SDPA decode (x)")
    axes[0].legend()
    save_figure(fig, png_path, "RTPurbo decode, one layer (32q/4kv, d128, bf16), 15% retrieval heads")


def main(argv=None) -> None:
    run(base_parser(__doc__.splitlines()[0], [
        ("--batches", str, None, "comma-separated batch sizes (override)"),
        ("--density", str, None, "measured retrieval density: numbers, or an accuracy JSON"),
        ("--ret-splits", str, None, "comma-separated retrieval split counts: the fused pipeline timed at each too "
                                    "(rows rtpurbo_splits, table splits)")]).parse_args(argv))


if __name__ == "__main__":
    main()

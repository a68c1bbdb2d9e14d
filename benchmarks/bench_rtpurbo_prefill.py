"""RTPurbo prefill vs dense causal attention, one attention layer of Qwen3-30B-A3B shape.

One layer: 32 query heads, 4 kv heads, head_dim 128, bf16, one prompt of S tokens. Dense baseline:
``F.scaled_dot_product_attention(is_causal=True)`` (the kernel SDPA picks: flash / cuDNN) on the same q/k/v, in
the same run.

RTPurbo is timed end to end for the layer: indexer projections of the retrieval heads, Triton block scores,
Triton top-p selection, BlockMask construction, block-sparse FlexAttention for the retrieval heads, sinks (4) +
window (8192) for the others, and the head gathers / scatters. The local heads run both ways in the same run:
``local=chunked`` (the window band as square causal pieces on SDPA's kernel, Triton merge) and ``local=flex``
(FlexAttention with a sliding-window block mask); the all-local rows (``n_ret=0``, no retrieval head) time the
local heads alone.

Random q/k make top-p keep almost every block, so the retrieval heads' density is set: the indexer keys of a
random ``density / top_p`` fraction of key blocks align with the indexer queries and hold ~all of the indexer
mass, so top-p (0.9) keeps about ``density`` of the causal blocks, plus the forced sink / local ones; the density
actually kept is measured (``ret_density``). Rows say where the density came from: ``planted`` (1%, 2%, 5%,
10%) or ``measured`` on a trained model (``--density``: numbers, or the JSON of ``bench_rtpurbo_accuracy.py``,
key ``prefill_ret_density``, the retrieval heads' kept fraction of a row at its longest context).

With 4 kv heads a layer has 0 or 1 retrieval heads near the 15% design point; a model with 15% retrieval
heads has 1 in 60% of its layers and 0 in 40%, so its mean layer time is ``0.6 t(1) + 0.4 t(0)`` — the
``rtpurbo@15%`` rows. ``n_ret=1`` rows (25% of this layer's heads) are measured directly.

Usage: ``python benchmarks/bench_rtpurbo_prefill.py [--density ACCURACY.json | 0.89]`` (H200), ``--quick`` (CPU).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sparrow.bench import (base_parser, free_memory, measure, planted_and_measured, plot_series, print_table,
                           save_figure, subplots, triton_interpreter_without_cuda, write_json)

triton_interpreter_without_cuda()  # the CPU smoke runs: Triton through its interpreter, before it is imported

from sparrow.attention.base import LayerShape
from sparrow.attention.rtpurbo import RTPurboAttention, RTPurboConfig
from sparrow.attention.rtpurbo_synthetic import prefill_indexer, prefill_vs_reference
from sparrow.kernels.sparse_prefill import SparsePrefillConfig, sparse_prefill_attention

NAME = "rtpurbo_prefill"
FLEX = {"dynamic": True}  # one compiled graph for every length and head count
TOP_P = 0.9


@torch.no_grad()
def run(args) -> None:
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if args.quick:
        lengths, hq, hkv, d, window, block, planted = [256, 512], 8, 4, 32, 64, 32, [0.05]
        dtype = torch.bfloat16 if cuda else torch.float32
    else:
        lengths, hq, hkv, d, window, block, planted = [32768, 131072, 1048576], 32, 4, 128, 8192, 128, \
            [0.01, 0.02, 0.05, 0.10]
        dtype = torch.bfloat16
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else lengths
    densities = planted_and_measured(planted, args.density, "prefill_ret_density")
    cfg = SparsePrefillConfig(top_p=TOP_P, block=block, num_sinks=4, window=window, ret_window=block)
    rows: list[dict] = []
    t_start = time.perf_counter()
    check = prefill_vs_reference(dev, dtype, hq, hkv, d, cfg, flex_dynamic=FLEX["dynamic"])
    print(f"fast path vs reference, relative error {check:.2e}" + ("" if check < 2e-2 else "  <-- TOO LARGE"))
    for S in lengths:
        try:
            bench_length(S, rows, dev, dtype, hq, hkv, d, cfg, densities, args.quick)
        except torch.cuda.OutOfMemoryError as e:  # record and go on with the next length
            rows.append(dict(S=S, config="error", error=f"out of memory: {str(e)[:200]}"))
        free_memory()
    config = dict(heads=hq, kv_heads=hkv, head_dim=d, dtype=str(dtype), window=window, sinks=4, block=block,
                  top_p=TOP_P, indexer_dim=16, quick=args.quick, seconds=time.perf_counter() - t_start,
                  fast_vs_reference_rel_err=check, density_json=args.density,
                  note="density: the retrieval heads' target kept fraction (ret_density: measured); ms of n_ret=1 "
                       "includes the indexer projection; rtpurbo@15% = 0.6 t(1) + 0.4 t(0), local=chunked")
    write_json(NAME, config, rows, out_dir=args.out)
    print()
    print_table(rows, ["S", "config", "local", "n_ret", "density", "density_source", "ret_density", "ms", "speedup"])


def bench_length(S, rows, dev, dtype, hq, hkv, d, cfg, densities, quick) -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, S, d, device=dev, dtype=dtype) for h in (hq, hkv, hkv))
    plen, nb = torch.tensor([S], device=dev), -(-S // cfg.block)
    reps = dict(warmup=1, iters=1) if S >= 524288 and not quick else dict(warmup=1, iters=3 if S >= 131072 else 10)

    def add(config, ms, *, n_ret=0, local="-", density=0.0, source="-", kept=0.0):
        rows.append(dict(S=S, config=config, local=local, n_ret=n_ret, density=density, density_source=source,
                         ret_density=kept, ms=ms, speedup=dense / ms))
        print(f"S={S} {config} local={local} n_ret={n_ret} density={density:.3f} ({source}, kept {kept:.3f}) "
              f"{ms:.2f} ms -> {dense / ms:.2f}x", flush=True)

    dense = measure(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                    **reps)["median_ms"]
    add("dense_sdpa", dense, density=1.0, kept=1.0)
    # indexer projection cost of one retrieval kv head (pre-RoPE q of its 8 query heads, its k)
    backend = RTPurboAttention(LayerShape(0, hq, hkv, d), RTPurboConfig(window=cfg.window, prefill_block=cfg.block),
                               [0]).to(dev)
    proj = measure(lambda: backend.index(q, k), **reps)["median_ms"]

    def sparse(n_ret: int, q_idx, k_idx, local: str):
        ret, loc = torch.arange(n_ret, device=dev), torch.arange(n_ret, hkv, device=dev)
        try:
            return sparse_prefill_attention(q, k, v, q_idx, k_idx, plen, ret, loc, cfg, impl="flex",
                                            score_impl="triton", flex_dynamic=FLEX["dynamic"], return_selection=True,
                                            local_impl=local)
        except Exception as e:  # noqa: BLE001 - a dynamic-shape compile this torch cannot do: specialise
            if FLEX["dynamic"] is None:
                raise
            print(f"dynamic FlexAttention failed ({type(e).__name__}: {str(e)[:200]}); compiling per shape")
            FLEX["dynamic"] = None
            return sparse(n_ret, q_idx, k_idx, local)

    t0 = {}
    for local in ("chunked", "flex"):  # the all-local layer: the local heads' cost alone, both ways
        t0[local] = measure(lambda: sparse(0, None, None, local), **reps)["median_ms"]
        add("rtpurbo", t0[local], local=local)
    for dens, source in densities:
        qi, ki = prefill_indexer(S, dens, cfg.block, 16, dev, dtype, top_p=TOP_P)
        kept = float(sparse(1, qi, ki, "chunked")[1][1].double().sum() / (nb * (nb + 1) / 2))
        t1 = measure(lambda: sparse(1, qi, ki, "chunked"), **reps)["median_ms"] + proj
        add("rtpurbo", t1, n_ret=1, local="chunked", density=dens, source=source, kept=kept)
        add("rtpurbo@15%", 0.6 * t1 + 0.4 * t0["chunked"], n_ret=0.6, local="chunked", density=dens, source=source,
            kept=kept)
        del qi, ki


def plot(result: dict, png_path: Path) -> None:
    rows = [r for r in result["rows"] if r["config"] == "rtpurbo@15%"]
    fig, ax = subplots(figsize=(6, 4))
    for src, style in (("planted", "o-"), ("measured", "o--")):
        plot_series(ax, [r for r in rows if r.get("density_source", "planted") == src], "S", "speedup", "density",
                    label=f"{{:.0%}} density ({src})", style=style)
    ax.set_xscale("log", base=2)
    ax.set(xlabel="prompt tokens", ylabel="speedup over SDPA causal (x)",
           title="RTPurbo prefill, one layer (32q/4kv, d128, bf16),\n15% retrieval heads")
    ax.axhline(1.0, color="gray", lw=0.5)
    ax.legend()
    save_figure(fig, png_path)


def main(argv=None) -> None:
    run(base_parser(__doc__.splitlines()[0], [
        ("--lengths", str, None, "comma-separated prompt lengths (override)"),
        ("--density", str, None, "measured retrieval density: numbers, or an accuracy JSON")]).parse_args(argv))


if __name__ == "__main__":
    main()

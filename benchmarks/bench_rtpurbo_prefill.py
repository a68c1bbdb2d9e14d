"""RTPurbo prefill vs dense causal attention, one attention layer of Qwen3-30B-A3B shape.

One layer: 32 query heads, 4 kv heads, head_dim 128, bf16, one prompt of S tokens. Dense baseline:
``F.scaled_dot_product_attention(is_causal=True)`` (flash) on the same q/k/v, in the same run.

RTPurbo is timed end to end for the layer: indexer projections of the retrieval heads, Triton block scores
(mean per-query indexer mass of every causal 128-token key block), Triton top-p selection, BlockMask
construction, block-sparse FlexAttention for the retrieval heads, sliding-window (8192) + 4-sink
FlexAttention for the others, and the head gathers / scatters.

Random q/k make top-p keep almost every block, so the selection density is set instead: the indexer keys of
a random fraction ``d`` of the key blocks (1%, 2%, 5%, 10%) align with the indexer queries, holding ~all of
the indexer mass; top-p (0.9) then keeps those blocks plus the forced sink / local blocks. The density the
selection actually kept is measured and reported (``ret_density``).

With 4 kv heads a layer has 0 or 1 retrieval heads near the 15% design point; a model with 15% retrieval
heads has 1 in 60% of its layers and 0 in 40%, so its mean layer time is ``0.6 t(1) + 0.4 t(0)`` — the
``rtpurbo@15%`` rows. ``ret=1`` rows (25% of this layer's heads) are measured directly as well.

Usage: ``python benchmarks/bench_rtpurbo_prefill.py`` (H200: ~4 min) or ``--quick`` (CPU smoke run).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runner import (  # noqa: E402
    base_parser, measure, print_table, save_figure, triton_interpreter_without_cuda, write_json,
)

triton_interpreter_without_cuda()  # before anything imports triton
from sparrow.attention.base import LayerShape  # noqa: E402
from sparrow.attention.rtpurbo import RTPurboAttention, RTPurboConfig  # noqa: E402
from sparrow.kernels.sparse_prefill import SparsePrefillConfig, sparse_prefill_attention  # noqa: E402

NAME = "rtpurbo_prefill"
FLEX = {"dynamic": True}  # one compiled graph for every length and head count


def synthetic_indexer(S: int, density: float, block: int, r: int, device, dtype, seed: int = 0):
    """q_idx, k_idx [1, 1, S, r]: a random ``density`` fraction of key blocks carries ~all indexer mass."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    u = torch.randn(r, generator=g)
    u = u / u.norm()
    nb = -(-S // block)
    hot = torch.rand(nb, generator=g) < density
    hot[0] = False  # the sink block is kept anyway
    k = torch.randn(S, r, generator=g) * 0.05
    tok_hot = hot.repeat_interleave(block)[:S]
    k[tok_hot] += 12.0 * u
    q = u.expand(S, r) + torch.randn(S, r, generator=g) * 0.05
    return (q.to(device, dtype)[None, None].contiguous(), k.to(device, dtype)[None, None].contiguous())


def check_against_reference(dev, dtype, hq, hkv, d, cfg) -> float:
    """Relative error of the Triton + FlexAttention path vs the PyTorch reference (dense masks) at S = 1000."""
    S = 1000
    g = torch.Generator(device="cpu").manual_seed(4)
    q = torch.randn(1, hq, S, d, generator=g).to(dev, dtype)
    k = torch.randn(1, hkv, S, d, generator=g).to(dev, dtype)
    v = torch.randn(1, hkv, S, d, generator=g).to(dev, dtype)
    small = SparsePrefillConfig(cfg.top_p, cfg.block, cfg.num_sinks, min(cfg.window, 300), cfg.ret_window)
    qi, ki = synthetic_indexer(S, 0.1, cfg.block, 16, dev, dtype, seed=5)
    ret, loc, plen = torch.arange(1, device=dev), torch.arange(1, hkv, device=dev), torch.tensor([S], device=dev)
    out = sparse_prefill_attention(q, k, v, qi, ki, plen, ret, loc, small, impl="flex", score_impl="triton",
                                   flex_dynamic=FLEX["dynamic"]).float()
    ref = sparse_prefill_attention(q, k, v, qi, ki, plen, ret, loc, small, impl="reference",
                                   score_impl="reference").float()
    return float((out - ref).norm() / ref.norm())


def run(args) -> None:
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if args.quick:
        lengths, hq, hkv, d, window, block, densities = [256, 512], 8, 4, 32, 64, 32, [0.05, 0.1]
        dtype = torch.bfloat16 if cuda else torch.float32
    else:
        lengths, hq, hkv, d, window, block, densities = [32768, 131072, 524288, 1048576], 32, 4, 128, 8192, 128, \
            [0.01, 0.02, 0.05, 0.10]
        dtype = torch.bfloat16
    if args.lengths:
        lengths = [int(x) for x in args.lengths.split(",")]
    top_p, sinks, r = 0.9, 4, 16
    cfg = SparsePrefillConfig(top_p=top_p, block=block, num_sinks=sinks, window=window, ret_window=block)
    rows: list[dict] = []
    t_start = time.perf_counter()
    check = check_against_reference(dev, dtype, hq, hkv, d, cfg)
    print(f"flex + Triton vs reference, relative error {check:.2e}" + ("" if check < 2e-2 else "  <-- TOO LARGE"),
          flush=True)
    for S in lengths:
        try:
            bench_length(S, rows, dev, dtype, hq, hkv, d, window, block, densities, cfg, r, args.quick)
        except torch.cuda.OutOfMemoryError as e:  # record and go on with the next length
            rows.append(dict(S=S, config="error", error=f"out of memory: {str(e)[:200]}"))
            print(f"S={S}: out of memory", flush=True)
        if cuda:
            torch.cuda.empty_cache()
    config = dict(heads=hq, kv_heads=hkv, head_dim=d, dtype=str(dtype), window=window, sinks=sinks, block=block,
                  top_p=top_p, indexer_dim=r, quick=args.quick, seconds=time.perf_counter() - t_start,
                  flex_vs_reference_rel_err=check,
                  note="ms of rtpurbo n_ret=1 includes the indexer projection; rtpurbo@15% = 0.6 t(1) + 0.4 t(0)")
    write_json(NAME, config, rows, out_dir=args.out)
    print()
    print_table([r for r in rows if r["config"] != "rtpurbo" or r["n_ret"] == 0],
                ["S", "config", "n_ret", "density", "ret_density", "ms", "speedup"])


def bench_length(S, rows, dev, dtype, hq, hkv, d, window, block, densities, cfg, r, quick) -> None:
    torch.manual_seed(0)
    q = torch.randn(1, hq, S, d, device=dev, dtype=dtype)
    k = torch.randn(1, hkv, S, d, device=dev, dtype=dtype)
    v = torch.randn(1, hkv, S, d, device=dev, dtype=dtype)
    plen = torch.tensor([S], device=dev)
    big = S >= 524288 and not quick
    reps = dict(warmup=1, iters=1) if big else dict(warmup=1, iters=3 if S >= 131072 else 10)

    dense = measure(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), **reps)
    rows.append(dict(S=S, config="dense_sdpa", n_ret=0, density=1.0, ret_density=1.0, ms=dense["median_ms"],
                     speedup=1.0))
    print(f"S={S} dense {dense['median_ms']:.2f} ms", flush=True)

    # indexer projection cost of one retrieval kv head (pre-RoPE q of its 8 query heads, its k)
    shape = LayerShape(0, hq, hkv, d)
    backend = RTPurboAttention(shape, RTPurboConfig(window=window, prefill_block=block), [0]).to(dev)
    proj = measure(lambda: backend.index(q, k), **reps)["median_ms"]

    def sparse(n_ret: int, q_idx, k_idx):
        ret = torch.arange(n_ret, device=dev)
        loc = torch.arange(n_ret, hkv, device=dev)
        try:
            return sparse_prefill_attention(q, k, v, q_idx, k_idx, plen, ret, loc, cfg, impl="flex",
                                            score_impl="triton", flex_dynamic=FLEX["dynamic"],
                                            return_selection=True)
        except Exception as e:  # noqa: BLE001 - a dynamic-shape compile this torch cannot do: specialise
            if FLEX["dynamic"] is None:
                raise
            print(f"dynamic FlexAttention failed ({type(e).__name__}: {str(e)[:200]}); compiling per shape")
            FLEX["dynamic"] = None
            return sparse(n_ret, q_idx, k_idx)

    t0 = measure(lambda: sparse(0, None, None), **reps)["median_ms"]
    rows.append(dict(S=S, config="rtpurbo", n_ret=0, density=0.0, ret_density=0.0, ms=t0,
                     speedup=dense["median_ms"] / t0))
    print(f"S={S} rtpurbo ret=0 {t0:.2f} ms", flush=True)
    for dens in densities:
        qi, ki = synthetic_indexer(S, dens, block, r, dev, dtype)
        _, (idx, cnt) = sparse(1, qi, ki)
        nb = -(-S // block)
        measured = float(cnt.double().sum() / (nb * (nb + 1) / 2))
        t1 = measure(lambda: sparse(1, qi, ki), **reps)["median_ms"] + proj
        t15 = 0.6 * t1 + 0.4 * t0
        rows.append(dict(S=S, config="rtpurbo", n_ret=1, density=dens, ret_density=measured, ms=t1,
                         speedup=dense["median_ms"] / t1))
        rows.append(dict(S=S, config="rtpurbo@15%", n_ret=0.6, density=dens, ret_density=measured, ms=t15,
                         speedup=dense["median_ms"] / t15))
        print(f"S={S} rtpurbo ret=1 d={dens:.2f} (measured {measured:.3f}) {t1:.2f} ms; 15% layer {t15:.2f} ms "
              f"-> {dense['median_ms'] / t15:.1f}x", flush=True)
        del qi, ki, idx, cnt


def plot(result: dict, png_path: Path) -> None:
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for dens in sorted({r["density"] for r in rows if r["config"] == "rtpurbo@15%"}):
        pts = sorted((r["S"], r["speedup"]) for r in rows if r["config"] == "rtpurbo@15%" and r["density"] == dens)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{dens:.0%} density")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("speedup over SDPA causal (x)")
    ax.set_title("RTPurbo prefill, one layer (32q/4kv, d128, bf16), 15% retrieval heads")
    ax.axhline(1.0, color="gray", lw=0.5)
    ax.legend()
    save_figure(fig, png_path)


def main(argv=None) -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--lengths", default=None, help="comma-separated prompt lengths (override)")
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()

"""SparseRL-Sync of 7B / 32B / 70B bf16 models over 10 / 25 / 100 / 400 Gbit/s links, projected from measurements.

Part ``measured``: real AdamW steps of a >= 0.5B-parameter linear stack (``sparrow.sync.synthetic``; fp32 masters,
synthetic gradients, two warm-up steps, then the measured one) at several learning rates, so that the densities
bracket 0.5-2 %. Per step: ``SyncSender.encode`` and ``SyncReceiver.apply_bucket`` (``verify="incremental"``,
running hashes known) timed, the buckets checked bit for bit, and the costs per parameter kept
(``sparrow.sync.projection.SyncRates``: encode and apply seconds, wire bytes).

Part ``projection`` (``sparrow.sync.projection.project_sync``): those rates interpolated to 0.5 / 1 / 2 % and
scaled to each model size, against a dense bf16 broadcast (plus one copy on the receiver), a pipelined dense
transfer (checkpoint-engine style: copy overlapped) and the rate reported for Kimi's checkpoint-engine (1T
parameters in ~20 s on its cluster).

Usage: ``python benchmarks/bench_sync_links.py`` (CUDA) or ``--quick`` (tiny, any device: densities of the tiny
model, projected at the measured densities only).
Writes ``docs/benchmarks/sync_links.json``; ``plot()`` draws ``sync_links.png``.
"""

from __future__ import annotations

import time

import torch

from sparrow.bench import (base_parser, copy_bandwidth_gbs, device_dtype, free_memory, plot_series, print_table,
                           save_figure, subplots, triton_interpreter_without_cuda, write_json)

triton_interpreter_without_cuda()  # the CPU smoke runs: Triton through its interpreter, before it is imported

from sparrow.sync.projection import SyncRates, project_sync, rates_at
from sparrow.sync.roundtrip import round_trip
from sparrow.sync.synthetic import adamw_bf16_step

NAME = "sync_links"
LINKS_GBIT = (10, 25, 100, 400)
MODELS = {"7B": 7_000_000_000, "32B": 32_000_000_000, "70B": 70_000_000_000}
DENSITIES = (0.005, 0.01, 0.02)
LRS = (1e-7, 2.5e-7, 6e-7, 1.5e-6)


def measure_step(width: int, layers: int, lr: float, iters: int) -> dict:
    """One AdamW step's sync, timed (``sparrow.sync.roundtrip``), as costs per parameter."""
    prev, new = adamw_bf16_step(width, layers, lr, device_dtype()[0])
    r = round_trip(prev, new, iters=iters, warmup=1)
    params, wire = r["params"], r["wire_bytes"]
    enc_ms, app_ms = r["encode"]["median_ms"], r["apply"]["incremental"]["median_ms"]
    free_memory()
    return {"part": "measured", "lr": lr, "params": params, "changed": r["changed"], "density": r["changed"] / params,
            "wire_bytes": wire, "ratio_vs_dense": 2 * params / wire, "encode_ms": enc_ms, "apply_ms": app_ms,
            "encode_s_per_param": enc_ms * 1e-3 / params, "apply_s_per_param": app_ms * 1e-3 / params,
            "payload_bytes_per_param": wire / params}


def main() -> None:
    options = [(flag, int, None, None) for flag in ("--width", "--layers", "--iters")]
    args = base_parser(__doc__.splitlines()[0], options).parse_args()
    quick = args.quick or not torch.cuda.is_available()
    width = args.width or (256 if quick else 4096)
    layers = args.layers or (4 if quick else 30)  # 30 x 4096^2 = 503M parameters
    iters = args.iters or (3 if quick else 10)
    lrs = (1e-6, 1e-5) if quick else LRS
    t0 = time.perf_counter()
    copy_gbs = copy_bandwidth_gbs()
    rows = [measure_step(width, layers, lr, iters) for lr in lrs]
    points = [SyncRates(r["density"], r["encode_s_per_param"], r["apply_s_per_param"], r["payload_bytes_per_param"])
              for r in rows if r["changed"]]
    lo, hi = min(pt.density for pt in points), max(pt.density for pt in points)
    targets = [d for d in DENSITIES if lo <= d <= hi] or sorted(pt.density for pt in points)
    for model, params in MODELS.items():
        for d in targets:
            rates = rates_at(points, d)
            for link in LINKS_GBIT:
                pr = project_sync(params, rates, link, copy_gbs=copy_gbs)
                rows.append({"part": "projection", "model": model, "params": params, "density": d,
                             "link_gbit": link, "payload_bytes": pr.payload_bytes, "encode_s": pr.encode_s,
                             "transfer_s": pr.transfer_s, "apply_s": pr.apply_s, "sparse_s": pr.sparse_s,
                             "dense_s": pr.dense_s, "pipelined_dense_s": pr.pipelined_dense_s,
                             "checkpoint_engine_s": pr.checkpoint_engine_s, "speedup_vs_dense": pr.speedup_vs_dense,
                             "speedup_vs_pipelined": pr.speedup_vs_pipelined})
    config = {"width": width, "layers": layers, "params": width * width * layers, "iters": iters, "quick": quick,
              "lrs": list(lrs), "links_gbit": list(LINKS_GBIT), "models": MODELS, "densities": targets,
              "copy_gbs": copy_gbs, "wall_s": time.perf_counter() - t0,
              "model": "sparse = encode + wire bytes / link + apply (per-parameter rates measured here, no overlap); "
                       "dense = 2 B/param / link + one device copy; pipelined dense = max(transfer, copy); "
                       "checkpoint engine: 20 s per 1e12 params as reported, scaled"}
    write_json(NAME, config, rows, out_dir=args.out)
    print_table([r for r in rows if r["part"] == "measured"],
                ["lr", "density", "wire_bytes", "ratio_vs_dense", "encode_ms", "apply_ms"])
    print_table([r for r in rows if r["part"] == "projection"],
                ["model", "density", "link_gbit", "sparse_s", "dense_s", "pipelined_dense_s", "checkpoint_engine_s",
                 "speedup_vs_pipelined"])


def plot(result: dict, png_path) -> None:
    proj = [r for r in result["rows"] if r.get("part") == "projection"]
    if not proj:
        print("sync_links: results of the earlier benchmark (no projection); its plot is left as it is")
        return
    models = list(result["config"]["models"])
    d0 = min({r["density"] for r in proj}, key=lambda d: abs(d - 0.01))
    fig, axes = subplots(1, len(models), figsize=(4.2 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        rs = [r for r in proj if r["model"] == model]
        plot_series(ax, rs, "link_gbit", "sparse_s", "density", label=lambda d: f"sparse, {100 * d:.1f}% changed",
                    style="-o", ms=3)
        at = [r for r in rs if r["density"] == d0]
        plot_series(ax, at, "link_gbit", "dense_s", style="k--", label="dense broadcast")
        plot_series(ax, at, "link_gbit", "pipelined_dense_s", style="k:", label="pipelined dense")
        ax.axhline(at[0]["checkpoint_engine_s"], color="grey", lw=0.7, label="checkpoint-engine rate (reported)")
        ax.set(xscale="log", yscale="log", xlabel="link (Gbit/s)", title=f"{model} bf16")
    axes[0][0].set_ylabel("sync time (s)")
    axes[0][0].legend(fontsize=7)
    save_figure(fig, png_path, title=f"projected from {result['config']['params'] / 1e6:.3g}M-param AdamW steps, "
                                     f"{result['environment']['device']}", dpi=130)


if __name__ == "__main__":
    main()

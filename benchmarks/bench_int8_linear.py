"""The drafter's weight-only int8 linear against the bf16 linear it replaces (and torchao's int8 path).

One transformer layer's seven linears (q, k, v, o, gate, up, down) of Qwen2.5-0.5B and -1.5B, for ``M`` rows
(the active decode batch), each callable replayed as a CUDA graph (as the engine runs decode), median of CUDA
events: bf16 ``F.linear`` (cuBLAS), Sparrow's ``int8_linear`` (Triton, int8 weights read once), and torchao's
``Int8WeightOnlyConfig`` linear. Outputs checked against the reference in the same run. ``weight_GBps`` is the
weight bytes read per second (the memory floor of a decode-sized linear).

Usage: ``python benchmarks/bench_int8_linear.py`` (H200: ~1 min) or ``--quick`` (CPU smoke run).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from sparrow.bench import (base_parser, device_dtype, graphed, measure, plot_series, print_table, rel_err, save_figure,
                           subplots, triton_interpreter_without_cuda, write_json)

triton_interpreter_without_cuda()  # the CPU smoke runs: Triton through its interpreter, before it is imported

from sparrow.kernels.int8_linear import int8_linear, quantize_int8
from sparrow.kernels.int8_linear.reference import int8_linear_reference

NAME = "int8_linear"
MODELS = {"qwen2.5-0.5b": (896, 4864, 128), "qwen2.5-1.5b": (1536, 8960, 256)}  # hidden, mlp, kv width


def layer_shapes(hidden: int, mlp: int, kv: int) -> list[tuple[int, int]]:
    """(out, in) of q, k, v, o, gate, up, down."""
    return [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (mlp, hidden), (mlp, hidden), (hidden, mlp)]


def torchao_linears(weights: list[torch.Tensor]):
    """torchao int8 weight-only copies of ``weights`` as ``nn.Linear`` modules, or the reason they fail."""
    try:
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        mods = []
        for w in weights:
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
            lin.weight.data.copy_(w)
            quantize_(lin, Int8WeightOnlyConfig(set_inductor_config=False))
            mods.append(lin)
        return mods, None
    except Exception as e:  # noqa: BLE001 - report, do not fail the benchmark
        return None, f"{type(e).__name__}: {e}"


def run(args) -> None:
    cuda = torch.cuda.is_available()
    dev, dtype = device_dtype()
    models = {"tiny": (64, 160, 32)} if args.quick else MODELS
    batches = [1, 5] if args.quick else [1, 8, 32, 64, 128, 256]
    rows = []
    for model, dims in models.items():
        shapes = layer_shapes(*dims)
        g = torch.Generator(device="cpu").manual_seed(0)
        weights = [(torch.randn(n, k, generator=g) * 0.02).to(dev, dtype) for n, k in shapes]
        quant = [quantize_int8(w) for w in weights]
        ao, ao_error = torchao_linears(weights) if cuda else (None, "CPU run")
        wbytes_bf16 = sum(w.numel() * w.element_size() for w in weights)
        wbytes_int8 = sum(q.numel() + s.numel() * 4 for q, s in quant)
        for M in batches:
            xs = [torch.randn(M, k, generator=g).to(dev, dtype) for _, k in shapes]
            err = max(rel_err(int8_linear(x, q, s), int8_linear_reference(x, q, s)) for x, (q, s) in zip(xs, quant))
            calls = {
                "bf16": lambda: [F.linear(x, w) for x, w in zip(xs, weights)],
                "sparrow_int8": lambda: [int8_linear(x, q, s, validate=False) for x, (q, s) in zip(xs, quant)],
            }
            if ao is not None:
                calls["torchao_int8"] = lambda: [m(x) for x, m in zip(xs, ao)]
            t = {k: measure(graphed(fn), warmup=3, iters=args.iters)["median_ms"] for k, fn in calls.items()}
            row = {"model": model, "M": M, "bf16_ms": t["bf16"], "sparrow_int8_ms": t["sparrow_int8"],
                   "torchao_int8_ms": t.get("torchao_int8"), "speedup_vs_bf16": t["bf16"] / t["sparrow_int8"],
                   "bf16_weight_GBps": wbytes_bf16 / t["bf16"] / 1e6,
                   "int8_weight_GBps": wbytes_int8 / t["sparrow_int8"] / 1e6, "max_rel_err": err}
            if "torchao_int8" in t:
                row["speedup_vs_torchao"] = t["torchao_int8"] / t["sparrow_int8"]
            rows.append(row)
            print_table([row], list(row))
            if not args.quick:
                assert err < 1e-2, f"int8 kernel disagrees with the reference: relative error {err:.3g}"
    print()
    print_table(rows, ["model", "M", "bf16_ms", "sparrow_int8_ms", "torchao_int8_ms", "speedup_vs_bf16",
                       "bf16_weight_GBps", "int8_weight_GBps", "max_rel_err"])
    write_json(NAME, {"models": {m: layer_shapes(*d) for m, d in models.items()}, "batches": batches,
                      "dtype": str(dtype), "iters": args.iters}, rows, args.out,
               extra={"torchao_error": ao_error} if ao_error else None)


def plot(result: dict, png_path: Path) -> None:
    rows = result["rows"]
    fig, axes = subplots(1, 2, figsize=(11, 4))
    plot_series(axes[0], rows, "M", "speedup_vs_bf16", "model", label="{}: Sparrow int8")
    ao = [r for r in rows if r.get("torchao_int8_ms")]
    plot_series(axes[0], ao, "M", lambda r: r["bf16_ms"] / r["torchao_int8_ms"], "model", label="{}: torchao int8",
                style="s--")
    plot_series(axes[1], rows, "M", "int8_weight_GBps", "model", label="{}: Sparrow int8")
    plot_series(axes[1], rows, "M", "bf16_weight_GBps", "model", label="{}: bf16 (cuBLAS)", style="s--")
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].set(ylabel="speed vs bf16 linear (x)", title="one layer's 7 linears, CUDA graphs")
    axes[1].set(ylabel="weight bytes read per second (GB/s)", title="achieved weight bandwidth")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows (active decode batch)")
        ax.legend(fontsize=7)
    save_figure(fig, png_path, f"Drafter int8 weight-only linear ({result['environment'].get('device', '')})")


def main() -> None:
    run(base_parser(__doc__.splitlines()[0], [("--iters", int, 50, None)]).parse_args())


if __name__ == "__main__":
    main()

"""SparseRL-Sync payload size: bytes of every codec against the entropy bound.

Part 1 (``density``): one bf16 tensor, a fraction rho (0.1 %-50 %) of elements changed by a few ULPs of
their bit pattern (+-1 ULP 90 %, +-2 7 %, +-3 3 %, i.e. what optimizer steps on bf16 weights produce);
bytes of dense / COO / compact / auto beside the entropy bound of the changed-position set
(log2 C(n, m) bits) and that bound plus the order-0 entropy of the bit-pattern deltas.

Part 2 (``adamw``): real AdamW updates of a >= 0.5B-parameter model (a plain stack of bias-free
``Linear`` layers, fp32 master weights initialised N(0, 0.02^2), synthetic gradients: a persistent
per-tensor direction plus fresh noise each step), lr 1e-6 and 1e-5; each step the fp32 masters are cast
to bf16 and diffed against the previous bf16 cast.

Usage: ``python benchmarks/bench_sync_payload.py`` (CUDA) or ``--quick`` (tiny, any device).
Writes ``docs/benchmarks/sync_payload.json``; ``plot()`` draws ``sync_payload.png``.
"""

from __future__ import annotations

import time

import torch

from sparrow.bench import (bar_groups, base_parser, device_dtype, free_memory, plot_series, print_table, save_figure,
                           subplots, synchronize, triton_interpreter_without_cuda, write_json)

triton_interpreter_without_cuda()  # the CPU smoke runs: Triton through its interpreter, before it is imported

from sparrow.sync.codecs import codec_bytes
from sparrow.sync.synthetic import SyntheticGrads, linear_stack, perturb_bits

NAME = "sync_payload"
CODECS = ("dense", "coo", "compact", "auto")


def density_sweep(n: int, densities: list[float], seed: int = 0) -> list[dict]:
    dev = device_dtype()[0]
    gen = torch.Generator(device=dev).manual_seed(seed)
    base = (torch.randn(n, generator=gen, device=dev) * 0.02).to(torch.bfloat16)
    rows = []
    for d in densities:
        new = perturb_bits(base, d, gen)
        t0 = time.perf_counter()
        b = codec_bytes([base], [new])
        synchronize()
        dt = time.perf_counter() - t0
        for c in (*CODECS, "bound_positions", "bound_positions_values"):
            rows.append({"part": "density", "density": d, "n": b["n"], "changed": b["m"], "codec": c,
                         "bytes": b[c], "bits_per_element": 8 * b[c] / b["n"],
                         "bits_per_change": 8 * b[c] / max(1, b["m"]),
                         "ratio_vs_dense": b["dense"] / max(1e-9, b[c]), "measure_s": dt})
        del new
    return rows


# ---------------------------------------------------------------------------------------------------
# real AdamW updates
# ---------------------------------------------------------------------------------------------------

def bf16_copies(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().to(torch.bfloat16) for p in model.parameters()]


def adamw_updates(width: int, layers: int, lrs: list[float], steps: int, *, entropy: bool = True) -> list[dict]:
    dev = device_dtype()[0]
    rows = []
    for lr in lrs:
        model = linear_stack(width, layers, dev)
        params = sum(p.numel() for p in model.parameters())
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
        grads = SyntheticGrads(model)
        prev = bf16_copies(model)
        for step in range(1, steps + 1):
            grads.fill()
            opt.step()
            opt.zero_grad(set_to_none=True)
            cur = bf16_copies(model)
            b = codec_bytes(prev, cur, entropy=entropy)
            base = {"part": "adamw", "lr": lr, "step": step, "params": params, "changed": b["m"],
                    "density": b["m"] / b["n"], "pm1_fraction": b.get("pm1_fraction")}
            for c in (*CODECS, "bound_positions", "bound_positions_values"):
                if c in b:
                    rows.append({**base, "codec": c, "bytes": b[c], "bits_per_element": 8 * b[c] / b["n"],
                                 "ratio_vs_dense": b["dense"] / max(1e-9, b[c])})
            prev = cur
        del model, opt, grads, prev
        free_memory()
    return rows


def main() -> None:
    args = base_parser(__doc__.splitlines()[0], [("--n", int, None, "elements of the density-sweep tensor")] +
                       [(f, int, None, None) for f in ("--width", "--layers", "--steps")]).parse_args()
    quick = args.quick or not torch.cuda.is_available() and args.n is None
    n = args.n or (1 << 18 if quick else 1 << 26)
    width = args.width or (256 if quick else 4096)
    layers = args.layers or (4 if quick else 30)  # 30 x 4096^2 = 503M parameters
    steps = args.steps or (2 if quick else 4)
    densities = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5]
    t0 = time.perf_counter()
    rows = density_sweep(n, densities)
    rows += adamw_updates(width, layers, [1e-6, 1e-5], steps)
    config = {"n": n, "width": width, "layers": layers, "params": width * width * layers, "steps": steps,
              "densities": densities, "quick": quick, "delta_distribution": "+-1: 90%, +-2: 7%, +-3: 3%",
              "grad_model": "0.5*fixed direction + fresh noise, both N(0, 1e-3^2); weights N(0, 0.02^2)",
              "wall_s": time.perf_counter() - t0}
    write_json(NAME, config, rows, out_dir=args.out)
    dens = [r for r in rows if r["part"] == "density" and r["codec"] in ("compact", "auto", "coo",
                                                                          "bound_positions_values")]
    print_table(dens, ["density", "codec", "bytes", "bits_per_change", "ratio_vs_dense"])
    adam = [r for r in rows if r["part"] == "adamw" and r["codec"] in ("compact", "auto",
                                                                       "bound_positions_values")]
    print_table(adam, ["lr", "step", "density", "pm1_fraction", "codec", "bytes", "ratio_vs_dense"])


def plot(result: dict, png_path) -> None:
    rows = result["rows"]
    fig, (a1, a2) = subplots(1, 2, figsize=(12, 4.5))
    styles = {"dense": "k-", "coo": "C1-o", "compact": "C0-o", "auto": "C2--", "bound_positions": "C3:",
              "bound_positions_values": "C3-."}
    labels = {"bound_positions": "entropy bound (positions)",
              "bound_positions_values": "entropy bound (positions + deltas)"}
    for c, st in styles.items():
        plot_series(a1, [r for r in rows if r["part"] == "density" and r["codec"] == c], "density",
                    "bits_per_element", style=st, label=labels.get(c, c), ms=3)
    a1.axhline(0.16, color="grey", lw=0.5)
    a1.text(1.1e-3, 0.17, "100x smaller than bf16", fontsize=7, color="grey")
    a1.set(xscale="log", yscale="log", xlabel="changed fraction", ylabel="payload bits per element (bf16 dense = 16)",
           title="payload vs density")
    a1.legend(fontsize=7)
    adam = [r for r in rows if r["part"] == "adamw"]
    lrs = sorted({r["lr"] for r in adam})
    cods = [c for c in ("coo", "compact", "auto", "bound_positions_values") if any(r["codec"] == c for r in adam)]
    mean = lambda xs: sum(xs) / max(1, len(xs))  # noqa: E731
    at = lambda lr, c, key: [r[key] for r in adam if r["lr"] == lr and r["codec"] == c]  # noqa: E731
    bar_groups(a2, [f"lr {lr:g}\n{100 * mean(at(lr, 'dense', 'density')):.1f}% changed" for lr in lrs],
               {labels.get(c, c): [mean(at(lr, c, "ratio_vs_dense")) for lr in lrs] for c in cods})
    a2.set(yscale="log", ylabel="x smaller than dense bf16",
           title=f"AdamW updates, {result['config'].get('params', 0) / 1e6:.3g}M params")
    a2.legend(fontsize=7)
    save_figure(fig, png_path, dpi=130)


if __name__ == "__main__":
    main()

"""SparseRL-Sync encode / apply for ~1B bf16 parameters against the memory-traffic floor.

For each density (fraction of bf16 bit patterns changed, +-1..3 ULP like optimizer steps) the whole pipeline is
timed: ``SyncSender.encode`` (scan, the one host read, the fused writer into the buckets, bucket checksums) and
``SyncReceiver.apply_bucket`` for every bucket. Without hashes the receiver runs ``verify=False``
(``apply_ms``); with them the sender keeps running hashes and the receiver runs ``verify="incremental"``
(``apply_ms_inc``, running hashes known: the steady state) and ``verify="full"`` (``apply_ms_full``). Every row
carries per-stage times (``StageTimer``: ``gpu_ms`` between marks from CUDA events, ``cpu_ms`` of the host).

The floor is the memory traffic a sync must do, divided by the copy bandwidth measured in the same run (bytes
read + written per second): encode reads old and new bits once (4 B / parameter), writes the changed snapshot
elements (2 B / change) and the payload; apply reads the payload and reads + writes the changed elements
(4 B / change). ``floor_full_ms`` adds the full verification's read of the receiver's weights (2 B / parameter).

Usage: ``python benchmarks/bench_sync_throughput.py`` (CUDA) or ``--quick`` (tiny, any device).
Writes ``docs/benchmarks/sync_throughput.json``; ``plot()`` draws ``sync_throughput.png``.
"""

from __future__ import annotations

import time

import torch

from sparrow.bench import (base_parser, copy_bandwidth_gbs, device_dtype, free_memory, plot_series, print_table,
                           save_figure, subplots, triton_interpreter_without_cuda, write_json)

triton_interpreter_without_cuda()  # the CPU smoke runs: Triton through its interpreter, before it is imported

from sparrow.sync.projection import memory_floor_ms
from sparrow.sync.roundtrip import round_trip
from sparrow.sync.synthetic import perturb_bits

NAME = "sync_throughput"
DENSITIES = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.1, 0.25]
APPLY_KEY = {False: "", "incremental": "_inc", "full": "_full"}  # the receiver's verify -> the keys' suffix


def run_density(base: dict, density: float, gen, *, iters: int, bucket_bytes: int) -> dict:
    """Encode / apply of one density, without and with hashes (``sparrow.sync.roundtrip``), checked bit for bit."""
    new = {k: perturb_bits(v, density, gen) for k, v in base.items()}
    row: dict = {"density": density, "params": sum(v.numel() for v in base.values())}
    for with_hash, verifies in ((False, (False,)), (True, ("incremental", "full"))):
        r = round_trip(base, new, bucket_bytes=bucket_bytes, with_hash=with_hash, verifies=verifies, iters=iters,
                       stage_reps=max(2, iters // 2))
        sfx = "_hash" if with_hash else ""
        timed = [(f"encode_{{}}{sfx}", r["encode"], r["encode_stages"])]
        timed += [(f"apply_{{}}{APPLY_KEY[v]}", r["apply"][v], r["apply_stages"][v]) for v in verifies]
        for name, t, stages in timed:  # e.g. apply_ms_inc, apply_p20_p80_inc, apply_stages_inc
            row[name.format("ms")], row[name.format("p20_p80")] = t["median_ms"], [t["p20_ms"], t["p80_ms"]]
            row[name.format("stages")] = stages
        if not with_hash:
            row.update(changed=r["changed"], wire_bytes=r["wire_bytes"], buckets=r["buckets"], bitexact=True)
    free_memory()
    return row


def add_floor(r: dict, copy_gbs: float) -> None:
    """The floor (see the module docstring; ``sparrow.sync.projection.memory_floor_ms``) and the ratios to it."""
    r.update(copy_gbs=copy_gbs, **memory_floor_ms(r["params"], r["changed"], r["wire_bytes"], copy_gbs),
             ratio_vs_dense=2 * r["params"] / r["wire_bytes"])
    r["x_floor"] = (r["encode_ms"] + r["apply_ms"]) / r["floor_ms"]
    r["x_floor_hash"] = (r["encode_ms_hash"] + r["apply_ms_inc"]) / r["floor_ms"]
    r["x_floor_full"] = (r["encode_ms_hash"] + r["apply_ms_full"]) / r["floor_full_ms"]


def main() -> None:
    args = base_parser(__doc__.splitlines()[0], [("--tensors", int, None, "number of weight tensors"),
                                                 ("--elems", int, None, "elements per tensor"),
                                                 ("--iters", int, None, None)]).parse_args()
    quick = args.quick or not torch.cuda.is_available()
    ntens = args.tensors or (4 if quick else 32)
    elems = args.elems or (1 << 16 if quick else 1 << 25)  # 32 x 2^25 = 1.07B parameters
    iters = args.iters or (3 if quick else 10)
    densities = [0.01, 0.1] if quick else DENSITIES
    dev = device_dtype()[0]
    t0 = time.perf_counter()
    copy_gbs = copy_bandwidth_gbs()
    gen = torch.Generator(device=dev).manual_seed(0)
    base = {f"layer{k}.weight": (torch.randn(elems, generator=gen, device=dev) * 0.02).to(torch.bfloat16)
            for k in range(ntens)}
    rows = []
    for d in densities:
        r = run_density(base, d, gen, iters=iters, bucket_bytes=256 << 20)
        add_floor(r, copy_gbs)
        rows.append(r)
    config = {"tensors": ntens, "elems_per_tensor": elems, "params": ntens * elems, "iters": iters,
              "densities": densities, "quick": quick, "codec": "auto", "bucket_bytes": 256 << 20,
              "copy_gbs": copy_gbs, "wall_s": time.perf_counter() - t0,
              "floor": "encode: 4 B/param + 2 B/change + payload; apply: payload + 4 B/change; full verify: "
                       "+ 2 B/param; divided by copy_gbs (bytes read + written per second)"}
    write_json(NAME, config, rows, out_dir=args.out)
    for r in rows:  # per-stage breakdown (CUDA events between StageTimer marks)
        print(f"density {r['density']}:")
        for key in ("encode_stages", "encode_stages_hash", "apply_stages", "apply_stages_inc", "apply_stages_full"):
            parts = ", ".join(f"{k} {v['gpu_ms']:.3f}/{v['cpu_ms']:.3f}" for k, v in r[key].items())
            print(f"  {key:20s} (gpu/cpu ms) {parts}")
    print_table(rows, ["density", "changed", "wire_bytes", "ratio_vs_dense", "encode_ms", "apply_ms", "encode_ms_hash",
                       "apply_ms_inc", "apply_ms_full", "floor_ms", "x_floor", "x_floor_hash", "x_floor_full"])


def plot(result: dict, png_path) -> None:
    rows = [{**r, "pct": 100 * r["density"]} for r in result["rows"]]
    if not rows or "apply_ms_full" not in rows[0]:
        print("sync_throughput: results of the earlier pipeline (bucket format 2); its plot is left as it is")
        return
    fig, (a1, a2) = subplots(1, 2, figsize=(12, 4.5))
    for y, style, label in (("encode_ms", "C0-o", "encode"), ("apply_ms", "C1-o", "apply"),
                            (lambda r: r["encode_ms"] + r["apply_ms"], "C2-o", "encode + apply"),
                            (lambda r: r["encode_ms_hash"] + r["apply_ms_inc"], "C2--", "+ hashes (incremental)"),
                            ("floor_ms", "k:", "memory-traffic floor")):
        plot_series(a1, rows, "pct", y, style=style, label=label)
    plot_series(a1, rows, "pct", lambda r: 2 * r["floor_ms"], style="k--", lw=0.7, label="2x floor (target)")
    a1.set(xscale="log", yscale="log", xlabel="changed elements (%)", ylabel="ms",
           title=f"{result['config']['params'] / 1e9:.2f}B bf16 params, {result['environment']['device']}")
    a1.legend(fontsize=7)
    for key, style, label in (("x_floor", "C2-o", "no hashes"), ("x_floor_hash", "C3-o", "hashes, incremental verify"),
                              ("x_floor_full", "C4-o", "hashes, full verify (its own floor)")):
        plot_series(a2, rows, "pct", key, style=style, label=label)
    a2.axhline(2.0, color="k", ls="--", lw=0.7, label="target")
    a2.set(xscale="log", xlabel="changed elements (%)", ylabel="x floor")
    a2.legend(fontsize=7)
    save_figure(fig, png_path, dpi=130)


if __name__ == "__main__":
    main()

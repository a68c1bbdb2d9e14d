"""SparseRL-Sync encode / apply throughput for ~1B bf16 parameters against the memory-bandwidth floor.

For each density (fraction of bf16 bit patterns changed, +-1..3 ULP like optimizer steps) the full
pipeline is timed: ``SyncSender.encode`` (diff against the snapshot, snapshot update, compaction,
packing, bucket assembly) and ``SyncReceiver.apply_bucket`` for every bucket (checks, decode, in-place
apply), with and without the target-hash verification. The floor is the bytes that must move divided
by the copy bandwidth measured in the same run:

* encode: read old + new bits (4 bytes / parameter), write the changed snapshot elements and the payload;
* apply: read the payload, read + write the changed elements.

Receivers are timed with ``verify=False`` (``apply_ms``), ``verify="full"`` (``apply_ms_hash``: every range
hashed before writing) and ``verify="incremental"`` (``apply_ms_inc``: running hashes, O(changes)). Each
row also carries a per-stage breakdown (``encode_stages*``, ``apply_stages*``: ``gpu_ms`` between
``StageTimer`` marks measured with CUDA events, and ``cpu_ms`` of the host between the same marks).

Usage: ``python benchmarks/bench_sync_throughput.py`` (CUDA) or ``--quick`` (tiny, any device).
Writes ``docs/benchmarks/sync_throughput.json``; ``plot()`` draws ``sync_throughput.png``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sync_payload import device, perturb  # noqa: E402
from runner import base_parser, copy_bandwidth_gbs, measure, print_table, save_figure, write_json  # noqa: E402

from sparrow.sync import SyncReceiver, SyncSender, parse_bucket  # noqa: E402
from sparrow.sync.stats import StageTimer  # noqa: E402

NAME = "sync_throughput"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int16)


def _stages(run, setup, timer, reps: int) -> dict:
    """Mean per-stage ``gpu_ms`` / ``cpu_ms`` of ``reps`` timed runs (StageTimer marks; CUDA events)."""
    acc: dict = {}
    for _ in range(reps):
        setup()
        timer.start()
        run()
        for k, v in timer.result().items():
            d = acc.setdefault(k, {"gpu_ms": 0.0, "cpu_ms": 0.0})
            d["gpu_ms"] += v["gpu_ms"] / reps
            d["cpu_ms"] += v["cpu_ms"] / reps
    return {k: {kk: round(vv, 4) for kk, vv in v.items()} for k, v in acc.items()}


def run_density(base: dict, density: float, gen, *, iters: int, bucket_bytes: int) -> dict:
    new = {k: perturb(v, density, gen) for k, v in base.items()}
    n = sum(v.numel() for v in base.values())
    dev = next(iter(base.values())).device
    row: dict = {"density": density, "params": n}
    reps = max(2, iters // 2)
    for with_hash in (False, True):
        sender = SyncSender(base, codec="auto", bucket_bytes=bucket_bytes, with_hash=with_hash)

        def reset_sender() -> None:
            for k, v in base.items():
                sender.snapshot[k].copy_(v)
            sender.rehash()  # the snapshot was written by hand: refresh its running hashes (untimed)

        t_enc = measure(lambda: list(sender.encode(new)), setup=reset_sender, warmup=2, iters=iters)
        sender.timer = StageTimer(dev)
        enc_stages = _stages(lambda: list(sender.encode(new)), reset_sender, sender.timer, reps)
        sender.timer = None
        reset_sender()
        encoded = list(sender.encode(new))
        buckets = [b for b, _ in encoded]
        ranges = [(e.name, e.start, e.length) for b in buckets for e in parse_bucket(b).entries]
        base_version = encoded[0][1].base_version
        rx_t = {k: v.clone() for k, v in base.items()}
        suffix = "_hash" if with_hash else ""
        row[f"encode_ms{suffix}"] = t_enc["median_ms"]
        row[f"encode_p20_p80{suffix}"] = [t_enc["p20_ms"], t_enc["p80_ms"]]
        row[f"encode_stages{suffix}"] = enc_stages
        modes = ("full", "incremental") if with_hash else (False,)
        for verify in modes:
            state: dict = {}

            def reset_rx() -> None:
                for k, v in base.items():
                    rx_t[k].copy_(v)
                state["rx"] = SyncReceiver(rx_t, verify=verify, version=base_version)
                if verify == "incremental":  # steady state: running hashes of the base already known
                    state["rx"].rehash(ranges)

            def apply() -> None:
                for b in buckets:
                    state["rx"].apply_bucket(b)

            t_app = measure(apply, setup=reset_rx, warmup=2, iters=iters)
            timer = StageTimer(dev)

            def setup_timed() -> None:
                reset_rx()
                state["rx"].timer = timer

            app_stages = _stages(apply, setup_timed, timer, reps)
            reset_rx()
            apply()
            ok = all(torch.equal(_bits(rx_t[k]), _bits(new[k])) for k in base)
            if not ok:
                raise AssertionError(f"receiver differs from sender at density {density} (verify={verify})")
            key = {False: "", "full": "_hash", "incremental": "_inc"}[verify]
            row[f"apply_ms{key}"] = t_app["median_ms"]
            row[f"apply_p20_p80{key}"] = [t_app["p20_ms"], t_app["p80_ms"]]
            row[f"apply_stages{key}"] = app_stages
        if not with_hash:
            m = sum(int((_bits(base[k]) != _bits(new[k])).sum()) for k in base)
            row["changed"] = m
            row["wire_bytes"] = sum(b.numel() for b in buckets)
            row["buckets"] = len(buckets)
            row["bitexact"] = True
        del sender, buckets, encoded, rx_t
    del new
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--tensors", type=int, default=None, help="number of weight tensors")
    p.add_argument("--elems", type=int, default=None, help="elements per tensor")
    p.add_argument("--iters", type=int, default=None)
    args = p.parse_args()
    quick = args.quick or not torch.cuda.is_available()
    ntens = args.tensors or (4 if quick else 32)
    elems = args.elems or (1 << 16 if quick else 1 << 25)  # 32 x 2^25 = 1.07B parameters
    iters = args.iters or (3 if quick else 10)
    densities = [0.01, 0.1] if quick else [0.001, 0.01, 0.04, 0.1, 0.25]
    dev = device()
    t0 = time.perf_counter()
    copy_gbs = copy_bandwidth_gbs()
    gen = torch.Generator(device=dev).manual_seed(0)
    base = {f"layer{k}.weight": (torch.randn(elems, generator=gen, device=dev) * 0.02).to(torch.bfloat16)
            for k in range(ntens)}
    rows = []
    for d in densities:
        r = run_density(base, d, gen, iters=iters, bucket_bytes=256 << 20)
        n, m, pay = r["params"], r["changed"], r["wire_bytes"]
        enc_floor = 4 * n + 2 * m + pay
        app_floor = pay + 4 * m
        r["copy_gbs"] = copy_gbs
        r["floor_ms"] = (enc_floor + app_floor) / (copy_gbs * 1e9) * 1e3
        r["encode_floor_ms"] = enc_floor / (copy_gbs * 1e9) * 1e3
        r["apply_floor_ms"] = app_floor / (copy_gbs * 1e9) * 1e3
        r["x_floor"] = (r["encode_ms"] + r["apply_ms"]) / r["floor_ms"]
        r["x_floor_hash"] = (r["encode_ms_hash"] + r["apply_ms_hash"]) / r["floor_ms"]
        r["x_floor_inc"] = (r["encode_ms_hash"] + r["apply_ms_inc"]) / r["floor_ms"]
        r["encode_model_gbs"] = 2 * n / (r["encode_ms"] * 1e-3) / 1e9
        r["apply_model_gbs"] = 2 * n / (r["apply_ms"] * 1e-3) / 1e9
        r["ratio_vs_dense"] = 2 * n / pay
        rows.append(r)
    config = {"tensors": ntens, "elems_per_tensor": elems, "params": ntens * elems, "iters": iters,
              "densities": densities, "quick": quick, "codec": "auto", "bucket_bytes": 256 << 20,
              "copy_gbs": copy_gbs, "wall_s": time.perf_counter() - t0,
              "floor": "encode: 4 B/param read + 2 B/change + payload; apply: payload + 4 B/change; / copy_gbs"}
    write_json(NAME, config, rows, out_dir=args.out)
    for r in rows:  # per-stage breakdown (CUDA events between StageTimer marks)
        print(f"density {r['density']}:")
        for key in ("encode_stages", "encode_stages_hash", "apply_stages", "apply_stages_hash", "apply_stages_inc"):
            parts = ", ".join(f"{k} {v['gpu_ms']:.3f}/{v['cpu_ms']:.3f}" for k, v in r[key].items())
            print(f"  {key:20s} (gpu/cpu ms) {parts}")
    print_table(rows, ["density", "changed", "wire_bytes", "ratio_vs_dense", "encode_ms", "apply_ms",
                       "encode_ms_hash", "apply_ms_hash", "apply_ms_inc", "floor_ms", "x_floor", "x_floor_hash",
                       "x_floor_inc",
                       "encode_model_gbs", "apply_model_gbs", "copy_gbs"])


def plot(result: dict, png_path) -> None:
    import matplotlib.pyplot as plt

    rows = sorted(result["rows"], key=lambda r: r["density"])
    d = [100 * r["density"] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    a1.plot(d, [r["encode_ms"] for r in rows], "C0-o", label="encode")
    a1.plot(d, [r["apply_ms"] for r in rows], "C1-o", label="apply")
    a1.plot(d, [r["encode_ms"] + r["apply_ms"] for r in rows], "C2-o", label="encode + apply")
    a1.plot(d, [r["encode_ms_hash"] + r["apply_ms_hash"] for r in rows], "C2--", label="... with hash verify")
    a1.plot(d, [r["floor_ms"] for r in rows], "k:", label="bandwidth floor")
    a1.plot(d, [2 * r["floor_ms"] for r in rows], "k--", lw=0.7, label="2x floor (target)")
    a1.set_xscale("log")
    a1.set_xlabel("changed elements (%)")
    a1.set_ylabel("ms")
    a1.set_title(f"{result['config']['params'] / 1e9:.2f}B bf16 params, {result['environment']['device']}")
    a1.legend(fontsize=7)
    a2.plot(d, [r["encode_model_gbs"] for r in rows], "C0-o", label="encode (model GB/s)")
    a2.plot(d, [r["apply_model_gbs"] for r in rows], "C1-o", label="apply (model GB/s)")
    a2.axhline(rows[0]["copy_gbs"], color="k", ls=":", label="copy bandwidth (read + write)")
    a2.set_xscale("log")
    a2.set_yscale("log")
    a2.set_xlabel("changed elements (%)")
    a2.set_ylabel("GB/s")
    a2.legend(fontsize=7)
    save_figure(fig, png_path, dpi=130)


if __name__ == "__main__":
    main()

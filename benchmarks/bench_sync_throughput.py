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


from sparrow.bench import base_parser, copy_bandwidth_gbs, measure, print_table, save_figure, write_json

from sparrow.sync import SyncReceiver, SyncSender, parse_bucket
from sparrow.sync.stats import StageTimer
from sparrow.sync.synthetic import perturb_bits

NAME = "sync_throughput"
DENSITIES = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.1, 0.25]


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
    new = {k: perturb_bits(v, density, gen) for k, v in base.items()}
    dev = next(iter(base.values())).device
    row: dict = {"density": density, "params": sum(v.numel() for v in base.values())}
    reps = max(2, iters // 2)
    for with_hash in (False, True):
        sender = SyncSender(base, codec="auto", bucket_bytes=bucket_bytes, with_hash=with_hash)

        def reset_sender() -> None:
            for k, v in base.items():
                sender.snapshot[k].copy_(v)
            sender.rehash()  # the snapshot was written by hand: refresh its running hashes (untimed)

        sfx = "_hash" if with_hash else ""
        t = measure(lambda: list(sender.encode(new)), setup=reset_sender, warmup=2, iters=iters)
        row[f"encode_ms{sfx}"], row[f"encode_p20_p80{sfx}"] = t["median_ms"], [t["p20_ms"], t["p80_ms"]]
        sender.timer = StageTimer(dev)
        row[f"encode_stages{sfx}"] = _stages(lambda: list(sender.encode(new)), reset_sender, sender.timer, reps)
        sender.timer = None
        reset_sender()
        encoded = list(sender.encode(new))
        buckets = [b for b, _ in encoded]
        ranges = [(e.name, e.start, e.length) for b in buckets for e in parse_bucket(b).entries]
        rx_t = {k: v.clone() for k, v in base.items()}
        for verify, key in (((False, ""),) if not with_hash else (("incremental", "_inc"), ("full", "_full"))):
            state: dict = {}

            def reset_rx() -> None:
                for k, v in base.items():
                    rx_t[k].copy_(v)
                state["rx"] = SyncReceiver(rx_t, verify=verify, version=encoded[0][1].base_version)
                if verify == "incremental":  # steady state: running hashes of the base already known
                    state["rx"].rehash(ranges)

            def apply() -> None:
                for b in buckets:
                    state["rx"].apply_bucket(b)

            t = measure(apply, setup=reset_rx, warmup=2, iters=iters)
            row[f"apply_ms{key}"], row[f"apply_p20_p80{key}"] = t["median_ms"], [t["p20_ms"], t["p80_ms"]]
            timer = StageTimer(dev)

            def setup_timed() -> None:
                reset_rx()
                state["rx"].timer = timer

            row[f"apply_stages{key}"] = _stages(apply, setup_timed, timer, reps)
            reset_rx()
            apply()
            if not all(torch.equal(rx_t[k].view(torch.int16), new[k].view(torch.int16)) for k in base):
                raise AssertionError(f"receiver differs from sender at density {density} (verify={verify})")
        if not with_hash:
            row["changed"] = sum(int((base[k].view(torch.int16) != new[k].view(torch.int16)).sum()) for k in base)
            row["wire_bytes"] = sum(b.numel() for b in buckets)
            row["buckets"] = len(buckets)
            row["bitexact"] = True
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def add_floor(r: dict, copy_gbs: float) -> None:
    """The floor (see the module docstring) and the ratios to it."""
    n, m, pay = r["params"], r["changed"], r["wire_bytes"]
    enc, app = 4 * n + 2 * m + pay, pay + 4 * m
    ms = lambda b: b / (copy_gbs * 1e9) * 1e3  # noqa: E731
    r.update(copy_gbs=copy_gbs, encode_floor_ms=ms(enc), apply_floor_ms=ms(app), floor_ms=ms(enc + app),
             floor_full_ms=ms(enc + app + 2 * n), ratio_vs_dense=2 * n / pay)
    r["x_floor"] = (r["encode_ms"] + r["apply_ms"]) / r["floor_ms"]
    r["x_floor_hash"] = (r["encode_ms_hash"] + r["apply_ms_inc"]) / r["floor_ms"]
    r["x_floor_full"] = (r["encode_ms_hash"] + r["apply_ms_full"]) / r["floor_full_ms"]


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
    densities = [0.01, 0.1] if quick else DENSITIES
    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
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
    import matplotlib.pyplot as plt

    rows = sorted(result["rows"], key=lambda r: r["density"])
    if not rows or "apply_ms_full" not in rows[0]:
        print("sync_throughput: results of the earlier pipeline (bucket format 2); its plot is left as it is")
        return
    d = [100 * r["density"] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    a1.plot(d, [r["encode_ms"] for r in rows], "C0-o", label="encode")
    a1.plot(d, [r["apply_ms"] for r in rows], "C1-o", label="apply")
    a1.plot(d, [r["encode_ms"] + r["apply_ms"] for r in rows], "C2-o", label="encode + apply")
    a1.plot(d, [r["encode_ms_hash"] + r["apply_ms_inc"] for r in rows], "C2--", label="... with hashes (incremental)")
    a1.plot(d, [r["floor_ms"] for r in rows], "k:", label="memory-traffic floor")
    a1.plot(d, [2 * r["floor_ms"] for r in rows], "k--", lw=0.7, label="2x floor (target)")
    a1.set_xscale("log")
    a1.set_yscale("log")
    a1.set_xlabel("changed elements (%)")
    a1.set_ylabel("ms")
    a1.set_title(f"{result['config']['params'] / 1e9:.2f}B bf16 params, {result['environment']['device']}")
    a1.legend(fontsize=7)
    for key, style, label in (("x_floor", "C2-o", "no hashes"), ("x_floor_hash", "C3-o", "hashes, incremental verify"),
                              ("x_floor_full", "C4-o", "hashes, full verify (its own floor)")):
        a2.plot(d, [r[key] for r in rows], style, label=label)
    a2.axhline(2.0, color="k", ls="--", lw=0.7, label="target")
    a2.set_xscale("log")
    a2.set_xlabel("changed elements (%)")
    a2.set_ylabel("x floor")
    a2.legend(fontsize=7)
    save_figure(fig, png_path, dpi=130)


if __name__ == "__main__":
    main()

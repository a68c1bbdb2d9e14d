"""SparseRL-Sync end-to-end sync time over 1 / 10 / 100 Gbit/s links against sending dense bf16.

Real AdamW updates of the >= 0.5B-parameter linear stack of ``bench_sync_payload`` (lr 1e-6 and 1e-5,
two warm-up steps, then one measured step). Sparse sync time = measured ``SyncSender.encode`` + wire
bytes / link bandwidth + measured ``SyncReceiver.apply_bucket`` (hash verification on). Dense sync time
= dense bf16 bytes / link bandwidth + one device copy of them on the receiver (measured copy bandwidth).

Usage: ``python benchmarks/bench_sync_links.py`` (CUDA) or ``--quick`` (tiny, any device).
Writes ``docs/benchmarks/sync_links.json``; ``plot()`` draws ``sync_links.png``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sync_payload import SyntheticGrads, device, linear_stack  # noqa: E402
from runner import base_parser, copy_bandwidth_gbs, measure, print_table, save_figure, write_json  # noqa: E402

from sparrow.sync import SyncReceiver, SyncSender  # noqa: E402

NAME = "sync_links"
LINKS_GBIT = (1, 10, 100)


def measure_lr(width: int, layers: int, lr: float, iters: int) -> dict:
    dev = device()
    model = linear_stack(width, layers, dev)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    grads = SyntheticGrads(model)
    for _ in range(2):
        grads.fill()
        opt.step()
    names = [n for n, _ in model.named_parameters()]
    prev = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    grads.fill()
    opt.step()
    opt.zero_grad(set_to_none=True)
    new = {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}
    del opt, grads
    sender = SyncSender(prev, codec="auto", bucket_bytes=256 << 20)

    def reset_sender() -> None:
        for n in names:
            sender.snapshot[n].copy_(prev[n])
        sender.rehash()  # the snapshot was written by hand: refresh its running hashes (untimed)

    t_enc = measure(lambda: list(sender.encode(new)), setup=reset_sender, warmup=1, iters=iters)
    reset_sender()
    encoded = list(sender.encode(new))
    buckets = [b for b, _ in encoded]
    rx_t = {n: t.clone() for n, t in prev.items()}
    state: dict = {}

    def reset_rx() -> None:
        for n in names:
            rx_t[n].copy_(prev[n])
        state["rx"] = SyncReceiver(rx_t, version=encoded[0][1].base_version)

    def apply() -> None:
        for b in buckets:
            state["rx"].apply_bucket(b)

    t_app = measure(apply, setup=reset_rx, warmup=1, iters=iters)
    reset_rx()
    apply()
    if not all(torch.equal(rx_t[n].view(torch.int16), new[n].view(torch.int16)) for n in names):
        raise AssertionError("receiver differs from sender")
    params = sum(t.numel() for t in prev.values())
    changed = sum(int((prev[n].view(torch.int16) != new[n].view(torch.int16)).sum()) for n in names)
    out = {"lr": lr, "params": params, "changed": changed, "density": changed / params,
           "wire_bytes": sum(b.numel() for b in buckets), "dense_bytes": 2 * params,
           "encode_ms": t_enc["median_ms"], "apply_ms": t_app["median_ms"]}
    del model, sender, buckets, encoded, rx_t, state, prev, new
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    args = p.parse_args()
    quick = args.quick or not torch.cuda.is_available()
    width = args.width or (256 if quick else 4096)
    layers = args.layers or (4 if quick else 30)
    iters = args.iters or (3 if quick else 10)
    t0 = time.perf_counter()
    copy_gbs = copy_bandwidth_gbs()
    rows = []
    for lr in (1e-6, 1e-5):
        r = measure_lr(width, layers, lr, iters)
        dense_copy_s = 2 * r["dense_bytes"] / (copy_gbs * 1e9)
        for link in LINKS_GBIT:
            bw = link * 1e9 / 8  # bytes / s
            sparse_s = r["encode_ms"] * 1e-3 + r["wire_bytes"] / bw + r["apply_ms"] * 1e-3
            dense_s = r["dense_bytes"] / bw + dense_copy_s
            rows.append({**r, "link_gbit": link, "sparse_s": sparse_s, "dense_s": dense_s,
                         "transfer_s": r["wire_bytes"] / bw, "speedup": dense_s / sparse_s,
                         "ratio_vs_dense": r["dense_bytes"] / r["wire_bytes"]})
    config = {"width": width, "layers": layers, "params": width * width * layers, "iters": iters, "quick": quick,
              "links_gbit": list(LINKS_GBIT), "copy_gbs": copy_gbs, "wall_s": time.perf_counter() - t0}
    write_json(NAME, config, rows, out_dir=args.out)
    print_table(rows, ["lr", "density", "link_gbit", "wire_bytes", "ratio_vs_dense", "encode_ms", "apply_ms",
                       "transfer_s", "sparse_s", "dense_s", "speedup"])


def plot(result: dict, png_path) -> None:
    import matplotlib.pyplot as plt

    rows = result["rows"]
    lrs = sorted({r["lr"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, lr in enumerate(lrs):
        rs = sorted((r for r in rows if r["lr"] == lr), key=lambda r: r["link_gbit"])
        ax.loglog([r["link_gbit"] for r in rs], [r["sparse_s"] for r in rs], f"C{k}-o",
                  label=f"sparse, lr {lr:g} ({100 * rs[0]['density']:.1f}% changed)")
    rs = sorted((r for r in rows if r["lr"] == lrs[0]), key=lambda r: r["link_gbit"])
    ax.loglog([r["link_gbit"] for r in rs], [r["dense_s"] for r in rs], "k--", label="dense bf16")
    ax.set_xlabel("link (Gbit/s)")
    ax.set_ylabel("sync time (s)")
    ax.set_title(f"weight sync, {result['config']['params'] / 1e6:.3g}M params")
    ax.legend(fontsize=8)
    save_figure(fig, png_path, dpi=130)


if __name__ == "__main__":
    main()

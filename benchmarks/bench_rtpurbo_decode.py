"""RTPurbo decode vs dense decode, one attention layer of Qwen3-30B-A3B shape, per generated token.

One layer: 32 query heads, 4 kv heads, head_dim 128, bf16; ``B`` rows (distinct prompts, no prefix sharing)
each with ``L`` cached tokens, one new token per row. Baselines in the same run: SDPA over the full cache
(``F.scaled_dot_product_attention``, q_len 1) and Sparrow's dense split-KV Triton decode kernel over the
two-level cache.

RTPurbo (Triton): indexer query projection, indexer block scores over the cached indexer keys, bisection
top-p (0.9) selection, split-KV attention over the kept 64-token blocks for the retrieval head, sinks (4) +
window (8192) from ring buffers for the other heads, and the split merge. Retrieval-head selection density
is set as in ``bench_rtpurbo_prefill.py`` (a random fraction of blocks carries the indexer mass) and the
density the selection kept is measured. ``rtpurbo@15%`` is a model with 15% retrieval heads:
``0.6 t(1 retrieval head) + 0.4 t(0)``.

Every callable is timed as a replayed CUDA graph (as the engine runs decode) and eagerly. ``step`` rows time
the whole backend decode (cache writes + attention) of :class:`RTPurboAttention` and :class:`DenseAttention`.

Usage: ``python benchmarks/bench_rtpurbo_decode.py`` (H200: ~3 min) or ``--quick`` (CPU smoke run).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runner import (  # noqa: E402
    base_parser, graphed, measure, print_table, save_figure, triton_interpreter_without_cuda, write_json,
)

triton_interpreter_without_cuda()  # before anything imports triton
from sparrow.attention.base import DecodeMeta, LayerShape  # noqa: E402
from sparrow.attention.dense import DenseAttention, DenseKVCache  # noqa: E402
from sparrow.attention.rtpurbo import RTPurboAttention, RTPurboCache, RTPurboConfig  # noqa: E402
from sparrow.kernels.decode_attention.triton_decode import decode_attention_triton  # noqa: E402
from sparrow.kernels.sparse_decode.triton_sparse_decode import sparse_decode_triton  # noqa: E402

NAME = "rtpurbo_decode"
GEN = 16  # generation-slot capacity: the new token is written at index 0


def hot_indexer_keys(B: int, L: int, density: float, block: int, u: torch.Tensor, seed: int) -> torch.Tensor:
    """[B, 1, L, r]: keys of a random ``density`` fraction of blocks aligned with ``u`` (~all the mass)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    r = u.numel()
    nb = -(-L // block)
    hot = torch.rand(B, nb, generator=g) < density
    hot[:, 0] = False
    k = torch.randn(B, 1, L, r, device=u.device, dtype=torch.float32) * 0.05
    tok = hot.repeat_interleave(block, dim=1)[:, :L].to(u.device)
    k += tok[:, None, :, None] * (12.0 * u)
    return k


class Case:
    """Caches and inputs for one (L, B): dense two-level cache, RTPurbo caches for 0 and 1 retrieval heads."""

    def __init__(self, L, B, hq, hkv, d, window, block, dtype, dev):
        self.L, self.B, self.hq, self.hkv, self.d = L, B, hq, hkv, d
        torch.manual_seed(0)
        self.pk = torch.randn(B, hkv, L, d, device=dev, dtype=dtype)
        self.pv = torch.randn(B, hkv, L, d, device=dev, dtype=dtype)
        self.gk = torch.randn(B + 1, hkv, GEN, d, device=dev, dtype=dtype)
        self.gv = torch.randn(B + 1, hkv, GEN, d, device=dev, dtype=dtype)
        q1 = torch.randn(1, hq, 1, d, device=dev, dtype=dtype)
        self.q = q1.expand(B, hq, 1, d).contiguous()  # one query for every row: a rank-1 indexer maps it to u
        self.k_new = torch.randn(B, hkv, 1, d, device=dev, dtype=dtype)
        self.v_new = torch.randn(B, hkv, 1, d, device=dev, dtype=dtype)
        self.rs = torch.arange(B, device=dev)
        self.ps = torch.arange(B, device=dev)
        self.plen = torch.full((B,), L - 1, device=dev)
        self.cl = torch.zeros(B, dtype=torch.int64, device=dev)
        self.window, self.block, self.dtype, self.dev = window, block, dtype, dev
        self.local = {}
        for n_ret in (0, 1):
            hl = hkv - n_ret
            wp = min(window, L)
            self.local[n_ret] = (torch.randn(B, hl, 4 + wp, d, device=dev, dtype=dtype),
                                 torch.randn(B, hl, 4 + wp, d, device=dev, dtype=dtype),
                                 torch.randn(B + 1, hl, min(window + 64, GEN), d, device=dev, dtype=dtype),
                                 torch.randn(B + 1, hl, min(window + 64, GEN), d, device=dev, dtype=dtype))
        g = torch.Generator(device="cpu").manual_seed(1)
        u = torch.randn(16, generator=g)
        self.u = (u / u.norm()).to(dev)

    def cache(self, n_ret: int, ik: torch.Tensor | None) -> RTPurboCache:
        r = 16
        if ik is None:
            ik = torch.zeros(self.B, n_ret, self.L, r, device=self.dev, dtype=self.dtype)
        gik = torch.zeros(self.B + 1, n_ret, GEN, r, device=self.dev, dtype=self.dtype)
        return RTPurboCache(self.pk[:, :n_ret], self.pv[:, :n_ret], self.gk[:, :n_ret], self.gv[:, :n_ret],
                            ik.to(self.dtype), gik, *self.local[n_ret])

    def backend(self, n_ret: int) -> RTPurboAttention:
        """An RTPurbo backend whose indexer maps this case's query to ``u`` (so the hot blocks win)."""
        shape = LayerShape(0, self.hq, self.hkv, self.d)
        b = RTPurboAttention(shape, RTPurboConfig(window=self.window, decode_block=self.block, impl="triton"),
                             list(range(n_ret))).to(self.dev)
        if n_ret:
            qg = b.group_queries(self.q[:1].float())[0, 0, 0]  # [qpk * d]
            wq = (qg / qg.square().sum())[:, None] * self.u.float()[None, :]
            b.load_indexer(wq[None].expand(n_ret, -1, -1), b.indexer_k.detach())
        return b


def bench_case(c: Case, densities, rows, use_graphs: bool) -> None:
    L, B = c.L, c.B
    reps = dict(warmup=3, iters=30 if torch.cuda.is_available() else 2)

    def timed(fn):
        eager = measure(fn, **reps)["median_ms"]
        graph = measure(graphed(fn), **reps)["median_ms"] if use_graphs else float("nan")
        return eager, graph

    def add(config, n_ret, density, ret_density, eager, graph):
        rows.append(dict(L=L, B=B, config=config, n_ret=n_ret, density=density, ret_density=ret_density,
                         eager_ms=eager, graph_ms=graph))

    add("sdpa", 0, 1.0, 1.0, *timed(lambda: F.scaled_dot_product_attention(c.q, c.pk, c.pv, enable_gqa=True)))
    add("dense_triton", 0, 1.0, 1.0, *timed(lambda: decode_attention_triton(
        c.q, c.pk, c.pv, c.gk, c.gv, c.rs, c.ps, c.plen, c.cl)))
    dense_backend = DenseAttention(LayerShape(0, c.hq, c.hkv, c.d), impl="triton")
    dense_cache = DenseKVCache(c.pk, c.pv, c.gk, c.gv)
    meta = DecodeMeta(c.rs, c.ps, c.plen, c.cl)
    add("dense_step", 0, 1.0, 1.0, *timed(lambda: dense_backend.decode(c.q, c.k_new, c.v_new, dense_cache, meta)))

    kw = dict(top_p=0.9, block=c.block, num_sinks=4, window=c.window, ret_window=128)
    for n_ret in (0, 1):
        b = c.backend(n_ret)
        ret, loc, is_ret = b.ret_idx, b.loc_idx, b.head_is_ret
        for dens in (densities if n_ret else [0.0]):
            ik = hot_indexer_keys(B, L, dens, c.block, c.u, seed=2) if n_ret else None
            cache = c.cache(n_ret, ik)
            del ik

            def attn():
                q_idx, _ = b.index(c.q, c.k_new)  # the indexer query projection: part of the cost
                return sparse_decode_triton(c.q, q_idx, cache, c.rs, c.ps, c.plen, c.cl, ret, loc, is_ret, **kw)

            measured = 0.0
            if n_ret:
                q_idx, _ = b.index(c.q, c.k_new)
                _, (_, cnt) = sparse_decode_triton(c.q, q_idx, cache, c.rs, c.ps, c.plen, c.cl, ret, loc, is_ret,
                                                   return_selection=True, **kw)
                pos = L - 1
                kept = cnt.double() * c.block - (c.block - 1 - pos % c.block)
                measured = float(kept.mean() / L)
            add("rtpurbo", n_ret, dens, measured, *timed(attn))
            add("rtpurbo_step", n_ret, dens, measured, *timed(
                lambda: b.decode(c.q, c.k_new, c.v_new, cache, meta, q_pre=c.q, k_pre=c.k_new)))
            del cache


def summarise(rows: list[dict]) -> list[dict]:
    """Per (L, B, density): the 15%-model RTPurbo time and speedups over SDPA and the dense Triton kernel."""
    out = []
    key = "graph_ms" if any(r["graph_ms"] == r["graph_ms"] for r in rows) else "eager_ms"  # NaN-free column
    for (L, B) in sorted({(r["L"], r["B"]) for r in rows}):
        sel = [r for r in rows if r["L"] == L and r["B"] == B]
        get = lambda cfg, n=None, d=None: next(  # noqa: E731
            r[key] for r in sel if r["config"] == cfg and (n is None or r["n_ret"] == n) and (d is None or r["density"] == d))
        sdpa, tri, dstep = get("sdpa"), get("dense_triton"), get("dense_step")
        t0, s0 = get("rtpurbo", 0), get("rtpurbo_step", 0)
        for d in sorted({r["density"] for r in sel if r["config"] == "rtpurbo" and r["n_ret"] == 1}):
            r1 = next(r for r in sel if r["config"] == "rtpurbo" and r["n_ret"] == 1 and r["density"] == d)
            t15 = 0.6 * r1[key] + 0.4 * t0
            st15 = 0.6 * get("rtpurbo_step", 1, d) + 0.4 * s0
            out.append(dict(L=L, B=B, density=d, ret_density=r1["ret_density"], sdpa_ms=sdpa, triton_ms=tri,
                            rtpurbo15_ms=t15, vs_sdpa=sdpa / t15, vs_triton=tri / t15, step_dense_ms=dstep,
                            step_rtpurbo15_ms=st15, step_speedup=dstep / st15, timing=key))
    return out


def check_against_reference(dev, dtype, hq, hkv, d, window) -> float:
    """Relative error of the Triton pipeline vs the PyTorch reference on a small case of this device."""
    from sparrow.kernels.sparse_decode import SparseDecodeConfig, sparse_decode_attention

    c = Case(2048, 2, hq, hkv, d, min(window, 512), 64, dtype, dev)
    b = c.backend(1)
    cache = c.cache(1, hot_indexer_keys(2, 2048, 0.05, 64, c.u, seed=3))
    q_idx, _ = b.index(c.q, c.k_new)
    cfg = SparseDecodeConfig(0.9, 64, 4, min(window, 512), 128)
    args = (c.q, q_idx, cache, c.rs, c.ps, c.plen, c.cl, b.ret_idx, b.loc_idx, b.head_is_ret, cfg)
    out = sparse_decode_attention(*args, impl="triton").float()
    ref = sparse_decode_attention(*args, impl="reference").float()
    return float((out - ref).norm() / ref.norm())


def run(args) -> None:
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    if args.quick:
        lengths, batches, hq, hkv, d, window, densities = [1024], [1, 2], 8, 4, 32, 128, [0.1]
        dtype = torch.bfloat16 if cuda else torch.float32
    else:
        lengths, batches, hq, hkv, d, window, densities = [131072, 1048576], [1, 4, 8, 16], 32, 4, 128, 8192, \
            [0.01, 0.02, 0.05, 0.10]
        dtype = torch.bfloat16
    if args.batches:
        batches = [int(x) for x in args.batches.split(",")]
    block = 64
    rows: list[dict] = []
    t_start = time.perf_counter()
    check = check_against_reference(dev, dtype, hq, hkv, d, window)
    print(f"Triton vs reference, relative error {check:.2e}" + ("" if check < 2e-2 else "  <-- TOO LARGE"), flush=True)
    for L in lengths:
        for B in batches:
            try:
                c = Case(L, B, hq, hkv, d, window, block, dtype, dev)
                bench_case(c, densities, rows, use_graphs=cuda)
                del c
            except torch.cuda.OutOfMemoryError as e:
                rows.append(dict(L=L, B=B, config="error", error=f"out of memory: {str(e)[:200]}"))
            if cuda:
                torch.cuda.empty_cache()
            print(f"L={L} B={B} done ({time.perf_counter() - t_start:.0f} s)", flush=True)
    ok = [r for r in rows if r["config"] != "error"]
    summary = summarise(ok)
    config = dict(heads=hq, kv_heads=hkv, head_dim=d, dtype=str(dtype), window=window, sinks=4, block=block,
                  top_p=0.9, indexer_dim=16, quick=args.quick, seconds=time.perf_counter() - t_start,
                  triton_vs_reference_rel_err=check,
                  note="rtpurbo@15% = 0.6 t(1 retrieval kv head) + 0.4 t(0); times per layer per decode step")
    write_json(NAME, config, rows, out_dir=args.out, extra={"summary": summary})
    print()
    print_table(summary, ["L", "B", "density", "ret_density", "sdpa_ms", "triton_ms", "rtpurbo15_ms", "vs_sdpa",
                          "vs_triton", "step_speedup"])


def plot(result: dict, png_path: Path) -> None:
    import matplotlib.pyplot as plt

    summ = result.get("summary", [])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, L in zip(axes, sorted({r["L"] for r in summ})[:2]):
        for d in sorted({r["density"] for r in summ}):
            pts = sorted((r["B"], r["vs_sdpa"]) for r in summ if r["L"] == L and r["density"] == d)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{d:.0%} density")
        ax.set_xscale("log", base=2)
        ax.set_title(f"context {L // 1024}K")
        ax.set_xlabel("batch (rows)")
        ax.axhline(1.0, color="gray", lw=0.5)
    axes[0].set_ylabel("speedup over SDPA decode (x)")
    axes[0].legend()
    save_figure(fig, png_path, "RTPurbo decode, one layer (32q/4kv, d128, bf16), 15% retrieval heads")


def main(argv=None) -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--batches", default=None, help="comma-separated batch sizes (override)")
    run(p.parse_args(argv))


if __name__ == "__main__":
    main()

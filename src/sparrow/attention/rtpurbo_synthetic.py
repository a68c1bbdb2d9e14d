"""A synthetic RTPurbo decode layer: caches and inputs of one attention layer with a chosen retrieval density,
and the speedups of a 15%-retrieval-head model derived from per-layer times; the prefill's indexer likewise.

What ``benchmarks/bench_rtpurbo_decode.py`` times, for a user timing their own shapes: :func:`hot_indexer_keys`
plants the blocks that carry the indexer's mass, :class:`SyntheticDecodeLayer` holds a dense two-level cache and
RTPurbo caches for zero and one retrieval kv head with a backend whose indexer maps the layer's query onto the
planted direction, :func:`decode_speedups` reads the times back and :func:`triton_vs_reference` checks the Triton
pipelines timed against the PyTorch reference. For ``benchmarks/bench_rtpurbo_prefill.py``:
:func:`prefill_indexer` plants the density in a prompt's indexer queries and keys, :func:`prefill_vs_reference`
checks the fast prefill path against the reference.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from sparrow._numerics import rel_err
from sparrow.attention.base import LayerShape
from sparrow.attention.rtpurbo import RTPurboAttention, RTPurboCache, RTPurboConfig
from sparrow.kernels.sparse_prefill import SparsePrefillConfig, sparse_prefill_attention

INDEXER_DIM = 16  #: the indexer key width of the synthetic layer


def _hot_blocks(g: torch.Generator, shape: tuple[int, ...], density: float, top_p: float) -> torch.Tensor:
    """A bool tensor of ``shape`` (blocks last): each block hot with chance ``density / top_p`` (a top-p selection of
    ``top_p`` over hot blocks that hold ~all the mass then keeps ~``density`` of them), the first block never."""
    hot = torch.rand(shape, generator=g) < min(1.0, density / top_p)
    hot[..., 0] = False
    return hot


def hot_indexer_keys(B: int, L: int, density: float, block: int, u: torch.Tensor, seed: int,
                     top_p: float = 0.9) -> torch.Tensor:
    """``[B, 1, L, r]`` indexer keys (``r = u.numel()``): a random ``density / top_p`` fraction of the ``block``-token
    blocks (never the first) aligned with the unit vector ``u``, so they carry ~all the mass; small noise
    (from torch's global generator) elsewhere. The hot blocks are deterministic in ``seed``; on ``u``'s device,
    float32."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    tok = _hot_blocks(g, (B, -(-L // block)), density, top_p).repeat_interleave(block, dim=1)[:, :L].to(u.device)
    return torch.randn(B, 1, L, u.numel(), device=u.device) * 0.05 + tok[:, None, :, None] * (12.0 * u)


def prefill_indexer(S: int, density: float, block: int, r: int, device: torch.device | str, dtype: torch.dtype,
                    seed: int = 0, top_p: float = 0.9) -> tuple[torch.Tensor, torch.Tensor]:
    """Indexer queries and keys ``q_idx, k_idx`` ``[1, 1, S, r]`` of one ``S``-token prompt (one retrieval kv head;
    on ``device`` in ``dtype``): the keys of a random ``density / top_p`` fraction of the ``block``-token key blocks
    (never the first, kept anyway as the sink) point along a random unit vector that every query follows, so they
    carry ~all the indexer mass and a top-p selection keeps about ``density`` of the causal blocks; small noise
    elsewhere. Deterministic in ``seed`` (its own generator)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    u = torch.randn(r, generator=g)
    u = u / u.norm()
    hot = _hot_blocks(g, (-(-S // block),), density, top_p)  # the sink block is kept anyway
    k = torch.randn(S, r, generator=g) * 0.05
    k[hot.repeat_interleave(block)[:S]] += 12.0 * u
    q = u.expand(S, r) + torch.randn(S, r, generator=g) * 0.05
    return q.to(device, dtype)[None, None].contiguous(), k.to(device, dtype)[None, None].contiguous()


def prefill_vs_reference(dev: torch.device | str, dtype: torch.dtype, hq: int, hkv: int, d: int,
                         config: SparsePrefillConfig, *,
                         S: int = 1000, flex_dynamic: bool | None = True) -> float:
    """The largest relative error (Frobenius, fp32) of the fast sparse prefill (FlexAttention for the retrieval
    head, Triton scores; the local heads both ``chunked`` and ``flex``) against the PyTorch reference, on random
    q / k / v of one ``S``-token prompt (``hq`` query heads, ``hkv`` kv heads, the first retrieval, head_dim ``d``)
    with a :func:`prefill_indexer` at 10% density. ``config``: the
    selection measured (its window cut to 300 tokens);
    ``flex_dynamic`` as :func:`~sparrow.kernels.sparse_prefill.sparse_prefill_attention` takes it. Needs CUDA or
    Triton's interpreter (``TRITON_INTERPRET=1``)."""
    g = torch.Generator(device="cpu").manual_seed(4)
    q, k, v = (torch.randn(1, h, S, d, generator=g).to(dev, dtype) for h in (hq, hkv, hkv))
    small = SparsePrefillConfig(config.top_p, config.block, config.num_sinks, min(config.window, 300),
                                config.ret_window)
    qi, ki = prefill_indexer(S, 0.1, config.block, INDEXER_DIM, dev, dtype, seed=5, top_p=config.top_p)
    args = (q, k, v, qi, ki, torch.tensor([S], device=dev), torch.arange(1, device=dev),
            torch.arange(1, hkv, device=dev), small)
    ref = sparse_prefill_attention(*args, impl="reference", score_impl="reference").float()
    outs = [sparse_prefill_attention(*args, impl="flex", score_impl="triton", local_impl=li, flex_dynamic=flex_dynamic)
            for li in ("chunked", "flex")]
    return max(rel_err(o, ref) for o in outs)


class SyntheticDecodeLayer:
    """Caches and inputs of one decode step of ``B`` rows with ``L`` cached tokens each (``hq`` query heads, ``hkv``
    kv heads, ``head_dim`` ``d``; seeded, so the same arguments give the same tensors): a dense two-level cache
    (``pk, pv`` the prompts', ``gk, gv`` the ``gen`` generation slots, the new token at slot 0), one query shared
    by every row (``q``), the new token's keys and values, the decode metadata tensors (``rs, ps, plen, cl``), and
    for 0 and 1 retrieval kv heads the local heads' sink + ``window`` ring buffers. :meth:`cache` and
    :meth:`backend` build the RTPurbo side."""

    def __init__(self, L: int, B: int, hq: int, hkv: int, d: int, window: int, block: int, dtype: torch.dtype,
                 dev: torch.device | str, gen: int = 16):
        self.L, self.B, self.hq, self.hkv, self.d, self.gen = L, B, hq, hkv, d, gen
        torch.manual_seed(0)
        rn = lambda *shape: torch.randn(*shape, device=dev, dtype=dtype)  # noqa: E731
        self.pk, self.pv, self.gk, self.gv = rn(B, hkv, L, d), rn(B, hkv, L, d), rn(B + 1, hkv, gen, d), \
            rn(B + 1, hkv, gen, d)
        self.q = rn(1, hq, 1, d).expand(B, hq, 1, d).contiguous()  # one query for every row: the indexer maps it to u
        self.k_new, self.v_new = rn(B, hkv, 1, d), rn(B, hkv, 1, d)
        self.rs, self.ps = torch.arange(B, device=dev), torch.arange(B, device=dev)
        self.plen, self.cl = torch.full((B,), L - 1, device=dev), torch.zeros(B, dtype=torch.int64, device=dev)
        self.window, self.block, self.dtype, self.dev = window, block, dtype, dev
        wp, wg = min(window, L), min(window + 64, gen)
        self.local = {n: (rn(B, hkv - n, 4 + wp, d), rn(B, hkv - n, 4 + wp, d), rn(B + 1, hkv - n, wg, d),
                          rn(B + 1, hkv - n, wg, d)) for n in (0, 1)}
        g = torch.Generator(device="cpu").manual_seed(1)
        u = torch.randn(INDEXER_DIM, generator=g)
        self.u = (u / u.norm()).to(dev)  #: the direction the hot indexer keys point along

    def cache(self, n_ret: int, ik: torch.Tensor | None) -> RTPurboCache:
        """The RTPurbo cache for ``n_ret`` (0 or 1) retrieval kv heads, ``ik`` the prompts' indexer keys (e.g.
        :func:`hot_indexer_keys`; None: zeros). ``KeyError`` for another ``n_ret``."""
        if ik is None:
            ik = torch.zeros(self.B, n_ret, self.L, INDEXER_DIM, device=self.dev, dtype=self.dtype)
        gik = torch.zeros(self.B + 1, n_ret, self.gen, INDEXER_DIM, device=self.dev, dtype=self.dtype)
        return RTPurboCache(self.pk[:, :n_ret], self.pv[:, :n_ret], self.gk[:, :n_ret], self.gv[:, :n_ret],
                            ik.to(self.dtype), gik, *self.local[n_ret])

    def backend(self, n_ret: int, impl: str = "triton") -> RTPurboAttention:
        """An RTPurbo backend (kv heads ``0 .. n_ret-1`` retrieval) whose indexer maps this layer's query onto
        ``u``, so that the hot blocks win the selection."""
        shape = LayerShape(0, self.hq, self.hkv, self.d)
        b = RTPurboAttention(shape, RTPurboConfig(window=self.window, decode_block=self.block, impl=impl),
                             list(range(n_ret))).to(self.dev)
        if n_ret:
            qg = b.group_queries(self.q[:1].float())[0, 0, 0]  # [qpk * d]
            wq = (qg / qg.square().sum())[:, None] * self.u.float()[None, :]
            b.load_indexer(wq[None].expand(n_ret, -1, -1), b.indexer_k.detach())
        return b


def decode_speedups(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (L, B, density, pipeline) of the ``rtpurbo`` rows with one retrieval head: the time of a model with 15%
    retrieval heads (``0.6 t(1 retrieval kv head) + 0.4 t(0)`` of 4 kv heads), and its speedups over ``sdpa``, the
    dense Triton kernel (``dense_triton``) and, for the whole backend step, ``dense_step`` vs ``rtpurbo_step``.
    ``rows``: ``{L, B, config, pipeline, n_ret, density, density_source, ret_density, eager_ms, graph_ms}``; the
    ``graph_ms`` column unless all of it is NaN (then ``eager_ms``; named in ``timing``). ``StopIteration`` when
    a row the speedups need is missing."""
    out = []
    key = "graph_ms" if any(r["graph_ms"] == r["graph_ms"] for r in rows) else "eager_ms"  # NaN-free column
    for (L, B) in sorted({(r["L"], r["B"]) for r in rows}):
        sel = [r for r in rows if r["L"] == L and r["B"] == B]
        get = lambda cfg, n=0, d=0.0, p="-": next(  # noqa: E731
            r[key] for r in sel if (r["config"], r["n_ret"], r["density"], r["pipeline"]) == (cfg, n, d, p))
        sdpa, tri, dstep = get("sdpa", d=1.0), get("dense_triton", d=1.0), get("dense_step", d=1.0)
        for r1 in (r for r in sel if r["config"] == "rtpurbo" and r["n_ret"] == 1):
            d, p = r1["density"], r1["pipeline"]
            t15 = 0.6 * r1[key] + 0.4 * get("rtpurbo", 0, 0.0, p)
            st15 = 0.6 * get("rtpurbo_step", 1, d, "library") + 0.4 * get("rtpurbo_step", 0, 0.0, "library")
            out.append(dict(L=L, B=B, pipeline=p, density=d, density_source=r1["density_source"],
                            ret_density=r1["ret_density"], sdpa_ms=sdpa, triton_ms=tri, rtpurbo15_ms=t15,
                            vs_sdpa=sdpa / t15, vs_triton=tri / t15, step_dense_ms=dstep, step_rtpurbo15_ms=st15,
                            step_speedup=dstep / st15, timing=key))
    return out


def triton_vs_reference(dev: torch.device | str, dtype: torch.dtype, hq: int, hkv: int, d: int, window: int, *,
                        top_p: float = 0.9, L: int = 2048, B: int = 2, block: int = 64) -> float:
    """The largest relative error (Frobenius, fp32) of the two Triton sparse-decode pipelines (``staged``: the
    indexer projection in PyTorch; ``fused``: inside the score kernel) against the PyTorch reference, on a
    :class:`SyntheticDecodeLayer` of ``L`` tokens and ``B`` rows (window at most 512, 5% planted density). Needs
    CUDA or Triton's interpreter (``TRITON_INTERPRET=1``)."""
    from sparrow.kernels.sparse_decode import SparseDecodeConfig, sparse_decode_attention

    c = SyntheticDecodeLayer(L, B, hq, hkv, d, min(window, 512), block, dtype, dev)
    b = c.backend(1)
    cache = c.cache(1, hot_indexer_keys(B, L, 0.05, block, c.u, seed=3, top_p=top_p))
    q_idx, _ = b.index(c.q, c.k_new)
    cfg = SparseDecodeConfig(top_p, block, 4, min(window, 512), 128)
    args = (c.q, q_idx, cache, c.rs, c.ps, c.plen, c.cl, b.ret_idx, b.loc_idx, b.head_is_ret, cfg)
    ref = sparse_decode_attention(*args, impl="reference").float()
    proj = dict(q_pre=c.q, indexer_q=b.indexer_q.detach(), q_scale=b.score_scale)
    outs = [sparse_decode_attention(*args, impl="triton", fused=False),
            sparse_decode_attention(c.q, None, *args[2:], impl="triton", **proj)]
    return max(rel_err(o, ref) for o in outs)

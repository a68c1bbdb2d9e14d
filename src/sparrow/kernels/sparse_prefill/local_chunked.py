"""Sliding-window + sink prefill at the cost of the window band, on the dense attention kernel SDPA picks.

Query ``i`` sees keys ``i - window < j <= i`` and the sinks ``j < num_sinks``. Cut the sequence into chunks
of ``C = window - 1`` tokens. Then query ``a`` of chunk ``c`` sees

* all of its own chunk up to itself — causal attention inside the chunk, and
* the keys ``b >= a`` of chunk ``c - 1`` (``i - j = C + a - b < window``) — the upper triangle, which is causal
  attention again once both the chunk's queries and the previous chunk's keys are reversed.

Both pieces are square and causal, so every chunk of a batch of chunks goes through one call of the platform's
fastest dense kernel (cuDNN / flash on CUDA, flash on the CPU), and together they cover exactly the band:
``C^2`` query-key pairs per chunk, the ``window * S`` the window implies, none of the rest. A last, partial
chunk of ``m`` rows adds three small pieces (its own causal ``m x m``, the reversed ``m x m`` triangle of the
previous chunk's first ``m`` keys, and the rest of that chunk, which all its rows see). The pieces' outputs
and log-sum-exps are merged, with the sinks outside the window, by one Triton kernel per group of chunks
(:mod:`.triton_local_merge`), which writes the result straight into the caller's output heads.

Chunks are processed in groups so that the temporaries stay near ``GROUP_ELEMENTS`` elements per piece.
"""

from __future__ import annotations

import math

import torch
from torch.nn.attention import SDPBackend

from .triton_local_merge import local_merge_triton

GROUP_ELEMENTS = 1 << 30  # per piece and group: the chunk queries' elements (2 GiB in bf16)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention and its natural-log log-sum-exp, on the kernel ``F.scaled_dot_product_attention`` would
    pick for these tensors (``enable_gqa``: ``Hkv`` may divide ``Hq``).

    q: [B, Hq, L, D], k, v: [B, Hkv, Lk, D]; ``causal`` needs ``L == Lk``. Returns ([B, Hq, L, D] in q's dtype,
    [B, Hq, L] float32, any strides).
    """
    choice = torch._fused_sdp_choice(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
    aten = torch.ops.aten
    L = q.shape[2]
    if choice == SDPBackend.CUDNN_ATTENTION.value:
        out, lse = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
        return out, lse.reshape(lse.shape[0], lse.shape[1], -1)[..., :L]
    if choice == SDPBackend.FLASH_ATTENTION.value and q.shape[-1] % 8 == 0:
        if q.is_cuda:
            out, lse = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]
        else:
            out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse
    if choice == SDPBackend.EFFICIENT_ATTENTION.value and k.shape[1] == q.shape[1]:
        out, lse = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)[:2]
        return out, lse[..., :L]
    # no fused kernel takes these tensors: the same in float32, spelled out
    g = q.shape[1] // k.shape[1]
    kf, vf = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    s = (q.float() @ kf.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return (torch.exp(s - lse[..., None]) @ vf).to(q.dtype), lse


def _chunks(x: torch.Tensor, c0: int, c1: int, C: int, flip: bool) -> torch.Tensor:
    """Chunks ``c0 .. c1 - 1`` of ``C`` positions of x [P, H, S, D] as [P * (c1 - c0), H, C, D] (reversed inside
    each chunk when ``flip``; a view when possible)."""
    P, H, _, D = x.shape
    y = x[:, :, c0 * C:c1 * C].unflatten(2, (c1 - c0, C)).transpose(1, 2)  # [P, G, H, C, D]
    if flip:
        y = y.flip(3)
    return y.reshape(P * (c1 - c0), H, C, D)


def local_attention_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_sinks: int, window: int,
                            scale: float | None = None, out: torch.Tensor | None = None,
                            head_map: torch.Tensor | None = None) -> torch.Tensor:
    """Causal sliding-window (``window``) + ``num_sinks`` sink attention.

    q: [P, Hq, S, D]; k, v: [P, Hkv, S, D] (``Hkv`` divides ``Hq``; query head ``h`` reads kv head
    ``h // (Hq / Hkv)``). Written into ``out[:, head_map[h]]`` when given (out: [P, *, S, D], head_map: [Hq]
    int64), else into a new [P, Hq, S, D]. Returns the tensor written.
    """
    P, Hq, S, D = q.shape
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    if out is None:
        out = torch.empty_like(q)
        head_map = torch.arange(Hq, device=q.device)
    if S <= window:  # every causal pair is inside the window (the sinks too)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        out.index_copy_(1, head_map, o)
        return out
    C = max(window - 1, 1)
    prev = window >= 2  # window 1: a query sees only itself (and the sinks)
    nf, m = S // C, S % C
    ns = min(num_sinks, S)
    kw = dict(num_sinks=ns, window=window, scale=scale)
    ks, vs = k[:, :, :max(ns, 1)], v[:, :, :max(ns, 1)]
    group = max(1, GROUP_ELEMENTS // max(1, P * Hq * C * D))
    for c0 in range(0, nf, group):
        c1 = min(nf, c0 + group)
        qa, ka, va = (_chunks(x, c0, c1, C, False) for x in (q, k, v))
        pieces = [(*attention_with_lse(qa, ka, va, causal=True, scale=scale), c1 - c0, 0, False)]
        del qa, ka, va
        cb = max(c0, 1)
        if prev and cb < c1:
            qb = _chunks(q, cb, c1, C, True)
            kb, vb = (_chunks(x, cb - 1, c1 - 1, C, True) for x in (k, v))
            pieces.append((*attention_with_lse(qb, kb, vb, causal=True, scale=scale), c1 - cb, cb - c0, True))
            del qb, kb, vb
        local_merge_triton(q, ks, vs, out, head_map, pieces, row0=c0 * C, rows=(c1 - c0) * C, chunk=C, **kw)
        del pieces
    if m:  # the last, partial chunk: rows nf*C .. S-1 (nf >= 1 since S > window > C)
        t0, p0 = nf * C, (nf - 1) * C
        qt, kt, vt = q[:, :, t0:], k[:, :, t0:], v[:, :, t0:]
        pieces = [(*attention_with_lse(qt, kt, vt, causal=True, scale=scale), 1, 0, False)]
        flip = lambda x: x.flip(2)  # noqa: E731
        pieces.append((*attention_with_lse(flip(qt), flip(k[:, :, p0:p0 + m]), flip(v[:, :, p0:p0 + m]), causal=True,
                                           scale=scale), 1, 0, True))
        pieces.append((*attention_with_lse(qt, k[:, :, p0 + m:t0], v[:, :, p0 + m:t0], causal=False, scale=scale),
                       1, 0, False))
        local_merge_triton(q, ks, vs, out, head_map, pieces, row0=t0, rows=m, chunk=m, **kw)
    return out

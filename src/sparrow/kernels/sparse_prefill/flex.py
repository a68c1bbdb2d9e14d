"""RTPurbo prefill through block-sparse FlexAttention: retrieval heads over their kept blocks, local heads over
sinks + window, both with masks built on the device from block indices (:mod:`.masks`); compiled. Local heads
can instead take the chunked path of :mod:`.local_chunked` (dense kernels over exactly the window band)."""

from __future__ import annotations

import torch

from .local_chunked import local_attention_chunked
from .masks import local_block_mask, retrieval_block_mask

_compiled_flex: dict = {}


def flex_attention_compiled(dynamic: bool | None = None):
    """``torch.compile``d :func:`flex_attention`, one per ``dynamic`` setting (eager flex would build dense
    scores). ``dynamic=None`` specialises on the first shapes and turns dynamic when they change;
    ``dynamic=True`` compiles one graph for every sequence length and head count."""
    if dynamic not in _compiled_flex:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex[dynamic] = torch.compile(flex_attention, dynamic=dynamic)
    return _compiled_flex[dynamic]


def sparse_prefill_flex(q, k, v, selection, ret_heads, loc_heads, *, block: int, num_sinks: int, window: int,
                        scale: float | None, flex_dynamic: bool | None, local_impl: str = "flex") -> torch.Tensor:
    """q: [P, Hq, S, D]; k, v: [P, Hkv, S, D]; ``selection``: the retrieval heads' kept blocks
    ``(ids [P*H_ret*Qb, KVb] int32, cnt [P*H_ret*Qb])`` (None without retrieval heads); ``local_impl``:
    ``"flex"`` or ``"chunked"`` for the local heads. Returns [P, Hq, S, D]."""
    P, Hq, S, D = q.shape
    Hr, Hl = ret_heads.shape[0], loc_heads.shape[0]
    Hkv = Hr + Hl
    qpk = Hq // Hkv
    flex = flex_attention_compiled(flex_dynamic)
    # the GPU kernel's default tiles (128 queries x 64 keys) must divide the mask's blocks: smaller blocks
    # get tiles of their own size
    opts = {"BLOCK_M": block, "BLOCK_N": block} if q.is_cuda and block < 128 else None
    q5 = q.view(P, Hkv, qpk, S, D)
    out = torch.empty((P, Hkv, qpk, S, D), dtype=q.dtype, device=q.device)
    if Hr:
        idx, cnt = selection
        nb = idx.shape[-1]
        mask = retrieval_block_mask(idx.view(P * Hr, nb, nb), cnt.view(P * Hr, nb), S, block)
        qr = q5[:, ret_heads].reshape(P * Hr, qpk, S, D)
        kr = k[:, ret_heads].reshape(P * Hr, 1, S, D)
        vr = v[:, ret_heads].reshape(P * Hr, 1, S, D)
        o = flex(qr, kr, vr, block_mask=mask, scale=scale, enable_gqa=qpk > 1, kernel_options=opts)
        out.index_copy_(1, ret_heads, o.view(P, Hr, qpk, S, D))
    if Hl and local_impl == "chunked":
        # without retrieval heads the local heads are all of q's, in order: no gather
        ql, kl, vl = (q, k, v) if not Hr else (q5[:, loc_heads].reshape(P, Hl * qpk, S, D), k[:, loc_heads],
                                                 v[:, loc_heads])
        src = torch.arange(Hkv, device=q.device) if not Hr else loc_heads
        head_map = (src[:, None] * qpk + torch.arange(qpk, device=q.device)).reshape(-1)
        local_attention_chunked(ql, kl, vl, num_sinks=num_sinks, window=window, scale=scale,
                                out=out.view(P, Hq, S, D), head_map=head_map)
    elif Hl:
        mask = local_block_mask(S, block, num_sinks=num_sinks, window=window, device=q.device)
        ql = q5[:, loc_heads].reshape(P, Hl * qpk, S, D)
        o = flex(ql, k[:, loc_heads].contiguous(), v[:, loc_heads].contiguous(), block_mask=mask, scale=scale,
                 enable_gqa=qpk > 1, kernel_options=opts)
        out.index_copy_(1, loc_heads, o.view(P, Hl, qpk, S, D))
    return out.view(P, Hq, S, D)

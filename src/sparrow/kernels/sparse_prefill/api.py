"""RTPurbo prefill: block scores, top-p block selection and block-sparse FlexAttention; ``impl`` dispatch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Impl = Literal["auto", "reference", "flex"]
ScoreImpl = Literal["auto", "reference", "triton"]


@dataclass(frozen=True)
class SparsePrefillConfig:
    """Selection (``top_p``, ``block``, ``ret_window``) and local attention (``num_sinks``, ``window``)."""

    top_p: float
    block: int
    num_sinks: int
    window: int
    ret_window: int


def prefill_block_scores(q_idx: torch.Tensor, k_idx: torch.Tensor, prompt_len: torch.Tensor, block: int, *,
                         impl: ScoreImpl = "auto") -> torch.Tensor:
    """Log mean per-query indexer mass of each causal key block: [P, H, S, r] x2 -> [P, H, Qb, KVb] float32.

    Only entries ``kb <= qb`` are defined for ``impl="triton"`` (the reference fills the rest with ``-inf``).
    """
    if impl == "auto":
        impl = "triton" if q_idx.is_cuda else "reference"
    if impl == "triton":
        from .triton_block_scores import prefill_block_scores_triton

        return prefill_block_scores_triton(q_idx.contiguous(), k_idx.contiguous(), prompt_len, block)
    if impl == "reference":
        from .reference import prefill_block_scores_reference

        return prefill_block_scores_reference(q_idx, k_idx, prompt_len, block)
    raise ValueError(f"impl must be 'auto', 'reference' or 'triton', got {impl!r}")


def select_prefill_blocks(q_idx, k_idx, prompt_len, cfg: SparsePrefillConfig, *, impl: ScoreImpl = "auto"):
    """Kept key blocks of every (prompt, retrieval head, query block): (ids [P*H*Qb, KVb] int32, cnt [P*H*Qb])."""
    P, H, S, _ = q_idx.shape
    if impl == "auto":
        impl = "triton" if q_idx.is_cuda else "reference"
    scores = prefill_block_scores(q_idx, k_idx, prompt_len, cfg.block, impl=impl)
    nb = scores.shape[-1]
    sink_blocks = -(-cfg.num_sinks // cfg.block)
    if impl == "triton":
        from sparrow.kernels.topp.triton_topp import MODE_PREFILL, topp_select_triton

        idx = torch.zeros((P * H * nb, nb), dtype=torch.int32, device=q_idx.device)
        return topp_select_triton(scores.view(P * H * nb, nb), prompt_len, prompt_len, cfg.top_p, mode=MODE_PREFILL,
                                  block=cfg.block, qblock=cfg.block, sink_blocks=sink_blocks,
                                  local_window=cfg.ret_window, inner=nb, h_inner=H * nb, sel_idx=idx)
    from sparrow.kernels.topp.api import mask_to_blocks

    from .reference import retrieval_selection_reference

    sel = retrieval_selection_reference(scores, prompt_len, top_p=cfg.top_p, block=cfg.block,
                                        num_sinks=cfg.num_sinks, ret_window=cfg.ret_window)
    return mask_to_blocks(sel.reshape(P * H * nb, nb))


_compiled_flex: dict = {}


def flex_attention_compiled(dynamic: bool | None = None):
    """``torch.compile``d :func:`flex_attention`, one per ``dynamic`` setting (eager flex would build dense
    scores). ``dynamic=None`` specialises on the first shapes and turns dynamic when they change;
    ``dynamic=True`` compiles one graph for every sequence length and head count."""
    if dynamic not in _compiled_flex:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled_flex[dynamic] = torch.compile(flex_attention, dynamic=dynamic)
    return _compiled_flex[dynamic]


def sparse_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_idx: torch.Tensor | None,
    k_idx: torch.Tensor | None,
    prompt_len: torch.Tensor,
    ret_heads: torch.Tensor,
    loc_heads: torch.Tensor,
    cfg: SparsePrefillConfig,
    *,
    scale: float | None = None,
    impl: Impl = "auto",
    score_impl: ScoreImpl = "auto",
    return_selection: bool = False,
    flex_dynamic: bool | None = None,
):
    """RTPurbo causal attention over right-padded prompts.

    Args:
        q: [P, Hq, S, D]; k, v: [P, Hkv, S, D] (post-RoPE; heads grouped by kv head).
        q_idx, k_idx: [P, H_ret, S, r] indexer queries / keys of the retrieval heads (None when there are none).
        prompt_len: [P] int64. ret_heads / loc_heads: [H_ret] / [H_loc] int64 kv-head ids.
        cfg: see :mod:`.reference` for the exact semantics.
        impl: ``"flex"`` (block-sparse FlexAttention, compiled), ``"reference"`` (dense masks + SDPA),
            ``"auto"`` (flex on CUDA). score_impl: block scores + top-p, ``"triton"`` or ``"reference"``.
        return_selection: also return the retrieval selection, ``(ids [P*H_ret*Qb, KVb], cnt)``.
        flex_dynamic: ``dynamic`` of the compiled FlexAttention (see :func:`flex_attention_compiled`).

    Returns: [P, Hq, S, D] (rows past ``prompt_len`` unspecified).
    """
    if impl == "auto":
        impl = "flex" if q.is_cuda else "reference"
    kw = dict(top_p=cfg.top_p, block=cfg.block, num_sinks=cfg.num_sinks, window=cfg.window,
              ret_window=cfg.ret_window, scale=scale)
    if impl == "reference":
        from .reference import sparse_prefill_reference

        out, sel = sparse_prefill_reference(q, k, v, q_idx, k_idx, prompt_len, ret_heads, loc_heads,
                                            return_selection=True, **kw)
        if return_selection:
            from sparrow.kernels.topp.api import mask_to_blocks

            sel = None if sel is None else mask_to_blocks(sel.reshape(-1, sel.shape[-1]))
            return out, sel
        return out
    if impl != "flex":
        raise ValueError(f"impl must be 'auto', 'reference' or 'flex', got {impl!r}")

    from .masks import local_block_mask, retrieval_block_mask

    P, Hq, S, D = q.shape
    Hr, Hl = ret_heads.shape[0], loc_heads.shape[0]
    Hkv = Hr + Hl
    qpk = Hq // Hkv
    flex = flex_attention_compiled(flex_dynamic)
    # the GPU kernel's default tiles (128 queries x 64 keys) must divide the mask's blocks: smaller blocks
    # get tiles of their own size
    opts = {"BLOCK_M": cfg.block, "BLOCK_N": cfg.block} if q.is_cuda and cfg.block < 128 else None
    q5 = q.view(P, Hkv, qpk, S, D)
    out = torch.empty((P, Hkv, qpk, S, D), dtype=q.dtype, device=q.device)
    selection = None
    if Hr:
        idx, cnt = select_prefill_blocks(q_idx, k_idx, prompt_len, cfg, impl=score_impl)
        selection = (idx, cnt)
        nb = idx.shape[-1]
        mask = retrieval_block_mask(idx.view(P * Hr, nb, nb), cnt.view(P * Hr, nb), S, cfg.block)
        qr = q5[:, ret_heads].reshape(P * Hr, qpk, S, D)
        kr = k[:, ret_heads].reshape(P * Hr, 1, S, D)
        vr = v[:, ret_heads].reshape(P * Hr, 1, S, D)
        o = flex(qr, kr, vr, block_mask=mask, scale=scale, enable_gqa=qpk > 1, kernel_options=opts)
        out.index_copy_(1, ret_heads, o.view(P, Hr, qpk, S, D))
    if Hl:
        mask = local_block_mask(S, cfg.block, num_sinks=cfg.num_sinks, window=cfg.window, device=q.device)
        ql = q5[:, loc_heads].reshape(P, Hl * qpk, S, D)
        o = flex(ql, k[:, loc_heads].contiguous(), v[:, loc_heads].contiguous(), block_mask=mask, scale=scale,
                 enable_gqa=qpk > 1, kernel_options=opts)
        out.index_copy_(1, loc_heads, o.view(P, Hl, qpk, S, D))
    out = out.view(P, Hq, S, D)
    return (out, selection) if return_selection else out

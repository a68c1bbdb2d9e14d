"""RTPurbo decode attention over the two-level cache: validation and ``impl`` dispatch."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..common.impl import Impl, resolve_impl
from .cache import SparseDecodeCache


@dataclass(frozen=True)
class SparseDecodeConfig:
    """Static parameters of a decode call: selection (``top_p``, ``block``, ``ret_window``) and local
    attention (``num_sinks``, ``window``). ``top_p`` may be a float32 device tensor, 0-dim or ``[A]`` (one mass per
    row), that the selection reads when it runs (in-place updates reach compiled steps and CUDA graphs)."""

    top_p: float | torch.Tensor
    block: int
    num_sinks: int
    window: int
    ret_window: int


def sparse_decode_attention(
    q: torch.Tensor,
    q_idx: torch.Tensor | None,
    cache: SparseDecodeCache,
    row_slot: torch.Tensor,
    prefix_slot: torch.Tensor,
    prefix_len: torch.Tensor,
    cached_len: torch.Tensor,
    ret_heads: torch.Tensor,
    loc_heads: torch.Tensor,
    head_is_ret: torch.Tensor,
    cfg: SparseDecodeConfig,
    *,
    scale: float | None = None,
    impl: Impl = "auto",
    validate: bool = True,
    return_selection: bool = False,
    q_pre: torch.Tensor | None = None,
    indexer_q: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    fused: bool = True,
):
    """RTPurbo attention of ``T`` new tokens per row (their K/V, indexer keys already written).

    Args:
        q: [A, Hq, T, D] post-RoPE queries, heads grouped by kv head (``h // (Hq / Hkv)``).
        q_idx: [A, H_ret, T, r] indexer queries of the retrieval kv heads, or None: projected from ``q_pre``
            [A, Hq, T, D] (pre-RoPE queries) by ``indexer_q`` [H_ret, q_per_kv * D, r] (each retrieval head's
            query group concatenated, ``g * D + d``) in float32 and multiplied by ``q_scale`` [H_ret] (None: 1) —
            inside the score kernel on the Triton path, so no launch of its own.
        cache: the layer's :class:`SparseDecodeCache` (the RTPurbo backend's ``RTPurboCache`` is one).
        row_slot, prefix_slot, prefix_len, cached_len: [A] int64 (see :class:`sparrow.attention.DecodeMeta`).
        ret_heads / loc_heads: [H_ret] / [H_loc] int64 kv-head ids of each kind (together a permutation of
            ``range(Hkv)``); head_is_ret: [Hkv] int32 (1 for retrieval heads).
        cfg: selection and window parameters (see :mod:`.reference` for the exact semantics).
        impl: ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``), ``"reference"`` (eager PyTorch),
            ``"auto"`` (Triton on CUDA tensors, the reference elsewhere).
        return_selection: also return the retrieval heads' selection — a bool block mask [A, H_ret, T, NB]
            for the reference, ``(block ids [A*H_ret*T, NB], counts [A*H_ret*T])`` for Triton.
        fused: Triton only — two launches (scores; selection, attention and merge in one kernel) when True, the
            staged four (scores, top-p, attention, merge) when False; the same results either way.

    Returns: [A, Hq, T, D] in ``q.dtype`` (and the selection when asked).

    Raises: ValueError on inconsistent shapes or parameters (only when ``validate``; the check reads no data),
    or an unknown ``impl``.
    """
    if validate:
        _check(q, q_idx, cache, row_slot, ret_heads, loc_heads, cfg, q_pre, indexer_q)
    impl = resolve_impl(impl, q)
    kw = dict(top_p=cfg.top_p, block=cfg.block, num_sinks=cfg.num_sinks, window=cfg.window,
              ret_window=cfg.ret_window, scale=scale, return_selection=return_selection)
    if q_idx is None and ret_heads.shape[0] == 0:
        q_idx = q.new_zeros((q.shape[0], 0, q.shape[2], cache.prefix_ik.shape[-1]))  # nothing to project
    if impl == "triton":
        from .triton_sparse_decode import sparse_decode_op, sparse_decode_triton

        kw.update(q_pre=q_pre, indexer_q=indexer_q, q_scale=q_scale, fused=fused)
        if not return_selection:  # the engine's path: one opaque custom op under torch.compile
            kw.pop("return_selection")
            return sparse_decode_op(q, q_idx, cache, row_slot, prefix_slot, prefix_len, cached_len, ret_heads,
                                    loc_heads, head_is_ret, **kw)
        return sparse_decode_triton(q, q_idx, cache, row_slot, prefix_slot, prefix_len, cached_len, ret_heads,
                                    loc_heads, head_is_ret, **kw)
    from .reference import project_indexer_queries, sparse_decode_reference

    if q_idx is None:
        q_idx = project_indexer_queries(q_pre, indexer_q, ret_heads, q_scale)
    return sparse_decode_reference(q, q_idx, cache, row_slot, prefix_slot, prefix_len, cached_len, ret_heads,
                                   loc_heads, **kw)


def _check(q, q_idx, cache, row_slot, ret_heads, loc_heads, cfg, q_pre=None, indexer_q=None) -> None:
    if q.dim() != 4:
        raise ValueError(f"q must be [A, Hq, T, D], got {tuple(q.shape)}")
    A, Hq, T, D = q.shape
    Hr, Hl = ret_heads.numel(), loc_heads.numel()
    if Hr + Hl == 0 or Hq % (Hr + Hl):
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({Hr} + {Hl})")
    r = cache.prefix_ik.shape[-1]
    if q_idx is None and Hr:
        if q_pre is None or indexer_q is None or q_pre.shape != q.shape:
            raise ValueError(f"without q_idx, q_pre must be given with q's shape {tuple(q.shape)} and indexer_q too")
        if tuple(indexer_q.shape) != (Hr, (Hq // (Hr + Hl)) * D, r):
            raise ValueError(f"indexer_q must be [H_ret, q_per_kv * D, r] = [{Hr}, {(Hq // (Hr + Hl)) * D}, {r}], "
                             f"got {tuple(indexer_q.shape)}")
    elif q_idx is not None and q_idx.shape[:3] != (A, Hr, T):
        raise ValueError(f"q_idx must be [A, H_ret, T, r] = [{A}, {Hr}, {T}, r], got {tuple(q_idx.shape)}")
    if cache.prefix_k.shape[1] != Hr or cache.prefix_lk.shape[1] != Hl:
        raise ValueError("cache head counts do not match ret_heads / loc_heads")
    if q_idx is not None and r != q_idx.shape[-1]:
        raise ValueError(f"indexer dims differ: q_idx {q_idx.shape[-1]} vs cache {r}")
    if row_slot.shape != (A,):
        raise ValueError(f"row_slot must have shape ({A},), got {tuple(row_slot.shape)}")
    if cfg.num_sinks > cfg.block:
        raise ValueError(f"num_sinks ({cfg.num_sinks}) must be <= block ({cfg.block})")
    if cfg.window < T:
        raise ValueError(f"window ({cfg.window}) must be >= the new tokens per step ({T})")
    Wg = cache.gen_lk.shape[2]
    if Hl and Wg < cache.gen_k.shape[2] and Wg < cfg.window + T - 1:
        raise ValueError(f"the local ring ({Wg}) is too short for window {cfg.window} and {T} new tokens")

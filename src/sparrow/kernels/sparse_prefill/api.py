"""RTPurbo prefill: block scores, top-p block selection, block-sparse attention for the retrieval heads and
sink + window attention for the others; validation and ``impl`` dispatch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..common.impl import Impl, resolve_impl

PrefillImpl = Literal["auto", "reference", "flex"]
"""The attention of :func:`sparse_prefill_attention`: block-sparse FlexAttention, dense masks + SDPA, or
``"auto"`` (flex on CUDA tensors, the reference elsewhere). Block scoring and selection take an :data:`Impl`."""
PREFILL_IMPLS: tuple[str, ...] = ("auto", "reference", "flex")
LocalImpl = Literal["auto", "chunked", "flex"]
"""The local heads' sink + window attention on the fast path: ``"chunked"`` (the window band cut into square
causal pieces for the dense kernel SDPA picks, merged by a Triton kernel: :mod:`.local_chunked`), ``"flex"``
(FlexAttention with a sliding-window block mask) or ``"auto"`` (chunked for power-of-two head dims >= 16, else
flex)."""
LOCAL_IMPLS: tuple[str, ...] = ("auto", "chunked", "flex")


@dataclass(frozen=True)
class SparsePrefillConfig:
    """Selection (``top_p``, ``block``, ``ret_window``) and local attention (``num_sinks``, ``window``). ``top_p``
    may be a float32 device tensor, 0-dim or ``[P]`` (one mass per prompt), read by the selection."""

    top_p: float | torch.Tensor
    block: int
    num_sinks: int
    window: int
    ret_window: int


def prefill_block_scores(q_idx: torch.Tensor, k_idx: torch.Tensor, prompt_len: torch.Tensor, block: int, *,
                         impl: Impl = "auto") -> torch.Tensor:
    """Log mean per-query indexer mass of each causal key block: [P, H, S, r] x2 -> [P, H, Qb, KVb] float32.

    Only entries ``kb <= qb`` are defined for ``impl="triton"`` (the reference fills the rest with ``-inf``).

    Raises: ValueError on an unknown ``impl``.
    """
    if resolve_impl(impl, q_idx) == "triton":
        from .triton_block_scores import prefill_block_scores_triton

        return prefill_block_scores_triton(q_idx.contiguous(), k_idx.contiguous(), prompt_len, block)
    from .reference import prefill_block_scores_reference

    return prefill_block_scores_reference(q_idx, k_idx, prompt_len, block)


def select_prefill_blocks(q_idx: torch.Tensor, k_idx: torch.Tensor, prompt_len: torch.Tensor,
                          cfg: SparsePrefillConfig, *, impl: Impl = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Kept key blocks of every (prompt, retrieval head, query block): (ids [P*H*Qb, KVb] int32, cnt [P*H*Qb])."""
    P, H, S, _ = q_idx.shape
    impl = resolve_impl(impl, q_idx)
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


def chunked_supported(head_dim: int) -> bool:
    """Whether the chunked local path's merge kernel takes ``head_dim`` (a power of two, at least 16)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def local_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_sinks: int, window: int,
                            scale: float | None = None,
                            impl: Literal["auto", "reference", "chunked"] = "auto") -> torch.Tensor:
    """Causal attention over the sinks ``j < num_sinks`` and the window ``i - window < j <= i``.

    Args:
        q: [P, Hq, S, D]; k, v: [P, Hkv, S, D] (``Hkv`` divides ``Hq``, query head ``h`` reads kv head
            ``h // (Hq / Hkv)``).
        impl: ``"chunked"`` (exactly the band's work on the dense attention kernel, Triton merge; CUDA, or the
            CPU under ``TRITON_INTERPRET=1``; power-of-two head dims >= 16), ``"reference"`` (a dense [S, S]
            mask), ``"auto"`` (chunked on CUDA where it applies, the reference elsewhere).

    Returns: [P, Hq, S, D] in q's dtype.

    Raises: ValueError on an unknown ``impl``, ``window < 1``, ``num_sinks < 0`` or head counts that do not divide.
    """
    if impl not in ("auto", "reference", "chunked"):
        raise ValueError(f"impl must be 'auto', 'reference' or 'chunked', got {impl!r}")
    if window < 1 or num_sinks < 0:
        raise ValueError(f"need window >= 1 and num_sinks >= 0, got window={window}, num_sinks={num_sinks}")
    if q.dim() != 4 or k.shape != v.shape or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"expected q [P, Hq, S, D], k = v [P, Hkv, S, D] with Hkv | Hq; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if impl == "auto":
        impl = "chunked" if q.is_cuda and chunked_supported(q.shape[-1]) else "reference"
    if impl == "chunked":
        if not chunked_supported(q.shape[-1]):
            raise ValueError(f"the chunked local path needs a power-of-two head_dim >= 16, got {q.shape[-1]}")
        from .local_chunked import local_attention_chunked

        return local_attention_chunked(q, k, v, num_sinks=num_sinks, window=window, scale=scale)
    from .reference import local_prefill_reference

    return local_prefill_reference(q, k, v, num_sinks=num_sinks, window=window, scale=scale)


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
    impl: PrefillImpl = "auto",
    score_impl: Impl = "auto",
    return_selection: bool = False,
    flex_dynamic: bool | None = None,
    local_impl: LocalImpl = "auto",
):
    """RTPurbo causal attention over right-padded prompts.

    Args:
        q: [P, Hq, S, D]; k, v: [P, Hkv, S, D] (post-RoPE; heads grouped by kv head).
        q_idx, k_idx: [P, H_ret, S, r] indexer queries / keys of the retrieval heads (None when there are none).
        prompt_len: [P] int64. ret_heads / loc_heads: [H_ret] / [H_loc] int64 kv-head ids.
        cfg: see :mod:`.reference` for the exact semantics.
        impl: ``"flex"`` (the fast path: block-sparse FlexAttention, compiled, for the retrieval heads; the local
            heads by ``local_impl``), ``"reference"`` (dense masks + SDPA), ``"auto"`` (flex on CUDA).
            score_impl: block scores + top-p, ``"triton"``, ``"reference"`` or
            ``"auto"`` (Triton on CUDA); the reference attention always scores with the reference.
        return_selection: also return the retrieval selection, ``(ids [P*H_ret*Qb, KVb], cnt)``.
        flex_dynamic: ``dynamic`` of the compiled FlexAttention (see :func:`.flex.flex_attention_compiled`).
        local_impl: the local heads on the fast path (:data:`LocalImpl`; ignored by the reference).

    Returns: [P, Hq, S, D] (rows past ``prompt_len`` unspecified).

    Raises: ValueError on an unknown ``impl``, ``score_impl`` or ``local_impl``.
    """
    if impl not in PREFILL_IMPLS:
        raise ValueError(f"impl must be one of {', '.join(map(repr, PREFILL_IMPLS))}, got {impl!r}")
    if local_impl not in LOCAL_IMPLS:
        raise ValueError(f"local_impl must be one of {', '.join(map(repr, LOCAL_IMPLS))}, got {local_impl!r}")
    if impl == "auto":
        impl = "flex" if q.is_cuda else "reference"
    if impl == "reference":
        from .reference import sparse_prefill_reference

        out, sel = sparse_prefill_reference(q, k, v, q_idx, k_idx, prompt_len, ret_heads, loc_heads,
                                            top_p=cfg.top_p, block=cfg.block, num_sinks=cfg.num_sinks,
                                            window=cfg.window, ret_window=cfg.ret_window, scale=scale,
                                            return_selection=True)
        if return_selection:
            from sparrow.kernels.topp.api import mask_to_blocks

            sel = None if sel is None else mask_to_blocks(sel.reshape(-1, sel.shape[-1]))
            return out, sel
        return out

    from .flex import sparse_prefill_flex

    selection = select_prefill_blocks(q_idx, k_idx, prompt_len, cfg, impl=score_impl) if ret_heads.shape[0] else None
    out = sparse_prefill_flex(q, k, v, selection, ret_heads, loc_heads, block=cfg.block, num_sinks=cfg.num_sinks,
                              window=cfg.window, scale=scale, flex_dynamic=flex_dynamic,
                              local_impl="chunked" if local_impl == "chunked" or (
                                  local_impl == "auto" and chunked_supported(q.shape[-1])) else "flex")
    return (out, selection) if return_selection else out

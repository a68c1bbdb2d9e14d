"""Top-p block selection: the public entry point, ``impl`` dispatch and conversions."""

from __future__ import annotations

import torch

from ..common.impl import Impl, resolve_impl


def mask_to_blocks(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bool [N, NB] -> (ascending block ids [N, NB] int32, counts [N] int32); entries past a count are 0."""
    nb = mask.shape[-1]
    cnt = mask.sum(-1)
    key = torch.where(mask, torch.arange(nb, device=mask.device), nb + torch.arange(nb, device=mask.device))
    idx = torch.sort(key, dim=-1).values
    idx = torch.where(idx < nb, idx, torch.zeros_like(idx))
    return idx.to(torch.int32), cnt.to(torch.int32)


def blocks_to_mask(idx: torch.Tensor, cnt: torch.Tensor, nb: int) -> torch.Tensor:
    """(block ids [N, K], counts [N]) -> bool [N, nb]."""
    k = torch.arange(idx.shape[-1], device=idx.device)
    live = k < cnt[..., None].long()
    out = torch.zeros(idx.shape[:-1] + (nb + 1,), dtype=torch.bool, device=idx.device)
    out.scatter_(-1, torch.where(live, idx.long(), nb), True)
    return out[..., :nb]


def topp_select(
    scores: torch.Tensor,
    q_lo: torch.Tensor,
    q_hi: torch.Tensor,
    top_p: float | torch.Tensor,
    *,
    block: int,
    sink_blocks: int = 0,
    local_window: int = 0,
    impl: Impl = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks attended by queries spanning positions ``q_lo .. q_hi`` of one selection row each.

    Args:
        scores: [N, NB] float log-masses of the row's key blocks (``block`` tokens each); only blocks
            holding a position ``<= q_hi`` take part.
        q_lo, q_hi: [N] integer first / last query position of each row.
        top_p: mass to reach, in (0, 1]; ``1`` keeps every valid block. A float, or a float32 device tensor read
            when the selection runs (0-dim, or [N]: one mass per row): a compiled step or CUDA graph follows
            in-place updates of it. A tensor's values are not checked (that would read them back to the host).
        sink_blocks: leading blocks always kept. local_window: blocks overlapping
            ``[q_lo - local_window + 1, q_hi]`` are always kept.
        impl: ``"triton"`` (bisection threshold, no sort), ``"reference"`` (sort), ``"auto"`` (Triton on CUDA
            tensors, the reference elsewhere).

    Returns: (ids [N, NB] int32 ascending, cnt [N] int32): the first ``cnt[n]`` ids of row ``n``.

    Raises: ValueError on inconsistent shapes, a float ``top_p`` outside (0, 1], a tensor ``top_p`` that is not
    float32 of shape () or [N], or an unknown ``impl``.
    """
    if scores.dim() != 2 or q_lo.shape != (scores.shape[0],) or q_hi.shape != q_lo.shape:
        raise ValueError(f"expected scores [N, NB] and q_lo, q_hi [N]; got {tuple(scores.shape)}, "
                         f"{tuple(q_lo.shape)}, {tuple(q_hi.shape)}")
    if isinstance(top_p, torch.Tensor):
        if top_p.dtype != torch.float32 or top_p.shape not in ((), q_lo.shape):
            raise ValueError(f"a tensor top_p must be float32 of shape () or {tuple(q_lo.shape)}, got "
                             f"{top_p.dtype} {tuple(top_p.shape)}")
    elif not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if resolve_impl(impl, scores) == "triton":
        from .triton_topp import MODE_EXPLICIT, topp_select_triton

        return topp_select_triton(scores.float().contiguous(), q_lo.contiguous(), q_hi.contiguous(), top_p,
                                  mode=MODE_EXPLICIT, block=block, sink_blocks=sink_blocks,
                                  local_window=local_window)
    from .reference import topp_select_reference

    return mask_to_blocks(topp_select_reference(scores, q_lo.long(), q_hi.long(), top_p, block=block,
                                                sink_blocks=sink_blocks, local_window=local_window))


def topp_select_dense(scores: torch.Tensor, q_lo: torch.Tensor, q_hi: torch.Tensor, top_p: float | torch.Tensor, *,
                      block: int, sink_blocks: int = 0, local_window: int = 0, impl: Impl = "auto") -> torch.Tensor:
    """:func:`topp_select` as a bool mask [N, NB]."""
    idx, cnt = topp_select(scores, q_lo, q_hi, top_p, block=block, sink_blocks=sink_blocks,
                           local_window=local_window, impl=impl)
    return blocks_to_mask(idx, cnt, scores.shape[-1])

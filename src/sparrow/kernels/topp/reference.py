"""Eager PyTorch oracle for top-p block selection (sort based: the readable statement, not the fast path)."""

from __future__ import annotations

import torch


def topp_mask_reference(scores: torch.Tensor, valid: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """The smallest set of entries whose softmax mass reaches ``top_p``.

    scores: [..., N] log-masses (unnormalised; ``-inf`` allowed); valid: [..., N] bool (entries that take
    part). Returns a bool mask [..., N]: entries ranked by score (descending) are kept while the mass
    *before* them is below ``top_p``, so the kept mass is ``>= top_p`` and dropping the last kept entry
    would fall below it. ``top_p`` at 1 or within float32 resolution of it (``>= 1 - 2**-25``, which float32
    stores as 1) keeps every valid entry, as the Triton kernel does. ``top_p`` may be a float32 tensor that
    broadcasts against ``scores.shape[:-1]`` (one mass per row, read on the device: no host sync).
    """
    if isinstance(top_p, torch.Tensor):
        top_p = top_p.float()[..., None]  # [..., 1] against the rows' entries
        keep_all = top_p >= 1.0 - 2.0**-25
    elif top_p >= 1.0 - 2.0**-25:
        return valid.clone()
    else:
        keep_all = None
    x = torch.where(valid, scores.float(), float("-inf"))
    m = x.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(x - m)
    mass = w / w.sum(-1, keepdim=True).clamp_min(1e-38)
    sorted_mass, order = torch.sort(mass, dim=-1, descending=True, stable=True)
    before = torch.cumsum(sorted_mass, -1) - sorted_mass
    keep_sorted = before < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    if keep_all is not None:
        keep = keep | keep_all
    return keep & valid


def forced_blocks_mask(nb: int, q_lo: torch.Tensor, q_hi: torch.Tensor, *, block: int, sink_blocks: int,
                       local_window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Validity and forced masks [..., nb] for queries spanning positions ``q_lo .. q_hi``.

    Valid blocks are those holding a position ``<= q_hi``; forced blocks are the first ``sink_blocks``
    and those overlapping the local window ``[q_lo - local_window + 1, q_hi]``.
    """
    b = torch.arange(nb, device=q_lo.device)
    n_valid = q_hi // block + 1
    first_local = (q_lo - local_window + 1).clamp_min(0) // block
    valid = b < n_valid[..., None]
    if local_window <= 0:
        first_local = torch.full_like(first_local, nb)
    forced = ((b < sink_blocks) | (b >= first_local[..., None])) & valid
    return valid, forced


def topp_select_reference(scores: torch.Tensor, q_lo: torch.Tensor, q_hi: torch.Tensor, top_p: float | torch.Tensor,
                          *, block: int, sink_blocks: int, local_window: int) -> torch.Tensor:
    """Bool mask [..., NB] of attended blocks: top-p over the valid blocks, plus the forced ones (``top_p`` as in
    :func:`topp_mask_reference`)."""
    valid, forced = forced_blocks_mask(scores.shape[-1], q_lo, q_hi, block=block, sink_blocks=sink_blocks,
                                       local_window=local_window)
    return topp_mask_reference(scores, valid, top_p) | forced

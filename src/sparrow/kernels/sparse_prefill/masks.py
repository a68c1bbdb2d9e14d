"""FlexAttention block masks for RTPurbo prefill, built on the device from block ids (no dense mask).

* :func:`retrieval_block_mask` — from the selected-block lists of the top-p kernel: every kept block below
  the diagonal is a *full* block (no ``mask_mod`` call), the diagonal block is the only partial one.
* :func:`local_block_mask` — sinks + sliding window by arithmetic on block indices: blocks wholly inside
  the window are full, the window's lower edge, the diagonal and the sink block are partial.

Both go through :meth:`BlockMask.from_kv_blocks` (the query-major transpose is skipped where the installed
PyTorch allows it: prefill is forward-only).
"""

from __future__ import annotations

import inspect

import torch
from torch.nn.attention.flex_attention import BlockMask

_FROM_KV = inspect.signature(BlockMask.from_kv_blocks).parameters


def _from_kv_blocks(kv_num, kv_idx, full_num, full_idx, block: int, mask_mod, S: int) -> BlockMask:
    kw = {}
    if "compute_q_blocks" in _FROM_KV:
        kw["compute_q_blocks"] = False
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(S, S), **kw)


def causal_mask_mod(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def retrieval_block_mask(sel_idx: torch.Tensor, sel_cnt: torch.Tensor, S: int, block: int) -> BlockMask:
    """sel_idx: [Z, Qb, KVb] int32 ascending kept blocks (the diagonal last), sel_cnt: [Z, Qb].

    Returns a BlockMask of batch ``Z`` (one entry per (prompt, retrieval kv head)), one head (broadcast over
    that kv head's query heads).
    """
    Z, Qb, KVb = sel_idx.shape
    qb = torch.arange(Qb, device=sel_idx.device, dtype=torch.int32)
    part_idx = torch.zeros((Z, 1, Qb, KVb), dtype=torch.int32, device=sel_idx.device)
    part_idx[..., 0] = qb
    part_num = torch.ones((Z, 1, Qb), dtype=torch.int32, device=sel_idx.device)
    full_num = (sel_cnt.to(torch.int32) - 1).clamp_min(0)[:, None]
    return _from_kv_blocks(part_num, part_idx, full_num, sel_idx[:, None].to(torch.int32), block, causal_mask_mod, S)


def local_mask_mod(num_sinks: int, window: int):
    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & ((q_idx - kv_idx < window) | (kv_idx < num_sinks))

    return mask_mod


def local_block_mask(S: int, block: int, *, num_sinks: int, window: int, device) -> BlockMask:
    """Sinks + sliding-window causal mask for ``S`` tokens, batch and head broadcast (``[1, 1, ...]``)."""
    Qb = -(-S // block)
    KVb = Qb
    qb = torch.arange(Qb, device=device, dtype=torch.int64)
    c = torch.arange(KVb, device=device, dtype=torch.int64)[None]
    lo_blk = (qb * block - window + 1).clamp_min(0) // block  # first block any query of qb sees
    i1 = qb * block + block - 1
    fl = torch.div(i1 - window + 1 + block - 1, block, rounding_mode="floor").clamp_min(0)  # first full block
    fl = torch.minimum(fl, qb)
    full_num = (qb - fl).clamp_min(0)
    full_idx = (fl[:, None] + c).clamp_max(KVb - 1)
    has_sink = ((lo_blk > 0) & (num_sinks > 0)).long()
    edge_hi = torch.maximum(fl, lo_blk)
    n_edge = edge_hi - lo_blk
    k = c - has_sink[:, None]
    part_idx = torch.where(c < has_sink[:, None], 0, torch.where(k < n_edge[:, None], lo_blk[:, None] + k, qb[:, None]))
    part_num = has_sink + n_edge + 1
    part_idx = part_idx.clamp_max(KVb - 1)
    return _from_kv_blocks(part_num.int()[None, None], part_idx.int()[None, None], full_num.int()[None, None],
                           full_idx.int()[None, None], block, local_mask_mod(num_sinks, window), S)

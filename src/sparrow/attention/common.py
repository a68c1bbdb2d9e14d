"""What the dense and RTPurbo backends share: writes into the two-level cache (prefix slots + generation
slots), exact causal attention, the decode kernel ``impl="auto"`` stands for, when decode takes the shared-prefix
path, and the reasons a configuration cannot run.

Cache writes are ``index_put_`` with index tensors built on the device (no host sync, fixed shapes: they
run inside compiled, CUDA-graphed decode steps). One index serves every tensor written at the same
positions (a head group's K, V and indexer keys).
"""

from __future__ import annotations

import os
from typing import Literal

import torch
import torch.nn.functional as F

from sparrow.attention.base import DecodeMeta, PrefixPackMask

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

Index = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def prefix_index(x: torch.Tensor, slot: torch.Tensor) -> Index:
    """Where ``x`` [B, H, S, *] goes in a prefix cache [P, H, L, *]: ``cache[slot[b], h, s]``, ``s < S``."""
    _, H, S = x.shape[:3]
    h = torch.arange(H, device=x.device)[None, :, None]
    s = torch.arange(S, device=x.device)[None, None, :]
    return slot[:, None, None], h, s


def row_index(x: torch.Tensor, slot: torch.Tensor, start: torch.Tensor, ring: int | None = None) -> Index:
    """Where ``x`` [A, H, T, *] goes in a generation cache [R, H, L, *]: ``cache[slot[a], h, start[a] + t]``,
    positions taken modulo ``ring`` for a ring buffer of that many slots."""
    _, H, T = x.shape[:3]
    h = torch.arange(H, device=x.device)[None, :, None]
    pos = start[:, None, None] + torch.arange(T, device=x.device)[None, None, :]
    if ring is not None:
        pos = pos % ring
    return slot[:, None, None], h, pos


def put(index: Index, *pairs: tuple[torch.Tensor, torch.Tensor]) -> None:
    """``cache[index] = x`` (cast to the cache's dtype) for every ``(cache, x)`` pair."""
    for cache, x in pairs:
        cache.index_put_(index, x.to(cache.dtype))


def write_prefix(cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot: torch.Tensor) -> None:
    """cache_[kv]: [P, H, L, D]; k, v: [B, H, S, D] written at ``cache[slot[b], :, :S]``."""
    put(prefix_index(k, slot), (cache_k, k), (cache_v, v))


def write_rows(cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               slot: torch.Tensor, start: torch.Tensor) -> None:
    """cache_[kv]: [R, H, L, D]; k, v: [A, H, T, D] written at ``cache[slot[a], :, start[a] + t]``."""
    put(row_index(k, slot, start), (cache_k, k), (cache_v, v))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Exact causal attention, SDPA (flash on GPU). q: [B, Hq, S, D]; k, v: [B, Hkv, S, D]. Returns [B, Hq, S, D]."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def train_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor | PrefixPackMask | None) -> torch.Tensor:
    """Exact, differentiable attention of the trainer. q: [B, Hq, S, D]; k, v: [B, Hkv, S, D]; ``mask``: None
    (causal), bool [B, S, S] (True where a query attends to a key: packed sequences), or a
    :class:`PrefixPackMask`: the prefix's queries on the causal kernel (flash on GPU, which skips the blocks above
    the diagonal) and only the later queries' rows through an explicit mask. Returns [B, Hq, S, D]."""
    if mask is None:
        return causal_attention(q, k, v)
    if isinstance(mask, PrefixPackMask):
        P, (B, _, S, _) = mask.prefix_len, q.shape
        if mask.rest.shape != (B, S - P, S):
            raise ValueError(f"PrefixPackMask of prefix {P} and rest {tuple(mask.rest.shape)} does not fit "
                             f"{B} sequences of {S} positions (rest must be [{B}, {S - P}, {S}])")
        if P == 0:  # no prefix: the explicit mask alone (no empty causal launch, no concatenation)
            return masked_attention(q, k, v, mask.rest)
        head = causal_attention(q[:, :, :P], k[:, :, :P], v[:, :, :P])
        return torch.cat([head, masked_attention(q[:, :, P:], k, v, mask.rest)], dim=2)
    return masked_attention(q, k, v, mask)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention through an explicit mask. q: [B, Hq, T, D]; k, v: [B, Hkv, S, D]; mask: bool [B, T, S], True where
    a query attends to a key (every row needs one). Returns [B, Hq, T, D]."""
    if q.shape[1] != k.shape[1]:  # an explicit mask: kv heads repeated per query head, so SDPA may pick its
        rep = q.shape[1] // k.shape[1]  # memory-efficient kernel
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])


def triton_head_dim(head_dim: int) -> bool:
    """Whether the Triton attention kernels take ``head_dim``: a power of two, at least 16."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def decode_impl(impl: str, head_dim: int, device: torch.device) -> str:
    """The decode kernel ``impl="auto"`` stands for: Triton on CUDA for power-of-two head dims >= 16, else the
    eager reference. Any other ``impl`` is returned as is."""
    if impl != "auto":
        return impl
    return "triton" if device.type == "cuda" and triton_head_dim(head_dim) else "reference"


SharedPrefix = bool | Literal["auto"]  # a backend's shared_prefix option


def check_shared_prefix(value: object, owner: str) -> None:
    """ValueError unless ``value`` is True, False or ``"auto"`` (``owner`` names the option in the message)."""
    if not (isinstance(value, bool) or value == "auto"):
        raise ValueError(f"{owner} shared_prefix must be True, False or 'auto', got {value!r}")


def shared_prefix_on(option: SharedPrefix, meta: DecodeMeta, impl: str) -> bool:
    """Whether a decode call takes the shared-prefix path (each prompt read once for the rows that share it):
    always for ``True``, never for ``False``; ``"auto"``: when the metadata carries the rows' grouping (the engine's
    steps build it) and the Triton kernels run (on the eager reference the two paths cost the same). A static
    choice: it reads no device value."""
    if option == "auto":
        return meta.prefix_order is not None and impl == "triton"
    return bool(option)


def configuration_reasons(*, dtype: torch.dtype, device: torch.device | str, impl: str, head_dim: int) -> list[str]:
    """Reasons a backend whose kernels run ``impl`` cannot compute in ``dtype`` on ``device`` (empty: it can).
    ``"auto"`` falls back to the reference wherever Triton cannot run, so only an explicit ``"triton"`` adds
    device and head-size reasons."""
    reasons = []
    if dtype not in FLOAT_DTYPES:
        reasons.append(f"dtype {dtype} is not one of float32, bfloat16, float16")
    if impl == "triton":
        if torch.device(device).type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            reasons.append("impl='triton' needs a CUDA device (or TRITON_INTERPRET=1)")
        if not triton_head_dim(head_dim):
            reasons.append(f"the Triton kernels need a power-of-two head_dim >= 16, got {head_dim}")
    return reasons

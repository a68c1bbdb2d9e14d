"""Dense attention: SDPA for training and prefill, split-KV decode over the two-level cache."""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from sparrow.attention.base import AttentionBackend, CacheSpec, DecodeMeta, LayerShape, PrefillMeta
from sparrow.kernels.decode_attention import decode_attention


class DenseKVCache(NamedTuple):
    """Full KV of every prompt slot and generation slot.

    prefix_k, prefix_v: [num_prefixes, Hkv, max_prefix_len, D]
    gen_k, gen_v:       [num_rows + 1, Hkv, max_gen_len, D] (the last slot is the engine's scratch row)
    """

    prefix_k: torch.Tensor
    prefix_v: torch.Tensor
    gen_k: torch.Tensor
    gen_v: torch.Tensor


def write_prefix(cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot: torch.Tensor) -> None:
    """cache_[kv]: [P, H, L, D]; k, v: [B, H, S, D] written at ``cache[slot[b], :, :S]``."""
    B, H, S, _ = k.shape
    h = torch.arange(H, device=k.device)[None, :, None]
    s = torch.arange(S, device=k.device)[None, None, :]
    idx = (slot[:, None, None], h, s)
    cache_k.index_put_(idx, k.to(cache_k.dtype))
    cache_v.index_put_(idx, v.to(cache_v.dtype))


def write_rows(cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               slot: torch.Tensor, start: torch.Tensor) -> None:
    """cache_[kv]: [R, H, L, D]; k, v: [A, H, T, D] written at ``cache[slot[a], :, start[a] + t]``."""
    A, H, T, _ = k.shape
    h = torch.arange(H, device=k.device)[None, :, None]
    pos = start[:, None, None] + torch.arange(T, device=k.device)[None, None, :]
    idx = (slot[:, None, None], h, pos)
    cache_k.index_put_(idx, k.to(cache_k.dtype))
    cache_v.index_put_(idx, v.to(cache_v.dtype))


def decode_impl(impl: str, head_dim: int, device: torch.device) -> str:
    """The decode kernel ``impl="auto"`` stands for: Triton on CUDA for power-of-two head dims >= 16, else the
    eager reference."""
    if impl != "auto":
        return impl
    pow2 = head_dim >= 16 and head_dim & (head_dim - 1) == 0
    return "triton" if device.type == "cuda" and pow2 else "reference"


def train_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Exact, differentiable attention of the trainer. q: [B, Hq, S, D]; k, v: [B, Hkv, S, D]; ``mask``: None
    (causal) or bool [B, S, S], True where a query attends to a key (packed sequences). Returns [B, Hq, S, D]."""
    gqa = q.shape[1] != k.shape[1]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if gqa:  # an explicit mask: kv heads repeated per query head, so SDPA may pick its memory-efficient kernel
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])


class DenseAttention(AttentionBackend):
    """Exact attention with a full KV cache.

    Training and prefill use :func:`torch.nn.functional.scaled_dot_product_attention` (flash on GPU).
    Decode uses :func:`sparrow.kernels.decode_attention.decode_attention`: a split-KV Triton kernel on
    CUDA, an eager PyTorch reference elsewhere (``impl`` overrides).

    Args:
        shape: the layer's head layout.
        impl: decode kernel, ``"auto" | "reference" | "triton"``.
    """

    def __init__(self, shape: LayerShape, *, impl: Literal["auto", "reference", "triton"] = "auto") -> None:
        super().__init__(shape)
        if impl not in ("auto", "reference", "triton"):
            raise ValueError(f"DenseAttention impl must be 'auto', 'reference' or 'triton', got {impl!r}")
        self.impl = impl

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, impl={self.impl}"

    def validate_configuration(self, *, dtype: torch.dtype, device: torch.device) -> list[str]:
        reasons = []
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            reasons.append(f"dtype {dtype} is not one of float32, bfloat16, float16")
        if self.impl == "triton" and torch.device(device).type != "cuda":
            import os

            if os.environ.get("TRITON_INTERPRET") != "1":
                reasons.append("impl='triton' needs a CUDA device (or TRITON_INTERPRET=1)")
        if self.shape.head_dim & (self.shape.head_dim - 1) or self.shape.head_dim < 16:
            if self.impl != "reference":
                reasons.append(f"the Triton decode kernel needs a power-of-two head_dim >= 16, got {self.shape.head_dim}")
        return reasons

    def forward_train(self, q, k, v, *, q_pre=None, k_pre=None, mask=None):
        return train_attention(q, k, v, mask)

    def init_cache(self, spec: CacheSpec, *, dtype: torch.dtype, device: torch.device) -> DenseKVCache:
        s = self.shape
        pshape = (spec.num_prefixes, s.num_kv_heads, spec.max_prefix_len, s.head_dim)
        gshape = (spec.num_rows + 1, s.num_kv_heads, spec.max_gen_len, s.head_dim)
        return DenseKVCache(
            torch.zeros(pshape, dtype=dtype, device=device),
            torch.zeros(pshape, dtype=dtype, device=device),
            torch.zeros(gshape, dtype=dtype, device=device),
            torch.zeros(gshape, dtype=dtype, device=device),
        )

    def prefill(self, q, k, v, cache: DenseKVCache, meta: PrefillMeta, *, q_pre=None, k_pre=None):
        # q: [P, Hq, S, D]; right padding keeps causal attention exact for the real tokens
        write_prefix(cache.prefix_k, cache.prefix_v, k, v, meta.prefix_slot)
        gqa = self.shape.num_heads != self.shape.num_kv_heads
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    def decode(self, q, k, v, cache: DenseKVCache, meta: DecodeMeta, *, q_pre=None, k_pre=None):
        # q: [A, Hq, T, D]; k, v: [A, Hkv, T, D]
        write_rows(cache.gen_k, cache.gen_v, k, v, meta.row_slot, meta.cached_len)
        return decode_attention(
            q, cache.prefix_k, cache.prefix_v, cache.gen_k, cache.gen_v,
            meta.row_slot, meta.prefix_slot, meta.prefix_len, meta.cached_len,
            impl=decode_impl(self.impl, self.shape.head_dim, q.device), validate=False,
        )

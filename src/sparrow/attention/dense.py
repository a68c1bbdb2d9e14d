"""Dense attention: SDPA for training and prefill, split-KV decode over the two-level cache."""

from __future__ import annotations

from typing import NamedTuple

import torch

from sparrow.attention.base import AttentionBackend, CacheSpec, DecodeMeta, LayerShape, PrefillMeta
from sparrow.attention.common import (
    causal_attention, configuration_reasons, decode_impl, train_attention, write_prefix, write_rows,
)
from sparrow.kernels.common.impl import IMPLS, Impl
from sparrow.kernels.decode_attention import decode_attention

# write_prefix, write_rows, decode_impl and train_attention are imported from here by other packages (the
# speculative drafter's windowed attention): they live in sparrow.attention.common
__all__ = ["DenseAttention", "DenseKVCache", "decode_impl", "train_attention", "write_prefix", "write_rows"]


class DenseKVCache(NamedTuple):
    """Full KV of every prompt slot and generation slot.

    prefix_k, prefix_v: [num_prefixes, Hkv, max_prefix_len, D]
    gen_k, gen_v:       [num_rows + 1, Hkv, max_gen_len, D] (the last slot is the engine's scratch row)
    """

    prefix_k: torch.Tensor
    prefix_v: torch.Tensor
    gen_k: torch.Tensor
    gen_v: torch.Tensor


class DenseAttention(AttentionBackend):
    """Exact attention with a full KV cache.

    Training and prefill use :func:`torch.nn.functional.scaled_dot_product_attention` (flash on GPU).
    Decode uses :func:`sparrow.kernels.decode_attention.decode_attention`: a split-KV Triton kernel on
    CUDA, an eager PyTorch reference elsewhere (``impl`` overrides).

    Args:
        shape: the layer's head layout.
        impl: decode kernel, ``"auto" | "reference" | "triton"``.
    """

    def __init__(self, shape: LayerShape, *, impl: Impl = "auto") -> None:
        super().__init__(shape)
        if impl not in IMPLS:
            raise ValueError(f"DenseAttention impl must be 'auto', 'reference' or 'triton', got {impl!r}")
        self.impl = impl

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, impl={self.impl}"

    def validate_configuration(self, *, dtype: torch.dtype, device: torch.device) -> list[str]:
        return configuration_reasons(dtype=dtype, device=device, impl=self.impl, head_dim=self.shape.head_dim)

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
        return causal_attention(q, k, v)

    def decode(self, q, k, v, cache: DenseKVCache, meta: DecodeMeta, *, q_pre=None, k_pre=None):
        # q: [A, Hq, T, D]; k, v: [A, Hkv, T, D]
        write_rows(cache.gen_k, cache.gen_v, k, v, meta.row_slot, meta.cached_len)
        return decode_attention(
            q, cache.prefix_k, cache.prefix_v, cache.gen_k, cache.gen_v,
            meta.row_slot, meta.prefix_slot, meta.prefix_len, meta.cached_len,
            impl=decode_impl(self.impl, self.shape.head_dim, q.device), validate=False,
        )

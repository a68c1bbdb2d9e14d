"""Dense attention: SDPA for training and prefill, split-KV decode over the two-level cache."""

from __future__ import annotations

from typing import NamedTuple

import torch

from sparrow.attention.base import AttentionBackend, CacheSpec, DecodeMeta, LayerShape, PrefillMeta
from sparrow.attention.common import (
    SharedPrefix, causal_attention, check_shared_prefix, configuration_reasons, decode_impl, shared_prefix_on,
    train_attention, write_prefix, write_rows,
)
from sparrow.kernels.common.impl import IMPLS, Impl
from sparrow.kernels.decode_attention import cascade_decode_attention, decode_attention

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
    CUDA, an eager PyTorch reference elsewhere (``impl`` overrides); on the shared-prefix path
    :func:`~sparrow.kernels.decode_attention.cascade_decode_attention`, which reads each prompt once for all
    the rows of its GRPO group (see ``docs/rollout.md``).

    Args:
        shape: the layer's head layout.
        impl: decode kernel, ``"auto" | "reference" | "triton"``.
        shared_prefix: ``"auto"`` (the shared-prefix kernel when the metadata groups the rows by prompt, as the
            engine's steps do, and Triton runs; on CUDA, batches under ``CASCADE_MIN_ROWS`` rows run the per-row
            kernel, and so does every batch inside ``per_row_decode()``: the engine's blocks whose rows share their
            prompts too little), ``True`` (always, every batch; the grouping built per call when absent) or
            ``False`` (every row reads its prompt itself, the kernel before shared-prefix decode).

    Raises:
        ValueError: an unknown ``impl`` or ``shared_prefix``.
    """

    def __init__(self, shape: LayerShape, *, impl: Impl = "auto", shared_prefix: SharedPrefix = "auto") -> None:
        super().__init__(shape)
        if impl not in IMPLS:
            raise ValueError(f"DenseAttention impl must be 'auto', 'reference' or 'triton', got {impl!r}")
        check_shared_prefix(shared_prefix, "DenseAttention")
        self.impl = impl
        self.shared_prefix = shared_prefix

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, impl={self.impl}, shared_prefix={self.shared_prefix}"

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
        impl = decode_impl(self.impl, self.shape.head_dim, q.device)
        rows = (q, cache.prefix_k, cache.prefix_v, cache.gen_k, cache.gen_v,
                meta.row_slot, meta.prefix_slot, meta.prefix_len, meta.cached_len)
        if shared_prefix_on(self.shared_prefix, meta, impl):
            meta = meta.grouped()
            # "auto" hands small batches to the per-row kernel (inside the op); an explicit True always shares
            min_rows = None if self.shared_prefix == "auto" else 0
            return cascade_decode_attention(*rows, meta.prefix_order, meta.group_start, impl=impl, min_rows=min_rows,
                                            validate=False)
        return decode_attention(*rows, impl=impl, validate=False)

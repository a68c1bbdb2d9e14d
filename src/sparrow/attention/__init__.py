"""Attention backends: the interface, dense attention, and (later) RTPurbo sparse attention."""

from sparrow.attention.base import AttentionBackend, CacheSpec, DecodeMeta, LayerShape, PrefillMeta
from sparrow.attention.dense import DenseAttention, DenseKVCache

__all__ = ["AttentionBackend", "CacheSpec", "DecodeMeta", "LayerShape", "PrefillMeta", "DenseAttention",
           "DenseKVCache"]

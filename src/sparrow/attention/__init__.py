"""Attention backends: the interface, dense attention, and (later) RTPurbo sparse attention."""

from sparrow.attention.base import AttentionBackend, CacheSpec, DecodeMeta, LayerShape, PrefillMeta
from sparrow.attention.dense import DenseAttention, DenseKVCache
from sparrow.attention.rtpurbo import (
    HeadProfile,
    IndexerWeights,
    RTPurboAttention,
    RTPurboCache,
    RTPurboConfig,
    rtpurbo_attention,
)


def dense(impl: str = "auto"):
    """An attention factory (``LayerShape -> DenseAttention``) for builders and recipe configs."""
    from functools import partial

    DenseAttention(LayerShape(0, 1, 1, 16), impl=impl)  # validate now, not at model build
    return partial(DenseAttention, impl=impl)


def rtpurbo(path: str, **overrides):
    """An attention factory (``LayerShape -> RTPurboAttention``) from the head profile and indexer that
    ``sparrow calibrate`` saved in ``path``; ``overrides`` replace saved config fields (e.g. ``top_p``)."""
    from sparrow.calibrate.io import rtpurbo_from_checkpoint

    return rtpurbo_from_checkpoint(path, **overrides)

__all__ = ["AttentionBackend", "CacheSpec", "DecodeMeta", "LayerShape", "PrefillMeta", "DenseAttention",
           "DenseKVCache", "HeadProfile", "IndexerWeights", "RTPurboAttention", "RTPurboCache", "RTPurboConfig",
           "dense", "rtpurbo", "rtpurbo_attention"]

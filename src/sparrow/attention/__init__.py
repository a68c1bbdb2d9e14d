"""Attention backends: the interface, dense attention, and RTPurbo sparse attention.

``dense`` and ``rtpurbo`` below are the recipe configs' ``_component_`` entry points. The function
``sparrow.attention.rtpurbo`` replaces the submodule of that name as an attribute of this package (the
module stays importable: ``from sparrow.attention.rtpurbo import RTPurboConfig``); reach the module's
siblings (``rtpurbo_io``, ``rtpurbo_stats``, ``common``) by their own names.
"""

from sparrow.attention.base import AttentionBackend, CacheSpec, DecodeMeta, LayerShape, PrefillMeta, PrefixPackMask
from sparrow.attention.dense import DenseAttention, DenseKVCache
from sparrow.attention.rtpurbo import (
    HeadProfile,
    IndexerWeights,
    RTPurboAttention,
    RTPurboCache,
    RTPurboConfig,
    rtpurbo_attention,
)
from sparrow.attention.rtpurbo_io import rtpurbo_from_checkpoint


def dense(impl: str = "auto"):
    """An attention factory (``LayerShape -> DenseAttention``) for builders and recipe configs."""
    from functools import partial

    DenseAttention(LayerShape(0, 1, 1, 16), impl=impl)  # validate now, not at model build
    return partial(DenseAttention, impl=impl)


def rtpurbo(path: str, **overrides):
    """An attention factory (``LayerShape -> RTPurboAttention``) from the head profile and indexer that
    ``sparrow calibrate`` saved in ``path``; ``overrides`` replace saved config fields (e.g. ``top_p``)."""
    return rtpurbo_from_checkpoint(path, **overrides)


__all__ = ["AttentionBackend", "CacheSpec", "DecodeMeta", "LayerShape", "PrefillMeta", "PrefixPackMask",
           "DenseAttention", "DenseKVCache", "HeadProfile", "IndexerWeights", "RTPurboAttention", "RTPurboCache",
           "RTPurboConfig", "dense", "rtpurbo", "rtpurbo_attention"]

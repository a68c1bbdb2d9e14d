"""Sparrow: fast long-context GRPO without changing what the model learns.

The four interfaces users compose:

* :class:`AttentionBackend` — one layer's KV-cache layout and attention (train / prefill / decode).
* :class:`Drafter` — proposes tokens for self-speculative decoding.
* :class:`ToggleController` — decides when to speculate and how far.
* :class:`WeightCodec` — encodes trainer -> rollout weight updates, bit-exactly.

Names are imported on first use, so ``import sparrow.sync`` does not pull in torchtune.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "AttentionBackend": "sparrow.attention.base",
    "DenseAttention": "sparrow.attention.dense",
    "Drafter": "sparrow.speculative.base",
    "ToggleController": "sparrow.speculative.base",
    "AlwaysOff": "sparrow.speculative.base",
    "WeightCodec": "sparrow.sync.base",
    "RolloutEngine": "sparrow.rollout.engine",
    "EngineConfig": "sparrow.rollout.engine",
    "SamplingParams": "sparrow.sampling",
    "RTPurboAttention": "sparrow.attention.rtpurbo",
    "RTPurboConfig": "sparrow.attention.rtpurbo",
    "QuantizedSelfDrafter": "sparrow.speculative.drafter",
    "DrafterConfig": "sparrow.speculative.drafter",
    "CostModel": "sparrow.speculative.costs",
    "CostModelToggle": "sparrow.speculative.toggle",
    "ThresholdToggle": "sparrow.speculative.toggle",
    "AlwaysOn": "sparrow.speculative.toggle",
    "rejection_sample": "sparrow.speculative.rejection",
    "SyncSender": "sparrow.sync.sender",
    "SyncReceiver": "sparrow.sync.receiver",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'sparrow' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # pragma: no cover
    from sparrow.attention.base import AttentionBackend
    from sparrow.attention.dense import DenseAttention
    from sparrow.rollout.engine import EngineConfig, RolloutEngine
    from sparrow.sampling import SamplingParams
    from sparrow.speculative.base import AlwaysOff, Drafter, ToggleController
    from sparrow.sync.base import WeightCodec
    from sparrow.attention.rtpurbo import RTPurboAttention, RTPurboConfig
    from sparrow.speculative.costs import CostModel
    from sparrow.speculative.drafter import DrafterConfig, QuantizedSelfDrafter
    from sparrow.speculative.rejection import rejection_sample
    from sparrow.speculative.toggle import AlwaysOn, CostModelToggle, ThresholdToggle
    from sparrow.sync.receiver import SyncReceiver
    from sparrow.sync.sender import SyncSender

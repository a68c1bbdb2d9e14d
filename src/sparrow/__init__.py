"""Sparrow: fast long-context GRPO without changing what the model learns.

The four interfaces users compose:

* :class:`AttentionBackend` — one layer's KV-cache layout and attention (train / prefill / decode).
* :class:`Drafter` — proposes tokens for self-speculative decoding.
* :class:`ToggleController` — decides when to speculate and how far.
* :class:`WeightCodec` — encodes trainer -> rollout weight updates, bit-exactly.
"""

from sparrow.attention.base import AttentionBackend
from sparrow.attention.dense import DenseAttention
from sparrow.rollout.engine import EngineConfig, RolloutEngine
from sparrow.rollout.sampling import SamplingParams
from sparrow.speculative.base import AlwaysOff, Drafter, ToggleController

try:  # the sync package is developed alongside; keep the top-level import working while it lands
    from sparrow.sync.base import WeightCodec
except ImportError:  # pragma: no cover
    WeightCodec = None  # type: ignore[assignment,misc]

__version__ = "0.1.0"

__all__ = ["AttentionBackend", "DenseAttention", "Drafter", "ToggleController", "AlwaysOff", "WeightCodec",
           "RolloutEngine", "EngineConfig", "SamplingParams", "__version__"]

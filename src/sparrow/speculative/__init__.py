"""Speculative decoding: drafters, exact rejection sampling, toggles.

Use it through the engine::

    drafter = QuantizedSelfDrafter(model, DrafterConfig(weight="int8"))
    engine = RolloutEngine(model, EngineConfig(max_draft=8, ...), drafter=drafter)
    engine.toggle = cost_model(engine, params, draft_lengths=(2, 4, 8))  # measures the engine
    ...
    drafter.refresh()  # after every weight sync
"""

from sparrow.speculative.base import AlwaysOff, Drafter, SpecDecision, StepStats, StepTimer, ToggleController
from sparrow.speculative.costs import CostModel, expected_tokens_per_cycle
from sparrow.speculative.drafter import DrafterConfig, QuantizedSelfDrafter
from sparrow.speculative.rejection import rejection_sample
from sparrow.speculative.toggle import (AdaptiveDraft, AlwaysOn, CostModelToggle, ThresholdToggle, always_on,
                                       cost_model, threshold)
from sparrow.speculative.window import WindowedDraftAttention

__all__ = ["AdaptiveDraft", "AlwaysOff", "AlwaysOn", "CostModel", "CostModelToggle", "Drafter",
           "DrafterConfig", "QuantizedSelfDrafter", "SpecDecision", "StepStats", "StepTimer", "ThresholdToggle",
           "ToggleController", "WindowedDraftAttention", "always_on", "cost_model", "expected_tokens_per_cycle",
           "rejection_sample", "threshold"]

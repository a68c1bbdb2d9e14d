"""Speculative decoding: drafters, exact rejection sampling, toggles.

Use it through the engine::

    drafter = QuantizedSelfDrafter(model, DrafterConfig(weight="int8"))
    engine = RolloutEngine(model, EngineConfig(max_draft=8, ...), drafter=drafter,
                           toggle=CostModelToggle(CostModel.calibrate(...)))
    ...
    drafter.refresh()  # after every weight sync
"""

from sparrow.speculative.base import (
    AlwaysOff,
    DraftContext,
    Drafter,
    DraftProposal,
    SpecDecision,
    StepStats,
    ToggleController,
)
from sparrow.speculative.costs import CostModel
from sparrow.speculative.drafter import DrafterConfig, QuantizedSelfDrafter
from sparrow.speculative.rejection import rejection_sample
from sparrow.speculative.runtime import expected_tokens_per_cycle
from sparrow.speculative.toggle import AdaptiveDraft, AlwaysOn, CostModelToggle, ThresholdToggle
from sparrow.speculative.window import WindowedDraftAttention

__all__ = ["AdaptiveDraft", "AlwaysOff", "AlwaysOn", "CostModel", "CostModelToggle", "DraftContext", "Drafter",
           "DrafterConfig", "DraftProposal", "QuantizedSelfDrafter", "SpecDecision", "StepStats", "ThresholdToggle",
           "ToggleController", "WindowedDraftAttention", "expected_tokens_per_cycle", "rejection_sample"]

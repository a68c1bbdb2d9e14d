"""Speculative decoding: drafters, exact rejection sampling, toggles."""

from sparrow.speculative.base import (
    AlwaysOff,
    DraftContext,
    Drafter,
    DraftProposal,
    SpecDecision,
    StepStats,
    ToggleController,
)
from sparrow.speculative.rejection import rejection_sample

__all__ = ["AlwaysOff", "DraftContext", "Drafter", "DraftProposal", "SpecDecision", "StepStats",
           "ToggleController", "rejection_sample"]

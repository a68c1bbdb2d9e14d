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

__all__ = ["AlwaysOff", "DraftContext", "Drafter", "DraftProposal", "SpecDecision", "StepStats",
           "ToggleController"]

"""The rollout engine: batched sampling with shared prompt prefixes and compiled, graph-replayed decode."""

from sparrow.rollout.engine import (EngineConfig, Generation, GenerationStats, GroupProgress, RolloutEngine,
                                    RolloutSession, Sample)
from sparrow.rollout.reference import generate_reference
from sparrow.sampling import SamplingParams, process_logits, top_k_mask, top_p_mask

__all__ = ["EngineConfig", "Generation", "GenerationStats", "GroupProgress", "RolloutEngine", "RolloutSession",
           "Sample", "SamplingParams", "generate_reference", "process_logits", "top_k_mask", "top_p_mask"]

"""The rollout engine: batched sampling with shared prompt prefixes and compiled, graph-replayed decode."""

from sparrow.rollout.config import EngineConfig, batch_buckets
from sparrow.rollout.engine import RolloutEngine
from sparrow.rollout.reference import generate_reference
from sparrow.rollout.results import Generation, GenerationStats, GroupProgress, Sample
from sparrow.rollout.session import RolloutSession
from sparrow.sampling import SamplingParams, process_logits, top_k_mask, top_p_mask

__all__ = ["EngineConfig", "Generation", "GenerationStats", "GroupProgress", "RolloutEngine", "RolloutSession",
           "Sample", "SamplingParams", "batch_buckets", "generate_reference", "process_logits", "top_k_mask",
           "top_p_mask"]

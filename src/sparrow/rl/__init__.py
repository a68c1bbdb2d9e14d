"""Reinforcement learning pieces: synthetic tasks, tokenizer, data pipelines, rewards, GRPO losses,
training log-probs, the rollout-vs-trainer tail agreement, and checkpoints. The recipe ``sparrow_grpo`` composes
them."""

from sparrow.rl.checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    read_optimizer_state,
    restore_rng_state,
    save_checkpoint,
)
from sparrow.rl.data import (ListSource, PromptFormat, PromptLengths, TaskSource, decode_response, prompt_loader,
                             read_jsonl)
from sparrow.rl.grpo import (GRPOConfig, StalenessStats, aggregation_weights, group_advantages, grpo_loss,
                             importance_weights)
from sparrow.rl.logprobs import hidden_states, response_logprobs, shared_prefix_logprobs
from sparrow.rl.metrics import JsonlLogger, plot_history, read_metrics
from sparrow.rl.mismatch import tail_agreement, tail_agreement_by, token_agreement
from sparrow.rl.partial import PartialRollout, PartialRolloutConfig, PartialStep
from sparrow.rl.rewards import CharAccuracy, CombinedReward, ExactMatch, FormatReward, MathAnswer, Reward, extract_final_answer
from sparrow.rl.rollout_batch import RolloutBatch, build_rollout_batch, exchange_rollouts
from sparrow.rl.tasks import Example, KVListRetrieval, KVRetrieval, NeedleQA, VariableTracking
from sparrow.rl.tokenizer import CharTokenizer, emittable_ids, stop_ids

__all__ = [
    "CharAccuracy", "CharTokenizer", "CombinedReward", "ExactMatch", "Example", "FormatReward", "GRPOConfig",
    "JsonlLogger", "KVListRetrieval", "KVRetrieval", "ListSource", "MathAnswer", "NeedleQA", "PartialRollout",
    "PartialRolloutConfig", "PartialStep", "PromptFormat", "PromptLengths", "Reward", "RolloutBatch",
    "StalenessStats", "TaskSource", "VariableTracking", "aggregation_weights", "build_rollout_batch",
    "decode_response", "emittable_ids", "exchange_rollouts", "extract_final_answer", "group_advantages",
    "grpo_loss", "hidden_states", "importance_weights", "latest_checkpoint", "load_checkpoint", "plot_history",
    "prompt_loader", "read_jsonl", "read_metrics", "read_optimizer_state", "response_logprobs",
    "restore_rng_state", "save_checkpoint", "shared_prefix_logprobs", "stop_ids", "tail_agreement",
    "tail_agreement_by", "token_agreement",
]

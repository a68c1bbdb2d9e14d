"""Model builders (torchtune architectures with pluggable attention), Hugging Face directories, checkpoint loading,
fused projections for the rollout model."""

from sparrow.models.attention import (AttentionFactory, SparrowAttention, attention_modules, policy_parameters,
                                     use_attention)
from sparrow.models.builders import (
    llama3,
    llama3_2_1b,
    llama3_2_3b,
    qwen2,
    qwen2_5_0_5b,
    qwen2_5_1_5b,
    qwen2_5_7b,
    tiny_llama3,
    tiny_qwen2,
)
from sparrow.models.checkpoint import load_model_state
from sparrow.models.fuse import (FusedFeedForward, FusedLinear, fuse_projections_, fused_projections,
                                 unfuse_projections_)
from sparrow.models.hf import (HFModelConfig, from_hf, hf_tokenizer, hf_twin, load_hf_checkpoint, model_config,
                               read_hf_config)

__all__ = [
    "AttentionFactory", "SparrowAttention", "attention_modules", "policy_parameters", "use_attention", "llama3", "llama3_2_1b",
    "llama3_2_3b", "qwen2", "qwen2_5_0_5b", "qwen2_5_1_5b", "qwen2_5_7b", "tiny_llama3", "tiny_qwen2",
    "load_hf_checkpoint", "load_model_state", "HFModelConfig", "from_hf", "hf_tokenizer", "hf_twin", "model_config",
    "read_hf_config", "FusedFeedForward", "FusedLinear", "fuse_projections_", "fused_projections",
    "unfuse_projections_",
]

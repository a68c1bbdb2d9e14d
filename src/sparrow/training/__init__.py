"""Supervised (teacher-forced) training of models from scratch: the GRPO warm start and the task models.

    model = tiny_qwen2(vocab_size=48, max_seq_len=80)
    init_weights(model, 0.02)
    source = TaskMixStream({"kv": lambda n: KVRetrieval(n)}, {"kv": 1.0}, seed=0, batch_size=16)
    cfg = TrainConfig(steps=100, curriculum=CurriculumConfig(min_context=64, max_context=64))
    Trainer(model, cfg, source).train()
    save_trained_model("out", model, {"model": {"_component_": "sparrow.models.tiny_qwen2", ...}})

``tune run sparrow_sft --config recipes/configs/<name>_sft.yaml`` does this from a config (see
``docs/training.md``).
"""

from sparrow.training.checkpoint import (
    FORMAT,
    MODEL_FILE,
    REPORT_FILE,
    build_model,
    load_recipe_model,
    load_trained_model,
    read_report,
    save_trained_model,
    write_report,
)
from sparrow.training.curriculum import Curriculum, CurriculumConfig
from sparrow.training.data import (
    ANSWER,
    EOS,
    IGNORED,
    PROMPT,
    TOKENIZER,
    Batch,
    BatchSource,
    TaskMixStream,
    encode_text,
    longest_sequence,
    sequence_ids,
    train_tokens,
)
from sparrow.training.episodes import EpisodeBatches, MarkovEpisodes
from sparrow.training.evaluate import (
    EVAL_SEED,
    Answers,
    accuracy_table,
    answers_with_fallback,
    binomial_se,
    engine_answers,
    greedy_accuracy,
    handled_context,
    longest_handled,
    model_score,
    paired,
    paired_accuracy,
    paired_delta_se,
    accuracy_summary,
    sampled_accuracy,
    teacher_forced_hits,
)
from sparrow.training.growth import (GrowthConfig, Width, active_layers, grow_, model_width, narrow_, shallow_layers,
                                     widen_)
from sparrow.training.init import init_weights
from sparrow.training.seeds import best_of_seeds, seed_devices
from sparrow.training.tasks import DEFAULT_MIX, EVAL_TASKS, FAMILIES, MultiQuery, Task, TaskFamily, TrainExample, pick
from sparrow.training.trainer import (
    EvalConfig,
    LossConfig,
    LossParts,
    OptimizerConfig,
    TrainConfig,
    Trainer,
    chunked_teacher_forced_loss,
    draw_prompt_positions,
    teacher_forced_loss,
    train_on_episodes,
)

__all__ = [
    "ANSWER", "Batch", "BatchSource", "Curriculum", "CurriculumConfig", "DEFAULT_MIX", "EOS", "EVAL_SEED", "EVAL_TASKS",
    "EpisodeBatches", "EvalConfig", "FAMILIES", "FORMAT", "GrowthConfig", "IGNORED", "LossConfig", "LossParts", "MODEL_FILE",
    "MarkovEpisodes", "MultiQuery", "OptimizerConfig", "PROMPT", "REPORT_FILE", "TOKENIZER", "Task", "TaskFamily",
    "TaskMixStream", "TrainConfig", "TrainExample", "Trainer", "Answers", "accuracy_table", "answers_with_fallback", "best_of_seeds", "binomial_se",
    "build_model", "encode_text", "engine_answers", "greedy_accuracy", "handled_context", "init_weights", "load_trained_model", "longest_handled",
    "longest_sequence", "model_score", "paired", "paired_accuracy", "paired_delta_se", "accuracy_summary", "active_layers", "grow_", "pick", "read_report", "sampled_accuracy", "save_trained_model",
    "seed_devices", "sequence_ids", "shallow_layers", "Width", "model_width", "narrow_", "widen_", "teacher_forced_hits", "teacher_forced_loss", "chunked_teacher_forced_loss", "draw_prompt_positions", "train_tokens", "write_report", "train_on_episodes",
    "load_recipe_model",
]

"""A trained model on disk: one safetensors state dict (what the GRPO recipe's ``checkpoint`` reads) and its
report; reloaded bit for bit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from sparrow.models import load_model_state, tiny_qwen2
from sparrow.training import (
    FORMAT, MODEL_FILE, REPORT_FILE, build_model, init_weights, load_trained_model, read_report, save_trained_model,
)

SPEC = {"_component_": "sparrow.models.tiny_qwen2", "vocab_size": 48, "num_layers": 1, "embed_dim": 32,
        "num_heads": 2, "num_kv_heads": 1, "intermediate_dim": 64, "max_seq_len": 40}


def _model():
    torch.manual_seed(0)
    model = build_model(SPEC)
    init_weights(model, 0.3)
    return model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_saved_weights_reload_bit_for_bit(tmp_path, dtype):
    model = _model()
    path = save_trained_model(tmp_path, model, {"model": SPEC, "train": {"steps": 3}}, dtype)
    assert path == tmp_path / MODEL_FILE and not list(tmp_path.glob("*.tmp"))
    saved = load_file(str(path))
    assert set(saved) == set(model.state_dict()) and all(v.dtype == dtype for v in saved.values())
    doc = read_report(tmp_path)
    assert doc["format"] == FORMAT and doc["weights_dtype"] == str(dtype)[6:] and doc["train"] == {"steps": 3}
    assert doc["params"] == sum(p.numel() for p in model.parameters())
    for load_dtype in {dtype, torch.float32}:  # float32 holds bf16 weights exactly
        state = load_trained_model(tmp_path, dtype=load_dtype).state_dict()
        assert all(torch.equal(state[k].to(dtype), v) for k, v in saved.items())
    loaded = load_trained_model(tmp_path, dtype=torch.bfloat16)
    assert loaded.layers[0].attn.pos_embeddings.cache.dtype == torch.float32  # RoPE tables stay float32
    assert not loaded.training


def test_the_grpo_recipes_loader_reads_the_file_as_it_is(tmp_path):
    """The GRPO recipe reads ``checkpoint`` with ``load_file`` and ``load_model_state`` into its ``model``."""
    model = _model()
    save_trained_model(tmp_path, model, {"model": SPEC})
    fresh = tiny_qwen2(**{k: v for k, v in SPEC.items() if k != "_component_"})
    load_model_state(fresh, load_file(str(tmp_path / MODEL_FILE)))
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


def test_reports_are_checked(tmp_path):
    with pytest.raises(FileNotFoundError, match="tune run sparrow_sft"):
        read_report(tmp_path)
    (tmp_path / REPORT_FILE).write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="is not a sparrow-task-model report"):
        read_report(tmp_path)
    with pytest.raises(ValueError, match="_component_"):
        save_trained_model(tmp_path, _model(), {"model": {"num_layers": 1}})
    assert not (tmp_path / MODEL_FILE).exists()


def test_load_recipe_model_reads_model_checkpoint_and_task(tmp_path):
    from sparrow.rl import KVRetrieval
    from sparrow.training import load_recipe_model

    model = _model()
    save_trained_model(tmp_path / "ckpt", model, {"model": SPEC})
    spec = "\n".join(f"  {k}: {v}" for k, v in SPEC.items())
    (tmp_path / "run.yaml").write_text(f"model:\n{spec}\ncheckpoint: ckpt/{MODEL_FILE}\n"  # relative to the file
                                       "task:\n  _component_: sparrow.rl.KVRetrieval\n  context_len: 32\n")
    loaded, task, cfg = load_recipe_model(tmp_path / "run.yaml")
    assert isinstance(task, KVRetrieval) and task.context_len == 32 and cfg.checkpoint == str(tmp_path / "ckpt" /
                                                                                            MODEL_FILE)
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    (tmp_path / "bad.yaml").write_text((tmp_path / "run.yaml").read_text().replace("num_heads: 2", "num_heads: 4"))
    with pytest.raises(ValueError, match="does not fit"):
        load_recipe_model(tmp_path / "bad.yaml")
    with pytest.raises(FileNotFoundError):
        load_recipe_model(tmp_path / "none.yaml")

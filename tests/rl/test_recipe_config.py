"""The GRPO recipe's configuration: every value checked before anything runs, input paths relative to the
config file, command-line values relative to the working directory."""

import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from sparrow.rl.recipe_config import check_config, check_values, load_config, resolve_paths

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "recipes" / "configs" / "tiny_kv_retrieval.yaml"


def _cfg(*overrides: str):
    cfg = load_config(TINY, list(overrides))
    check_config(cfg)
    return cfg


@pytest.mark.parametrize("overrides,match", [
    pytest.param(["trainer_precision=bf16"], "trainer_precision must be one of fp32, bf16-mixed, got 'bf16'",
                 id="precision"),
    pytest.param(["indexer_refresh={every: 5, sequences: 2}"], "indexer_refresh needs every, sequences, steps; "
                 "missing: steps", id="indexer-refresh-steps"),
    pytest.param(["indexer_refresh={every: 5, steps: 0, sequences: 2}"], "indexer_refresh.steps must be an integer "
                 ">= 1", id="indexer-refresh-zero"),
    pytest.param(["speculative={drafter: {_component_: sparrow.speculative.DrafterConfig}, toggle: {_component_: "
                  "sparrow.speculative.cost_model, max_active: 8}}"],
                 "speculative.toggle: sparrow.speculative.cost_model takes no argument 'max_active'", id="ignored-key"),
    pytest.param(["speculative={drafter: {_component_: sparrow.speculative.DrafterConfig}, toggle: {_component_: "
                  "sparrow.speculative.always_on, draft_lengths: [2, 4]}}"],
                 "sparrow.speculative.always_on takes no argument 'draft_lengths'", id="always-lengths"),
    pytest.param(["speculative={drafter: {_component_: sparrow.speculative.DrafterConfig}, toggle: cost_model}"],
                 "speculative.toggle needs a _component_", id="toggle-not-a-component"),
    pytest.param(["speculative={drafter: {_component_: sparrow.speculative.DrafterConfig}, toggle: {_component_: "
                  "sparrow.speculative.sometimes}}"], "speculative.toggle: cannot find component", id="unknown-toggle"),
    pytest.param(["speculative={drafter: {_component_: sparrow.speculative.DrafterConfig, bits: 3}, toggle: "
                  "{_component_: sparrow.speculative.always_on}}"], "DrafterConfig takes no argument 'bits'",
                 id="drafter-arg"),
    pytest.param(["optimizer.momentum=0.9"], "optimizer: torch.optim.AdamW takes no argument 'momentum'",
                 id="optimizer-arg"),
    pytest.param(["model.num_layer=2"], "model: sparrow.models.tiny_qwen2 takes no argument 'num_layer'",
                 id="model-arg"),
    pytest.param(["sync.codec=zip"], "sync.codec must be one of auto, compact, coo, dense", id="codec"),
    pytest.param(["group_size=0"], "group_size must be an integer >= 1", id="group"),
    pytest.param(["enable_activation_checkpointing=always"], "enable_activation_checkpointing must be true or false",
                 id="activation-checkpointing"),
    pytest.param(["shared_prefix=1"], "shared_prefix must be true or false", id="shared-prefix"),
    pytest.param(["engine.inductor_options.triton.enable_pdll=true"], "triton.enable_pdll.* not torch._inductor",
                 id="inductor-option"),
    pytest.param(["minibatches=3"], "minibatches \\(3\\) must divide", id="minibatches"),
    pytest.param(["sampling.top_p=0"], "top_p must be in", id="top-p"),
    pytest.param(["sampling.max_new_tokens=7"], "exceeds engine.max_new_tokens", id="max-new"),
    pytest.param(["loss.is_mode=drop"], "is_mode", id="loss"),
    pytest.param(["prompt={system: be brief}"], "prompt.system needs prompt.chat: true", id="system-without-chat"),
    pytest.param(["task=null"], "needs a task or a dataset", id="no-data"),
    pytest.param(["dataset=d.jsonl"], "both a task and a dataset", id="task-and-data"),
    pytest.param(["rtpurbo_schedule={_component_: sparrow.attention.rtpurbo_schedule.SparsityScheduleConfig, "
                  "treshold: 0.9}"], "SparsityScheduleConfig takes no argument 'treshold'", id="schedule-arg"),
    pytest.param(["rtpurbo_schedule={_component_: sparrow.attention.rtpurbo_schedule.SparsityScheduleConfig, "
                  "lengths: [8, 64]}"], "lengths must start at 0", id="schedule-lengths"),
])
def test_bad_values_are_refused_naming_the_key(overrides, match):
    cfg = _cfg(*overrides)
    with pytest.raises(ValueError, match=match):
        check_values(cfg)


def test_the_shipped_values_pass():
    check_values(_cfg())
    check_values(_cfg("engine.inductor_options.triton.enable_pdl=true"))  # a section of Inductor settings


def test_relative_input_paths_resolve_against_the_config_file(tmp_path, monkeypatch):
    conf = tmp_path / "configs" / "run.yaml"
    conf.parent.mkdir()
    conf.write_text(OmegaConf.to_yaml(OmegaConf.create({
        "model_dir": "../models/qwen", "checkpoint": "ckpt/model.safetensors", "dataset": "/abs/data.jsonl",
        "output_dir": "outputs/run", "tokenizer": {"_component_": "x", "path": "${model_dir}", "merges_file": "m.txt"},
        "attention": {"_component_": "y", "path": "calib"}, "task": {"_component_": "z", "context_len": 8},
    })))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(conf, ["attention.path=cli_calib"])
    here = conf.parent
    assert cfg.model_dir == str((tmp_path / "models" / "qwen"))
    assert cfg.checkpoint == str(here / "ckpt" / "model.safetensors")
    assert cfg.dataset == "/abs/data.jsonl"  # absolute: untouched
    assert cfg.tokenizer.path == str(tmp_path / "models" / "qwen")  # an interpolation follows what it points at
    assert cfg.tokenizer.merges_file == str(here / "m.txt")
    assert cfg.attention.path == "cli_calib"  # a command-line value: relative to the working directory
    assert cfg.output_dir == "outputs/run"  # outputs: relative to the working directory
    assert cfg.task.context_len == 8
    # negative control: without the resolution the same file names a path that does not exist from here
    raw = OmegaConf.load(conf)
    assert not (Path.cwd() / raw.checkpoint).parent.exists()


def test_resolve_paths_leaves_what_is_not_a_relative_input():
    got = resolve_paths({"checkpoint": None, "model_dir": "???", "name": "a/b", "model": {"path": "${x}", "n": "c"}},
                        "/base")
    assert got == {"checkpoint": None, "model_dir": "???", "name": "a/b", "model": {"path": "${x}", "n": "c"}}
    assert resolve_paths({"dataset": "d.jsonl"}, "/base") == {"dataset": os.path.normpath("/base/d.jsonl")}


def test_load_config_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config(tmp_path / "none.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("config: 1\n")
    with pytest.raises(ValueError, match="'config' cannot be a key"):
        load_config(bad)
    with pytest.raises(ValueError, match="key=value"):
        load_config(TINY, ["seed"])

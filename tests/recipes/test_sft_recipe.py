"""The real CLI (`tune run sparrow_sft`) on tiny models: outputs, determinism, the task-mix path, the checkpoint the
GRPO recipe loads, several seeds, config errors."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sparrow.models import load_model_state
from sparrow.training import build_model, load_trained_model, read_report

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "recipes" / "configs"
TUNE = str(Path(sys.executable).parent / "tune")
TINY = ["steps=3", "data.batch_size=4", "eval.final_examples=4", "task.context_len=32", "curriculum.min_context=32",
        "curriculum.max_context=32", "model.num_layers=1", "model.embed_dim=32", "model.num_heads=2",
        "model.num_kv_heads=1", "model.intermediate_dim=64", "model.max_seq_len=40"]
QUICK = ["minutes=0.02", "eval.every_s=0.5", "eval.examples=2", "eval.final_examples=4", "data.tokens_per_step=1024",
         "model.num_layers=1", "model.embed_dim=32", "model.num_heads=2", "model.num_kv_heads=1",
         "model.intermediate_dim=64", "curriculum.min_context=64", "curriculum.max_context=128",
         "model.max_seq_len=170"]


def run(out: Path, *overrides: str, config: str = "tiny_kv_retrieval_sft.yaml"):
    cmd = [TUNE, "run", "sparrow_sft", "--config", str(CONFIGS / config), f"output_dir={out}", *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=out.parent, capture_output=True, text=True, timeout=600, env=env)


def test_writes_weights_and_report_deterministically(tmp_path):
    a, b = run(tmp_path / "a", *TINY), run(tmp_path / "b", *TINY)
    assert a.returncode == 0 and b.returncode == 0, (a.stderr + b.stderr)[-3000:]
    report = read_report(tmp_path / "a")
    assert report["train"]["steps"] == 3 and report["weights_dtype"] == "float32" and report["reload_matches_weights"]
    [row] = report["accuracy"]
    assert (row["task"], row["context"], row["n"]) == ("task", 32, 4)
    assert 0 <= row["accuracy"] <= 1 and 0 <= row["sampled_accuracy"] <= 1
    wa, wb = load_file(str(tmp_path / "a/model.safetensors")), load_file(str(tmp_path / "b/model.safetensors"))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k].view(torch.int32), wb[k].view(torch.int32)) for k in wa)
    other = run(tmp_path / "c", *TINY, "data.seed=2")  # other examples: other weights
    assert other.returncode == 0, other.stderr[-3000:]
    wc = load_file(str(tmp_path / "c/model.safetensors"))
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)
    # what the GRPO recipe does with `checkpoint:` and its `model:` section
    model = build_model(report["model"])
    load_model_state(model, wa)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in wa.items())


def test_a_task_mix_model_with_its_curriculum_and_table(tmp_path):
    r = run(tmp_path / "m", *QUICK, config="tiny_task_model_sft.yaml")
    assert r.returncode == 0, r.stderr[-3000:]
    doc = read_report(tmp_path / "m")
    assert doc["weights_dtype"] == "bfloat16" and doc["reload_matches_weights"] is True
    assert doc["params"] == sum(p.numel() for p in load_trained_model(tmp_path / "m").parameters())
    assert doc["train"]["tokens_seen"] > 0 and doc["train"]["steps"] >= 1 and doc["eval_weights_dtype"] == "float32"
    assert {(r["task"], r["context"]) for r in doc["accuracy"]} == {
        (t, n) for t in ("kv_retrieval", "variable_tracking") for n in (64, 128)}
    assert set(doc["tasks"]["train"]) == {"kv_mq", "kv_vary_mq", "vt_mq", "kv", "vt"}
    assert doc["train"]["config"]["curriculum"]["max_context"] == 128
    saved = load_file(str(tmp_path / "m/model.safetensors"))
    state = load_trained_model(tmp_path / "m", dtype=torch.bfloat16).state_dict()
    assert all(v.dtype == torch.bfloat16 and torch.equal(state[k].view(torch.int16), v.view(torch.int16))
               for k, v in saved.items())


@pytest.mark.slow
def test_several_seeds_keep_the_best(tmp_path):
    r = run(tmp_path / "best", *QUICK, "seeds=[3,4]", config="tiny_task_model_sft.yaml")
    assert r.returncode == 0, r.stderr[-3000:]
    report = read_report(tmp_path / "best")
    assert report["chosen_seed"] in (3, 4) and [c["seed"] for c in report["candidates"]] == [3, 4]
    kept = load_file(str(tmp_path / "best" / f"seed_{report['chosen_seed']}" / "model.safetensors"))
    other = load_file(str(tmp_path / "best" / f"seed_{7 - report['chosen_seed']}" / "model.safetensors"))
    best = load_file(str(tmp_path / "best" / "model.safetensors"))
    assert all(torch.equal(best[k], kept[k]) for k in best) and not all(torch.equal(best[k], other[k]) for k in best)
    assert report["train"]["config"]["seed"] == report["chosen_seed"]


def test_loss_of_the_warm_start_config():
    """The shipped config's loss: answer tokens pooled without <eos>, plus 0.1 x the whole sequence."""
    sys.path.insert(0, str(REPO / "recipes"))
    from omegaconf import OmegaConf
    from sparrow_sft import SFTRecipe

    cfg = OmegaConf.load(CONFIGS / "tiny_kv_retrieval_sft.yaml")
    recipe = SFTRecipe(cfg)
    loss = recipe._setup_config(cfg).loss
    assert (loss.prompt_weight, loss.prompt_tokens) == (0.1, "sequence")
    assert (loss.answer_eos, loss.answer_mean) == (False, "token")


def test_unknown_key_fails_before_training(tmp_path):
    r = run(tmp_path / "d", "learning_rate=1e-3")
    assert r.returncode != 0 and "unknown config keys: learning_rate" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("overrides,message", [
    pytest.param(["optimizer.rate=1e-3"], "unknown config keys: optimizer.rate", id="unknown-section-key"),
    pytest.param(["mix={kv: 1.0}"], "a task or a mix", id="task-and-mix"),
    pytest.param(["loss.answer_mean=row"], "answer_mean one of", id="bad-value"),
    pytest.param(["save_dtype=float16"], "save_dtype must be one of", id="dtype"),
    pytest.param(["checkpoint_every_s=-1"], "checkpoint_every_s must be a number of seconds >= 0", id="every"),
    pytest.param(["resume=maybe"], "resume must be true or false, got 'maybe'", id="resume"),
    pytest.param(["model.max_seq_len=50"], "max_seq_len 50 is too short", id="short-model"),
    pytest.param(["eval.tasks=[kv_retrieval]"], "eval.tasks: unknown or none ['kv_retrieval']", id="eval-task"),
    pytest.param(["growth.layers=2"], "unknown config keys: growth.layers", id="growth-key"),
    pytest.param(["model.num_layers=2", "growth.start_layers=2"], "start_layers must be in [1, 2) for a model of 2",
                 id="growth-too-deep"),
    pytest.param(["growth.at_progress=0"], "0 < at_progress <= 1, got {'at_progress': 0}", id="growth-progress"),
    pytest.param(["growth.start_num_heads=3"], "growth: cannot start at Width(embed_dim=128, num_heads=3, "
                 "intermediate_dim=384, vocab=48) in a model of Width(embed_dim=128, num_heads=4, intermediate_dim=384, "
                 "vocab=48) with 4 key-value heads", id="growth-heads"),
    pytest.param(["growth.start_vocab=40"], "growth.start_vocab=40: the data's ids reach 48", id="growth-vocab"),
])
def test_config_errors_fail_in_setup(tmp_path, overrides, message):
    sys.path.insert(0, str(REPO / "recipes"))
    from sparrow_sft import SFTRecipe

    from sparrow.rl.recipe_config import load_config

    cfg = load_config(CONFIGS / "tiny_kv_retrieval_sft.yaml", [f"output_dir={tmp_path / 'd'}", *overrides])
    with pytest.raises(ValueError) as err:
        SFTRecipe(cfg).setup(cfg)
    assert message in str(err.value)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("narrow", [pytest.param(False, id="depth"), pytest.param(True, id="depth-and-width")])
def test_a_growing_run_saves_the_whole_model(tmp_path, narrow):
    width = ["growth.start_embed_dim=16", "growth.start_num_heads=1", "growth.start_intermediate_dim=24",
             "model.vocab_size=64", "growth.start_vocab=48"]
    r = run(tmp_path / "g", *TINY, "steps=4", "model.num_layers=3", "growth.start_layers=1", "growth.at_progress=0.5",
            *(width if narrow else []))
    assert r.returncode == 0, r.stderr[-3000:]
    report = read_report(tmp_path / "g")
    wider = "width 16 -> 32, query heads 1 -> 2, MLP 24 -> 64, ids 48 -> 64; " if narrow else ""
    assert report["train"]["grown_at"]["step"] == 2
    assert f"growth: {wider}1 -> 3 layers (2 start as the identity) at step 2" in r.stdout
    start = ", width 16, 1 query heads, MLP 24, 48 ids" if narrow else ""
    assert f"layers [0] of 3{start} until the growth" in r.stdout
    weights = load_file(str(tmp_path / "g/model.safetensors"))
    ids = 64 if narrow else 48
    assert weights["layers.0.mlp.w1.weight"].shape == (64, 32) and weights["tok_embeddings.weight"].shape == (ids, 32)
    for i in (1, 2):  # grown from zero output projections, then trained for two steps
        assert weights[f"layers.{i}.mlp.w2.weight"].any() and weights[f"layers.{i}.attn.output_proj.weight"].any()
    assert len(load_trained_model(tmp_path / "g").layers) == 3


def test_a_run_stopped_by_a_time_limit_resumes_to_the_same_bits(tmp_path):
    """checkpoint_every_s keeps the latest training state; resume: true continues it to the weights a run never
    stopped ends with, bit for bit. Another config, or no state at all, is refused before anything loads."""
    sys.path.insert(0, str(REPO / "recipes"))
    from sparrow_sft import STATE_DIR, SFTRecipe

    from sparrow.rl.recipe_config import load_config

    def recipe(out, *overrides):
        cfg = load_config(CONFIGS / "tiny_kv_retrieval_sft.yaml", [f"output_dir={out}", *TINY, "steps=5", *overrides])
        r = SFTRecipe(cfg)
        r.setup(cfg)
        return r

    def finish(r):
        r.train()
        r.save_checkpoint()
        r.cleanup()
        return load_file(str(r.output_dir / "model.safetensors"))

    whole = finish(recipe(tmp_path / "whole"))
    stopped = recipe(tmp_path / "stopped", "checkpoint_every_s=1e-9")
    save = stopped.save_state

    def save_then_stop():  # the call's time limit, right after the state of step 2 is on disk
        save()
        if stopped.trainer.step == 2:
            raise KeyboardInterrupt

    stopped.save_state = save_then_stop
    with pytest.raises(KeyboardInterrupt):
        stopped.train()
    stopped.cleanup()
    assert [p.name for p in (tmp_path / "stopped" / STATE_DIR).glob("step_*")] == ["step_000002"]  # latest only
    with pytest.raises(ValueError, match=r"other values of \['optimizer'\]; only \['resume', 'checkpoint_every_s', "):
        recipe(tmp_path / "stopped", "resume=true", "optimizer.lr=2e-3")
    resumed = recipe(tmp_path / "stopped", "resume=true", "checkpoint_every_s=0")
    assert resumed.trainer.step == 2
    again = finish(resumed)
    assert resumed.stats["resumed_at"] == [2] and resumed.stats["steps"] == 5
    assert all(torch.equal(whole[k].view(torch.int32), again[k].view(torch.int32)) for k in whole)
    with pytest.raises(FileNotFoundError, match="no checkpoint to resume from"):
        recipe(tmp_path / "never", "resume=true")


def test_sigterm_saves_the_state_and_exits_then_resume_finishes(tmp_path):
    """The real CLI sent SIGTERM mid-run (what `timeout` sends): the step in flight ends, the state is saved, the
    recipe exits with status 1 naming the state and writes no model; resume: true finishes the run."""
    out = tmp_path / "t"
    overrides = [*TINY, "steps=400", "log_every_s=0", "checkpoint_every_s=1e6"]  # checkpoints only at the stop
    cmd = [TUNE, "run", "sparrow_sft", "--config", str(CONFIGS / "tiny_kv_retrieval_sft.yaml"), f"output_dir={out}",
           *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in proc.stdout:  # training has started: a progress line
            if " step " in line:
                break
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 1, err[-3000:]
    assert "stopped by SIGTERM at step" in err and "resume=true" in err
    states = list((out / "train_state").glob("step_*"))
    assert len(states) == 1 and not (out / "model.safetensors").exists()
    stopped_at = int(states[0].name.split("_")[1])
    assert 1 <= stopped_at < 400
    r = run(out, *overrides, "resume=true")
    assert r.returncode == 0, r.stderr[-3000:]
    train = read_report(out)["train"]
    assert train["resumed_at"] == [stopped_at] and train["steps"] == 400 and train["stopped"] is False

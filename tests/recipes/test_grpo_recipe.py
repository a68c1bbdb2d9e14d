"""The real CLI (`tune run sparrow_grpo`) on a tiny model: resume exactness, errors, configs, Hugging Face directories."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sparrow.rl import read_metrics
from sparrow.rl.recipe_config import load_config

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "recipes" / "configs" / "tiny_kv_retrieval.yaml"
TUNE = str(Path(sys.executable).parent / "tune")
TINY = [
    "checkpoint=null", "init_std=0.02", "task.context_len=32", "engine.max_prompt_len=33", "engine.max_rows=16",
    "engine.max_new_tokens=4", "sampling.max_new_tokens=4", "model.num_layers=1", "model.embed_dim=32",
    "model.num_heads=2", "model.num_kv_heads=1", "model.intermediate_dim=64", "model.max_seq_len=40",
    "group_size=4", "prompts_per_step=4", "eval.every=0", "plot=false", "optimizer.lr=1e-2",
    "ppo_epochs=2", "minibatches=2", "reward._component_=sparrow.rl.CharAccuracy",
]


def run(out: Path, *overrides: str, nproc: int = 1, env: dict | None = None, timeout: int = 600,
        base: list[str] = TINY, config: Path = CONFIG):
    cmd = [TUNE, "run"] + (["--nproc_per_node", str(nproc)] if nproc > 1 else []) + [
        "sparrow_grpo", "--config", str(config), f"output_dir={out}", *base, *overrides]
    e = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(cmd, cwd=out.parent, capture_output=True, text=True, timeout=timeout, env=e)


def in_process(tmp_path: Path, monkeypatch, *overrides: str, config: Path = CONFIG, base: list[str] = TINY):
    """The recipe module and a set-up GRPORecipe in this process (one rank), for tests that look inside."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("sparrow_grpo_recipe", REPO / "recipes" / "sparrow_grpo.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = load_config(config, [*base, f"output_dir={tmp_path}", *overrides])
    recipe = mod.GRPORecipe(cfg)
    recipe.setup(cfg)
    return mod, recipe


def _bits(path: Path) -> dict[str, torch.Tensor]:
    return {k: v.view(torch.int32) if v.dtype == torch.float32 else v for k, v in load_file(str(path)).items()}


def test_resume_is_bitwise_exact(tmp_path):
    straight = run(tmp_path / "a", "total_steps=4", "checkpoint_every=2")
    assert straight.returncode == 0, straight.stderr[-3000:]
    first = run(tmp_path / "b", "total_steps=2", "checkpoint_every=2")
    assert first.returncode == 0, first.stderr[-3000:]
    second = run(tmp_path / "b", "total_steps=4", "checkpoint_every=2", "resume_from_checkpoint=true")
    assert second.returncode == 0, second.stderr[-3000:]
    a, b = tmp_path / "a/checkpoints/step_000004", tmp_path / "b/checkpoints/step_000004"
    for f in ("model.safetensors", "optimizer.safetensors"):
        wa, wb = _bits(a / f), _bits(b / f)
        assert wa.keys() == wb.keys()
        assert all(torch.equal(wa[k], wb[k]) for k in wa), f
    # and training did move the weights
    w0 = _bits(tmp_path / "a/checkpoints/step_000002/model.safetensors")
    w4 = _bits(a / "model.safetensors")
    assert any(not torch.equal(w0[k], w4[k]) for k in w0)
    state = json.loads((b / "state.json").read_text())
    assert state["step"] == 4 and len(state["history"]) == 4


BAD_INPUT = [
    (["total_steps=1", "grpo_epochs=2"], "unknown config keys: grpo_epochs"),
    (["total_steps=1", "loss.clip=0.1"], "unknown config keys: loss.clip"),
    (["total_steps=1", "checkpoint=/nonexistent/model.safetensors"], "starting checkpoint .* does not exist"),
    (["total_steps=1", "engine.max_prompt_len=20"], "measure up to 33 tokens .* more than engine.max_prompt_len = 20"),
    (["total_steps=1", "resume_from_checkpoint=true"], "no checkpoint to resume from"),
    (["total_steps=1", "trainer_ranks=2"], "trainer_ranks=2 with 1 ranks"),
    (["total_steps=1", "shared_prefix=true", "micro_batch_size=6"], "multiples of group_size"),
    (["total_steps=1", "profile_steps=[0]"], "profile_steps must be a list of step numbers >= 1"),
]


@pytest.mark.parametrize("overrides,match", BAD_INPUT)
def test_bad_input_fails_before_training(tmp_path, monkeypatch, overrides, match):
    # setup raises, in this process (a subprocess per case cost ~8 s of start-up); the CLI's exit: the next test
    out = tmp_path / "o"
    out.mkdir()
    with pytest.raises(Exception, match=match):
        in_process(out, monkeypatch, *overrides)
    assert not (out / "checkpoints").exists()


def test_bad_input_exits_the_cli_with_the_message(tmp_path):
    import re

    overrides, match = BAD_INPUT[3]
    r = run(tmp_path / "o", *overrides)
    assert r.returncode != 0
    assert re.search(match, r.stderr), r.stderr[-2000:]
    assert not (tmp_path / "o/checkpoints").exists()


def test_dataset_row_without_answer(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "ab=12;?ab=", "answer": "12"}\n{"prompt": "cd=34;?cd="}\n')
    r = run(tmp_path / "o", "total_steps=1", "task=null", f"dataset={data}")
    assert r.returncode != 0 and "d.jsonl:2: row has no 'answer'" in r.stderr


# the shipped starting checkpoint: rewards vary within groups from the first step, so gradients are not zero
SHIPPED = ["prompts_per_step=4", "group_size=4", "eval.every=0", "plot=false", "ppo_epochs=2", "minibatches=2",
           f"checkpoint={REPO / 'checkpoints/tiny_kv_retrieval/model.safetensors'}"]


def run_shipped(out: Path, *overrides: str, nproc: int) -> None:
    r = run(out, *overrides, nproc=nproc, base=SHIPPED)
    assert r.returncode == 0, r.stderr[-4000:]


def _assert_same_training(a: Path, b: Path, lr: float = 1e-4) -> None:
    """Two checkpoints of the same optimizer steps, summed in a different order: equal up to rounding.

    The gradients are pinned by Adam's moments, to fp32's rounding of them. The weights only loosely: an Adam update is
    ``lr * m / sqrt(v)``, so where two minibatches' gradients nearly cancel, rounding in ``g`` moves the update by
    up to ~lr (seen on the tiny model: 3 of 860,800 elements past 0.5 lr, between the per-row trainer and the
    shared-prefix one); a step that is really different moves most elements."""
    from sparrow.rl import read_optimizer_state

    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys()
    diff = torch.cat([(wa[k] - wb[k]).abs().flatten() for k in wa])
    assert float(diff.max()) < 2 * lr and int((diff > 0.1 * lr).sum()) <= diff.numel() // 10_000, (
        float(diff.max()), int((diff > 0.1 * lr).sum()))
    oa, ob = read_optimizer_state(a), read_optimizer_state(b)
    assert oa["state"].keys() == ob["state"].keys()
    for i in oa["state"]:
        assert int(oa["state"][i]["step"]) == int(ob["state"][i]["step"])
        # fp32 gradients of the tiny model differ from fp64 ones by up to ~1.3e-4 of a tensor's largest in every
        # path (per row, shared prefix: measured on random groups); the squares double that
        for k, rel in (("exp_avg", 2e-4), ("exp_avg_sq", 4e-4)):
            x, y = oa["state"][i][k], ob["state"][i][k]
            assert float((x - y).abs().max()) <= rel * float(x.abs().max()) + 1e-12, (i, k)


def _tiny_rtpurbo_dir(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny model checkpoint (TINY's shape) and its calibrated RTPurbo profile + indexer."""
    from safetensors.torch import save_file

    from sparrow.attention import RTPurboConfig
    from sparrow.calibrate import fit_indexer, profile_heads, repeat_span_sequences, save_rtpurbo
    from sparrow.models import tiny_qwen2

    torch.manual_seed(0)
    model = tiny_qwen2(vocab_size=48, num_layers=1, embed_dim=32, num_heads=2, num_kv_heads=1,
                       intermediate_dim=64, max_seq_len=40)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02 if p.dim() >= 2 else 1.0)
    ckpt = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt))
    profile = profile_heads(model, repeat_span_sequences(1, 36, 48), ratio=1.0)
    indexer, _ = fit_indexer(model, profile, repeat_span_sequences(4, 36, 48, seed=1), steps=3, dim=4)
    out = tmp_path / "rtpurbo"
    save_rtpurbo(out, profile, indexer, config=RTPurboConfig.for_context(40, indexer_dim=4))
    return ckpt, out


MATH = [("what is 12 plus 30", "42"), ("how many apples: 7 times 6", "42"), ("sum of 100 and 23", "123"),
        ("19 minus 4", "15"), ("the total of 5 and 5", "10")]
SYSTEM = "Put the final answer in \\boxed{}."


def _hf_run_config(tmp_path: Path) -> Path:
    """A config file beside a tiny Qwen2.5-layout Hugging Face directory and a JSONL math dataset, both named by
    paths relative to the config file: from_hf + hf_tokenizer + the directory's chat template (the released
    Qwen2.5-Instruct one) + a math reward."""
    from omegaconf import OmegaConf

    from tests.hf_dirs import (QWEN2_5_INSTRUCT_TEMPLATE, QWEN_ROWS, qwen2_config, write_chat_template, write_model,
                               write_qwen_tokenizer)

    here = tmp_path / "project"
    write_model(here / "qwen_tiny", qwen2_config(vocab_size=QWEN_ROWS, max_position_embeddings=512))
    write_qwen_tokenizer(here / "qwen_tiny")
    write_chat_template(here / "qwen_tiny", QWEN2_5_INSTRUCT_TEMPLATE, eos_token="<|im_end|>",
                        pad_token="<|endoftext|>")
    (here / "math.jsonl").write_text("".join(json.dumps({"prompt": q, "answer": a}) + "\n" for q, a in MATH))
    cfg = OmegaConf.to_container(OmegaConf.load(CONFIG))
    cfg.update(
        model_dir="qwen_tiny", checkpoint=None, task=None, dataset="math.jsonl",
        tokenizer={"_component_": "sparrow.models.hf_tokenizer", "path": "${model_dir}"},
        model={"_component_": "sparrow.models.from_hf", "path": "${model_dir}", "max_seq_len": 160},
        prompt={"chat": True, "system": SYSTEM},
        reward={"_component_": "sparrow.rl.CombinedReward", "components": [
            {"_component_": "sparrow.rl.MathAnswer"}, {"_component_": "sparrow.rl.FormatReward", "style": "boxed"}]},
        group_size=4, prompts_per_step=4, minibatches=1, micro_batch_size=16, total_steps=2, checkpoint_every=2,
        plot=False, eval={"every": 1, "prompts": 3},
        metric_logger={"_component_": "sparrow.rl.JsonlLogger", "log_dir": "${output_dir}/logs"})
    cfg["engine"].update(max_prompt_len=96, max_new_tokens=12, max_rows=16)
    cfg["sampling"].update(max_new_tokens=12, top_p=0.9, top_k=50)
    path = here / "configs" / "math.yaml"
    path.parent.mkdir()
    cfg["model_dir"] = "../qwen_tiny"  # relative to the config file
    cfg["dataset"] = "../math.jsonl"
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(cfg)))
    return path


def test_a_hugging_face_directory_with_a_jsonl_math_dataset(tmp_path, monkeypatch):
    """The real-model path on a CPU: a Qwen2.5-layout directory (151,936 embedding rows, 151,665 tokens) read by
    from_hf / hf_tokenizer, JSONL prompts in the chat format with a math reward, top-p / top-k sampling, run by
    the real CLI from another directory; and, in process, what it trains on."""
    from sparrow.models import from_hf
    from sparrow.rl import PromptFormat

    config = _hf_run_config(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = run(elsewhere / "out", config=config, base=[])
    assert r.returncode == 0, r.stderr[-4000:]
    steps = [m for m in read_metrics(elsewhere / "out" / "logs") if "time/step_s" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert all(math.isfinite(m[k]) for k in ("loss", "mismatch_kl", "outside_support_frac", "reward/mean"))
        assert m["mismatch_kl"] < 0.05 and "eval/accuracy" in m

    monkeypatch.chdir(elsewhere)
    mod, recipe = in_process(tmp_path / "in", monkeypatch, config=config, base=[])
    tok = recipe.tokenizer
    assert recipe.vocab_limit == 151_665 and recipe.stop_ids == (tok.im_end_id, tok.pad_id)
    fmt = PromptFormat(chat=True, system=SYSTEM)
    batch = next(recipe.data_iter)
    held_out = recipe.eval_set[0][0]  # the held-out prompts are the dataset's first rows
    for ids, (question, _) in [(b["prompt_ids"], MATH[b["index"]]) for b in batch] + [(held_out, MATH[0])]:
        assert ids == fmt.encode(tok, question)  # training and held-out prompts: one tokenization
        assert tok.decode(ids) == (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{question}"
                                   "<|im_end|>\n<|im_start|>assistant\n")  # no EOS: the assistant's turn is open
    prompts, gen, rewards = recipe._rollout(batch)
    tokens = torch.cat([s.tokens for s in gen.samples])
    assert int(tokens.max()) < 151_665  # never an embedding row without a token ...
    with pytest.raises(TypeError):  # ... which torchtune's decode cannot turn into text
        tok.decode([151_700])
    # the trainer starts from the directory's weights, bit for bit
    ref = from_hf(config.parent / "../qwen_tiny").state_dict()
    own = recipe.model.state_dict()
    assert set(ref) == set(own) and all(torch.equal(ref[k].view(torch.int32), own[k].view(torch.int32)) for k in ref)
    recipe.cleanup()


def test_the_main_job_runs_from_any_directory(tmp_path):
    """`tune run sparrow_grpo --config <absolute path>` from elsewhere: the starting checkpoint, named relative to
    the config file, is found."""
    r = run(tmp_path / "o", "total_steps=1", "eval.every=0", "prompts_per_step=4", "plot=false", base=[])
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "o" / "logs").is_dir()
    bad = run(tmp_path / "b", "total_steps=1", "checkpoint=nowhere/model.safetensors", base=[])
    assert bad.returncode != 0 and "starting checkpoint" in bad.stderr and "does not exist" in bad.stderr


@pytest.mark.parametrize("path", sorted((REPO / "recipes" / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_configs_are_valid(path):
    from sparrow.rl.recipe_config import check_config, check_values, load_config

    cfg = load_config(path)
    if "engine" in cfg:  # GRPO configs (the SFT configs are checked by their recipe's own key list)
        check_config(cfg)
        check_values(cfg)
        if cfg.get("checkpoint"):  # an input path, resolved against the config file
            assert Path(cfg.checkpoint).is_file()
    else:  # SFT configs: their recipe's keys, config dataclasses and task names (no model is built)
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes"))
        from sparrow_sft import SFTRecipe

        recipe = SFTRecipe(cfg)
        recipe.train_cfg = recipe._setup_config(cfg)
        recipe._setup_tasks(cfg)


def test_bitwise_sync_check_catches_one_flipped_bit(tmp_path, monkeypatch):
    """The recipe's after-sync check compares every bit of the rollout copy with what the trainer sent."""
    mod, recipe = in_process(tmp_path, monkeypatch)
    sent = recipe._trainer_bf16()
    recipe._check_sync(sent)  # freshly set up: both sides hold the same bits
    p = next(iter(mod.policy_parameters(recipe.rollout_model).values()))
    p.view(torch.int16).view(-1)[0] ^= 1  # one mantissa bit
    with pytest.raises(RuntimeError, match="rollout weights differ"):
        recipe._check_sync(sent)
    recipe.cleanup()


def test_old_policy_logprobs_use_the_training_forwards_precision(tmp_path, monkeypatch):
    """With several updates per step, π_old comes from a separate no-grad pass; it must run in the precision of
    the training forward (bf16 autocast on the GPU), so that at the first update π_θ / π_old is exactly 1. Checked
    on the CPU with bf16 autocast standing in for the GPU's, bit for bit."""
    mod, recipe = in_process(tmp_path, monkeypatch, "ppo_epochs=1", "minibatches=2", "micro_batch_size=16")
    cfg = recipe.cfg
    monkeypatch.setattr(recipe, "_autocast", lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    seen = []
    real = mod.grpo_loss

    def spy(lp, old, *a, **k):
        seen.append((lp.detach().clone(), old.detach().clone()))
        return real(lp, old, *a, **k)

    monkeypatch.setattr(mod, "grpo_loss", spy)
    prompts, gen, rewards = recipe._rollout(next(recipe.data_iter))
    adv = mod.group_advantages(rewards.view(-1, recipe.group), recipe.grpo.advantage_scale).flatten()
    rb = mod.build_rollout_batch(prompts, gen.samples, recipe.group, rewards, adv, pad_id=recipe.tokenizer.pad_id)
    first_rows = rb.select(torch.arange(8))  # the first minibatch, one micro-batch
    with torch.no_grad():  # what π_old was before: the same pass in fp32
        fp32 = recipe._logprobs(first_rows.tokens, first_rows.prompt_len, first_rows.response_len,
                                max_response_len=rb.max_response_len, sampling=recipe._sampling_params(),
                                chunk_size=cfg.logprob_chunk)
    recipe._train_on(rb)
    lp, old = seen[0]  # the first update: nothing has changed the weights yet
    assert torch.equal(lp.view(torch.int32), old.view(torch.int32))
    assert not torch.equal(fp32.view(torch.int32), lp.view(torch.int32))  # the check tells the precisions apart
    recipe.cleanup()


@pytest.mark.parametrize("on", [pytest.param(True, id="on"), pytest.param(False, id="off")])
def test_activation_checkpointing_reaches_the_trainers_layers(tmp_path, monkeypatch, on):
    """``enable_activation_checkpointing`` recomputes every decoder layer of the trainer's log-prob pass in the
    backward (and nothing of the no-grad π_old pass); off, no layer is (the logits chunks always are)."""
    import sparrow.rl.logprobs as lp_mod

    layers = []
    real = lp_mod.checkpoint

    def counting(fn, *args, **kw):
        if isinstance(fn, torch.nn.Module):
            layers.append(fn)
        return real(fn, *args, **kw)

    monkeypatch.setattr(lp_mod, "checkpoint", counting)
    mod, recipe = in_process(tmp_path, monkeypatch, "ppo_epochs=1", "minibatches=2", "micro_batch_size=16",
                             f"enable_activation_checkpointing={str(on).lower()}")
    prompts, gen, rewards = recipe._rollout(next(recipe.data_iter))
    adv = mod.group_advantages(rewards.view(-1, recipe.group), recipe.grpo.advantage_scale).flatten()
    recipe._train_on(mod.build_rollout_batch(prompts, gen.samples, recipe.group, rewards, adv,
                                             pad_id=recipe.tokenizer.pad_id))
    micro_batches = 2 * math.ceil(recipe.prompts_per_step * recipe.group // 2 / 16)  # two updates' micro-batches
    assert len(layers) == (micro_batches * len(recipe.model.layers) if on else 0)
    recipe.cleanup()


def test_stop_at_ends_on_a_whole_step(tmp_path, monkeypatch):
    """``train(stop_at=...)``: the first step always runs, and no step starts that the last step's duration says
    would end after ``stop_at``; far enough ahead, every step runs; several ranks are refused before any step."""
    import time

    _, recipe = in_process(tmp_path / "now", monkeypatch, "total_steps=3")
    recipe.train(stop_at=time.perf_counter())
    assert recipe.step == 1
    recipe.cleanup()
    _, recipe = in_process(tmp_path / "later", monkeypatch, "total_steps=3")
    recipe.train(stop_at=time.perf_counter() + 3600)
    assert recipe.step == 3
    recipe.world = 2
    with pytest.raises(ValueError, match="one process only"):
        recipe.train(stop_at=time.perf_counter() + 3600)
    assert recipe.step == 3
    recipe.cleanup()


def test_profile_steps_write_the_op_table_and_mark_the_step(tmp_path, monkeypatch):
    """``profile_steps``: the listed step runs under the profiler, its op table lands in ``output_dir/profile`` and
    its metrics say ``profiled`` (benchmarks leave it out of the timed steps); the other steps are untouched."""
    from sparrow.rl.runs import step_rows

    _, recipe = in_process(tmp_path, monkeypatch, "total_steps=3", "profile_steps=[2]")
    seen = []
    recipe._log_step = lambda metrics, bar: seen.append(dict(metrics, step=recipe.step))
    recipe.train()
    recipe.cleanup()
    assert [m.get("profiled") for m in seen] == [None, 1.0, None]
    assert [p.name for p in (tmp_path / "profile").iterdir()] == ["step2_rank0.txt"]
    table = (tmp_path / "profile" / "step2_rank0.txt").read_text()
    assert "aten::" in table and "Self CPU" in table
    assert [r["timed"] for r in step_rows("c", 0, seen, warmup=0)] == [True, False, True]

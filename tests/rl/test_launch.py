"""Launching a recipe as a user types it: the command, its metric log read back, failures, technique overrides."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from sparrow.rl.launch import (
    LaunchError, launch_options, launch_recipe, log_overrides, recipe_env, run_in_process, speculative_section,
    technique_overrides,
)

# a recipe file tune runs: writes one metrics record per step into output_dir/logs, then fails when told to
RECIPE = '''
import json, sys, time
from pathlib import Path
from omegaconf import OmegaConf
from torchtune import config

@config.parse
def main(cfg):
    logs = Path(cfg.output_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    with open(logs / "metrics.jsonl", "w") as f:
        for step in range(1, cfg.total_steps + 1):
            f.write(json.dumps({"step": step, "time/step_s": 0.5 * step}) + "\\n")
            f.flush()
            time.sleep(0.2)
    print("done")
    sys.exit(cfg.get("exit_code", 0))

if __name__ == "__main__":
    main()
'''


@pytest.fixture
def fake_recipe(tmp_path):
    (tmp_path / "fake_recipe.py").write_text(RECIPE)
    (tmp_path / "fake.yaml").write_text("output_dir: x\ntotal_steps: 1\n")
    return tmp_path


def launch(tmp, overrides, out, **kw):
    """The fake recipe, importable by module name from ``tmp``."""
    env = recipe_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp), env["PYTHONPATH"]])
    return launch_recipe(tmp / "fake.yaml", overrides, out=out, recipe="fake_recipe", env=env, **kw)


def test_launch_recipe_reads_the_metric_log(fake_recipe):
    out = fake_recipe / "run"
    run = launch(fake_recipe, [f"output_dir={out}", "total_steps=3"], out)
    assert run.returncode == 0 and [r["step"] for r in run.steps] == [1, 2, 3]
    assert run.first_step_s is not None and 0 < run.first_step_s < run.wall_s
    assert run.command.startswith("tune run ") and "total_steps=3" in run.command
    assert "done" in run.output and (fake_recipe / "run.log").read_text() == run.output


def test_launch_recipe_failure(fake_recipe):
    out = fake_recipe / "bad"
    overrides = [f"output_dir={out}", "exit_code=3"]
    with pytest.raises(LaunchError, match="exit 3"):
        launch(fake_recipe, overrides, out)
    run = launch(fake_recipe, overrides, out, check=False)
    assert run.returncode == 3 and len(run.steps) == 1
    with pytest.raises(subprocess.TimeoutExpired):
        launch(fake_recipe, [f"output_dir={out}", "total_steps=50"], out, timeout=0.5)


def test_overrides():
    assert log_overrides("o", 4)[:2] == ["output_dir=o", "total_steps=4"]
    assert "metric_logger.log_dir=o/logs" in log_overrides("o", 4)
    assert technique_overrides("all_off")[-1] == "speculative=null"
    on = technique_overrides("all_on", "cal", toggle="threshold", lengths=(4,), max_active=64)
    assert on[:3] == ["attention._component_=sparrow.attention.rtpurbo", "attention.path=cal", "sync.codec=auto"]
    assert on[3] == ("speculative={drafter: {_component_: sparrow.speculative.DrafterConfig, weight: int8}, toggle: "
                     "{_component_: sparrow.speculative.threshold, num_draft: 4, draft_lengths: [4], max_active: 64}}")
    with pytest.raises(ValueError):
        technique_overrides("all_on")
    with pytest.raises(ValueError):
        technique_overrides("rtpurbo_only", "cal")


def test_speculative_section():
    d = {"_component_": "sparrow.speculative.DrafterConfig"}
    assert speculative_section(d, "always", [2, 4])["toggle"] == {"_component_": "sparrow.speculative.always_on",
                                                                  "num_draft": 4}
    assert speculative_section(d, "cost_model", [2])["toggle"] == {"_component_": "sparrow.speculative.cost_model",
                                                                   "draft_lengths": [2]}
    with pytest.raises(ValueError):
        speculative_section(d, "sometimes", [2])
    with pytest.raises(ValueError):
        speculative_section(d, "threshold", [])


def test_launch_options_parse():
    from sparrow.bench import base_parser

    args = base_parser("q", launch_options("c.yaml", 7)).parse_args(["--model", "m", "--set", "a=1", "b=2"])
    assert (str(args.config), args.steps, args.configs, args.set) == ("c.yaml", 7, "all_off,all_on", ["a=1", "b=2"])


class _Logger:
    def __init__(self):
        self.records, self.closed = [], False

    def close(self):
        self.closed = True


class _Recipe:
    made: list = []

    def __init__(self, cfg):
        self.cfg, self.metric_logger, self.calls = cfg, _Logger(), []
        _Recipe.made.append(self)

    def setup(self, cfg):
        self.calls.append("setup")

    def train(self):
        self.calls.append("train")
        if self.cfg.get("fail"):
            raise RuntimeError("boom")
        self.metric_logger.records.append({"step": 1, "time/step_s": 1.0})

    def cleanup(self):
        self.calls.append("cleanup")


def test_run_in_process():
    out = run_in_process(_Recipe, {"a": 1}, after=lambda r: {"seen": r.cfg.a})
    rec = _Recipe.made[-1]
    assert rec.calls == ["setup", "train", "cleanup"] and rec.metric_logger.closed
    assert out["records"] == [{"step": 1, "time/step_s": 1.0}] and out["seen"] == 1 and out["run_s"] >= out["setup_s"]
    with pytest.raises(RuntimeError, match="boom"):
        run_in_process(_Recipe, {"fail": True})
    assert _Recipe.made[-1].metric_logger.closed  # closed whatever happens
    assert json.dumps(out)


def test_grpo_base_config_and_technique_config_are_valid_recipe_configs(tmp_path):
    """The base (every technique off) and each technique on its own pass the recipe's key and value checks; each
    switch changes what it names and nothing else; the base is left as it was."""
    from omegaconf import OmegaConf

    from sparrow.rl.launch import REWARDS, TASKS, grpo_base_config, technique_config
    from sparrow.rl.recipe_config import check_config, check_values

    model = {"_component_": "sparrow.models.tiny_qwen2", "vocab_size": 64}
    base = grpo_base_config(model, tmp_path / "model.safetensors", "cpu", context=64, group=4, prompts_per_step=2,
                            max_new=4, steps=3, eval_prompts=0, compile=False, bucket_growth=2)
    assert base["attention"] == {"_component_": "sparrow.attention.dense"} and base["sync"]["codec"] == "dense"
    assert base["engine"]["batch_buckets"] == [1, 2, 4, 8] and base["engine"]["max_prompt_len"] == 65
    assert base["trainer_precision"] == "fp32" and "fused" not in base["optimizer"] and base["eval"]["every"] == 0
    spec = speculative_section({"_component_": "sparrow.speculative.DrafterConfig"}, "always", [2])
    runs = {"off": {}, "rtpurbo": dict(rtpurbo=tmp_path / "cal", indexer_refresh_every=2),
            "spec": dict(speculative=spec), "sync": dict(sparse_sync=True),
            "partial": dict(overprovision=1, max_staleness=2, bucket_growth=2)}
    before = json.dumps(base)
    for name, kw in runs.items():
        cfg = technique_config(base, tmp_path / name, seed=5, **kw)
        check_config(OmegaConf.create(cfg))
        check_values(OmegaConf.create(cfg))
        assert cfg["seed"] == 5 and cfg["output_dir"] == cfg["metric_logger"]["log_dir"] == str(tmp_path / name)
        changed = {k for k in set(cfg) | set(base) if cfg.get(k) != base.get(k)} - {"seed", "output_dir",
                                                                                    "metric_logger"}
        assert changed == {"off": set(), "rtpurbo": {"attention", "indexer_refresh"}, "spec": {"speculative"},
                           "sync": {"sync"}, "partial": {"partial_rollout", "engine"}}[name]
    partial = technique_config(base, tmp_path, overprovision=1, bucket_growth=2)
    assert partial["engine"]["max_rows"] == 12 and partial["engine"]["batch_buckets"] == [1, 2, 4, 8, 12]
    assert json.dumps(base) == before
    assert set(TASKS) >= {"kv_retrieval", "kv_list"} and "exact_match" in REWARDS
    with pytest.raises(ValueError, match="task"):
        grpo_base_config(model, "m", "cpu", task="sudoku")


@pytest.mark.parametrize("bounded", [True, False], ids=["unbacked-sizes", "backed-sizes"])
def test_compiled_engines_skip_bucket_1_only_where_it_would_compile_graphs_of_its_own(tmp_path, monkeypatch, bounded):
    """Where this torch specialises size 1 (backed dynamic sizes), the benchmark's compiled engines start their
    buckets above 1 (one compile of every step kind less); with unbacked sizes, or uncompiled, bucket 1 stays."""
    import sparrow.rollout.config as engine_config
    from sparrow.rl.launch import grpo_base_config, technique_config

    monkeypatch.setattr(engine_config, "bounded_unbacked_sizes", lambda: bounded)
    model = {"_component_": "sparrow.models.tiny_qwen2", "vocab_size": 64}
    kw = dict(context=64, group=8, prompts_per_step=8, eval_prompts=0)
    compiled = grpo_base_config(model, tmp_path / "m", "cuda", **kw)
    assert compiled["engine"]["batch_buckets"] == ([1, 4, 16, 64] if bounded else [4, 16, 64])
    partial = technique_config(compiled, tmp_path, overprovision=2)
    assert partial["engine"]["batch_buckets"] == ([1, 4, 16, 64, 80] if bounded else [4, 16, 64, 80])
    eager = grpo_base_config(model, tmp_path / "m", "cuda", compile=False, **kw)
    assert eager["engine"]["batch_buckets"] == [1, 4, 16, 64]
    assert engine_config.smallest_bucket(True, dynamic_batch=False) == 1  # static steps: one per bucket in any case


def test_configuration_names():
    from sparrow.rl.launch import CONFIGS, configuration_names

    assert configuration_names(" all_off, spec_only,,") == ["all_off", "spec_only"]
    assert configuration_names("all_off,all_on,spec_only", partial=True) == [
        "all_off", "all_on", "spec_only", "all_off_partial", "all_on_partial"]  # twins where there are
    assert configuration_names("all_off,all_off_partial", partial=True) == ["all_off", "all_off_partial"]
    with pytest.raises(ValueError, match="'nope'"):
        configuration_names("all_off,nope")
    assert all(set(s) >= {"rtpurbo", "spec", "sparse_sync"} for s in CONFIGS.values())


def test_configuration_switches_what_the_name_says(tmp_path):
    from omegaconf import OmegaConf

    from sparrow.rl.launch import CONFIGS, configuration, grpo_base_config
    from sparrow.rl.recipe_config import check_config, check_values

    model = {"_component_": "sparrow.models.tiny_qwen2", "vocab_size": 64}
    base = grpo_base_config(model, tmp_path / "model.safetensors", "cpu", context=64, group=4, prompts_per_step=2,
                            max_new=4, steps=3, eval_prompts=0, compile=False, bucket_growth=2)
    for name, on in CONFIGS.items():
        cfg = configuration(base, name, tmp_path / name, seed=3, rtpurbo=tmp_path / "cal", draft_window=64,
                            spec_toggle="threshold", draft_lengths=[2, 4], max_active=8)
        check_config(OmegaConf.create(cfg))
        check_values(OmegaConf.create(cfg))
        assert cfg["seed"] == 3 and cfg["output_dir"] == str(tmp_path / name)
        assert (cfg["attention"]["_component_"] == "sparrow.attention.rtpurbo") == on["rtpurbo"]
        assert (cfg["sync"]["codec"] == "auto") == on["sparse_sync"]
        assert ("partial_rollout" in cfg) == bool(on.get("partial"))
        assert (cfg.get("speculative") is not None) == on["spec"]
    spec = configuration(base, "spec_only", tmp_path, draft_window=64, spec_toggle="threshold", draft_lengths=[2, 4],
                         max_active=8)["speculative"]
    assert spec["drafter"] == {"_component_": "sparrow.speculative.DrafterConfig", "weight": "int8", "window": 64}
    assert spec["toggle"] == {"_component_": "sparrow.speculative.threshold", "num_draft": 4, "draft_lengths": [2, 4],
                              "max_active": 8}
    on = configuration(base, "all_on", tmp_path, rtpurbo=tmp_path / "cal", draft_window=64)  # RTPurbo: no window
    assert "window" not in on["speculative"]["drafter"] and on["attention"]["path"] == str(tmp_path / "cal")
    partial = configuration(base, "all_off_partial", tmp_path)
    assert partial["partial_rollout"]["overprovision"] == 2  # default: a step's prompts
    assert configuration(base, "all_off_partial", tmp_path, overprovision=5)["partial_rollout"]["overprovision"] == 5
    with pytest.raises(KeyError):
        configuration(base, "nope", tmp_path)


def test_grpo_options_pass_on_to_grpo_base_config(tmp_path):
    from sparrow.bench import base_parser, fill_defaults, keyword_args
    from sparrow.rl.launch import GRPO_DEFAULTS, grpo_base_config, grpo_options

    p = base_parser("q", [*grpo_options(), ("--context", int, 64, None)])
    args = fill_defaults(p.parse_args(["--quick", "--group", "4", "--no-shared-prefix", "--no-compile",
                                       "--max-new", "4"]), True, **GRPO_DEFAULTS)
    kw = keyword_args(grpo_base_config, args)
    assert kw["steps"] == 2 and kw["reward"] == "char_accuracy" and kw["lr"] == 1e-3 and kw["group"] == 4
    assert kw["shared_prefix"] is False and kw["compile"] is False and kw["context"] == 64
    cfg = grpo_base_config({"_component_": "sparrow.models.tiny_qwen2"}, tmp_path / "m", "cpu", **kw)
    assert cfg["group_size"] == 4 and cfg["total_steps"] == 2 and cfg["reward"]["_component_"].endswith("CharAccuracy")
    full = fill_defaults(p.parse_args([]), False, **GRPO_DEFAULTS)
    assert (full.steps, full.prompts_per_step, full.eval_prompts, full.lr, full.compile) == (8, 8, 64, 1e-5, None)


class _Engine:
    def __init__(self):
        self.calls = []

    def generate(self, prompts, group, params):
        from sparrow.rollout import Generation, GenerationStats

        self.calls.append((prompts, group, params))
        return Generation([], GenerationStats(generated_tokens=len(prompts) * group * params.max_new_tokens,
                                              prefill_s=0.25))


class _TrainedRecipe:
    group = 3

    def __init__(self):
        from sparrow.sampling import SamplingParams

        self.engine = _Engine()
        self.data_iter = iter([[{"prompt_ids": [1, 2]}, {"prompt_ids": [3]}], [{"prompt_ids": [9]}]])
        self.params = SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=(2,))

    def _sampling_params(self):
        return self.params


def test_fixed_rollout_decodes_the_next_prompts_to_a_fixed_length():
    from sparrow.rl.launch import fixed_rollout

    recipe = _TrainedRecipe()
    out = fixed_rollout(recipe, 5)
    assert set(out) == {"fixed_rollout_s", "fixed_tokens", "fixed_prefill_s"} and out["fixed_rollout_s"] >= 0
    assert out["fixed_tokens"] == 2 * 3 * 5 and out["fixed_prefill_s"] == 0.25
    assert len(recipe.engine.calls) == 2  # once to compile the no-stop mode, once timed, the same prompts
    for prompts, group, params in recipe.engine.calls:
        assert prompts == [[1, 2], [3]] and group == 3
        assert params.max_new_tokens == 5 and params.stop_token_ids == () and params.temperature == 1.0
    assert recipe.params.stop_token_ids == (2,)  # the recipe's own parameters are left alone
    assert next(recipe.data_iter) == [{"prompt_ids": [9]}]  # one batch taken

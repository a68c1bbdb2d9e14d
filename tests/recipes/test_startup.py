"""The recipe's start-up: every step compiled and the cost model calibrated during setup, their phases logged with
the first step's metrics, and nothing compiled inside the steps."""

from __future__ import annotations

import pytest
from torch._dynamo.utils import counters

from tests.recipes.test_grpo_recipe import in_process

STARTUP = ["engine.compile=true", "engine.compile_backend=eager", "engine.max_rows=4", "total_steps=2",
           "metric_logger._component_=sparrow.rl.JsonlLogger", "speculative.drafter._component_=sparrow.speculative.DrafterConfig",
           "speculative.drafter.weight=int8", "speculative.toggle._component_=sparrow.speculative.cost_model",
           "speculative.toggle.draft_lengths=[2]"]


@pytest.mark.slow
def test_setup_phases_are_logged_once_and_steps_compile_nothing(tmp_path, monkeypatch):
    from sparrow.speculative.costs import CostModel

    real = CostModel.calibrate.__func__

    def quick(cls, engine, params=None, **kw):  # the real measurement, at two buckets and one run a point
        return real(cls, engine, params, steps=1, buckets=(engine.config.buckets[0], 4), **kw)

    monkeypatch.setattr(CostModel, "calibrate", classmethod(quick))
    _, recipe = in_process(tmp_path, monkeypatch, *STARTUP, f"metric_logger.log_dir={tmp_path / 'logs'}")
    assert recipe.engine.config.compile_cache == str(tmp_path / "compile_cache")  # the run's output by default
    after_setup = counters["stats"]["unique_graphs"]
    recipe.train()
    steps = [r for r in recipe.metric_logger.records if "time/step_s" in r]
    recipe.cleanup()
    first, second = steps
    for key in ("setup/compile_decode_s", "setup/compile_draft_s", "setup/compile_verify_s", "setup/calibrate_s",
                "setup/rollout_s"):
        assert first[key] > 0, key
    # one graph of each kind: one symbolic step serves every bucket (unbacked sizes), or the default buckets leave
    # out the bucket 1 that backed sizes would specialise (smallest_bucket)
    assert (first["setup/graphs_decode"], first["setup/graphs_draft"], first["setup/graphs_verify"]) == (1, 1, 1)
    assert not any(k.startswith("setup/") for k in second)  # logged once
    assert first["compile/graphs"] == second["compile/graphs"] == after_setup  # the steps compiled nothing
    assert list((tmp_path / "compile_cache" / "costs").glob("*.json"))  # the calibration, for the next run

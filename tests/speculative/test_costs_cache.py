"""The cost-model calibration is cached in the engine's compile cache, keyed by everything it depends on, and loaded
instead of measured when the key and the calibration's settings match."""

from __future__ import annotations

import pytest

import sparrow.speculative.costs as costs
from sparrow.rollout import EngineConfig, RolloutEngine, SamplingParams
from sparrow.speculative.costs import CostModel, cost_key
from sparrow.speculative.drafter import DrafterConfig, QuantizedSelfDrafter
from tests.helpers import random_tiny

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=8)


def _engine(model, **kw) -> RolloutEngine:
    cfg = dict(max_rows=2, max_prompt_len=16, max_new_tokens=8, compile=False, max_draft=2)
    cfg.update(kw)
    return RolloutEngine(model, EngineConfig(**cfg), drafter=QuantizedSelfDrafter(model, DrafterConfig(weight="int8")))


@pytest.fixture(scope="module")
def model():
    return random_tiny("qwen2", num_layers=1)


def test_calibration_lives_in_the_engines_compile_cache_and_is_loaded_back(model, tmp_path, monkeypatch):
    measured = []
    real = RolloutEngine.time_step

    def counting(self, *a, **kw):
        measured.append(a)
        return real(self, *a, **kw)

    monkeypatch.setattr(RolloutEngine, "time_step", counting)
    eng = _engine(model, compile_cache=str(tmp_path))
    first = CostModel.calibrate(eng, PARAMS, steps=1)
    files = list((tmp_path / "costs").glob("*.json"))
    assert len(files) == 1 and measured
    n = len(measured)
    again = CostModel.calibrate(_engine(model, compile_cache=str(tmp_path), progress=True), PARAMS, steps=1)
    assert len(measured) == n and again.meta == first.meta  # loaded: nothing timed (progress is not in the key)
    CostModel.calibrate(eng, PARAMS, steps=2)  # other calibration settings: measured, and kept beside
    assert len(measured) > n and len(list((tmp_path / "costs").glob("*.json"))) == 2
    n = len(measured)
    CostModel.calibrate(eng, PARAMS, steps=1, refresh=True)
    assert len(measured) > n


def test_without_a_compile_cache_calibrations_go_to_the_default_folder(model, tmp_path, monkeypatch):
    monkeypatch.setattr(costs, "DEFAULT_CACHE_DIR", tmp_path / "default")
    CostModel.calibrate(_engine(model), PARAMS, steps=1)
    assert len(list((tmp_path / "default").glob("*.json"))) == 1
    CostModel.calibrate(_engine(model), PARAMS, steps=1, cache_dir=None)
    assert len(list((tmp_path / "default").glob("*.json"))) == 1


def test_cost_key_follows_the_engine_drafter_and_processing(model):
    base = cost_key(_engine(model), PARAMS)
    assert "device=" in base and "triton=" in base
    same = {cost_key(_engine(model, block_steps=3), PARAMS), cost_key(_engine(model, progress=True), PARAMS),
            cost_key(_engine(model, compile_cache="elsewhere"), PARAMS)}
    assert same == {base}
    other = [cost_key(_engine(model, batch_buckets=(2,)), PARAMS), cost_key(_engine(model, max_rows=4), PARAMS),
             cost_key(_engine(model, compile=True), PARAMS),
             cost_key(_engine(random_tiny("qwen2", num_layers=1, intermediate_dim=96)), PARAMS),
             cost_key(_engine(model), SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=(1, 2))),
             cost_key(RolloutEngine(model, EngineConfig(max_rows=2, max_prompt_len=16, max_new_tokens=8, compile=False,
                                                        max_draft=2),
                                    drafter=QuantizedSelfDrafter(model, DrafterConfig(weight="int8", window=4))),
                      PARAMS)]
    assert len({base, *other}) == len(other) + 1


@pytest.mark.parametrize("lengths, timed", [
    pytest.param([3], {3}, id="one-length"),
    pytest.param([3, 1, 3], {1, 3}, id="shortest-and-longest"),
    pytest.param([], {2, 3}, id="default-ladder"),
])
def test_the_cost_model_toggle_times_only_the_draft_lengths_it_was_given(model, tmp_path, monkeypatch, lengths, timed):
    """A recipe's ``draft_lengths: [4]`` made the engine compile cycles of 4 drafts ahead, and the calibration then
    timed cycles of 2 as well: a fresh verify-step compile (~70 s on an H100) per batch specialisation."""
    from sparrow.speculative.toggle import cost_model

    cycles = set()
    real = RolloutEngine.time_step

    def recording(self, kind, *a, **kw):
        if kind == "cycle":
            cycles.add(kw["k"])
        return real(self, kind, *a, **kw)

    monkeypatch.setattr(RolloutEngine, "time_step", recording)
    toggle = cost_model(_engine(model, compile_cache=str(tmp_path), max_draft=3), PARAMS, draft_lengths=lengths)
    assert cycles == timed
    if lengths:  # and the toggle asks only for those lengths (what the engine compiled ahead)
        assert toggle.draft_lengths() == tuple(sorted(set(lengths)))

"""The context curriculum: levels, advancing by accuracy or by the time cap of a partly solved level."""

from __future__ import annotations

import pytest

from sparrow.training import Curriculum, CurriculumConfig


def test_levels_double_up_to_the_maximum():
    assert CurriculumConfig(min_context=64, max_context=300).levels() == [64, 128, 256, 300]
    assert CurriculumConfig(min_context=64, max_context=64).levels() == [64]


def test_an_unsolved_level_is_held_past_its_time_cap():
    cfg = CurriculumConfig(min_context=256, max_context=1024, ramp=0.5, advance_acc=0.8, min_advance_acc=0.3)
    cur = Curriculum(cfg)  # 3 levels: a level's cap is 25% of the run
    assert not cur.update(0.30, {"kv": 0.1, "vt": 0.9})  # time is up, but kv is unsolved: hold
    assert not cur.update(0.40) and cur.top == 256
    assert cur.update(0.41, {"kv": 0.35, "vt": 0.5}, elapsed_s=41.0) and cur.top == 512  # partly solved: capped
    assert not cur.update(0.60)  # no accuracy measured at 512 yet
    assert cur.update(0.61, {"kv": 0.85, "vt": 0.81}) and cur.top == 1024  # solved: advance at once
    assert [e["reason"] for e in cur.events] == ["time", "accuracy"] and cur.events[0]["elapsed_s"] == 41.0
    assert not cur.update(0.99, {"kv": 1.0})  # the last level
    assert Curriculum(CurriculumConfig(min_context=256, max_context=1024, ramp=0.5, min_advance_acc=0.0)).update(0.26)


def test_time_mode_grows_geometrically_and_samples_stay_in_range():
    cur = Curriculum(CurriculumConfig(min_context=64, max_context=1024, ramp=0.5, mode="time"), seed=3)
    assert cur.top == 64 and not cur.update(0.1)
    assert cur.update(0.25) and cur.top == 256 and cur.update(0.5) and cur.top == 1024
    lengths = [cur.sample() for _ in range(200)]
    assert all(64 <= n <= 1024 and n % 64 == 0 for n in lengths) and lengths.count(1024) > 60
    assert len(set(lengths)) > 5  # log-uniform below the top
    assert Curriculum(CurriculumConfig(min_context=33, max_context=33)).sample() == 33


@pytest.mark.parametrize("kwargs,match", [
    pytest.param({"min_context": 128, "max_context": 64}, "min_context <= max_context", id="order"),
    pytest.param({"ramp": 0.0}, r"ramp must be in \(0, 1\], got 0.0", id="ramp"),
    pytest.param({"mode": "steps"}, "mode must be one of", id="mode"),
    pytest.param({"advance_acc": 1.5}, "advance_acc=1.5", id="acc"),
])
def test_config_refuses_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CurriculumConfig(**kwargs)

"""PartialRollout on its own: the staleness bound by drop and by finish, what a step hands over, restarts."""

import pytest
import torch

from sparrow.rl import PartialRollout, PartialRolloutConfig
from sparrow.rollout import EngineConfig, RolloutEngine, SamplingParams
from tests.helpers import random_tiny

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=(3, 7, 11), seed=2)


def _rows(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_ids": torch.randint(0, 64, (int(k),), generator=g).tolist(), "answer": str(i)}
            for i, k in enumerate(torch.randint(3, 12, (n,), generator=g))]


def _partial(cfg, P=2, O=2, rows=None):
    engine = RolloutEngine(random_tiny("qwen2", std=0.15), EngineConfig(max_rows=12, max_prompt_len=16,
                                                                       max_new_tokens=12, compile=False,
                                                                       block_steps=1))
    source = iter(rows or _rows(200))
    return engine, PartialRollout(engine, cfg, prompts_per_step=P, overprovision=O, group=2,
                                  draw=lambda: [next(source) for _ in range(2)],
                                  score=lambda row, s: float(s.length))


def _steps(engine, partial, n, version0=0):
    out = []
    for v in range(version0, version0 + n):
        engine.set_policy_version(v)
        out.append((v, partial.step(v, PARAMS)))
    return out


@pytest.mark.parametrize("on_stale,staleness", [("finish", 1), ("finish", 2), ("drop", 0), ("drop", 1)])
def test_every_trained_group_keeps_to_the_staleness_bound(on_stale, staleness):
    """Each step hands over prompts_per_step whole groups, oldest first, scored; no trained token is older than
    max_staleness versions; with a bound above 0 rows did span versions; drop at bound 0 discards the groups still
    running (finish waits for due groups and drops nothing)."""
    cfg = PartialRolloutConfig(True, overprovision=2, max_staleness=staleness, on_stale=on_stale)
    engine, partial = _partial(cfg)
    dropped, spanning = 0, 0
    for v, st in _steps(engine, partial, 8):
        assert len(st.rows) == 2 and len(st.generation) == 4 and st.rewards.tolist() == [
            float(s.length) for s in st.generation]
        groups = [s.prompt_index for s in st.generation.samples[::2]]
        assert groups == sorted(groups)
        for s in st.generation:
            assert v - staleness <= int(s.versions.min()) and int(s.versions.max()) <= v
            spanning += len(set(s.versions.tolist())) > 1
        assert partial.held <= 2  # prompts_per_step + overprovision held, prompts_per_step handed over
        dropped += st.metrics["partial/dropped_groups"]
    assert (spanning > 0) == (staleness > 0)
    assert (dropped > 0) == (on_stale == "drop" and staleness == 0)


def test_finish_refuses_a_step_whose_due_groups_exceed_it():
    """With finish, more over-provisioned groups than a step trains can come due at once (the config check
    refuses such a section; built without it, the step says so)."""
    engine, partial = _partial(PartialRolloutConfig(True, overprovision=6, max_staleness=1), P=1, O=6)
    with pytest.raises(RuntimeError, match="exceed max_staleness"):
        _steps(engine, partial, 6)
    with pytest.raises(ValueError, match="above prompts_per_step"):
        PartialRolloutConfig(True, overprovision=6, max_staleness=1).check(1)


def test_state_restarts_the_held_groups_first():
    engine, partial = _partial(PartialRolloutConfig(True, overprovision=2, max_staleness=1))
    _steps(engine, partial, 2)
    state = partial.state_dict()
    assert len(state["queue"]) >= partial.held > 0
    with pytest.raises(RuntimeError, match="holds no groups"):
        partial.load_state_dict(state)
    runs = []
    for _ in range(2):
        engine, fresh = _partial(PartialRolloutConfig(True, overprovision=2, max_staleness=1), rows=_rows(200, seed=9))
        fresh.load_state_dict(state)
        st = _steps(engine, fresh, 1, version0=2)[0][1]
        assert all(r in state["queue"][:4] for r in st.rows)  # the restarted groups come before new draws
        runs.append([s.tokens.tolist() for s in st.generation])
    assert runs[0] == runs[1]
    _, empty = _partial(PartialRolloutConfig(True))
    with pytest.raises(ValueError, match="'queue' list"):
        empty.load_state_dict({"rows": []})

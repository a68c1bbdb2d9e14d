"""Toggles, adaptive draft length and the measured cost model."""

import math

import pytest
import torch

from sparrow.rollout import EngineConfig, RolloutEngine, SamplingParams
from sparrow.speculative import (
    AdaptiveDraft,
    AlwaysOn,
    CostModel,
    CostModelToggle,
    StepStats,
    ThresholdToggle,
    expected_tokens_per_cycle,
)
from sparrow.speculative.drafter import QuantizedSelfDrafter
from tests.helpers import random_tiny
from tests.speculative.common import CopyDrafter, perturbed_copy, prompts


def test_expected_tokens_per_cycle():
    for k in (1, 3, 8):
        assert expected_tokens_per_cycle(0.0, k) == 1.0
        assert expected_tokens_per_cycle(1.0, k) == k + 1
        for a in (0.3, 0.8, 0.95):
            assert math.isclose(expected_tokens_per_cycle(a, k), sum(a**i for i in range(k + 1)))


def synthetic_costs(draft_ratio=0.3, verify_per_token=0.02, kv_slope=1e-6, buckets=(1, 2, 4, 8, 16, 32)):
    """Costs shaped like a weight-bound decode: target ~1 + batch term, draft a fraction of it, verify
    growing with the tokens it scores."""
    target = {b: (1.0 + 0.01 * b, kv_slope * b) for b in buckets}
    draft = {b: (draft_ratio * (1.0 + 0.01 * b), kv_slope * b) for b in buckets}
    verify = {b: {k: (1.0 + 0.01 * b * (k + 1) + verify_per_token * b * k, kv_slope * b) for k in (1, 8)}
              for b in buckets}
    return CostModel(key="synthetic", target=target, draft=draft, verify=verify)


def test_cost_model_queries_interpolate_and_round_trip(tmp_path):
    m = synthetic_costs()
    assert m.target_step(4, 0) == pytest.approx(1.04)
    assert m.target_step(3, 0) == pytest.approx(1.03)  # between buckets: linear
    assert m.verify_step(4, 0, 4) == pytest.approx(1.0 + 0.04 * 5 + 0.02 * 4 * 4)  # between draft lengths
    assert m.cycle(4, 1000, 4) == pytest.approx(4 * m.draft_step(4, 1000) + m.verify_step(4, 1000, 4))
    assert m.target_step(4, 1000) > m.target_step(4, 0)
    path = m.save(tmp_path / "c.json")
    back = CostModel.load(path, "synthetic")
    assert back.target == m.target and back.verify == m.verify
    with pytest.raises(ValueError, match="measured for"):
        CostModel.load(path, "another")
    with pytest.raises(ValueError, match="same non-empty set"):
        CostModel(key="x", target={1: (0, 0)}, draft={}, verify={})


def test_threshold_toggle():
    t = ThresholdToggle(max_active=8, num_draft=3)
    assert t.decide(StepStats(8, 100.0, 200)).speculate and t.decide(StepStats(8, 100.0, 200)).num_draft == 3
    assert not t.decide(StepStats(9, 100.0, 200)).speculate
    with pytest.raises(ValueError, match="max_active"):
        ThresholdToggle(0)
    with pytest.raises(ValueError, match="num_draft"):
        AlwaysOn(0)


def test_adaptive_draft_length_follows_acceptance():
    costs = synthetic_costs()
    st = StepStats(4, 100.0, 100, bucket=4)
    a = AdaptiveDraft(lengths=(1, 2, 4, 8), prior=0.5)
    k_low, _ = a.best(costs, st)
    for _ in range(40):
        a.observe(proposed=400, accepted=380)
    assert a.alpha == pytest.approx(0.95, abs=0.01)
    k_high, s_high = a.best(costs, st)
    assert k_high > k_low
    # the choice maximises predicted speedup among the candidates
    assert s_high == pytest.approx(max(costs.speedup(4, 100.0, k, a.alpha) for k in (1, 2, 4, 8)))
    for _ in range(40):
        a.observe(proposed=400, accepted=40)
    assert a.best(costs, st)[0] == 1
    a.reset()
    assert a.alpha == 0.5 and a.observed_tokens == 0
    with pytest.raises(ValueError, match="lengths"):
        AdaptiveDraft(lengths=(0, 2))
    with pytest.raises(ValueError, match="ema"):
        AdaptiveDraft(ema=0.0)


def test_cost_model_toggle_speculates_only_where_it_pays_with_hysteresis():
    # draft cheap at small batch, as costly as the target at large batch
    buckets = (1, 2, 4, 8, 16, 32, 64)
    target = {b: (1.0, 0.0) for b in buckets}
    draft = {b: (0.1 + 0.9 * min(1.0, b / 32), 0.0) for b in buckets}
    verify = {b: {1: (1.0, 0.0), 8: (1.0 + 0.002 * b * 8, 0.0)} for b in buckets}
    costs = CostModel(key="x", target=target, draft=draft, verify=verify)
    t = CostModelToggle(costs, margin=0.05, hysteresis=0.03, adaptive=AdaptiveDraft(lengths=(2, 4), prior=0.8))
    assert t.decide(StepStats(1, 10.0, 10, bucket=1)).speculate
    assert not t.decide(StepStats(64, 10.0, 10, bucket=64)).speculate
    # find a bucket whose prediction sits in the hysteresis band: it keeps the previous state
    for b in range(1, 65):
        s = t.predict(StepStats(b, 10.0, 10, bucket=b))[1]
        if 1.02 <= s < 1.05:
            t.on = True
            assert t.decide(StepStats(b, 10.0, 10, bucket=b)).speculate
            t.on = False
            assert not t.decide(StepStats(b, 10.0, 10, bucket=b)).speculate
            break
    else:  # pragma: no cover - the synthetic costs are built to cross the band
        raise AssertionError("no bucket in the hysteresis band")
    # measured acceptance turns speculation off where the prior had it on
    for _ in range(50):
        t.observe(proposed=100, accepted=5, rows=25)
    assert not t.decide(StepStats(1, 10.0, 10, bucket=1)).speculate
    with pytest.raises(ValueError, match="margin"):
        CostModelToggle(costs, margin=-1)


def _small_batch_pays() -> CostModel:
    """SD pays at bucket 1 when acceptance is high (draft a tenth of a target step), never at bucket 64."""
    buckets = (1, 64)
    return CostModel(key="x", target={b: (1.0, 0.0) for b in buckets},
                     draft={1: (0.1, 0.0), 64: (1.0, 0.0)},
                     verify={b: {2: (1.0, 0.0), 4: (1.0, 0.0)} for b in buckets})


@pytest.mark.parametrize("probe_every", [0, 4])
def test_cost_model_toggle_probes_to_remeasure_acceptance(probe_every):
    t = CostModelToggle(_small_batch_pays(), adaptive=AdaptiveDraft(lengths=(2, 4), prior=0.8),
                        probe_every=probe_every, probe_max=16)
    small = StepStats(1, 10.0, 10, bucket=1)
    assert t.decide(small).speculate
    t.observe(proposed=4096, accepted=0, rows=1)  # the first tokens of every response: nothing accepted
    decisions = [t.decide(small).speculate for _ in range(12)]
    if probe_every == 0:  # negative control: acceptance is never measured again, SD stays off for good
        assert decisions == [False] * 12
        return
    # off, except the probe_every-th block, which speculates to measure acceptance; a probe that leaves SD off
    # doubles the interval (4, then 8 blocks)
    assert decisions == [i + 1 in (4, 12) for i in range(12)] and t.probes == 2
    t.observe(proposed=4096, accepted=0, rows=1)
    later = [t.decide(small).speculate for _ in range(200)]
    assert sum(later) <= 200 // 16 + 1  # in the long run one block in probe_max (16 here)
    t.observe(proposed=4096, accepted=4000, rows=1)  # the probe saw high acceptance: SD is back on
    assert t.decide(small).speculate and t.on
    # where even perfect acceptance would not pay, probing would only cost time: never
    t.reset()
    big = StepStats(64, 10.0, 10, bucket=64)
    assert not any(t.decide(big).speculate for _ in range(3 * probe_every)) and t.probes == 0


@pytest.mark.parametrize("correct", [True, False])
def test_cost_model_toggle_corrects_the_calibration_with_measured_block_times(correct):
    # calibrated: SD pays at bucket 1 (predicted ~2.3x at alpha 0.8); in the rollout a cycle takes 4x its
    # calibrated time (host syncs, bookkeeping) while plain steps take what was calibrated
    costs = _small_batch_pays()
    t = CostModelToggle(costs, adaptive=AdaptiveDraft(lengths=(2, 4), prior=0.8), probe_every=0,
                        correct_costs=correct, ema_blocks=2)
    small = StepStats(1, 10.0, 10, bucket=1)
    k, first = t.predict(small)
    assert first > 1.5 and t.decide(small).speculate
    for _ in range(6):
        t.observe_block(small, num_draft=k, steps=4, seconds=4 * 4.0 * costs.cycle(1, 10.0, k))
        t.observe_block(small, num_draft=0, steps=16, seconds=16 * costs.target_step(1, 10.0))
    if not correct:  # negative control: the calibration alone keeps speculating where it does not pay
        assert t.predict(small)[1] == pytest.approx(first) and t.decide(small).speculate
        return
    assert t.time_ratio[(1, True)] == pytest.approx(4.0) and t.time_ratio[(1, False)] == pytest.approx(1.0)
    assert t.predict(small)[1] == pytest.approx(first / 4) and not t.decide(small).speculate
    # an outlier block (a graph captured inside it) moves the average by at most the clamp
    t.observe_block(small, num_draft=0, steps=1, seconds=1e3)
    assert t.time_ratio[(1, False)] <= 0.5 * 1.0 + 0.5 * 4.0 + 1e-9


def test_engine_reports_every_block_to_the_toggle():
    from sparrow.speculative import SpecDecision, ToggleController

    class Alternate(ToggleController):  # speculate every other block; record the block reports
        def __init__(self):
            self.n, self.blocks = 0, []

        def decide(self, stats):
            self.n += 1
            return SpecDecision(True, 2) if self.n % 2 else SpecDecision(False, 0)

        def observe_block(self, stats, *, num_draft, steps, seconds):
            self.blocks.append((stats.bucket, num_draft, steps, seconds))

    model = random_tiny("qwen2")
    toggle = Alternate()
    eng = RolloutEngine(model, EngineConfig(max_rows=4, max_prompt_len=32, max_new_tokens=12, compile=False,
                                            block_steps=3, max_draft=2), drafter=QuantizedSelfDrafter(model))
    eng.toggle = toggle
    g = eng.generate([[1, 2, 3], [4, 5]], 2, SamplingParams(temperature=1.0, max_new_tokens=12, seed=0))
    assert len(toggle.blocks) == toggle.n > 1 and all(sec > 0 for *_, sec in toggle.blocks)
    assert sum(st for _, k, st, _ in toggle.blocks if k) == g.stats.spec_cycles > 0
    assert sum(st for _, k, st, _ in toggle.blocks) == g.stats.decode_steps
    assert {k for _, k, _, _ in toggle.blocks} == {0, 2}


def test_cost_model_toggle_rejects_negative_probe_interval():
    with pytest.raises(ValueError, match="probe_every"):
        CostModelToggle(_small_batch_pays(), probe_every=-1)


def test_calibrate_on_the_engine_and_cache(tmp_path):
    model = random_tiny("qwen2")
    cfg = EngineConfig(max_rows=4, max_prompt_len=32, max_new_tokens=16, compile=False, block_steps=2, max_draft=3)
    eng = RolloutEngine(model, cfg, drafter=QuantizedSelfDrafter(model))
    params = SamplingParams(temperature=1.0, max_new_tokens=16)
    m = CostModel.calibrate(eng, params, steps=2, cache_dir=tmp_path)
    assert m.buckets == [1, 2, 4] and sorted(m.verify[4]) == [2, 3]
    assert all(m.target_step(b, 20) > 0 and m.draft_step(b, 20) > 0 and m.cycle(b, 20, 3) > 0 for b in m.buckets)
    assert m.meta["seconds"] > 0 and len(list(tmp_path.glob("*.json"))) == 1
    again = CostModel.calibrate(eng, params, steps=2, cache_dir=tmp_path)  # loaded, not re-measured
    assert again.meta == m.meta
    with pytest.raises(ValueError, match="contexts"):
        CostModel.calibrate(eng, params, contexts=(10, 5), cache_dir=None)
    # the engine still generates exactly after calibration used its rows as scratch
    p = SamplingParams(temperature=0.0, max_new_tokens=10)
    got = eng.generate(prompts(), 1, p)
    ref = RolloutEngine(model, EngineConfig(max_rows=4, max_prompt_len=32, max_new_tokens=16, compile=False)).generate(
        prompts(), 1, p)
    assert [s.tokens.tolist() for s in got] == [s.tokens.tolist() for s in ref]


def test_engine_reports_toggle_feedback():
    model = random_tiny("qwen2")
    adaptive = AdaptiveDraft(lengths=(1, 2, 3), prior=0.9)
    toggle = ThresholdToggle(max_active=64, adaptive=adaptive, costs=synthetic_costs(buckets=(1, 2, 4, 8)))
    cfg = EngineConfig(max_rows=8, max_prompt_len=64, max_new_tokens=16, compile=False, block_steps=2, max_draft=3)
    eng = RolloutEngine(model, cfg, drafter=CopyDrafter(perturbed_copy(model, 0.3)), toggle=toggle)
    g = eng.generate(prompts(), 2, SamplingParams(temperature=1.0, max_new_tokens=16, seed=1))
    assert adaptive.observed_tokens == g.stats.draft_proposed > 0
    assert adaptive.alpha < 0.9  # the poor drafter's acceptance pulled the estimate down
    assert sum(g.stats.block_tokens.values()) == g.stats.generated_tokens - len(g)  # first tokens come from prefill
    assert set(g.stats.draft_len_hist) <= {1, 2, 3}
    torch.testing.assert_close(torch.tensor(g.stats.tokens_per_cycle), torch.tensor(
        1 + g.stats.draft_accepted / g.stats.spec_row_cycles))


def test_calibration_at_the_longest_draft_length():
    """Calibration times draft steps alone, then cycles: a cycle must start its drafts at index 0 whatever a
    draft-only step left behind (it started at 1, and a cycle of max_draft drafts indexed past the buffers)."""
    model = random_tiny("qwen2")
    eng = RolloutEngine(model, EngineConfig(max_rows=2, max_prompt_len=16, max_new_tokens=8, compile=False,
                                            block_steps=2, max_draft=2), drafter=QuantizedSelfDrafter(model))
    m = CostModel.calibrate(eng, SamplingParams(temperature=1.0, max_new_tokens=8), steps=1, cache_dir=None)
    assert sorted(m.verify[2]) == [2, 3]  # one draft length (2 = max_draft), its verify cost reused for 3


def test_toggles_name_the_draft_lengths_they_can_ask_for():
    from sparrow.speculative.base import AlwaysOff

    # what RolloutEngine.prepare compiles ahead: every length decide() may return, and nothing else
    assert AlwaysOff().draft_lengths() == ()
    assert AlwaysOn(3).draft_lengths() == (3,)
    assert ThresholdToggle(8, num_draft=2).draft_lengths() == (2,)
    assert ThresholdToggle(8, adaptive=AdaptiveDraft(lengths=(4, 2, 4))).draft_lengths() == (2, 4)
    t = CostModelToggle(_small_batch_pays(), adaptive=AdaptiveDraft(lengths=(2, 4), prior=0.8))
    assert t.draft_lengths() == (2, 4)
    seen = {t.decide(StepStats(a, 100.0, 100, 1 if a == 1 else 64)).num_draft for a in (1, 1, 64)}
    assert seen - {0} and seen - {0} <= set(t.draft_lengths())  # it speculates at one row, within the set


def test_cost_key_names_everything_the_costs_depend_on(monkeypatch):
    """A cached calibration is reused only for the same library, attention configuration and processing."""
    import copy

    import sparrow
    from sparrow.attention.rtpurbo import RTPurboConfig, rtpurbo_attention
    from sparrow.models import use_attention
    from sparrow.speculative.costs import cost_key

    model = random_tiny("qwen2")
    cfg = EngineConfig(max_rows=4, max_prompt_len=32, max_new_tokens=16, compile=False, max_draft=2)
    params = SamplingParams(temperature=1.0, max_new_tokens=16)

    def key(m, p=params):
        return cost_key(RolloutEngine(m, cfg, drafter=QuantizedSelfDrafter(m)), p)

    base = key(model)
    assert f"sparrow={sparrow.__version__}" in base and "torch=" in base
    small = dict(decode_block=16, prefill_block=16, ret_window=16, ring_slack=4)
    sparse = [use_attention(copy.deepcopy(model), rtpurbo_attention(None, None, RTPurboConfig(**small, window=w)))
              for w in (8, 16)]
    keys = {base, key(sparse[0]), key(sparse[1]), key(model, SamplingParams(temperature=1.0, vocab_limit=60)),
            key(model, SamplingParams(temperature=1.0, top_p=0.9))}
    assert len(keys) == 5  # dense vs RTPurbo, two windows, the vocabulary limit, top-p: all distinct
    assert key(model) == base  # and stable
    monkeypatch.setattr(sparrow, "__version__", "9.9.9")
    assert key(model) != base


def test_cost_model_table_at_one_context():
    m = synthetic_costs()
    rows = m.table(0, [4, 2, 4], alphas=(0.9,))
    assert [r["bucket"] for r in rows] == m.buckets
    r = rows[2]  # bucket 4
    assert list(r) == ["bucket", "ctx", "target_ms", "draft_ms", "verify2_ms", "verify4_ms", "best_speedup@a=0.9"]
    assert r["target_ms"] == pytest.approx(1e3 * m.target_step(4, 0))
    assert r["verify2_ms"] == pytest.approx(1e3 * m.verify_step(4, 0, 2))
    assert r["best_speedup@a=0.9"] == pytest.approx(max(m.speedup(4, 0, k, 0.9) for k in (2, 4)))
    with pytest.raises(ValueError):
        m.table(0, [])

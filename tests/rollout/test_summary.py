"""sparrow.rollout.summary: one generate call as a record, several side by side per bucket."""

from __future__ import annotations

import pytest
import torch

from sparrow.models.attention import attention_modules
from sparrow.rollout import EngineConfig, Generation, GenerationStats, RolloutEngine, Sample, SamplingParams
from sparrow.rollout.summary import bucket_comparison, engine_before, engine_speedups, generation_summary
from sparrow.speculative import AlwaysOff, AlwaysOn
from tests.helpers import random_tiny


def _gen(lengths, stops, **stats) -> Generation:
    samples = [Sample(0, i, torch.zeros(n, dtype=torch.int64), torch.zeros(n), "stop" if s else "length")
               for i, (n, s) in enumerate(zip(lengths, stops))]
    return Generation(samples, GenerationStats(**stats))


def test_generation_summary_of_a_speculative_and_a_plain_call():
    spec = _gen([3, 10, 5, 7], [True, False, True, True], prefill_s=0.5, generated_tokens=25, decode_steps=6,
                spec_cycles=4, spec_row_cycles=10, draft_proposed=20, draft_accepted=15, draft_len_hist={4: 2, 2: 2},
                block_tokens={4: 20, 2: 5, 1: 0}, block_time_s={4: 0.5, 2: 0.25, 1: 0.0}, active_hist={4: 3, 2: 3},
                spec_hist={4: 2, 2: 2}, apart_steps=2)
    r = generation_summary("SD", spec, 1.5)
    assert (r["steps"], r["steps_apart"]) == (6, 2)
    assert (r["run"], r["latency_s"], r["decode_s"], r["tokens"]) == ("SD", 1.5, 1.0, 25)
    assert r["decode_tok_s"] == pytest.approx(25.0)
    assert r["acceptance"] == pytest.approx(0.75) and r["tokens_per_cycle"] == pytest.approx(2.5)
    assert (r["len_p50"], r["len_p90"], r["len_max"], r["stop_frac"]) == (7, 7, 10, 0.75)
    assert r["bucket_tok_s"] == {2: 20.0, 4: 40.0}  # bucket 1 ran no block time: left out
    assert list(r["draft_len_hist"]) == [2, 4] and r["bucket_spec_steps"] == {2: 2, 4: 2}
    plain = generation_summary("AR", _gen([4], [False], prefill_s=1.0, generated_tokens=4), 1.0)
    assert plain["acceptance"] is None and plain["tokens_per_cycle"] is None and plain["decode_tok_s"] == 0.0
    with pytest.raises(ValueError):
        generation_summary("none", _gen([], []), 1.0)


def test_bucket_comparison_against_the_first_run():
    rows = [{"run": "AR", "bucket_tok_s": {1: 10.0, 8: 40.0}, "bucket_steps": {}, "bucket_spec_steps": {}},
            {"run": "SD toggle+adaptive", "bucket_tok_s": {1: 20.0}, "bucket_steps": {1: 4, 8: 2},
             "bucket_spec_steps": {1: 3}},
            {"run": "SD always k=4", "bucket_tok_s": {1: 5.0, 8: 80.0}, "bucket_steps": {}, "bucket_spec_steps": {}}]
    t = bucket_comparison(rows)
    assert [r["bucket"] for r in t] == [1, 8]
    assert t[0]["SD toggle+adaptive /AR"] == 2.0 and t[0]["SD always k=4 /AR"] == 0.5 and t[0]["toggle SD frac"] == 0.75
    assert t[1]["SD toggle+adaptive"] is None and t[1]["SD toggle+adaptive /AR"] is None
    assert t[1]["SD always k=4 /AR"] == 2.0 and t[1]["toggle SD frac"] == 0.0
    assert "AR /AR" not in t[0]


class _Engine:
    """generate() returns a fixed generation per toggle; the counters grow when a toggle is named "new"."""

    def __init__(self):
        self.toggle, self.calls, self.sampling_modes, self.captured_graphs = None, [], 1, 2

    def generate(self, prompts, samples, params):
        self.calls.append((type(self.toggle).__name__, len(prompts), samples, params.max_new_tokens))
        if isinstance(self.toggle, AlwaysOn):
            self.captured_graphs += 1  # a graph captured inside the clock
        n = len(prompts) * samples
        spec = not isinstance(self.toggle, AlwaysOff)
        return _gen([4] * n, [True] * n, prefill_s=0.5, generated_tokens=4 * n, draft_proposed=8 * spec,
                    draft_accepted=6 * spec, spec_row_cycles=4 * spec, block_tokens={n: 4 * n}, block_time_s={n: 1.0})


def _costs():
    from sparrow.speculative import CostModel

    buckets = (1, 2, 4, 8)
    return CostModel(key="t", target={b: (1.0, 0.0) for b in buckets}, draft={b: (0.3, 0.0) for b in buckets},
                     verify={b: {k: (1.2, 0.0) for k in (1, 8)} for b in buckets})


def _policies():
    from sparrow.speculative import CostModelToggle

    return [("AR", AlwaysOff()), ("SD toggle", CostModelToggle(_costs())), ("SD always", AlwaysOn(2))]


def test_timed_generate_times_the_call():
    from sparrow.rollout.summary import timed_generate
    from sparrow.sampling import SamplingParams

    eng = _Engine()
    eng.toggle = AlwaysOff()
    gen, seconds = timed_generate(eng, [[1], [2]], 3, SamplingParams(max_new_tokens=4))
    assert len(gen) == 6 and seconds >= 0 and eng.calls == [("AlwaysOff", 2, 3, 4)]


def test_policy_runs_against_the_first(monkeypatch):
    from sparrow.rollout import summary
    from sparrow.sampling import SamplingParams

    latency = {"AlwaysOff": 4.0, "CostModelToggle": 2.0, "AlwaysOn": 5.0}
    real = summary.timed_generate
    monkeypatch.setattr(summary, "timed_generate",
                        lambda e, *a: (real(e, *a)[0], latency[type(e.toggle).__name__]))
    saved, logged = [], []
    rows = summary.policy_runs("trained", _Engine(), [[1], [2]], 2, SamplingParams(max_new_tokens=4), _policies(),
                               save=lambda rs: saved.append([r["run"] for r in rs]), log=logged.append)
    assert [r["run"] for r in rows] == ["AR", "SD toggle", "SD always"] and {r["phase"] for r in rows} == {"trained"}
    assert [r["speedup_vs_ar"] for r in rows] == [1.0, 2.0, 0.8]
    assert [r["latency_reduction"] for r in rows] == [0.0, 0.5, pytest.approx(-0.25)]
    assert "final_alpha_estimate" in rows[1] and "final_alpha_estimate" not in rows[2]
    assert rows[1]["acceptance"] == 0.75 and rows[0]["acceptance"] is None
    assert saved == [["AR"], ["AR", "SD toggle"], ["AR", "SD toggle", "SD always"]] and len(logged) == 3
    import time

    late = summary.policy_runs("x", _Engine(), [[1]], 1, SamplingParams(max_new_tokens=4), _policies(),
                               deadline=time.perf_counter() + 3.0, log=logged.append)
    assert [r["run"] for r in late] == ["AR"] and "skipped (deadline)" in logged[-1]  # the first always runs


def test_fixed_batch_runs_hold_the_batch(monkeypatch):
    import time

    from sparrow.rollout import summary
    from sparrow.sampling import SamplingParams

    latency = {"AlwaysOff": 2.5, "CostModelToggle": 2.5, "AlwaysOn": 1.5}  # decode 2 s, 2 s, 1 s (prefill 0.5)
    real = summary.timed_generate
    monkeypatch.setattr(summary, "timed_generate",
                        lambda e, *a: (real(e, *a)[0], latency[type(e.toggle).__name__]))
    eng = _Engine()
    params = SamplingParams(max_new_tokens=4, stop_token_ids=())
    rows = summary.fixed_batch_runs(eng, [1, 4], [[1], [2], [3], [4]], 2, params, _policies, log=lambda m: None)
    assert [(r["batch"], r["prompts"], r["samples"], r["new_tokens"]) for r in rows] == [(1, 1, 1, 4), (4, 2, 2, 4)]
    assert [c[1:3] for c in eng.calls] == [(1, 1)] * 3 + [(2, 2)] * 3
    r = rows[1]
    assert (r["AR tok/s"], r["SD toggle tok/s"], r["SD always tok/s"]) == (8.0, 8.0, 16.0)  # 16 tokens each
    assert (r["SD toggle /AR"], r["SD always /AR"]) == (1.0, 2.0)
    assert "AR /AR" not in r and "AR acceptance" not in r and r["SD toggle acceptance"] == 0.75
    assert (r["AR compiled"], r["SD always compiled"]) == (0, 1)
    assert summary.fixed_batch_runs(eng, [1], [[1]], 1, params, _policies, deadline=time.perf_counter() - 1,
                                    log=lambda m: None) == []


def test_phase_tables_per_phase():
    from sparrow._report import format_table
    from sparrow.rollout.summary import phase_tables

    rows = [{"run": "AR", "phase": "b", "latency_s": 2.0, "bucket_tok_s": {1: 10.0}, "bucket_steps": {},
             "bucket_spec_steps": {}},
            {"run": "AR", "phase": "a", "latency_s": 1.0, "bucket_tok_s": {}, "bucket_steps": {},
             "bucket_spec_steps": {}}]
    text = phase_tables(rows, ["run", "latency_s"])
    assert text.split("\n")[:2] == ["", "Phase 'a':"] and text.index("Phase 'a'") < text.index("Phase 'b'")
    assert format_table([rows[1]], ["run", "latency_s"]) + "\n" + "bucket" in text  # no bucket times: a header
    assert text.endswith(format_table(bucket_comparison([rows[0]]), ["bucket", "AR", "toggle SD frac"]))
    with pytest.raises(KeyError):
        phase_tables([{"run": "AR"}], ["run"])


def test_engine_speedups_before_over_after_per_token_and_at_fixed_batches():
    """Latency: before over after; per token: after's tokens/s over before's (other lengths allowed, flagged);
    fixed batches matched by size (a size only one side ran is left out). Negative control: swapped sides give the
    inverse ratios."""
    after = {"latency_s": 2.0, "decode_tok_s": 600.0, "tokens": 1000}
    before = {"latency_s": 3.0, "decode_tok_s": 400.0, "tokens": 1010}
    fa = [{"batch": 2, "AR tok/s": 90.0}, {"batch": 8, "AR tok/s": 300.0}, {"batch": 32, "AR tok/s": 800.0}]
    fb = [{"batch": 2, "AR tok/s": 60.0}, {"batch": 8, "AR tok/s": 250.0}]
    out = engine_speedups(after, before, fa, fb)
    assert out["latency_speedup"] == pytest.approx(1.5) and out["decode_tok_s_speedup"] == pytest.approx(1.5)
    assert out["same_token_count"] is False
    assert [(r["batch"], r["speedup"]) for r in out["fixed"]] == [(2, pytest.approx(1.5)), (8, pytest.approx(1.2))]
    swapped = engine_speedups(before, after, fb, fa)
    assert swapped["latency_speedup"] == pytest.approx(1 / 1.5)
    assert [r["speedup"] for r in swapped["fixed"]] == [pytest.approx(1 / 1.5), pytest.approx(1 / 1.2)]
    assert engine_speedups(after, after)["same_token_count"] is True and engine_speedups(after, after)["fixed"] == []


def test_engine_before_is_the_unfused_per_row_engine_on_a_copy():
    """The baseline engine: separate projections and every layer's attention reading each row's prompt, on a copy
    (the model handed in keeps its backends and its modules); it samples what the default engine samples (same
    weights, counter-based noise). Negative control: the default engine on the same model is neither."""
    torch.manual_seed(0)
    model = random_tiny()
    kept = [(m, m.backend) for m in attention_modules(model)]
    cfg = EngineConfig(max_rows=4, max_prompt_len=32, max_new_tokens=6, compile=False, block_steps=3)
    old = engine_before(model, cfg)
    assert old.config.fuse_projections is False and old.model is not model
    assert all(m.backend.shared_prefix is False for m in attention_modules(old.model))
    assert [(m, m.backend) for m in attention_modules(model)] == kept
    now = RolloutEngine(model, cfg)
    assert now.config.fuse_projections is True
    assert any(m.backend.shared_prefix is not False for m in attention_modules(now.model))
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7]]
    a, b = now.generate(prompts, 2, params), old.generate(prompts, 2, params)
    assert [s.tokens.tolist() for s in a] == [s.tokens.tolist() for s in b]

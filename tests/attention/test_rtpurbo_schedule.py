import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparrow.attention import CacheSpec, DecodeMeta, PrefillMeta
from sparrow.attention.rtpurbo import RTPurboAttention, RTPurboConfig, rtpurbo_backends
from sparrow.attention.rtpurbo_schedule import SparsitySchedule, SparsityScheduleConfig
from sparrow.rollout.forward import decode_hidden, logits_from_hidden, prefill_hidden
from tests.helpers import random_tiny

CFG = SparsityScheduleConfig(threshold=0.86, margin=0.04, top_p=0.9, lengths=(0, 16, 64))


def check_responds_to_the_tail(schedule: SparsitySchedule, tails: list[float]) -> None:
    """After each update: every tier's top-p rises (or sits at max_top_p) when the tail is below the threshold,
    falls (or sits at min_top_p) when it is at least threshold + margin, holds in between; bounds hold and top-p
    never decreases with length."""
    c = schedule.config
    for tail in tails:
        before = schedule.top_p
        after = schedule.update(tail)
        assert all(c.min_top_p - 1e-12 <= p <= c.max_top_p + 1e-12 for p in after)
        assert all(b >= a - 1e-12 for a, b in zip(after, after[1:])), "top-p decreased with length"
        if tail < c.threshold:
            assert all(a > b or a == pytest.approx(c.max_top_p) for a, b in zip(after, before)), (tail, before, after)
        elif tail >= c.threshold + c.margin:
            assert after[0] < before[0] or after[0] == pytest.approx(c.min_top_p), (tail, before, after)
        else:
            assert after == before


@settings(max_examples=50, deadline=None)
@given(tails=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=30))
def test_the_schedule_tightens_below_the_threshold_and_relaxes_above(tails):
    check_responds_to_the_tail(SparsitySchedule(CFG), tails)


class _IgnoresTheTail(SparsitySchedule):
    def update(self, tail):  # a fixed budget: what a schedule must not be
        return self.top_p


class _AlwaysRelaxes(SparsitySchedule):
    def update(self, tail):
        return super().update(1.0)


@pytest.mark.parametrize("broken", [_IgnoresTheTail, _AlwaysRelaxes])
def test_schedules_that_ignore_the_tail_fail_the_check(broken):
    """Negative control."""
    with pytest.raises(AssertionError):
        check_responds_to_the_tail(broken(CFG), [0.5, 0.7, 0.95, 0.99, 0.3])


def _closed_loop(schedule: SparsitySchedule, steps: int = 40) -> list[float]:
    """A rollout whose tail agreement falls as the kept mass falls: tail = 1 - 2 * (1 - top_p) (top-p 0.93 is
    the threshold 0.86). Returns the tail of every step."""
    out = []
    for _ in range(steps):
        tail = 1.0 - 2.0 * (1.0 - schedule.top_p[0])
        out.append(tail)
        schedule.update(tail)
    return out


@pytest.mark.parametrize("kind", ["schedule", "fixed budget"])
def test_the_schedule_holds_the_tail_near_the_threshold_a_fixed_budget_does_not(kind):
    tails = _closed_loop((SparsitySchedule if kind == "schedule" else _IgnoresTheTail)(CFG))
    settled = tails[10:]
    if kind == "schedule":  # tightens as soon as it dips; relaxes back only while comfortably above
        assert min(settled) >= CFG.threshold - 0.1 and sum(t >= CFG.threshold for t in settled) >= 0.6 * len(settled)
        assert max(settled) < 1.0  # and it does not keep everything
    else:  # top-p 0.9 forever: tail 0.8 < 0.86 at every step
        assert max(settled) < CFG.threshold


def test_per_tier_tails_move_their_tiers_and_keep_later_tiers_at_least_as_lenient():
    s = SparsitySchedule(CFG)
    p0 = s.top_p
    assert p0 == pytest.approx([0.9, 0.95, 0.975])  # dropped mass halves per tier
    s.update({2: 0.5})  # only the longest tier is below the threshold
    assert s.top_p[:2] == pytest.approx(p0[:2]) and s.top_p[2] > p0[2]
    s.update({0: 0.99, 1: float("nan")})  # tier 0 relaxes; a tier without tokens holds
    assert s.top_p[0] < p0[0] and s.top_p[1] == pytest.approx(p0[1])
    s.update({0: 0.1, 1: 0.99, 2: 0.99})
    assert s.top_p[1] >= s.top_p[0]  # tier 1 relaxed, but never below tier 0
    tiers = s.tier_of(torch.tensor([0, 15, 16, 63, 64, 1000]))
    assert tiers.tolist() == [0, 0, 1, 1, 2, 2]
    with pytest.raises(ValueError, match="tier 3"):
        s.update({3: 0.5})
    state = s.state_dict()
    s2 = SparsitySchedule(CFG)
    s2.load_state_dict(state)
    assert s2.top_p == s.top_p
    with pytest.raises(ValueError, match="does not fit"):
        SparsitySchedule(SparsityScheduleConfig()).load_state_dict(state)


@pytest.mark.parametrize("kw,match", [
    (dict(threshold=1.5), "threshold"), (dict(top_p=0.4, min_top_p=0.5), "min_top_p"), (dict(tighten=1.2), "tighten"),
    (dict(relax=0.9), "relax"), (dict(lengths=(5,)), "lengths"), (dict(lengths=(0, 10, 10)), "lengths"),
    (dict(lengths=tuple(range(0, 90, 10))), "lengths"), (dict(length_factor=0.0), "length_factor"),
    (dict(version=2), "version"), (dict(margin=1.0), "margin"),
], ids=lambda x: str(x) if isinstance(x, str) else None)
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        SparsityScheduleConfig(**kw)


def _sparse_model():
    cfg = RTPurboConfig(decode_block=8, prefill_block=8, ret_window=8, ring_slack=4, window=8, top_p=0.3,
                        impl="reference", prefill_impl="reference")
    return random_tiny("qwen2", attention=lambda s: RTPurboAttention(s, cfg, [1]))


def test_set_selection_is_in_place_per_row_and_survives_a_bf16_cast():
    model = _sparse_model()
    b = rtpurbo_backends(model)[0]
    ptr = b.top_p_values.data_ptr()
    b.set_selection([0.5, 0.8, 0.95], [0, 4, 10])
    values, lengths = b.selection()
    assert b.top_p_values.data_ptr() == ptr and values == pytest.approx([0.5, 0.8, 0.95]) and lengths == [0, 4, 10]
    assert b.row_top_p(torch.tensor([0, 3, 4, 9, 10, 500])).tolist() == pytest.approx([0.5, 0.5, 0.8, 0.8, 0.95, 0.95])
    model.to(torch.bfloat16)  # the rollout copy's cast must not round the selection's masses
    assert b.top_p_values.dtype == torch.float32 and b.row_top_p(torch.tensor([5])).item() == pytest.approx(0.8)
    assert b.score_scale.dtype == torch.float32 and b.indexer_q.dtype == torch.bfloat16
    for bad, lengths in (([0.5, 0.8], [0]), ([0.5], [3]), ([0.5, 0.6], [0, 0]), ([1.5], [0]), ([0.9] * 9, range(9))):
        with pytest.raises(ValueError):
            b.set_selection(bad, lengths)


def test_an_in_place_schedule_update_reaches_a_compiled_decode_step_without_recompiling():
    """The decode step compiled once (fullgraph); the schedule moves top-p between calls: the compiled step's
    output follows (equal to eager at the new top-p, different from the old one) and nothing recompiles."""
    from torch._dynamo.testing import CompileCounter

    model = _sparse_model()
    spec = CacheSpec(num_prefixes=1, max_prefix_len=48, num_rows=2, max_gen_len=8)
    caches = [b.init_cache(spec, dtype=torch.float32, device=torch.device("cpu")) for b in rtpurbo_backends(model)]
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 64, (1, 48), generator=g)
    with torch.no_grad():
        prefill_hidden(model, prompt, caches, PrefillMeta(torch.tensor([0]), torch.tensor([48])))
    tok = torch.randint(0, 64, (2, 1), generator=g)
    meta = DecodeMeta(torch.tensor([0, 1]), torch.tensor([0, 0]), torch.tensor([48, 48]), torch.tensor([0, 0]))

    def step(tok, meta):  # rewrites the same cache position each call: idempotent
        return logits_from_hidden(model, decode_hidden(model, tok, caches, meta))

    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    schedule = SparsitySchedule(SparsityScheduleConfig(top_p=0.3, min_top_p=0.1, lengths=(0,)))
    outs, refs = [], []
    with torch.no_grad():
        for tail in (None, 0.5, 0.5, 0.99):  # start, tighten twice, relax
            if tail is not None:
                schedule.step(tail, model)
            outs.append(compiled(tok, meta))
            refs.append(step(tok, meta))
    assert counter.frame_count == 1, "an in-place update recompiled the step"
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert rtpurbo_backends(model)[0].selection()[0] == pytest.approx([schedule.top_p[0]])
    assert not torch.allclose(outs[0], outs[2])  # top-p 0.3 -> 0.825 changed the selection
    assert math.isclose(schedule.top_p[0], 1 - 0.7 * 0.25 * 1.25)

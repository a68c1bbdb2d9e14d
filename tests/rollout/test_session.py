"""RolloutSession: generation that stops when enough groups finish and resumes, across weight changes."""

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparrow.rollout import EngineConfig, RolloutEngine, SamplingParams
from tests.helpers import bits_equal, random_tiny
from tests.rollout.stale_reference import stale_reference

PARAMS = SamplingParams(temperature=1.0, max_new_tokens=16, stop_token_ids=(3, 7), seed=5)


def _prompts(n=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 20, (n,), generator=g).tolist()
    return [torch.randint(0, 64, (k,), generator=g).tolist() for k in lens]


def _engine(model, drafter=None, **kw):
    cfg = dict(max_rows=6, max_prompt_len=32, max_new_tokens=16, compile=False, block_steps=2)
    cfg.update(kw)
    return RolloutEngine(model, EngineConfig(**cfg, max_draft=2 if drafter is not None else 0), drafter=drafter)


_MODEL = random_tiny("qwen2", std=0.15)  # flat enough that stop tokens end rows at varied lengths
_ENGINE = _engine(_MODEL)
_FULL = _ENGINE.generate(_prompts(), 2, PARAMS)


def _same_tokens(got, ref, bitwise: bool) -> None:
    assert [(s.prompt_index, s.sample_index) for s in got] == [(s.prompt_index, s.sample_index) for s in ref]
    for a, b in zip(got, ref):
        assert torch.equal(a.tokens, b.tokens) and a.finish_reason == b.finish_reason
        assert bits_equal(a.logprobs, b.logprobs) if bitwise else torch.allclose(a.logprobs, b.logprobs, atol=1e-5)


@settings(max_examples=8, deadline=None)
@given(plan=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 2)), min_size=1, max_size=6),
       upfront=st.booleans())
def test_a_session_run_in_pieces_draws_what_one_generate_draws(plan, upfront):
    """Prompts added at any time, runs cut anywhere (``run(min_groups=k)``): every group draws exactly the tokens
    of one generate() of all prompts (its noise stream is its id), and when every prompt is there from the start
    the schedule is generate's own, so the log-probs are bit-identical too."""
    prompts = _prompts()
    session = _ENGINE.start(2, PARAMS)
    got, added = [], 0
    if upfront:
        session.add(prompts)
        added = len(prompts)
    for n_add, n_run in plan:
        if n_add and added < len(prompts):
            ids = session.add(prompts[added: added + n_add])
            assert ids == list(range(added, added + len(ids)))
            added += len(ids)
        k = min(n_run, len(session.open_groups))
        out = session.run(k)
        assert len(out) >= 2 * k and len(out) % 2 == 0  # whole groups, at least k of them
        got += out.samples
    if added < len(prompts):
        session.add(prompts[added:])
    got += session.run().samples
    assert session.open_groups == []
    session.close()
    got.sort(key=lambda s: (s.prompt_index, s.sample_index))
    _same_tokens(got, _FULL.samples, bitwise=upfront)
    assert all(torch.equal(s.versions, torch.zeros_like(s.versions)) for s in got)
    assert _ENGINE.slots.free_rows == list(range(6)) and len(_ENGINE.slots.free_prefixes) == 6  # every slot given back


def test_negative_control_groups_renumbered_per_call_draw_other_tokens():
    """The property above fails when a group's noise stream is not its session-wide id: a session that numbers
    the groups of every add() from 0 draws other tokens for the later ones."""
    session = _ENGINE.start(2, PARAMS)
    got = []
    for p in _prompts():
        session._next = 0  # the broken numbering
        session.add([p])
        got += session.run().samples
    session.close()
    assert [s.tokens.tolist() for s in got] != [s.tokens.tolist() for s in _FULL.samples]


def test_run_stops_when_enough_groups_have_finished_and_keeps_the_rest():
    prompts = _prompts()
    session = _ENGINE.start(2, PARAMS)
    session.add(prompts)
    first = session.run(min_groups=1)
    groups = sorted({s.prompt_index for s in first})
    assert len(groups) >= 1 and len(first) == 2 * len(groups)
    left = session.open_groups
    assert sorted(groups + left) == list(range(6))
    prog = {p.group: p for p in session.progress()}
    running = [g for g in left if prog[g].admitted_version is not None]
    waiting = [g for g in left if prog[g].admitted_version is None]
    assert running and all(prog[g].lengths == (0, 0) for g in waiting)
    # finish= waits for a named group; admit=False decodes only the running rows
    target = running[-1]
    out = session.run(0, finish=[target], admit=False)
    assert target in {s.prompt_index for s in out} and target not in session.open_groups
    assert {p.group for p in session.progress() if p.admitted_version is None} == set(waiting) - {
        s.prompt_index for s in out}
    # dropping frees the slots at once; the remaining groups still draw generate()'s tokens
    drop = session.open_groups[0]
    session.drop([drop])
    rest = session.run()
    session.close()
    got = sorted(first.samples + out.samples + rest.samples, key=lambda s: (s.prompt_index, s.sample_index))
    _same_tokens(got, [s for s in _FULL.samples if s.prompt_index != drop], bitwise=False)
    assert _ENGINE.slots.free_rows == list(range(6))


def test_sessions_share_the_engines_slots_and_check_their_arguments():
    session = _ENGINE.start(2, PARAMS)
    session.add(_prompts())
    assert session.run(0).samples == [] and len(_ENGINE.slots.free_rows) == 6  # nothing to finish: nothing admitted
    first = session.run(1)  # three groups admitted (all six slots); returns once one has finished
    assert len(first) == 2 and len(_ENGINE.slots.free_rows) == 2
    with pytest.raises(RuntimeError, match="other open rollout sessions hold the rest"):
        _ENGINE.generate(_prompts()[:1], 3, PARAMS)
    beside = _ENGINE.generate(_prompts()[:3], 2, PARAMS)  # in the two free slots, beside the session's rows
    _same_tokens(beside.samples, _FULL.samples[:6], bitwise=False)
    with pytest.raises(ValueError, match="min_groups"):
        session.run(6)
    with pytest.raises(ValueError, match="not open"):
        session.run(finish=[99])
    with pytest.raises(ValueError, match="not open"):
        session.drop([99])
    waiting = [p.group for p in session.progress() if p.admitted_version is None]
    with pytest.raises(ValueError, match="waiting"):
        session.run(0, finish=waiting[:1], admit=False)
    rest = session.run()  # the generation beside it did not disturb the session's rows
    _same_tokens(sorted(first.samples + rest.samples, key=lambda s: (s.prompt_index, s.sample_index)),
                 _FULL.samples, bitwise=False)
    session.close()
    with pytest.raises(RuntimeError, match="closed"):
        session.run()
    with pytest.raises(ValueError, match="policy version"):
        _ENGINE.set_policy_version(-1)
    with pytest.raises(ValueError, match="n_samples"):
        _ENGINE.start(7, PARAMS)


# ------------------------------------------------------------------------ weights changing mid-generation
def _rtpurbo(model):
    from sparrow.attention.rtpurbo import HeadProfile, RTPurboConfig, rtpurbo_attention
    from sparrow.models import use_attention

    prof = HeadProfile.from_scores(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), 0.5)
    cfg = RTPurboConfig(decode_block=16, prefill_block=16, ret_window=16, ring_slack=4, prefill_impl="reference",
                        top_p=0.8, impl="reference", window=8)  # rings of 8 + 4: they wrap within 16 tokens
    return use_attention(model, rtpurbo_attention(prof, None, cfg))


def _mismatches(samples, switch, models, prompts, n, params, forced: bool):
    """Per sample, what differs from the stale-KV reference (tokens ``< switch`` by version 0, the rest by version
    1): tokens, behaviour log-probs, version stamps."""
    bad = []
    for s in samples:
        k = switch[(s.prompt_index, s.sample_index)]
        versions = [0 if i < k else 1 for i in range(params.max_new_tokens)]
        toks, lps = stale_reference(dict(enumerate(models)), prompts[s.prompt_index], versions, params,
                                    sid=s.prompt_index * n + s.sample_index,
                                    forced=s.tokens.tolist() if forced else None)
        if s.tokens.tolist() != toks:
            bad.append((s.prompt_index, s.sample_index, "tokens"))
        elif not torch.allclose(s.logprobs, torch.tensor(lps), atol=1e-5, rtol=0):
            bad.append((s.prompt_index, s.sample_index, "logprobs"))
        elif s.versions.tolist() != versions[: s.length]:
            bad.append((s.prompt_index, s.sample_index, "versions"))
    return bad


@pytest.mark.parametrize("attention,drafter", [
    pytest.param("dense", False, id="dense"),
    pytest.param("rtpurbo", False, id="rtpurbo"),
    pytest.param("dense", True, id="dense-int8-drafter"),
])
def test_rows_continue_over_their_cached_kv_across_a_weight_change(attention, drafter, monkeypatch):
    """A session runs until one group finishes; the weights then change in place (what a sync does), the drafter
    re-quantizes, the version becomes 1, and the session runs to the end. Every sample equals a one-row
    reference that keeps the KV each token's step wrote (prompt and early tokens from the old weights) and samples
    token i with the weights of its version: tokens, behaviour log-probs, version stamps (with the drafter, whose
    exact rejection sampling draws other tokens of the same distribution, the reference is teacher-forced on the
    session's tokens). RTPurbo's rings wrap across the change. Negative control: an engine that stamps every token
    with the newest version fails."""
    from sparrow.speculative import DrafterConfig, QuantizedSelfDrafter

    torch.manual_seed(3)
    old = random_tiny("qwen2", std=0.15)
    if attention == "rtpurbo":
        old = _rtpurbo(old)
    new = copy.deepcopy(old)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    prompts, n = _prompts(5, seed=2), 2

    def run(broken: bool):
        model = copy.deepcopy(old)
        d = QuantizedSelfDrafter(model, DrafterConfig(weight="int8")) if drafter else None
        eng = _engine(model, d, max_rows=4)
        if broken:  # stamps retroactively: every token the newest version
            real = eng.set_policy_version
            monkeypatch.setattr(eng, "set_policy_version", lambda v: (real(v), eng.rows.versions.fill_(v)))
        session = eng.start(n, PARAMS)
        session.add(prompts)
        before = session.run(min_groups=1)
        switch = {(s.prompt_index, s.sample_index): 99 for s in before}
        for p in session.progress():
            for j, length in enumerate(p.lengths):
                switch[(p.group, j)] = length  # tokens sampled by the old weights (0: admitted after)
        assert any(0 < length < 16 for p in session.progress() for length in p.lengths)  # rows span the change
        with torch.no_grad():
            for dst, src in zip(model.parameters(), new.parameters()):
                dst.copy_(src)  # in place, as SyncReceiver applies a sync
        if d is not None:
            d.refresh()
        eng.set_policy_version(1)
        after = session.run()
        session.close()
        if d is not None:  # the cycles ran on both sides of the change
            assert before.stats.spec_cycles > 0 and after.stats.spec_cycles > 0
        return before.samples + after.samples, switch

    samples, switch = run(broken=False)
    assert {tuple(s.versions.unique().tolist()) for s in samples} >= {(0,), (0, 1)}
    assert _mismatches(samples, switch, (old, new), prompts, n, PARAMS, forced=drafter) == []
    # the reference tells the weights apart: all of it from the new weights matches no row that started before
    spanning = [s for s in samples if 0 < switch[(s.prompt_index, s.sample_index)] < s.length]
    assert len(_mismatches(spanning, {k: 0 for k in switch}, (old, new), prompts, n, PARAMS, drafter)) == len(spanning)
    broken, switch_b = run(broken=True)
    bad = _mismatches(broken, switch_b, (old, new), prompts, n, PARAMS, forced=drafter)
    assert bad and {b[2] for b in bad} == {"versions"}

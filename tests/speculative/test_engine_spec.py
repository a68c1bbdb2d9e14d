"""The engine's speculative path: greedy equality, exact sampling distribution, log-probs, compilation."""

import pytest
import torch

from sparrow.rollout import EngineConfig, RolloutEngine, SamplingParams
from sparrow.rollout.steps import draft_step, verify_step
from sparrow.sampling import process_logits
from sparrow.speculative import rejection
from sparrow.speculative.drafter import DrafterConfig, QuantizedSelfDrafter
from sparrow.speculative.toggle import AlwaysOn, ThresholdToggle
from tests.helpers import random_tiny
from tests.speculative.common import CopyDrafter, perturbed_copy, prompts
from tests.speculative.stats import chi2_homogeneity, chi2_sf


def _cfg(**kw):
    cfg = dict(max_rows=4, max_prompt_len=64, max_new_tokens=24, compile=False, block_steps=3)
    cfg.update(kw)
    return EngineConfig(**cfg)


def _assert_same(got, ref, lp_tol=1e-4):
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert (a.prompt_index, a.sample_index) == (b.prompt_index, b.sample_index)
        assert a.tokens.tolist() == b.tokens.tolist()
        assert a.finish_reason == b.finish_reason
        assert torch.allclose(a.logprobs, b.logprobs, atol=lp_tol, rtol=0)


@pytest.fixture(scope="module")
def target():
    return random_tiny("qwen2")


def _drafters(model):
    return {
        "int8": QuantizedSelfDrafter(model, DrafterConfig(weight="int8")),
        "int8-window": QuantizedSelfDrafter(model, DrafterConfig(weight="int8", window=6, sink=2)),
        "perturbed": CopyDrafter(perturbed_copy(model, 0.1)),
    }


@pytest.mark.parametrize("drafter", ["int8", "int8-window", "perturbed"])
def test_greedy_equals_autoregressive_over_many_prompts(target, drafter):
    ps = prompts(n_lens=[3, 5, 8, 13, 21, 34, 2, 9, 17, 30, 4, 11], seed=7)
    params = [SamplingParams(temperature=0.0, max_new_tokens=24),
              SamplingParams(temperature=0.0, max_new_tokens=17, stop_token_ids=(3, 7, 11, 19))]
    d = _drafters(target)[drafter]
    for p in params:
        ref = RolloutEngine(target, _cfg(max_rows=8)).generate(ps, 2, p)
        for k, sync in ((1, 1), (3, 3), (5, 2)):
            eng = RolloutEngine(target, _cfg(max_rows=8, max_draft=5, block_steps=sync), drafter=d, toggle=AlwaysOn(k))
            got = eng.generate(ps, 2, p)
            _assert_same(got.samples, ref.samples)
            assert got.stats.spec_cycles > 0 and got.stats.draft_proposed > 0
            assert got.stats.generated_tokens == ref.stats.generated_tokens


def test_greedy_toggle_switching_and_context_end(target):
    """SD and AR blocks interleave (threshold toggle as rows finish); rows run to the model's last position."""
    model = random_tiny("qwen2", max_seq_len=48)
    ps = prompts(n_lens=[30, 28, 12, 5, 20, 25], seed=3)
    p = SamplingParams(temperature=0.0, max_new_tokens=18, stop_token_ids=(2, 5, 9))
    ref = RolloutEngine(model, _cfg(max_rows=8, max_prompt_len=30, max_new_tokens=18)).generate(ps, 2, p)
    eng = RolloutEngine(model, _cfg(max_rows=8, max_prompt_len=30, max_new_tokens=18, max_draft=6, block_steps=2),
                        drafter=CopyDrafter(perturbed_copy(model, 0.1)), toggle=ThresholdToggle(max_active=4, num_draft=6))
    got = eng.generate(ps, 2, p)
    _assert_same(got.samples, ref.samples)
    assert 0 < got.stats.spec_cycles < got.stats.decode_steps  # both kinds of blocks ran


def _teacher_forced_logprobs(model, prompt, tokens, params):
    seq = torch.tensor(list(prompt) + tokens.tolist())[None]
    with torch.no_grad():
        logits = model(seq)[0].float()
    lp = process_logits(logits, params)[len(prompt) - 1: len(prompt) - 1 + len(tokens)]
    return lp.gather(-1, tokens[:, None]).squeeze(-1)


def test_sampled_outputs_report_target_logprobs_and_stop_correctly(target):
    ps = prompts()
    p = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=20, stop_token_ids=(7, 11), seed=3)
    eng = RolloutEngine(target, _cfg(max_draft=4), drafter=CopyDrafter(perturbed_copy(target, 0.3)),
                        toggle=AlwaysOn(4))
    g = eng.generate(ps, 3, p)
    assert 0.0 < g.stats.acceptance_rate < 1.0
    for s in g:
        ref_lp = _teacher_forced_logprobs(target, ps[s.prompt_index], s.tokens, p)
        assert torch.allclose(s.logprobs, ref_lp, atol=1e-4), (s.logprobs, ref_lp)
        if s.finish_reason == "stop":
            assert s.tokens[-1].item() in p.stop_token_ids
            assert not set(s.tokens[:-1].tolist()) & set(p.stop_token_ids)
        else:
            assert s.length == p.max_new_tokens
    # seeded runs are reproducible, and a row's tokens do not depend on its batch
    again = RolloutEngine(target, _cfg(max_rows=16, max_draft=4, block_steps=5),
                          drafter=CopyDrafter(perturbed_copy(target, 0.3)), toggle=AlwaysOn(4)).generate(ps, 3, p)
    assert [s.tokens.tolist() for s in g] == [s.tokens.tolist() for s in again]


# --------------------------------------------------------------------- empirical distribution
DIST_PROMPTS = prompts(n_lens=[5, 17, 3, 30], seed=1)


def _token_counts(gen, pos, n_prompts, vocab=64):
    c = torch.zeros(n_prompts, vocab)
    for s in gen:
        c[s.prompt_index % n_prompts, s.tokens[pos]] += 1
    return c


def _combined_pvalue(a: torch.Tensor, b: torch.Tensor) -> float:
    """Chi-square homogeneity over several strata (prompts): statistics and degrees of freedom add up."""
    stat, df = 0.0, 0
    for i in range(a.shape[0]):
        # chi2_homogeneity returns a p-value; rebuild its statistic through the same pooling
        x, y = a[i].double(), b[i].double()
        tot = x + y
        big = tot >= 5
        x = torch.cat([x[big], x[~big].sum()[None]])
        y = torch.cat([y[big], y[~big].sum()[None]])
        tot = x + y
        keep = tot > 0
        x, y, tot = x[keep], y[keep], tot[keep]
        ex, ey = tot * x.sum() / tot.sum(), tot * y.sum() / tot.sum()
        stat += float(((x - ex) ** 2 / ex).sum() + ((y - ey) ** 2 / ey).sum())
        df += int(keep.sum()) - 1
    return chi2_sf(stat, df)


def _distribution_runs(target, params, n_copies=8, n_samples=64, perturbation=0.15):
    ps = DIST_PROMPTS * n_copies  # every copy has its own sample ids, hence independent noise
    cfg = dict(max_rows=256, max_prompts=32, max_prompt_len=32, max_new_tokens=3, block_steps=4)
    ar = RolloutEngine(target, _cfg(**cfg)).generate(ps, n_samples, params)
    eng = RolloutEngine(target, _cfg(**cfg, max_draft=2), drafter=CopyDrafter(perturbed_copy(target, perturbation)),
                        toggle=AlwaysOn(2))
    return ar, eng, ps


@pytest.mark.parametrize("params", [
    pytest.param(SamplingParams(temperature=1.0, max_new_tokens=3, seed=1), id="t1.0"),
    pytest.param(SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=3, seed=2), id="t0.7-p0.9"),
])
def test_second_and_third_tokens_follow_autoregressive_distribution(target, params, monkeypatch):
    ar, eng, ps = _distribution_runs(target, params)
    sd = eng.generate(ps, 64, params)
    assert 0.2 < sd.stats.acceptance_rate < 0.95, sd.stats.acceptance_rate
    n = len(DIST_PROMPTS)
    for pos in (1, 2):
        pval = _combined_pvalue(_token_counts(ar, pos, n), _token_counts(sd, pos, n))
        assert pval > 1e-3, (pos, pval)
    # negative control: accepting with min(1, q/p) must be detected by the same test
    monkeypatch.setattr(rejection, "acceptance_probability", lambda p, q: (q / p.clamp_min(1e-30)).clamp(max=1.0))
    broken = eng.generate(ps, 64, params)
    worst = min(_combined_pvalue(_token_counts(ar, pos, n), _token_counts(broken, pos, n)) for pos in (1, 2))
    assert worst < 1e-6, worst


def test_distribution_test_catches_a_wrong_residual(target, monkeypatch):
    params = SamplingParams(temperature=1.0, max_new_tokens=3, seed=1)
    ar, eng, ps = _distribution_runs(target, params, n_copies=24)
    monkeypatch.setattr(rejection, "residual_distribution", lambda p, q: p)  # residual p instead of (p - q)+
    broken = eng.generate(ps, 64, params)
    n = len(DIST_PROMPTS)
    worst = min(_combined_pvalue(_token_counts(ar, pos, n), _token_counts(broken, pos, n)) for pos in (1, 2))
    assert worst < 1e-6, worst
    assert chi2_homogeneity(torch.tensor([50.0, 50.0]), torch.tensor([50.0, 50.0])) == pytest.approx(1.0)


# ------------------------------------------------------------------------------- compilation
def test_spec_steps_compile_without_graph_breaks(target):
    ps = prompts()
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=10, max_new_tokens=10, stop_token_ids=(1,), seed=4)
    d = QuantizedSelfDrafter(target, DrafterConfig(weight="int8", window=8))
    eager = RolloutEngine(target, _cfg(max_rows=8, max_draft=3), drafter=d, toggle=AlwaysOn(3)).generate(ps, 2, p)
    eng = RolloutEngine(target, _cfg(max_rows=8, max_draft=3, compile=True, compile_backend="eager"),
                        drafter=d, toggle=AlwaysOn(3))
    got = eng.generate(ps, 2, p)
    _assert_same(got.samples, eager.samples)
    d = eng.drafts
    slots = torch.tensor([0, 1, 2, eng.scratch])
    d.cursor.zero_()
    explain = torch._dynamo.explain(draft_step)(eng.state, slots)
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    explain = torch._dynamo.explain(verify_step)(eng.state, slots, d.tokens[:, :3], d.probs[:, :3])
    assert explain.graph_break_count == 0 and explain.graph_count == 1


def test_engine_validates_speculative_configuration(target):
    with pytest.raises(ValueError, match="max_draft"):
        RolloutEngine(target, _cfg(), drafter=CopyDrafter(target))
    with pytest.raises(ValueError, match="needs a drafter"):
        RolloutEngine(target, _cfg(max_draft=2), toggle=AlwaysOn(2))
    with pytest.raises(ValueError, match="max_draft"):
        EngineConfig(max_draft=-1)
    eng = RolloutEngine(target, _cfg(max_draft=2), drafter=CopyDrafter(target))  # default toggle: always on
    g = eng.generate(prompts()[:2], 1, SamplingParams(temperature=0.0, max_new_tokens=5))
    assert g.stats.spec_cycles > 0 and set(g.stats.draft_len_hist) == {2}
    assert g.stats.acceptance_rate == 1.0  # the drafter is the target itself


def test_prepare_compiles_every_draft_length_ahead_and_changes_no_result(target):
    """With a drafter, prepare() also runs the draft step and the cycle of each draft length the toggle can ask
    for, on the scratch row: generate compiles nothing more and samples what an unprepared engine samples."""
    from torch._dynamo.utils import counters

    ps = prompts()
    p = SamplingParams(temperature=0.9, top_p=0.9, top_k=10, max_new_tokens=10, stop_token_ids=(1,), seed=4)
    d = QuantizedSelfDrafter(target, DrafterConfig(weight="int8", window=8))
    eager = RolloutEngine(target, _cfg(max_rows=8, max_draft=3), drafter=d, toggle=AlwaysOn(3)).generate(ps, 2, p)
    torch.compiler.reset()
    eng = RolloutEngine(target, _cfg(max_rows=8, max_draft=3, compile=True, compile_backend="eager"),
                        drafter=d, toggle=AlwaysOn(3))
    eng.prepare(p)
    counters.clear()
    got = eng.generate(ps, 2, p)
    assert counters["stats"]["unique_graphs"] == 0 and got.stats.spec_cycles > 0
    _assert_same(got.samples, eager.samples)

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparrow.rl import tail_agreement, tail_agreement_by, token_agreement


def _reference_tail(mu: torch.Tensor, pi: torch.Tensor, mask: torch.Tensor, q: float) -> float:
    """The statement: the q-quantile (linear) of min(1, pi / mu) over the masked tokens, in float64."""
    a = torch.minimum(torch.ones((), dtype=torch.float64), (pi.double() - mu.double()).exp())
    return float(torch.quantile(a[mask], q)) if mask.any() else float("nan")


def check_tail(fn, mu, pi, mask, q) -> None:
    got, want = float(fn(mu, pi, mask, q)), _reference_tail(mu, pi, mask, q)
    assert (math.isnan(got) and math.isnan(want)) or abs(got - want) < 1e-5, (got, want)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 6), length=st.integers(1, 12), q=st.floats(0.0, 1.0), seed=st.integers(0, 10_000),
       keep=st.floats(0.0, 1.0))
def test_tail_is_the_quantile_of_the_per_token_agreement_over_masked_tokens(n, length, q, seed, keep):
    g = torch.Generator().manual_seed(seed)
    mu = -torch.rand(n, length, generator=g) * 3
    pi = mu + torch.randn(n, length, generator=g) * 0.7
    mask = torch.rand(n, length, generator=g) < keep
    check_tail(tail_agreement, mu, pi, mask, q)


@pytest.mark.parametrize("broken", ["ignores-mask", "mean", "symmetric-ratio"])
def test_the_property_check_rejects_broken_statistics(broken):
    """Negative control: statistics that are not the masked quantile of min(1, pi / mu) fail the check."""
    g = torch.Generator().manual_seed(0)
    mu = -torch.rand(4, 10, generator=g) * 3
    pi = mu + torch.randn(4, 10, generator=g)
    mask = torch.rand(4, 10, generator=g) < 0.6
    pi[~mask] = mu[~mask] - 30.0  # what the mask hides: terrible agreement
    fns = {
        "ignores-mask": lambda m, p, k, q: tail_agreement(m, p, torch.ones_like(k), q),
        "mean": lambda m, p, k, q: token_agreement(m, p)[k].mean(),
        "symmetric-ratio": lambda m, p, k, q: torch.quantile(torch.exp(-(p - m).abs())[k], q),
    }
    check_tail(tail_agreement, mu, pi, mask, 0.05)
    with pytest.raises(AssertionError):
        check_tail(fns[broken], mu, pi, mask, 0.05)


def test_identical_distributions_agree_everywhere():
    lp = -torch.rand(8, 30) * 5
    mask = torch.rand(8, 30) < 0.7
    assert float(tail_agreement(lp, lp.clone(), mask)) == 1.0
    assert torch.equal(token_agreement(lp, lp), torch.ones_like(lp))


def test_known_shifts_give_the_known_quantile():
    """100 tokens: the trainer gives token i the rollout's log-prob minus i / 100 nats (padding past them hidden):
    agreements exp(-i / 100), whose 5th percentile (linear) is exp(-(99 - 0.05 * 99) / 100)."""
    mu = torch.full((2, 60), -1.0)
    pi = mu.clone()
    mask = torch.zeros(2, 60, dtype=torch.bool)
    mask[0, :50] = mask[1, :50] = True
    shift = torch.arange(100, dtype=torch.float32) / 100
    pi[mask] = mu[mask] - shift
    pi[~mask] = -50.0  # masked out: must not count
    q_pos = 0.05 * 99
    want = math.exp(-(99 - q_pos) / 100)
    assert abs(float(tail_agreement(mu, pi, mask, 0.05)) - want) < 1e-6
    pi[mask] = mu[mask] + shift  # the trainer more confident than the rollout: full agreement
    assert float(tail_agreement(mu, pi, mask)) == 1.0


def test_outside_the_trainers_support_is_zero_and_nothing_selected_is_nan():
    mu = torch.tensor([[-1.0, -2.0, -0.5]])
    pi = torch.tensor([[-1.0, float("-inf"), -0.5]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    assert token_agreement(mu, pi).tolist() == [[1.0, 0.0, 1.0]]
    assert float(tail_agreement(mu, pi, mask, 0.0)) == 0.0
    assert math.isnan(float(tail_agreement(mu, pi, torch.zeros_like(mask))))
    assert math.isnan(float(tail_agreement(torch.zeros(0, 3), torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.bool))))


def test_the_mean_agreement_estimates_one_minus_the_total_variation():
    """With y ~ mu, E[min(1, pi(y) / mu(y))] = sum_v min(mu_v, pi_v): the sampled-token statistic measures the
    distributions' overlap (what Taming Sparse Rollout's per-token L1 agreement is) without either's full row."""
    g = torch.Generator().manual_seed(3)
    mu = torch.softmax(torch.randn(50, 20, generator=g) * 2, -1)
    pi = torch.softmax(torch.log(mu) + torch.randn(50, 20, generator=g), -1)
    y = torch.multinomial(mu, 400, replacement=True, generator=g)  # 400 draws per context
    a = token_agreement(mu.gather(1, y).log(), pi.gather(1, y).log())
    overlap = torch.minimum(mu, pi).sum(-1)
    assert float((a.mean(1) - overlap).abs().max()) < 0.06
    assert abs(float(a.mean() - overlap.mean())) < 0.01


def test_no_host_sync_it_compiles_in_one_graph():
    """Data-dependent shapes or reads would break a fullgraph compile: the statistic has neither."""
    fn = torch.compile(tail_agreement, fullgraph=True, backend="eager")
    mu, pi = -torch.rand(3, 7), -torch.rand(3, 7)
    mask = torch.rand(3, 7) < 0.5
    mask[0, 0] = True
    assert float(fn(mu, pi, mask, 0.05)) == pytest.approx(_reference_tail(mu, pi, mask, 0.05), abs=1e-6)


def test_breakdown_by_key_per_row_and_per_token():
    g = torch.Generator().manual_seed(1)
    mu = -torch.rand(6, 9, generator=g) * 2
    pi = mu + torch.randn(6, 9, generator=g) * 0.5
    mask = torch.rand(6, 9, generator=g) < 0.8
    mask[:, 0] = True
    version = torch.tensor([0, 0, 2, 2, 2, 5])  # e.g. the weight version each row was sampled at
    by_row = tail_agreement_by(version, mu, pi, mask, 0.1)
    assert sorted(by_row) == [0, 2, 5]
    for v, tail in by_row.items():
        rows = version == v
        assert tail == pytest.approx(_reference_tail(mu[rows], pi[rows], mask[rows], 0.1), abs=1e-5)
    position = torch.arange(9).expand(6, 9) // 3  # per token: three tiers of generated length
    by_tok = tail_agreement_by(position, mu, pi, mask)
    for v, tail in by_tok.items():
        assert tail == pytest.approx(_reference_tail(mu, pi, mask & (position == v), 0.05), abs=1e-5)
    mask[version == 5] = False
    assert 5 not in tail_agreement_by(version, mu, pi, mask)  # no masked token carries key 5


def test_bad_input_raises():
    x = torch.zeros(2, 3)
    m = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="one shape"):
        tail_agreement(x, torch.zeros(2, 4), m)
    with pytest.raises(ValueError, match="bool"):
        tail_agreement(x, x, m.float())
    with pytest.raises(ValueError, match="q must be"):
        tail_agreement(x, x, m, 1.5)
    with pytest.raises(ValueError, match="floating"):
        tail_agreement(x.long(), x, m)
    with pytest.raises(ValueError, match="integer"):
        tail_agreement_by(torch.zeros(2), x, x, m)
    with pytest.raises(ValueError, match="lead"):
        tail_agreement_by(torch.zeros(3, dtype=torch.long), x, x, m)


def test_the_recipe_logs_the_tail_and_its_schedule_moves_rtpurbo_top_p_between_steps(tmp_path, monkeypatch):
    """GRPO with RTPurbo rollouts and a sparsity schedule (a threshold of 1: every step's tail is below it): the
    tail agreement is logged every step (overall and per length tier), every step tightens, and the rollout
    model's backends hold the schedule's top-p. Without a schedule the tail is still logged."""
    from sparrow.attention.rtpurbo import rtpurbo_backends
    from tests.recipes.test_grpo_recipe import _tiny_rtpurbo_dir, in_process

    ckpt, rt = _tiny_rtpurbo_dir(tmp_path)
    common = ("total_steps=2", f"checkpoint={ckpt}", "attention._component_=sparrow.attention.rtpurbo",
              f"attention.path={rt}", "metric_logger._component_=sparrow.rl.JsonlLogger", "ppo_epochs=1",
              "minibatches=1")
    _, recipe = in_process(tmp_path / "sched", monkeypatch, *common,
                           "rtpurbo_schedule._component_=sparrow.attention.rtpurbo_schedule.SparsityScheduleConfig",
                           "rtpurbo_schedule.threshold=1.0", "rtpurbo_schedule.top_p=0.6",
                           "rtpurbo_schedule.lengths=[0,2]")
    assert rtpurbo_backends(recipe.rollout_model)[0].selection()[0] == pytest.approx([0.6, 0.8])  # applied at setup
    recipe.train()
    recipe.cleanup()
    recs = [r for r in recipe.metric_logger.records if "reward/mean" in r]
    assert len(recs) == 2
    for r in recs:
        for key in ("mismatch/tail_agreement_p5", "mismatch/tail_agreement_p5/tier0",
                    "mismatch/tail_agreement_p5/tier1"):
            assert 0.0 <= r[key] < 1.0, (key, r[key])
    tops = [r["rtpurbo/top_p"] for r in recs]
    assert 0.6 < tops[0] < tops[1]  # tightened after each step
    assert rtpurbo_backends(recipe.rollout_model)[0].selection()[0] == pytest.approx(recipe.schedule.top_p)
    _, plain = in_process(tmp_path / "plain", monkeypatch, *common, "total_steps=1")
    plain.train()
    plain.cleanup()
    (rec,) = [r for r in plain.metric_logger.records if "reward/mean" in r]
    assert 0.0 <= rec["mismatch/tail_agreement_p5"] <= 1.0 and "rtpurbo/top_p" not in rec

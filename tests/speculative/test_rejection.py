"""Exactness of speculative rejection sampling: analytic (float64) and Monte Carlo."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparrow.sampling import row_keys, top_p_mask
from sparrow.speculative import rejection
from sparrow.speculative.rejection import (
    accept_counter_based,
    acceptance_probability,
    rejection_sample,
    residual_distribution,
)
from tests.speculative.stats import chi2_gof

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def emission_probability(p: torch.Tensor, q: torch.Tensor, accept=None, residual=None) -> torch.Tensor:
    """Exact probability of each token being the next emitted one: drafted and accepted, or drawn from
    the residual after a rejection. p, q: [..., V] float64."""
    accept = accept or acceptance_probability
    residual = residual or residual_distribution
    a = accept(p, q)
    kept = q * a
    return kept + (1.0 - kept.sum(-1, keepdim=True)) * residual(p, q)


@st.composite
def distributions(draw, v):
    """A probability vector of size v: generic, top-p truncated, one-hot, nearly one-hot or with zeros."""
    kind = draw(st.sampled_from(["generic", "top_p", "one_hot", "near_one_hot", "sparse", "flat"]))
    logits = torch.tensor(draw(st.lists(st.floats(-12, 12, allow_nan=False), min_size=v, max_size=v)),
                          dtype=torch.float64)
    if kind == "top_p":
        logits = top_p_mask(logits, draw(st.floats(0.05, 0.99)))
    elif kind == "one_hot":
        logits = torch.full_like(logits, float("-inf"))
        logits[draw(st.integers(0, v - 1))] = 0.0
    elif kind == "near_one_hot":
        logits = torch.full_like(logits, -40.0)
        logits[draw(st.integers(0, v - 1))] = 0.0
    elif kind == "sparse":
        mask = torch.tensor(draw(st.lists(st.booleans(), min_size=v, max_size=v)))
        mask[draw(st.integers(0, v - 1))] = True
        logits = logits.masked_fill(~mask, float("-inf"))
    elif kind == "flat":
        logits = torch.zeros_like(logits)
    return torch.softmax(logits, -1)


@st.composite
def pq_pairs(draw):
    v = draw(st.integers(1, 12))
    p = draw(distributions(v))
    relation = draw(st.sampled_from(["independent", "equal", "perturbed"]))
    if relation == "equal":
        q = p.clone()
    elif relation == "perturbed":  # q close to p: acceptance near one, residual near zero
        eps = draw(st.floats(1e-12, 1e-3))
        noise = torch.tensor(draw(st.lists(st.floats(0, 1), min_size=v, max_size=v)), dtype=torch.float64)
        q = p + eps * noise * (p > 0)
        q = q / q.sum()
    else:
        q = draw(distributions(v))
    return p, q


@SETTINGS
@given(pq=pq_pairs())
def test_emission_distribution_equals_target_exactly(pq):
    p, q = pq
    got = emission_probability(p, q)
    assert torch.allclose(got, p, atol=1e-12, rtol=0), (p, q, got)
    assert abs(float(got.sum()) - 1.0) < 1e-12


@SETTINGS
@given(v=st.integers(2, 6), data=st.data())
def test_two_positions_compose_to_the_target_sequence_distribution(v, data):
    """Position 2's distributions depend on token 1. A row either emits (x1, x2) in one cycle (x1 accepted,
    x2 accepted or residual) or is rejected at 1 and gets x2 from the next cycle (marginally p2)."""
    p1, q1 = data.draw(distributions(v)), data.draw(distributions(v))
    p2 = torch.stack([data.draw(distributions(v)) for _ in range(v)])  # [x1, x2]
    q2 = torch.stack([data.draw(distributions(v)) for _ in range(v)])
    a1 = acceptance_probability(p1, q1)
    reject1 = 1.0 - (q1 * a1).sum()
    same_cycle = (q1 * a1)[:, None] * emission_probability(p2, q2)
    next_cycle = (reject1 * residual_distribution(p1, q1))[:, None] * p2
    joint = same_cycle + next_cycle
    assert torch.allclose(joint, p1[:, None] * p2, atol=1e-12, rtol=0)


def test_identity_catches_broken_rules():
    p = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    q = torch.tensor([0.1, 0.6, 0.1, 0.2], dtype=torch.float64)
    assert torch.allclose(emission_probability(p, q), p, atol=1e-12)
    inverted = lambda p, q: (q / p.clamp_min(1e-300)).clamp(max=1.0)  # noqa: E731 - min(1, q/p)
    assert not torch.allclose(emission_probability(p, q, accept=inverted), p, atol=1e-3)
    target_residual = lambda p, q: p  # noqa: E731 - residual p instead of (p - q)+
    assert not torch.allclose(emission_probability(p, q, residual=target_residual), p, atol=1e-3)


# ------------------------------------------------------------------------------ the public function
def _tables(v=5, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(2.0 * torch.randn(k + 1, v, generator=g, dtype=torch.float64), -1)
    q = torch.softmax(2.0 * torch.randn(k, v, generator=g, dtype=torch.float64), -1)
    p[1] = torch.softmax(top_p_mask(torch.log(p[1]), 0.8), -1)  # a truncated target position
    return p, q


def _run_public(p, q, n, seed):
    """n rows of one speculative cycle with context-independent distributions, then the rest of the
    sequence drawn directly from the target (what the next cycles would emit, marginally)."""
    k, v = q.shape
    g = torch.Generator().manual_seed(seed)
    d = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g) for i in range(k)], 1)
    tokens, num = rejection_sample(d, q.expand(n, k, v), p.expand(n, k + 1, v), generator=g)
    seq = torch.stack([torch.multinomial(p[i], n, replacement=True, generator=g) for i in range(k + 1)], 1)
    pos = torch.arange(k + 1)[None]
    seq = torch.where(pos < num[:, None], tokens, seq)
    return tokens, num, seq


def test_public_rejection_sample_matches_target_monte_carlo():
    p, q = _tables()
    n = 60_000
    tokens, num, seq = _run_public(p, q, n, seed=1)
    k, v = q.shape
    assert bool(((num >= 1) & (num <= k + 1)).all())
    pos = torch.arange(k + 1)[None]
    assert bool((tokens[pos >= num[:, None]] == -1).all())
    assert bool((tokens[pos < num[:, None]] >= 0).all())
    assert 0.0 < (num - 1).float().mean().item() / k < 1.0  # both paths are exercised
    for i in range(k + 1):
        assert chi2_gof(torch.bincount(seq[:, i], minlength=v), p[i]) > 1e-3
    joint = torch.bincount(seq[:, 0] * v + seq[:, 1], minlength=v * v)
    assert chi2_gof(joint, (p[0][:, None] * p[1]).flatten()) > 1e-3


def test_public_rejection_sample_negative_control(monkeypatch):
    p, q = _tables()
    monkeypatch.setattr(rejection, "acceptance_probability",
                        lambda p, q: (q / p.clamp_min(1e-300)).clamp(max=1.0))
    _, _, seq = _run_public(p, q, 60_000, seed=1)
    assert chi2_gof(torch.bincount(seq[:, 0], minlength=p.shape[1]), p[0]) < 1e-6


def test_public_rejection_sample_edge_cases():
    v = 4
    p = torch.softmax(torch.randn(3, 3, v), -1)
    d = torch.multinomial(p[:, 0], 1)
    # identical distributions: every draft is accepted, plus the bonus token
    d2 = torch.stack([torch.multinomial(p[:, i], 1).squeeze(1) for i in range(2)], 1)
    tokens, num = rejection_sample(d2, p[:, :2], p)
    assert num.tolist() == [3, 3, 3]
    assert torch.equal(tokens[:, :2], d2)
    # a target that gives the drafted token zero probability always rejects it
    q = torch.zeros(3, 1, v)
    q[:, 0, 0] = 1.0
    t = torch.zeros(3, 2, v)
    t[:, :, 1] = 1.0
    tokens, num = rejection_sample(torch.zeros(3, 1, dtype=torch.int64), q, t)
    assert num.tolist() == [1, 1, 1] and tokens[:, 0].tolist() == [1, 1, 1] and tokens[:, 1].tolist() == [-1] * 3
    # k = 0: a plain sample from the target
    tokens, num = rejection_sample(torch.zeros(3, 0, dtype=torch.int64), torch.zeros(3, 0, v), p[:, :1])
    assert num.tolist() == [1, 1, 1] and tokens.shape == (3, 1)
    del d


def test_public_rejection_sample_validates():
    v = 5
    with pytest.raises(ValueError, match="shapes"):
        rejection_sample(torch.zeros(2, 3, dtype=torch.int64), torch.rand(2, 3, v), torch.rand(2, 3, v))
    with pytest.raises(ValueError, match="expected"):
        rejection_sample(torch.zeros(2, dtype=torch.int64), torch.rand(2, 3, v), torch.rand(2, 4, v))
    with pytest.raises(ValueError, match="lie in"):
        rejection_sample(torch.full((2, 3), v, dtype=torch.int64), torch.rand(2, 3, v), torch.rand(2, 4, v))
    with pytest.raises(ValueError, match="integer"):
        rejection_sample(torch.zeros(2, 3), torch.rand(2, 3, v), torch.rand(2, 4, v))
    with pytest.raises(ValueError, match="floating"):
        rejection_sample(torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, 3, v, dtype=torch.int64),
                         torch.rand(2, 4, v))


@pytest.mark.parametrize("k", [0, 3])
def test_public_rejection_sample_on_an_empty_batch(k):
    tokens, num = rejection_sample(torch.zeros(0, k, dtype=torch.int64), torch.rand(0, k, 5), torch.rand(0, k + 1, 5))
    assert tokens.shape == (0, k + 1) and num.shape == (0,) and tokens.dtype == num.dtype == torch.int64


# --------------------------------------------------------------------------- the engine's variant
def test_counter_based_variant_matches_target_and_is_deterministic():
    p, q = _tables(v=6, k=2, seed=3)
    n = 40_000
    k, v = q.shape
    g = torch.Generator().manual_seed(5)
    d = torch.stack([torch.multinomial(q[i].float(), n, replacement=True, generator=g) for i in range(k)], 1)
    keys = row_keys(torch.tensor(7), torch.arange(n), torch.arange(k + 1)[None].expand(n, k + 1).contiguous())
    logp = torch.log(p.float()).expand(n, k + 1, v)
    tokens, acc = accept_counter_based(logp, d, q.float().expand(n, k, v), keys, greedy=False)
    tokens2, acc2 = accept_counter_based(logp, d, q.float().expand(n, k, v), keys, greedy=False)
    assert torch.equal(tokens, tokens2) and torch.equal(acc, acc2)
    first = tokens[:, 0]
    assert chi2_gof(torch.bincount(first, minlength=v), p[0]) > 1e-3
    second = tokens[acc >= 1, 1]  # given the first draft was accepted, the second is again p-distributed
    assert chi2_gof(torch.bincount(second, minlength=v), p[1]) > 1e-3
    assert bool((tokens.gather(1, acc[:, None]) >= 0).all())


def test_counter_based_greedy_accepts_argmax_prefix():
    v = 6
    logp = torch.log_softmax(torch.randn(4, 4, v), -1)
    best = logp.argmax(-1)
    d = best[:, :3].clone()
    d[1, 0] = (d[1, 0] + 1) % v
    d[2, 2] = (d[2, 2] + 1) % v
    keys = torch.zeros(4, 4, dtype=torch.int64)
    tokens, acc = accept_counter_based(logp, d, None, keys, greedy=True)
    assert acc.tolist() == [3, 0, 2, 3]
    for r in range(4):
        n = int(acc[r]) + 1
        assert tokens[r, :n].tolist() == best[r, :n].tolist()

import math

import pytest
import torch

from sparrow.rl import (GRPOConfig, StalenessStats, aggregation_weights, group_advantages, grpo_loss,
                        importance_weights)


def test_group_advantages():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5]])
    a = group_advantages(r, "group")
    assert torch.allclose(a[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.equal(a[1], torch.zeros(4))  # no signal in a group that agrees
    assert torch.allclose(group_advantages(r, "none")[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    with pytest.raises(ValueError, match="prompts, group"):
        group_advantages(r.flatten())


def _batch(N=4, L=5):
    torch.manual_seed(0)
    mask = torch.arange(L)[None, :] < torch.tensor([5, 3, 1, 4])[:, None]
    logp = (torch.randn(N, L) * 0.3 - 1.0).requires_grad_()
    old = logp.detach() + torch.randn(N, L) * 0.05
    sign = (-1.0) ** (torch.arange(N)[:, None] + torch.arange(L)[None, :])
    behav = old + 0.45 * sign + torch.randn(N, L) * 0.05  # w = pi_old / mu on both sides of 1
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0])
    return logp, old, behav, adv, mask


def _brute_force(logp, old, behav, adv, mask, cfg):
    """Per-token loops of the same definitions."""
    N, L = mask.shape
    per_seq, tokens = [], []
    for i in range(N):
        terms = []
        for t in range(L):
            if not mask[i, t]:
                continue
            ratio = math.exp(logp[i, t] - old[i, t])
            clip = min(max(ratio, 1 - cfg.clip_low), 1 + cfg.clip_high)
            pg = -min(ratio * adv[i], clip * adv[i])
            w = math.exp(old[i, t] - behav[i, t])
            w = min(w, cfg.is_threshold) if cfg.is_mode == "truncate" else (w if w <= cfg.is_threshold else 0.0)
            terms.append(pg * w)
        per_seq.append(terms)
        tokens += terms
    if cfg.aggregation == "token_mean":
        return sum(tokens) / len(tokens)
    if cfg.aggregation == "seq_mean_token_mean":
        return sum(sum(s) / len(s) for s in per_seq) / N
    return sum(tokens) / (N * cfg.max_response_len)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_sum_constant"])
@pytest.mark.parametrize("is_mode", ["truncate", "mask"])
def test_loss_matches_per_token_definition(aggregation, is_mode):
    cfg = GRPOConfig(aggregation=aggregation, max_response_len=7, is_mode=is_mode, is_threshold=1.3)
    logp, old, behav, adv, mask = _batch()
    loss, m = grpo_loss(logp, old, behav, adv, mask, aggregation_weights(mask, cfg), cfg)
    ref = _brute_force(logp.detach().double(), old.double(), behav.double(), adv.double(), mask, cfg)
    assert abs(float(loss.detach()) - ref) < 1e-5
    assert 0 < float(m["is_clip_frac"]) < 1
    loss.backward()
    assert logp.grad[~mask].abs().max() == 0 and logp.grad[mask].abs().max() > 0


def test_ppo_clip_edges_are_asymmetric():
    """Ratios e^{±0.3} lie outside both [1 - clip_low, 1 + clip_high] edges (0.8, 1.28)."""
    cfg = GRPOConfig(clip_low=0.2, clip_high=0.28, is_level="none")
    logp, _, _, adv, mask = _batch()
    sign = (-1.0) ** (torch.arange(4)[:, None] + torch.arange(5)[None, :])
    old = logp.detach() - 0.3 * sign
    loss, m = grpo_loss(logp, old, old, adv, mask, aggregation_weights(mask, cfg), cfg)
    ref = _brute_force(logp.detach().double(), old.double(), old.double(), adv.double(), mask, cfg)
    assert abs(float(loss.detach()) - ref) < 1e-5
    assert float(m["policy_clip_frac"]) == 1.0


def test_microbatches_accumulate_to_the_minibatch_loss():
    cfg = GRPOConfig(aggregation="seq_mean_token_mean")
    logp, old, behav, adv, mask = _batch()
    w = aggregation_weights(mask, cfg)
    whole, _ = grpo_loss(logp, old, behav, adv, mask, w, cfg)
    parts = sum(grpo_loss(logp[s], old[s], behav[s], adv[s], mask[s], w[s], cfg)[0]
                for s in (slice(0, 1), slice(1, 4)))
    assert torch.allclose(whole, parts)


def test_on_policy_gradient_is_advantage_weighted_score():
    """ratio == 1 and no mismatch: d loss / d logp = -adv * weight."""
    cfg = GRPOConfig(is_level="none")
    logp, _, _, adv, mask = _batch()
    w = aggregation_weights(mask, cfg)
    loss, m = grpo_loss(logp, logp.detach(), logp.detach(), adv, mask, w, cfg)
    loss.backward()
    assert torch.allclose(logp.grad, -adv[:, None] * w)
    assert float(m["mismatch_kl"]) == 0.0 and float(m["policy_clip_frac"]) == 0.0


def test_sequence_level_is_and_mismatch_kl():
    cfg = GRPOConfig(is_level="sequence", is_threshold=1.5, is_mode="mask")
    logp, old, behav, adv, mask = _batch()
    w, frac = importance_weights(old, behav, mask, cfg)
    seq = ((old - behav) * mask).sum(1).exp()
    expect = torch.where(seq <= 1.5, seq, torch.zeros_like(seq))
    assert torch.allclose(w[:, 0], expect) and torch.allclose(w, w[:, :1].expand_as(w))
    assert math.isclose(float(frac), float((seq > 1.5).float().mean()))
    _, m = grpo_loss(logp, old, behav, adv, mask, aggregation_weights(mask, cfg), cfg)
    d = (old - behav)[mask]
    assert math.isclose(float(m["mismatch_kl"]), float((d.exp() - d - 1).mean()), rel_tol=1e-5)


def test_kl_to_reference():
    cfg = GRPOConfig(kl_beta=0.1, is_level="none")
    logp, old, _, adv, mask = _batch()
    ref = old - 0.2
    loss_kl, m = grpo_loss(logp, old, old, adv, mask, aggregation_weights(mask, cfg), cfg, ref=ref)
    loss_0, _ = grpo_loss(logp, old, old, adv, mask, aggregation_weights(mask, cfg), GRPOConfig(is_level="none"))
    d = (ref - logp.detach())[mask]
    k3 = (d.exp() - d - 1).mean()
    assert math.isclose(float(loss_kl - loss_0), 0.1 * float(k3), rel_tol=1e-4)
    assert math.isclose(float(m["kl_ref"]), float(k3), rel_tol=1e-4)
    with pytest.raises(ValueError, match="reference"):
        grpo_loss(logp, old, old, adv, mask, aggregation_weights(mask, cfg), cfg)


@pytest.mark.parametrize("kwargs,match", [
    (dict(aggregation="sum"), "aggregation"), (dict(aggregation="seq_sum_constant"), "max_response_len"),
    (dict(is_level="batch"), "is_level"), (dict(is_threshold=0.5), "is_threshold"),
    (dict(is_mode="clip"), "is_mode"), (dict(clip_low=1.5), "clip_low"), (dict(kl_beta=-1.0), "kl_beta"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**kwargs)


def _aged_batch():
    logp, old, behav, adv, mask = _batch()
    old = old.clone()
    old[1, 1] = float("-inf")  # a token outside pi_old's support
    age = torch.tensor([[0, 0, 1, 1, 2], [1, 1, 1, 0, 0], [2, 0, 0, 0, 0], [0, 1, 2, 2, 9]])  # 9: past the mask
    return logp, old, behav, adv, mask, age


def test_staleness_stats_match_the_per_token_definition():
    """Per version age: token share, tokens whose weight pi_old / mu exceeds C, mismatch KL (k3) over the tokens
    inside the support; brute-force loops over the tokens, and at a single age grpo_loss's own is_clip_frac and
    mismatch_kl."""
    cfg = GRPOConfig(is_threshold=1.3)
    _, old, behav, _, mask, age = _aged_batch()
    got = StalenessStats.of(old, behav, mask, age, cfg, max_age=2).metrics()
    tok = {k: [] for k in range(3)}
    for i, t in zip(*torch.nonzero(mask, as_tuple=True)):
        tok[int(age[i, t])].append((float(old[i, t]), float(behav[i, t])))
    total = sum(len(v) for v in tok.values())
    for k, pairs in tok.items():
        inside = [(o, b) for o, b in pairs if math.isfinite(o)]
        assert math.isclose(got[f"partial/staleness_{k}"], len(pairs) / total)
        assert math.isclose(got[f"partial/is_clip_frac_age{k}"],
                            sum(math.exp(o - b) > 1.3 for o, b in inside) / len(pairs))
        kl = sum(math.exp(o - b) - (o - b) - 1 for o, b in inside) / len(inside)
        assert math.isclose(got[f"partial/mismatch_kl_age{k}"], kl, rel_tol=1e-6)
    logp, old, behav, adv, mask = _batch()
    _, m = grpo_loss(logp, old, behav, adv, mask, aggregation_weights(mask, cfg), cfg)
    one = StalenessStats.of(old, behav, mask, torch.zeros_like(mask, dtype=torch.int64), cfg, 0).metrics()
    assert math.isclose(one["partial/is_clip_frac_age0"], float(m["is_clip_frac"]), rel_tol=1e-6)
    assert math.isclose(one["partial/mismatch_kl_age0"], float(m["mismatch_kl"]), rel_tol=1e-5)


def test_staleness_stats_add_over_micro_batches_and_check_inputs():
    cfg = GRPOConfig()
    _, old, behav, _, mask, age = _aged_batch()
    whole = StalenessStats.of(old, behav, mask, age, cfg, 2)
    parts = [StalenessStats.of(old[s], behav[s], mask[s], age[s], cfg, 2) for s in (slice(0, 1), slice(1, 4))]
    summed = parts[0] + parts[1]
    assert torch.equal(whole.tokens, summed.tokens) and torch.equal(whole.over, summed.over)
    assert torch.allclose(whole.kl, summed.kl)
    assert torch.equal(StalenessStats.from_tensor(whole.as_tensor()).tokens, whole.tokens)
    assert float(whole.tokens.sum()) == float(mask.sum())  # every response token in one bin
    with pytest.raises(ValueError, match="integer"):
        StalenessStats.of(old, behav, mask, age.float(), cfg, 2)
    with pytest.raises(ValueError, match="one shape"):
        StalenessStats.of(old, behav, mask, age[:, :2], cfg, 2)
    with pytest.raises(ValueError, match="max_age"):
        StalenessStats.of(old, behav, mask, age, cfg, -1)

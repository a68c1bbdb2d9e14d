"""The trainer's log-probs are the behaviour policy's: with identical weights, under every sampling setting
(vocabulary limit, temperature, top-k, top-p), they equal what the engine reported for the tokens it sampled,
and the mismatch KL between the two is zero."""

from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparrow.rl import GRPOConfig, aggregation_weights, build_rollout_batch, grpo_loss, response_logprobs
from sparrow.rollout import EngineConfig, RolloutEngine, SamplingParams
from tests.helpers import random_tiny

VOCAB, LIMIT = 64, 57  # ids 57..63 are embedding rows without a token (as Qwen2.5's last 271 rows)
_MODEL = random_tiny("qwen2", std=0.3, vocab_size=VOCAB)
_ENGINE = RolloutEngine(_MODEL, EngineConfig(max_rows=16, max_prompt_len=16, max_new_tokens=10, compile=False))
_CFG = GRPOConfig()


def behaviour_and_trainer(params: SamplingParams, trainer: SamplingParams, seed: int):
    """Sample with ``params``; the trainer's log-probs of the same tokens with ``trainer``, same weights."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, LIMIT, (n,), generator=g).tolist() for n in (5, 11, 3)]
    gen = _ENGINE.generate(prompts, 3, replace(params, seed=seed))
    n = len(gen)
    rb = build_rollout_batch(prompts, gen.samples, 3, torch.zeros(n), torch.randn(n, generator=g))
    with torch.no_grad():
        lp = response_logprobs(_MODEL, rb.tokens, rb.prompt_len, rb.response_len,
                               max_response_len=rb.max_response_len, sampling=trainer)
    _, metrics = grpo_loss(lp, lp, rb.behaviour_logprobs, rb.advantages, rb.mask,
                           aggregation_weights(rb.mask, _CFG), _CFG)
    return rb, lp, metrics


def check_same_distribution(rb, lp, metrics) -> None:
    response = rb.tokens.gather(1, (rb.prompt_len[:, None] + torch.arange(rb.max_response_len)).clamp(
        max=rb.tokens.shape[1] - 1))[rb.mask]
    assert int(response.max()) < LIMIT  # never a row without a token
    assert float((lp - rb.behaviour_logprobs)[rb.mask].abs().max()) < 1e-4
    assert float(metrics["outside_support_frac"]) == 0.0
    assert float(metrics["mismatch_kl"]) < 1e-7


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(t=st.one_of(st.just(0.0), st.floats(0.3, 2.0)), p=st.floats(0.2, 1.0),
       k=st.sampled_from([0, 1, 3, 10, 64]), seed=st.integers(0, 2**20))
def test_trainer_logprobs_equal_the_engines_under_every_setting(t, p, k, seed):
    params = SamplingParams(temperature=t, top_p=p, top_k=k, max_new_tokens=10, vocab_limit=LIMIT)
    check_same_distribution(*behaviour_and_trainer(params, params, seed))


@pytest.mark.parametrize("broken", [
    pytest.param(lambda s: replace(s, top_p=1.0), id="trainer-without-top-p"),
    pytest.param(lambda s: replace(s, top_p=1.0, top_k=0), id="temperature-only"),
    pytest.param(lambda s: replace(s, vocab_limit=None), id="trainer-without-vocab-limit"),
])
def test_a_trainer_that_drops_part_of_the_processing_is_caught(broken):
    params = SamplingParams(temperature=0.9, top_p=0.5, top_k=10, max_new_tokens=10, vocab_limit=LIMIT)
    check_same_distribution(*behaviour_and_trainer(params, params, 3))
    with pytest.raises(AssertionError):
        check_same_distribution(*behaviour_and_trainer(params, broken(params), 3))


def test_without_the_limit_the_rows_without_tokens_are_sampled():
    """Negative control of the vocabulary check: the same engine without the limit samples ids >= LIMIT."""
    rb, lp, m = behaviour_and_trainer(SamplingParams(max_new_tokens=10), SamplingParams(), 5)
    with pytest.raises(AssertionError):
        check_same_distribution(rb, lp, m)


def test_tokens_outside_the_trainers_nucleus_carry_no_loss():
    """A sampled token that π_old's top-p drops (the bf16 rollout's nucleus held it) has importance weight 0:
    finite loss, zero gradient through it, counted in outside_support_frac and kept out of the mismatch KL."""
    logp = torch.tensor([[-0.5, float("-inf"), -1.0]], requires_grad=True)
    old = logp.detach().clone()
    behav = torch.tensor([[-0.6, -2.0, -1.1]])
    mask = torch.tensor([[True, True, True]])
    loss, m = grpo_loss(logp, old, behav, torch.tensor([1.0]), mask, aggregation_weights(mask, _CFG), _CFG)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all() and logp.grad[0, 1] == 0
    assert abs(float(m["outside_support_frac"]) - 1 / 3) < 1e-6 and torch.isfinite(m["mismatch_kl"])
    seq = GRPOConfig(is_level="sequence")
    loss_seq, _ = grpo_loss(logp, old, behav, torch.tensor([1.0]), mask, aggregation_weights(mask, seq), seq)
    assert float(loss_seq.detach()) == 0.0  # π_old(y) = 0 for the whole sequence

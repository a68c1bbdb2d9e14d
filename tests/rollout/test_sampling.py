import math
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from sparrow.sampling import (
    SamplingParams,
    process_logits,
    row_keys,
    sample,
    top_k_mask,
    top_p_mask,
    uniform_noise,
)

TEMPERATURES = st.one_of(st.just(0.0), st.floats(0.05, 3.0))
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@st.composite
def logit_rows(draw):
    v = draw(st.integers(1, 40))
    vals = draw(st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=v, max_size=v))
    return torch.tensor(vals, dtype=torch.float64)


def check_top_p(logits: torch.Tensor, kept: torch.Tensor, p: float) -> None:
    """kept must be the smallest set of most likely tokens whose mass reaches p."""
    probs = torch.softmax(logits, -1)
    kept_mass = probs[kept].sum().item()
    assert kept.any()
    # most likely first: every kept token is at least as likely as every dropped one
    if (~kept).any():
        assert probs[kept].min() >= probs[~kept].max()
    assert kept_mass >= p - 1e-9  # reaches p ...
    smallest = probs[kept].min().item()
    assert kept_mass - smallest < p + 1e-9  # ... and dropping its least likely token would not


def _margin_ok(logits, p):
    probs = torch.softmax(logits, -1).sort(descending=True).values
    c = torch.cumsum(probs, 0)
    return bool(((c - p).abs() > 1e-6).all()) and bool((probs[1:] != probs[:-1]).all())


@SETTINGS
@given(logits=logit_rows(), p=st.floats(0.01, 1.0))
def test_top_p_keeps_smallest_set_reaching_p(logits, p):
    assume(_margin_ok(logits, p))
    kept = torch.isfinite(top_p_mask(logits, p))
    check_top_p(logits, kept, p)


def _broken_top_p(logits, p):  # off by one: keeps tokens while the mass *including* them is <= p
    sorted_logits, order = torch.sort(logits, descending=True)
    probs = torch.softmax(sorted_logits, -1)
    drop_sorted = torch.cumsum(probs, -1) > p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def test_top_p_property_catches_a_broken_mask():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0], dtype=torch.float64)
    with pytest.raises(AssertionError):
        check_top_p(logits, torch.isfinite(_broken_top_p(logits, 0.8)), 0.8)
    check_top_p(logits, torch.isfinite(top_p_mask(logits, 0.8)), 0.8)


def check_top_k(logits, kept, k):
    k = min(k, logits.numel())
    kth = logits.sort(descending=True).values[k - 1]
    assert torch.equal(kept, logits >= kth)  # the k largest, plus ties with the k-th


@SETTINGS
@given(logits=logit_rows(), k=st.integers(1, 50))
def test_top_k_keeps_k_largest(logits, k):
    check_top_k(logits, torch.isfinite(top_k_mask(logits, k)), k)


def test_top_k_property_catches_a_broken_mask():
    logits = torch.tensor([3.0, 1.0, 2.0, 0.0])
    broken = torch.isfinite(logits.masked_fill(logits <= logits.sort(descending=True).values[1], float("-inf")))
    with pytest.raises(AssertionError):
        check_top_k(logits, broken, 2)


@SETTINGS
@given(logits=logit_rows(), t=st.floats(0.05, 3.0), p=st.floats(0.05, 1.0), k=st.integers(0, 50))
def test_processed_distribution_is_normalised_on_its_support(logits, t, p, k):
    lp = process_logits(logits.float()[None], SamplingParams(temperature=t, top_p=p, top_k=k))[0]
    assert math.isclose(lp.exp().sum().item(), 1.0, rel_tol=1e-5)
    assert torch.isfinite(lp).any()


def test_gumbel_sampling_matches_the_distribution():
    logits = torch.tensor([1.5, 0.2, -0.5, 0.9, -2.0])
    params = SamplingParams(temperature=0.8, top_p=0.95)
    n = 40000
    keys = row_keys(torch.tensor(7), torch.arange(n), torch.zeros(n, dtype=torch.int64))
    tokens, _ = sample(logits.expand(n, -1), params, keys)
    expected = process_logits(logits[None], params)[0].exp()
    freq = torch.bincount(tokens, minlength=5).double() / n
    tv = 0.5 * (freq - expected.double()).abs().sum().item()
    assert tv < 0.015
    # negative control: tokens drawn from the raw (unprocessed) distribution are far off
    raw = torch.softmax(logits, -1).double()
    assert 0.5 * (freq - raw).abs().sum().item() > 3 * tv


def test_noise_is_uniform_and_counter_based():
    keys = row_keys(torch.tensor(123), torch.arange(64), torch.arange(64))
    u = uniform_noise(keys, 1000)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    # the same (seed, sample, step) gives the same noise whatever else is in the batch
    k2 = row_keys(torch.tensor(123), torch.tensor([5, 70]), torch.tensor([5, 70]))
    assert torch.equal(uniform_noise(k2, 1000)[0], u[5])
    other_seed = uniform_noise(row_keys(torch.tensor(124), torch.arange(64), torch.arange(64)), 1000)
    assert not torch.equal(other_seed, u)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=1e-30), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
    ],
    ids=["neg-temp", "tiny-temp", "top-p-0", "top-p-1.5", "top-k-neg", "max-new-0"],
)
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_unknown_stop_token():
    with pytest.raises(ValueError, match="unknown stop token"):
        SamplingParams(stop_token_ids=(5, 99)).validate_vocab(64)


@pytest.mark.slow
def test_compiled_noise_is_bitwise_equal_to_eager():
    """The decode step is compiled; its noise must equal the eager (prefill / reference) noise bit for bit."""
    from tests.helpers import DEVICE

    keys = row_keys(torch.tensor(2**40 + 7, device=DEVICE), torch.arange(9, device=DEVICE) * 1000,
                    torch.arange(9, device=DEVICE) + 2**20)
    eager = uniform_noise(keys, 151936, salt=3)
    compiled = torch.compile(uniform_noise, fullgraph=True)(keys, 151936, salt=3)
    assert torch.equal(eager.view(torch.int32), compiled.view(torch.int32))


# -- the vocabulary limit and the top-p boundary at a real vocabulary ------------------------------------
from sparrow.sampling import token_logprobs, vocab_mask  # noqa: E402


def _descending_float32_top_p(logits, p):  # the rule summed from the most likely down: rounds near 1
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    keep = (torch.cumsum(probs, dim=-1) - probs) < p
    return torch.zeros_like(keep).scatter(-1, order, keep)


def _float64_top_p(logits, p):
    sorted_logits, order = torch.sort(logits.double(), dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    keep = (torch.cumsum(probs, dim=-1) - probs) < p
    return torch.zeros_like(keep).scatter(-1, order, keep)


@pytest.mark.parametrize("p", [0.5, 0.9, 0.99, 0.999])
def test_top_p_agrees_with_transformers_at_the_qwen_vocabulary(p):
    """151,936 ids: the kept set is the one transformers' TopPLogitsWarper keeps, and float64's count."""
    warper = pytest.importorskip("transformers.generation.logits_process").TopPLogitsWarper
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(4, 151936, generator=g) * 3.0
    ours = torch.isfinite(top_p_mask(logits, p))
    hf = torch.isfinite(warper(p)(None, logits.clone()))
    assert torch.equal(ours, hf)
    exact = _float64_top_p(logits, p).sum(-1)
    assert (ours.sum(-1) - exact).abs().max() <= 2
    if p == 0.999:  # negative control: the float32 sum from the most likely down misses by ~200 tokens
        assert (_descending_float32_top_p(logits, p).sum(-1) - exact).abs().max() > 50


@SETTINGS
@given(logits=logit_rows(), limit=st.integers(1, 40), t=TEMPERATURES, p=st.floats(0.05, 1.0),
       k=st.integers(0, 50))
def test_vocab_limit_removes_the_rows_past_it(logits, limit, t, p, k):
    params = SamplingParams(temperature=t, top_p=p, top_k=k, vocab_limit=limit)
    lp = process_logits(logits.float()[None], params)[0]
    check_vocab_limit(lp, limit)


def check_vocab_limit(lp: torch.Tensor, limit: int) -> None:
    assert (lp[limit:].exp() == 0).all()
    assert math.isclose(lp.exp().sum().item(), 1.0, rel_tol=1e-5)


def test_vocab_limit_property_catches_processing_without_it():
    """The rows past the limit are the most likely ones: processing that ignores the limit samples them."""
    logits = torch.tensor([[0.5, 0.1, -0.3, 4.0, 3.0]])
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9, top_k=2)):
        check_vocab_limit(process_logits(logits, replace(params, vocab_limit=3))[0], 3)
        with pytest.raises(AssertionError):
            check_vocab_limit(process_logits(logits, params)[0], 3)


@SETTINGS
@given(logits=logit_rows(), limit=st.integers(1, 40), t=TEMPERATURES, p=st.floats(0.05, 1.0),
       k=st.integers(0, 50), seed=st.integers(0, 2**31))
def test_token_logprobs_equal_the_processed_distribution_with_gradients(logits, limit, t, p, k, seed):
    """The trainer's token_logprobs (fused cross-entropy when only temperature and the limit apply) equals
    gathering from process_logits, values and gradients, for tokens in the support."""
    V = logits.numel()
    limit = min(limit, V)
    params = SamplingParams(temperature=t, top_p=p, top_k=k, vocab_limit=limit)
    x = logits.float().expand(6, V).clone()
    lp_full = process_logits(x, params)
    g = torch.Generator().manual_seed(seed)
    support = torch.isfinite(lp_full[0]).nonzero().flatten()
    tok = support[torch.randint(0, len(support), (6,), generator=g)]
    a = x.clone().requires_grad_(True)
    b = x.clone().requires_grad_(True)
    got = token_logprobs(a, tok, params)
    want = process_logits(b, params).gather(-1, tok[:, None]).squeeze(-1)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    got.sum().backward()
    want.sum().backward()
    assert torch.allclose(a.grad, b.grad, atol=1e-5)


def test_vocab_limit_validation():
    with pytest.raises(ValueError, match="vocab_limit"):
        SamplingParams(vocab_limit=0)
    with pytest.raises(ValueError, match="exceeds the model"):
        SamplingParams(vocab_limit=65).validate_vocab(64)
    with pytest.raises(ValueError, match="unknown stop token"):  # a stop id the limit makes unreachable
        SamplingParams(vocab_limit=60, stop_token_ids=(61,)).validate_vocab(64)
    x = torch.randn(3, 10)
    assert torch.equal(vocab_mask(x, None), x) and torch.equal(vocab_mask(x, 10), x)
    assert torch.isinf(vocab_mask(x, 7)[:, 7:]).all() and torch.equal(vocab_mask(x, 7)[:, :7], x[:, :7])


def _old_unit(h):  # the mapping before the fix: the largest 24-bit value rounds to 1.0
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def test_uniforms_stay_strictly_inside_the_unit_interval():
    from sparrow.sampling import bits_to_unit

    h = torch.tensor([0, 255, 256, (1 << 32) - 512, (1 << 32) - 256, (1 << 32) - 1], dtype=torch.int64)
    u = bits_to_unit(h)
    assert (u > 0).all() and (u < 1).all()
    assert torch.isfinite(-torch.log(-torch.log(u))).all()
    assert torch.equal(u[:-2], _old_unit(h)[:-2])  # every other value is what it was
    assert _old_unit(h)[-1] == 1.0  # negative control: the old mapping reached 1, a Gumbel value of +inf


def test_the_draw_at_a_real_vocabulary_is_never_decided_by_a_uniform_of_one(monkeypatch):
    """128 draws at Qwen2.5's 151,936 ids (vocabulary limit 151,665): every uniform is below 1, so no Gumbel
    value is +inf, and no id past the limit is drawn. Negative control: with the old uniforms three entries of
    these rows were exactly 1, and each of those rows drew that entry, whatever its probability."""
    import sparrow.sampling as sampling

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(128, 151_936, generator=g)
    keys = row_keys(torch.tensor(9), torch.arange(128), torch.full((128,), 5))
    params = SamplingParams(temperature=1.0, vocab_limit=151_665)
    assert (uniform_noise(keys, 151_936) < 1).all()
    tokens, lp = sample(logits, params, keys)
    assert int(tokens.max()) < 151_665 and torch.isfinite(lp).all()
    monkeypatch.setattr(sampling, "bits_to_unit", _old_unit)
    ones = uniform_noise(keys, 151_936) == 1.0
    rows = ones.any(1).nonzero().flatten()
    assert len(rows) == 3
    old_tokens, _ = sample(logits, params, keys)
    assert torch.equal(old_tokens[rows], ones[rows].float().argmax(1))  # the uniform of one decided the draw


# -- the vocabulary-wide argmax in two steps --------------------------------------------------------------
from sparrow.sampling import ARGMAX_CHUNK, vocab_argmax  # noqa: E402

SPECIALS = st.sampled_from([float("-inf"), float("inf"), float("nan"), 0.0, -0.0, 1.0, 1.0, 2.0])


@st.composite
def tied_rows(draw):
    """[rows, V] float32 with many ties (few distinct values, infinities, NaN, both zeros) and a run length that
    does and does not divide V."""
    rows, v = draw(st.integers(1, 3)), draw(st.integers(1, 40))
    vals = draw(st.lists(st.one_of(SPECIALS, st.floats(-4, 4, width=32)), min_size=rows * v, max_size=rows * v))
    return torch.tensor(vals, dtype=torch.float32).view(rows, v), draw(st.integers(1, 9))


def _last_run_on_ties(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """A broken two-step argmax (the negative control): the last run holding the maximum, not the first."""
    V = x.shape[-1]
    runs = -(-V // chunk)
    best, where = torch.nn.functional.pad(x, (0, runs * chunk - V), value=float("-inf")).unflatten(
        -1, (runs, chunk)).max(dim=-1)
    run = runs - 1 - torch.argmax(best.flip(-1), dim=-1, keepdim=True)
    return (run * chunk + where.gather(-1, run)).squeeze(-1)


@SETTINGS
@given(case=tied_rows())
def test_vocab_argmax_is_torch_argmax(case):
    """The same index as ``torch.argmax`` for every row: the first of equal maxima, across runs and inside one,
    the first NaN, an all -inf row; runs of 1..9 ids over rows of 1..40 (the last run short or full)."""
    x, chunk = case
    assert torch.equal(vocab_argmax(x, chunk), torch.argmax(x, dim=-1))


def test_vocab_argmax_property_catches_the_last_run_on_ties():
    x = torch.tensor([[0.0, 3.0, 1.0, 3.0, 2.0]])  # the maximum in runs 0 and 1 (runs of 2 ids)
    assert int(vocab_argmax(x, 2)) == 1 == int(torch.argmax(x, -1))
    assert int(_last_run_on_ties(x, 2)) == 3


def test_vocab_argmax_at_a_real_vocabulary_compiled_and_eager():
    """151,936 ids (not a multiple of the run length), rows with ties planted across runs, [A, k + 1, V] shaped as
    the verify step's: compiled (as in the decode step) and eager both give ``torch.argmax``'s index."""
    from tests.helpers import DEVICE

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 151_936, generator=g).to(DEVICE)
    x[0, 0, [7, ARGMAX_CHUNK + 5, 150_000]] = 9.0  # equal maxima in three runs
    x[1, 2, -1] = 9.0  # the maximum in the short last run
    want = torch.argmax(x, dim=-1)
    assert int(want[0, 0]) == 7 and int(want[1, 2]) == 151_935
    assert torch.equal(vocab_argmax(x), want)
    assert torch.equal(torch.compile(vocab_argmax, fullgraph=True)(x), want)

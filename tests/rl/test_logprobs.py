import torch

from sparrow.rl import response_logprobs
from sparrow.rollout import SamplingParams
from tests.helpers import random_tiny


def _direct(model, tokens, plen, rlen, L, temperature):
    out = torch.zeros(tokens.shape[0], L)
    for i in range(tokens.shape[0]):
        logits = model(tokens[i: i + 1])[0].float() / temperature
        lp = torch.log_softmax(logits, -1)
        for j in range(int(rlen[i])):
            p = int(plen[i]) + j
            out[i, j] = lp[p - 1, tokens[i, p]]
    return out


def test_chunked_logprobs_equal_full_logits_and_gradients():
    model = random_tiny("qwen2", std=0.1)
    tokens = torch.randint(0, 64, (3, 20))
    plen, rlen = torch.tensor([5, 9, 3]), torch.tensor([10, 11, 2])
    direct = _direct(model, tokens, plen, rlen, 11, 0.7)
    for chunk in (1, 4, 1000):
        model.zero_grad()
        got = response_logprobs(model, tokens, plen, rlen, max_response_len=11, sampling=SamplingParams(temperature=0.7), chunk_size=chunk)
        assert torch.allclose(got, direct, atol=1e-5)
        got.sum().backward()
        g = [p.grad.clone() for p in model.parameters()]
        if chunk == 1:
            g1 = g
        else:
            assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g, g1))


# -- shared-prefix log-probs: one packed sequence per group, same result as one row per sample ------------
import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import sparrow.rl.logprobs as lp_mod  # noqa: E402
from sparrow.rl import shared_prefix_logprobs  # noqa: E402

_MODEL = random_tiny("qwen2", std=0.1)


def _group_batch(prompt_lens, resp_lens, group, seed):
    """Prompt-major rows: ``group`` samples of each prompt, random tokens (never all equal)."""
    g = torch.Generator().manual_seed(seed)
    N = len(prompt_lens) * group
    plen = torch.tensor([p for p in prompt_lens for _ in range(group)])
    rlen = torch.tensor(resp_lens[:N])
    S = int((plen + rlen).max())
    tokens = torch.randint(0, 64, (N, S), generator=g)
    for i, p in enumerate(prompt_lens):
        tokens[i * group:(i + 1) * group, :p] = tokens[i * group, :p].clone()
    return tokens, plen, rlen


def _both(model, tokens, plen, rlen, group, L):
    out = []
    for fn, kw in ((response_logprobs, {}), (shared_prefix_logprobs, {"group": group})):
        model.zero_grad()
        lp = fn(model, tokens, plen, rlen, max_response_len=L, sampling=SamplingParams(temperature=0.8), chunk_size=7,
                **kw)
        if lp.requires_grad:  # no response token at all: nothing to differentiate
            (lp * torch.linspace(0.5, 1.5, lp.numel()).view_as(lp)).sum().backward()
        out.append((lp.detach(), [torch.zeros_like(p) if p.grad is None else p.grad.clone()
                                  for p in model.parameters()]))
    return out


def _agree(a, b, atol=2e-5):
    return torch.allclose(a[0], b[0], atol=atol) and all(torch.allclose(x, y, atol=atol) for x, y in zip(a[1], b[1]))


@settings(max_examples=25, deadline=None)
@given(group=st.integers(1, 4), prompts=st.lists(st.integers(1, 9), min_size=1, max_size=3),
       resp=st.lists(st.integers(0, 8), min_size=12, max_size=12), seed=st.integers(0, 2**16))
def test_shared_prefix_logprobs_and_gradients_equal_per_row(group, prompts, resp, seed):
    tokens, plen, rlen = _group_batch(prompts, resp, group, seed)
    L = max(1, int(rlen.max()))
    per_row, shared = _both(_MODEL, tokens, plen, rlen, group, L)
    assert _agree(per_row, shared)
    assert torch.equal(shared[0] == 0, per_row[0] == 0)  # zero exactly past each response
    # responses back to back: the packed width is the longest prompt plus the longest group's total
    pack = lp_mod.pack_shared_prefix(tokens, plen, rlen, group=group)
    assert pack.tokens.shape == (len(prompts), max(prompts) + int(rlen.view(-1, group).sum(1).max()))


def test_a_leaky_pack_is_caught(monkeypatch):
    # negative control: responses of a group that see each other's tokens change the log-probs
    real = lp_mod.pack_shared_prefix

    def leaky(tokens, prompt_len, response_len, *, group):
        p = real(tokens, prompt_len, response_len, group=group)
        P = p.mask.prefix_len  # the responses follow the longest prompt
        k = torch.arange(p.mask.rest.shape[-1])
        p.mask.rest[:, :, P:] |= k[None, P:] < k[P:, None]  # earlier responses visible
        return p

    tokens, plen, rlen = _group_batch([5, 3], [4, 6, 2, 5, 3, 6], 3, seed=1)
    good = _both(_MODEL, tokens, plen, rlen, 3, 6)
    monkeypatch.setattr(lp_mod, "pack_shared_prefix", leaky)
    bad = _both(_MODEL, tokens, plen, rlen, 3, 6)
    assert _agree(*good) and not _agree(*bad)


def test_shared_prefix_refuses_rows_that_do_not_share_their_prompt():
    tokens, plen, rlen = _group_batch([5, 3], [4, 6, 2, 5, 3, 6], 3, seed=2)
    with pytest.raises(ValueError, match="do not split into groups of 4"):
        shared_prefix_logprobs(_MODEL, tokens, plen, rlen, group=4, max_response_len=6)
    other = tokens.clone()
    other[1, 2] = (other[1, 2] + 1) % 64  # one prompt token differs inside the first group
    with pytest.raises(ValueError, match="do not share their prompt"):
        shared_prefix_logprobs(_MODEL, other, plen, rlen, group=3, max_response_len=6)
    longer = plen.clone()
    longer[4] += 1
    with pytest.raises(ValueError, match="do not share their prompt"):
        shared_prefix_logprobs(_MODEL, tokens, longer, rlen, group=3, max_response_len=6)


# -- activation checkpointing: the same bits, fewer saved activations ---------------------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


def _run_saving(fn, checkpoint_layers: bool, **kw):
    """(log-probs, gradients, bytes the autograd graph saved outside checkpointed regions) of one backward."""
    model = _MODEL
    model.zero_grad()
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp = fn(model, *kw.pop("batch"), sampling=SamplingParams(temperature=0.8), chunk_size=5,
                checkpoint_layers=checkpoint_layers, **kw)
    (lp * torch.linspace(0.5, 1.5, lp.numel()).view_as(lp)).sum().backward()
    return lp, [p.grad.clone() for p in model.parameters()], sum(saved)


@pytest.mark.parametrize("fn,kw", [pytest.param(response_logprobs, {}, id="per-row"),
                                   pytest.param(shared_prefix_logprobs, {"group": 3}, id="shared-prefix")])
def test_activation_checkpointing_gives_the_same_bits_and_saves_less(fn, kw, monkeypatch):
    batch = _group_batch([7, 4], [5, 8, 3, 6, 2, 7], 3, seed=3)
    L = int(batch[2].max())
    lp0, g0, saved0 = _run_saving(fn, False, batch=batch, max_response_len=L, **kw)
    lp1, g1, saved1 = _run_saving(fn, True, batch=batch, max_response_len=L, **kw)
    assert torch.equal(_bits(lp0), _bits(lp1))
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(g0, g1))
    assert saved1 < saved0 / 2, (saved1, saved0)  # the layers' activations are no longer kept
    # negative control: a checkpoint that keeps everything (the layer called directly) saves as much as none
    monkeypatch.setattr(lp_mod, "checkpoint", lambda f, *a, use_reentrant, **k: f(*a, **k))
    _, _, broken = _run_saving(fn, True, batch=batch, max_response_len=L, **kw)
    assert not broken < saved0 / 2

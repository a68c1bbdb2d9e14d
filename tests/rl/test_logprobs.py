import torch

from sparrow.rl import response_logprobs
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
        got = response_logprobs(model, tokens, plen, rlen, max_response_len=11, temperature=0.7, chunk_size=chunk)
        assert torch.allclose(got, direct, atol=1e-5)
        got.sum().backward()
        g = [p.grad.clone() for p in model.parameters()]
        if chunk == 1:
            g1 = g
        else:
            assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(g, g1))

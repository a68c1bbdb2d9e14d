"""The one initialisation of models trained from scratch: what it draws, what it keeps, seeds."""

from __future__ import annotations

import math

import pytest
import torch

from sparrow.models import tiny_qwen2
from sparrow.training import init_weights


def _model(seed=0):
    torch.manual_seed(seed)
    return tiny_qwen2(vocab_size=64, num_layers=4, embed_dim=128, num_heads=4, num_kv_heads=2, intermediate_dim=512)


def test_matrices_are_normal_and_the_rest_is_kept():
    model = _model()
    before = {k: v.clone() for k, v in model.named_parameters()}
    init_weights(model, 0.05)
    for name, p in ((n, q.detach()) for n, q in model.named_parameters()):
        if p.dim() >= 2:
            assert abs(float(p.std()) - 0.05) < 0.01 and abs(float(p.mean())) < 0.01, name
        else:
            assert torch.equal(p, before[name]), name  # norm scales stay 1, biases as built
    assert any(n.endswith("bias") and p.abs().sum() > 0 for n, p in model.named_parameters())


def test_residual_scaling_and_zero_biases():
    model = _model()
    init_weights(model, 0.05, residual_scaling=True, zero_bias=True)
    scaled = 0.05 / math.sqrt(2 * 4)
    for name, p in ((n, q.detach()) for n, q in model.named_parameters()):
        if name.endswith(("output_proj.weight", "w2.weight")):
            assert abs(float(p.std()) - scaled) < 0.005, name
        elif p.dim() >= 2:
            assert abs(float(p.std()) - 0.05) < 0.01, name
        elif name.endswith("bias"):
            assert (p == 0).all(), name
        else:
            assert (p == 1).all(), name


def test_a_seed_fixes_the_weights():
    a, b, c = _model(1), _model(1), _model(2)
    for m in (a, b, c):
        torch.manual_seed(7 if m is not c else 8)
        init_weights(m)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.tok_embeddings.weight, c.tok_embeddings.weight)


def test_bad_arguments():
    with pytest.raises(ValueError, match="std must be > 0, got 0.0"):
        init_weights(_model(), 0.0)
    with pytest.raises(ValueError, match="residual_scaling needs a model with layers, got Linear"):
        init_weights(torch.nn.Linear(2, 2), residual_scaling=True)

"""Shared fixtures of the speculative tests: tiny targets and drafters that share the target's cache."""

from __future__ import annotations

import copy

import torch

from sparrow.rollout.forward import decode_hidden, logits_from_hidden
from sparrow.speculative.base import Drafter


class CopyDrafter(Drafter):
    """A drafter that is another model of the target's shape (e.g. a perturbed copy), run over the
    target's caches. Its draft distributions differ from the target's, so rejections happen often."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def refresh(self) -> None:
        pass

    def forward_logits(self, tokens, caches, meta):
        return logits_from_hidden(self.model, decode_hidden(self.model, tokens, caches, meta))

    def __repr__(self) -> str:
        return "CopyDrafter()"


def perturbed_copy(model: torch.nn.Module, scale: float = 0.15, seed: int = 5) -> torch.nn.Module:
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    return m


def prompts(n_lens=(5, 17, 3, 30, 9), vocab=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in n_lens]

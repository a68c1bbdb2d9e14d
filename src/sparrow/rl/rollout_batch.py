"""Turning engine samples into padded training tensors, and gathering them from the rollout ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist

from sparrow.rollout.engine import Sample


@dataclass
class RolloutBatch:
    """N = prompts x group sequences, padded.

    tokens: [N, S] prompt + response, right-padded with ``pad_id``.
    prompt_len, response_len: [N] int64.
    behaviour_logprobs: [N, L] the engine's log-probs of each response token (0 past the response).
    mask: [N, L] bool, True on response tokens. rewards, advantages: [N] float32.
    """

    tokens: torch.Tensor
    prompt_len: torch.Tensor
    response_len: torch.Tensor
    behaviour_logprobs: torch.Tensor
    mask: torch.Tensor
    rewards: torch.Tensor
    advantages: torch.Tensor

    @property
    def max_response_len(self) -> int:
        return self.mask.shape[1]

    def to(self, device: torch.device | str) -> "RolloutBatch":
        return RolloutBatch(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))

    def select(self, idx: torch.Tensor | slice) -> "RolloutBatch":
        return RolloutBatch(*(getattr(self, f)[idx] for f in self.__dataclass_fields__))


def build_rollout_batch(prompts: Sequence[Sequence[int]], samples: Sequence[Sample], group: int,
                        rewards: torch.Tensor, advantages: torch.Tensor, *, pad_id: int = 0) -> RolloutBatch:
    """``samples`` prompt-major (sample j of prompt i at ``i * group + j``), as the engine returns them."""
    N = len(samples)
    if N != len(prompts) * group:
        raise ValueError(f"{N} samples for {len(prompts)} prompts x group {group}")
    plen = torch.tensor([len(prompts[i // group]) for i in range(N)], dtype=torch.int64)
    rlen = torch.tensor([s.length for s in samples], dtype=torch.int64)
    L = max(1, int(rlen.max()))
    S = int((plen + rlen).max())
    tokens = torch.full((N, S), pad_id, dtype=torch.int64)
    behav = torch.zeros((N, L), dtype=torch.float32)
    prompt_ids = [torch.as_tensor(p, dtype=torch.int64) for p in prompts]  # once per prompt, not per sample
    for i, s in enumerate(samples):
        p = prompt_ids[i // group]
        tokens[i, : len(p)] = p
        tokens[i, len(p): len(p) + s.length] = s.tokens
        behav[i, : s.length] = s.logprobs
    mask = torch.arange(L)[None, :] < rlen[:, None]
    return RolloutBatch(tokens, plen, rlen, behav, mask, rewards.float(), advantages.float())


def exchange_rollouts(batch, local, group: int, world: int, rank: int, device: torch.device, max_new: int,
                      trainers: int = 1):
    """Gather the samples and rewards of every rollout rank (ranks ``trainers .. world-1``) on every trainer
    rank (an all-gather of padded tensors).

    Returns (prompts, samples, rewards) on the trainer ranks and (None, None, None) elsewhere.
    """
    share = len(batch) // (world - trainers)
    rows = share * group
    tok = torch.full((rows, max_new), -1, dtype=torch.int64)
    lp = torch.zeros((rows, max_new), dtype=torch.float32)
    meta = torch.zeros((rows, 3), dtype=torch.float32)  # length, reward, finished-by-stop
    if local is not None:
        _, gen, rewards = local
        for i, s in enumerate(gen.samples):
            tok[i, : s.length] = s.tokens
            lp[i, : s.length] = s.logprobs
            meta[i] = torch.tensor([s.length, float(rewards[i]), 1.0 if s.finish_reason == "stop" else 0.0])
    parts = []
    for t in (tok, lp, meta):
        t = t.to(device)
        out = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(out, t)
        parts.append([o.cpu() for o in out[trainers:]])
    if rank >= trainers:
        return None, None, None
    samples, rewards = [], []
    for r in range(world - trainers):
        for i in range(rows):
            n = int(parts[2][r][i, 0])
            samples.append(Sample(r * share + i // group, i % group, parts[0][r][i, :n].clone(),
                                  parts[1][r][i, :n].clone(), "stop" if parts[2][r][i, 2] > 0 else "length"))
            rewards.append(float(parts[2][r][i, 1]))
    return [b["prompt_ids"] for b in batch], samples, torch.tensor(rewards, dtype=torch.float32)

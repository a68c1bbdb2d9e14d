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
    behaviour_logprobs: [N, L] the engine's log-probs of each response token (0 past the response), each under the
        policy version that sampled it.
    versions: [N, L] int64 that version (-1 past the response, and for samples that carry no stamps).
    mask: [N, L] bool, True on response tokens. rewards, advantages: [N] float32.
    """

    tokens: torch.Tensor
    prompt_len: torch.Tensor
    response_len: torch.Tensor
    behaviour_logprobs: torch.Tensor
    versions: torch.Tensor
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
    versions = torch.full((N, L), -1, dtype=torch.int64)
    prompt_ids = [torch.as_tensor(p, dtype=torch.int64) for p in prompts]  # once per prompt, not per sample
    for i, s in enumerate(samples):
        p = prompt_ids[i // group]
        tokens[i, : len(p)] = p
        tokens[i, len(p): len(p) + s.length] = s.tokens
        behav[i, : s.length] = s.logprobs
        if s.versions is not None:
            versions[i, : s.length] = s.versions
    mask = torch.arange(L)[None, :] < rlen[:, None]
    return RolloutBatch(tokens, plen, rlen, behav, versions, mask, rewards.float(), advantages.float())


def exchange_rollouts(batch, local, group: int, world: int, rank: int, device: torch.device, max_new: int,
                      trainers: int = 1, *, n_prompts: int | None = None, max_prompt_len: int | None = None):
    """Gather the samples and rewards of every rollout rank (ranks ``trainers .. world-1``) on every trainer
    rank (an all-gather of padded tensors).

    Args:
        batch: the step's data rows (every rank drew the same); rollout rank ``r`` generated the ``r``-th equal
            share of them. None when the prompts travel with the samples (then ``n_prompts`` gives their number).
        local: this rank's (prompts, Generation, rewards), None on ranks that do not roll out.
        max_prompt_len: the prompts travel too, padded to this length: partial rollout, where each rollout rank
            trains the groups it chose.

    Returns (prompts, samples, rewards) on the trainer ranks and (None, None, None) elsewhere; the samples carry
    their version stamps.
    """
    n = len(batch) if batch is not None else n_prompts
    if n is None or (batch is None and max_prompt_len is None):
        raise ValueError("exchange_rollouts without a batch needs n_prompts and max_prompt_len")
    share = n // (world - trainers)
    rows = share * group
    tok = torch.full((rows, max_new), -1, dtype=torch.int64)
    lp = torch.zeros((rows, max_new), dtype=torch.float32)
    ver = torch.full((rows, max_new), -1, dtype=torch.int64)
    meta = torch.zeros((rows, 3), dtype=torch.float32)  # length, reward, finished-by-stop
    send = [tok, lp, ver, meta]
    if max_prompt_len is not None:
        send.append(torch.full((share, max_prompt_len + 1), -1, dtype=torch.int64))  # length, then the ids
    if local is not None:
        prompts, gen, rewards = local
        for i, s in enumerate(gen.samples):
            tok[i, : s.length] = s.tokens
            lp[i, : s.length] = s.logprobs
            if s.versions is not None:
                ver[i, : s.length] = s.versions
            meta[i] = torch.tensor([s.length, float(rewards[i]), 1.0 if s.finish_reason == "stop" else 0.0])
        if max_prompt_len is not None:
            for i, p in enumerate(prompts):
                send[4][i, 0] = len(p)
                send[4][i, 1: 1 + len(p)] = torch.as_tensor(p, dtype=torch.int64)
    parts = []
    for t in send:
        t = t.to(device)
        out = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(out, t)
        parts.append([o.cpu() for o in out[trainers:]])
    if rank >= trainers:
        return None, None, None
    samples, rewards = [], []
    for r in range(world - trainers):
        for i in range(rows):
            k = int(parts[3][r][i, 0])
            samples.append(Sample(r * share + i // group, i % group, parts[0][r][i, :k].clone(),
                                  parts[1][r][i, :k].clone(), "stop" if parts[3][r][i, 2] > 0 else "length",
                                  parts[2][r][i, :k].to(torch.int32)))
            rewards.append(float(parts[3][r][i, 1]))
    if max_prompt_len is None:
        prompts = [b["prompt_ids"] for b in batch]
    else:
        prompts = [p[i, 1: 1 + int(p[i, 0])].tolist() for p in parts[4] for i in range(share)]
    return prompts, samples, torch.tensor(rewards, dtype=torch.float32)

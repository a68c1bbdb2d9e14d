"""A token-level synthetic task with long-tailed episode lengths, and its training batches.

:class:`MarkovEpisodes` is a stream of *episodes*: a Markov chain over a class's own tokens (``successors``
Zipf-weighted successors per token) ending with ``EOS`` at a class-dependent hazard, mean episode lengths
log-spaced from ``min_mean`` to ``max_mean`` over the classes. A model trained on it has peaked, structured
next-token distributions (what speculative decoding's acceptance depends on), and prompts that end inside a
fresh episode give rollouts with long-tailed response lengths. Everything is drawn on ``device``.
"""

from __future__ import annotations

import math

import torch

from sparrow.training.data import ANSWER, Batch


class MarkovEpisodes:
    """Episodes of class-coloured Markov chains with a class-dependent stop hazard.

    Token ids: :attr:`EOS` ``= 1``; class ``c`` owns ids ``first + c * per_class .. first + (c + 1) * per_class
    - 1``. Inside an episode each token moves to one of ``successors`` tokens of its class (Zipf weights); after
    each token the episode ends (EOS) with probability ``1 / mean_len[c]``; after EOS a new episode starts at a
    uniformly random token of a uniformly random class. A model needs ``vocab_needed`` embedding rows.

    Raises:
        ValueError: a size below 1, ``first <= EOS`` or not ``0 < min_mean <= max_mean``.
    """

    EOS = 1

    def __init__(self, n_classes: int = 8, per_class: int = 256, successors: int = 8, min_mean: float = 128,
                 max_mean: float = 8192, first: int = 16, seed: int = 0, device: str | torch.device = "cpu") -> None:
        if min(n_classes, per_class, successors) < 1 or first <= self.EOS or not 0 < min_mean <= max_mean:
            raise ValueError(f"MarkovEpisodes: need sizes >= 1, first > {self.EOS}, 0 < min_mean <= max_mean; got "
                             f"{n_classes}, {per_class}, {successors}, {first}, {min_mean}, {max_mean}")
        self.C, self.M, self.first, self.device = n_classes, per_class, first, torch.device(device)
        g = torch.Generator().manual_seed(seed)
        n = n_classes * per_class
        base = (torch.arange(n) // per_class) * per_class
        self.succ = (torch.randint(0, per_class, (n, successors), generator=g) + base[:, None]).to(self.device)
        w = 1.0 / torch.arange(1, successors + 1, dtype=torch.float64) ** 1.1
        self.succ_logp = torch.log(w / w.sum()).float().to(self.device)  # [successors]
        ratio = (max_mean / min_mean) ** (1.0 / max(1, n_classes - 1))
        self.means = [min_mean * ratio**c for c in range(n_classes)]
        self.hazard = torch.tensor([1.0 / m for m in self.means], device=self.device)
        self.vocab_needed = first + n

    def entropy(self) -> float:
        """Mean next-token entropy (nats) inside an episode, ignoring the rare EOS: the loss floor."""
        p = self.succ_logp.exp()
        return float(-(p * self.succ_logp).sum())

    def _step(self, x: torch.Tensor, g: torch.Generator, allow_eos: bool) -> torch.Tensor:
        """x: [R] task-local ids (-1: EOS) -> the next ids."""
        R, dev = x.shape[0], self.device
        xc = x.clamp(min=0)
        u = torch.rand(R, generator=g, device=dev)
        noise = torch.rand(R, self.succ.shape[1], generator=g, device=dev).clamp(1e-12, 1 - 1e-7)
        gumbel = -torch.log(-torch.log(noise))
        nxt = self.succ[xc].gather(1, torch.argmax(self.succ_logp + gumbel, dim=1, keepdim=True)).squeeze(1)
        if allow_eos:
            nxt = torch.where(u < self.hazard[xc // self.M], torch.full_like(nxt, -1), nxt)
        start = torch.randint(0, self.C * self.M, (R,), generator=g, device=dev)
        return torch.where(x < 0, start, nxt)

    def streams(self, rows: int, length: int, g: torch.Generator, start_class: int | None = None,
                allow_eos: bool = True) -> torch.Tensor:
        """``[rows, length]`` vocabulary ids of task streams, a fresh episode starting at position 0."""
        if start_class is None:
            x = torch.randint(0, self.C * self.M, (rows,), generator=g, device=self.device)
        else:
            x = start_class * self.M + torch.randint(0, self.M, (rows,), generator=g, device=self.device)
        out = torch.empty((rows, length), dtype=torch.int64, device=self.device)
        for t in range(length):
            out[:, t] = x
            x = self._step(x, g, allow_eos)
        return torch.where(out < 0, torch.full_like(out, self.EOS), out + self.first)

    def prompts(self, n: int, min_len: int, max_len: int, seed: int,
                tail: int = 24) -> tuple[list[list[int]], list[int]]:
        """``n`` prompts of log-uniform lengths in ``[min_len, max_len]``, each ending ``tail`` tokens inside a
        fresh episode of a random class; and those classes."""
        host = torch.Generator().manual_seed(seed)
        g = torch.Generator(device=self.device).manual_seed(seed)
        lens = torch.exp(torch.empty(n).uniform_(math.log(min_len), math.log(max_len), generator=host)).long().tolist()
        classes = torch.randint(0, self.C, (n,), generator=host).tolist()
        body = self.streams(n, max(lens) - tail, g).cpu()
        out = []
        for i, (L, c) in enumerate(zip(lens, classes)):
            ep = self.streams(1, tail, g, start_class=c, allow_eos=False)[0].cpu()
            out.append(torch.cat([body[i, : L - tail - 1], torch.tensor([self.EOS]), ep]).tolist())
        return out, classes


class EpisodeBatches:
    """Training batches of :class:`MarkovEpisodes` streams: ``batch`` rows of ``seq_len + 1`` tokens drawn from
    a pool of ``batch * 64`` streams, renewed every 64 batches; every target is an :data:`ANSWER` (plain
    language-model loss). The context asked for is ignored: the chain is local."""

    def __init__(self, task: MarkovEpisodes, seq_len: int, batch: int, seed: int = 1) -> None:
        if seq_len < 1 or batch < 1:
            raise ValueError(f"EpisodeBatches: seq_len and batch must be >= 1, got {seq_len}, {batch}")
        self.task, self.seq_len, self.batch = task, seq_len, batch
        self.g = torch.Generator(device=task.device).manual_seed(seed)
        self.pool = task.streams(batch * 64, seq_len + 1, self.g)
        self.count = 0

    def longest_sequence(self, context: int) -> int:
        return self.seq_len + 1

    def next(self, context: int) -> Batch:
        if self.count % 64 == 63:
            self.pool = self.task.streams(self.batch * 64, self.seq_len + 1, self.g)
        self.count += 1
        idx = torch.randint(0, self.pool.shape[0], (self.batch,), generator=self.g, device=self.task.device)
        roles = torch.full((self.batch, self.seq_len), ANSWER, dtype=torch.int8, device=self.task.device)
        return Batch(self.pool[idx], roles, ["episodes"] * self.batch, self.seq_len)

    def close(self) -> None:
        pass

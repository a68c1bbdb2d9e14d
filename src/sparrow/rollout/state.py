"""The engine's device state: one :class:`RowState` for the generation slots, one :class:`DraftState` for the
speculative cycle's scratch. Every compiled step reads and writes them in place, so CUDA graphs captured once
keep working across generations."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparrow.attention.base import DecodeMeta


@dataclass
class RowState:
    """Per generation slot (``R`` = the engine's rows + one scratch row that padding rows point at; every
    generation ``L = max_new_tokens + max_draft + 1`` long, the verify pass's scratch columns included).

    Attributes:
        tokens: [R, L] int64 emitted tokens.
        logprobs: [R, L] float32 their log-probs under the processed distribution they were sampled from.
        versions: [R, L] int32 the policy version that sampled each token (:attr:`policy_version` when it was
            emitted).
        n_gen: [R] int64 tokens emitted; the last one's KV is not cached yet.
        done: [R] bool the row stopped (stop token or ``max_new``); the scratch row always is.
        last_token: [R] int64 the token the next step feeds.
        prefix_slot: [R] int64 the prefix slot (prompt) the row reads.
        prefix_len: [R] int64 that prompt's length.
        sample_id: [R] int64 the row's noise stream (``group * n_samples + sample``, the group's id in its session).
        seed: [] int64 base of the counter-based noise of the current generation.
        max_new: [] int64 tokens a row may emit in the current generation.
        policy_version: [] int32 the version of the weights the steps sample from now, stamped on every token
            they emit (set in place between blocks, after a weight sync: captured graphs read it).
    """

    tokens: torch.Tensor
    logprobs: torch.Tensor
    versions: torch.Tensor
    n_gen: torch.Tensor
    done: torch.Tensor
    last_token: torch.Tensor
    prefix_slot: torch.Tensor
    prefix_len: torch.Tensor
    sample_id: torch.Tensor
    seed: torch.Tensor
    max_new: torch.Tensor
    policy_version: torch.Tensor

    @classmethod
    def allocate(cls, rows: int, length: int, device: torch.device) -> "RowState":
        def i64(*shape: int, fill: int = 0) -> torch.Tensor:
            return torch.full(shape, fill, dtype=torch.int64, device=device)

        return cls(tokens=i64(rows, length), logprobs=torch.zeros((rows, length), dtype=torch.float32, device=device),
                   versions=torch.zeros((rows, length), dtype=torch.int32, device=device),
                   n_gen=i64(rows, fill=1), done=torch.ones(rows, dtype=torch.bool, device=device),
                   last_token=i64(rows), prefix_slot=i64(rows), prefix_len=i64(rows, fill=1), sample_id=i64(rows),
                   seed=i64(), max_new=i64(fill=1), policy_version=torch.zeros((), dtype=torch.int32, device=device))

    def meta(self, row_slot: torch.Tensor, cached_len: torch.Tensor) -> DecodeMeta:
        """Attention metadata of rows ``row_slot`` [A] whose new tokens start after ``cached_len`` [A] cached ones,
        with the rows grouped by prompt (on the device, static shapes) for the backends' shared-prefix decode."""
        return DecodeMeta(row_slot, self.prefix_slot[row_slot], self.prefix_len[row_slot], cached_len).grouped()

    def stand_in(self, rows: torch.Tensor, prefix_slot: torch.Tensor, prefix_len: int, n_gen: int) -> None:
        """Rows ``rows`` [A] as rows at context ``prefix_len + n_gen`` reading ``prefix_slot`` [A] (their own noise
        streams, last token 0), done: steps run on them change no length (for timing them)."""
        self.prefix_slot[rows] = prefix_slot
        self.prefix_len[rows] = prefix_len
        self.n_gen[rows] = n_gen
        self.sample_id[rows] = rows
        self.last_token[rows] = 0
        self.done[rows] = True

    def idle(self, rows: torch.Tensor | slice = slice(None)) -> None:
        """Rows back to the state of a fresh allocation: nothing cached, done."""
        self.n_gen[rows] = 1
        self.prefix_len[rows] = 1
        self.done[rows] = True


@dataclass
class DraftState:
    """Scratch of the speculative cycle (``R`` rows as :class:`RowState`, ``K`` = the engine's ``max_draft``).

    Attributes:
        tokens: [R, K] int64 draft tokens of the current cycle, by batch position.
        probs: [R, K, V] float32 processed draft probabilities they were drawn from (unused when greedy).
        cursor: [] int64 the draft index the next draft step writes (a tensor, so every draft step is one graph).
        counters: [3] int64 since the last block's host read: draft tokens proposed to live rows, accepted,
            live row-cycles.
    """

    tokens: torch.Tensor
    probs: torch.Tensor
    cursor: torch.Tensor
    counters: torch.Tensor

    @classmethod
    def allocate(cls, rows: int, max_draft: int, vocab: int, device: torch.device) -> "DraftState":
        return cls(tokens=torch.zeros((rows, max_draft), dtype=torch.int64, device=device),
                   probs=torch.zeros((rows, max_draft, vocab), dtype=torch.float32, device=device),
                   cursor=torch.zeros((), dtype=torch.int64, device=device),
                   counters=torch.zeros(3, dtype=torch.int64, device=device))

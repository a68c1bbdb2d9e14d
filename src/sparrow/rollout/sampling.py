"""Sampling: parameters, logit processing (temperature, top-k, top-p) and batch-invariant noise.

Every function here is shape-static and host-sync-free, so it runs inside the compiled decode step.

Randomness is *counter-based*: the noise for vocabulary entry ``v`` of token ``t`` of sample ``i`` is a
hash of ``(seed, i, t, v)``. A sample's tokens therefore do not depend on which other rows share its
batch, on compaction, on prefix sharing, or on CUDA-graph replay order — a seeded run is reproducible
and its rows are independent. Sampling is Gumbel-max: ``argmax(logprobs + gumbel)`` draws exactly from
``softmax(logprobs)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_M32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. Validated on construction (``ValueError`` naming the bad field).

    Attributes:
        temperature: ``0`` is greedy; otherwise logits are divided by it.
        top_p: nucleus mass in ``(0, 1]``; ``1`` disables.
        top_k: keep the ``k`` most likely tokens (ties with the k-th kept too); ``0`` disables.
        max_new_tokens: generated tokens per sample, at least 1.
        stop_token_ids: a sample finishes after emitting any of these (the stop token is included).
        seed: base of the counter-based noise.

    The log-probability reported for each token is taken under the distribution it was sampled from
    (after temperature / top-k / top-p). For greedy decoding (``temperature == 0``) it is the model's
    unprocessed ``log_softmax``.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    seed: int = 0

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate_vocab(self, vocab_size: int) -> None:
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"unknown stop token ids {bad}: the vocabulary has {vocab_size} tokens")


def top_k_mask(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Set everything below the k-th largest logit to -inf. logits: [..., V]."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_mask(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``p``; -inf elsewhere.

    logits: [..., V]. The most likely token is always kept.
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of the strictly more likely tokens
    drop_sorted = mass_before >= p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities of the distribution tokens are sampled from. logits: [..., V] float32."""
    logits = logits.float()
    if params.greedy:
        return torch.log_softmax(logits, dim=-1)
    logits = logits / params.temperature
    logits = top_k_mask(logits, params.top_k)
    logits = top_p_mask(logits, params.top_p)
    return torch.log_softmax(logits, dim=-1)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    # a 32-bit integer finaliser on int64 tensors holding values in [0, 2**32)
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def row_keys(seed: torch.Tensor, sample_id: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Per-token 32-bit keys. seed: [] int64; sample_id: [N] int64; step: [N] or [N, T] int64."""
    s = _mix32((seed & _M32) ^ _mix32((seed >> 32) & _M32) ^ 0x2545F491)
    if step.dim() == 2:
        sample_id = sample_id[:, None]
    k = _mix32(s ^ (sample_id & _M32))
    return _mix32(k ^ _mix32(step & _M32))


def uniform_noise(keys: torch.Tensor, vocab_size: int, salt: int = 0) -> torch.Tensor:
    """Uniforms in (0, 1), float32, shape ``keys.shape + (V,)``; deterministic in (key, index, salt).

    The vocabulary index enters only through XOR (no multiplication of an index by a large constant),
    so compiled kernels, whose index arithmetic may be 32-bit, compute the same bits as eager mode.
    """
    v = torch.arange(vocab_size, device=keys.device, dtype=torch.int64)
    salt_c = (0x5BD1E995 + salt * 0x27D4EB2F) & _M32
    h = _mix32(_mix32(keys[..., None] ^ v) ^ salt_c)
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def gumbel_noise(keys: torch.Tensor, vocab_size: int, salt: int = 0) -> torch.Tensor:
    return -torch.log(-torch.log(uniform_noise(keys, vocab_size, salt)))


def sample_from_logprobs(logprobs: torch.Tensor, keys: torch.Tensor, greedy: bool) -> torch.Tensor:
    """Draw one token per row. logprobs: [..., V]; keys: [...] (see :func:`row_keys`). Returns int64 [...]."""
    if greedy:
        return torch.argmax(logprobs, dim=-1)
    return torch.argmax(logprobs + gumbel_noise(keys, logprobs.shape[-1]), dim=-1)


def sample(
    logits: torch.Tensor, params: SamplingParams, keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Process ``logits`` [..., V] and draw tokens; returns (tokens int64 [...], their log-probs float32 [...])."""
    logprobs = process_logits(logits, params)
    tokens = sample_from_logprobs(logprobs, keys, params.greedy)
    return tokens, logprobs.gather(-1, tokens[..., None]).squeeze(-1)

"""Sampling: parameters, logit processing (vocabulary limit, temperature, top-k, top-p) and batch-invariant
noise.

Every function here is shape-static and host-sync-free, so it runs inside the compiled decode step; the
trainer computes its log-probs with the same processing (:func:`token_logprobs`).

Randomness is *counter-based*: the noise for vocabulary entry ``v`` of token ``t`` of sample ``i`` is a
hash of ``(seed, i, t, v)``. A sample's tokens therefore do not depend on which other rows share its
batch, on compaction, on prefix sharing, or on CUDA-graph replay order — a seeded run is reproducible
and its rows are independent. Sampling is Gumbel-max: ``argmax(logprobs + gumbel)`` draws exactly from
``softmax(logprobs)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

_M32 = 0xFFFFFFFF
MIN_TEMPERATURE = 1e-5


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
        vocab_limit: ids at or above it are never sampled (``None``: every id of the model may be). A
            checkpoint's embedding often has more rows than its tokenizer has tokens (Qwen2.5: 151,936 rows,
            151,665 tokens): the rows past the tokenizer have no text, so they are masked out of the
            distribution. The GRPO recipe sets it from the tokenizer.

    The log-probability reported for each token is taken under the distribution it was sampled from
    (vocabulary limit, temperature, top-k, top-p: :func:`process_logits`); the trainer computes its
    log-probs under the same processing (:func:`token_logprobs`), so behaviour and trainer policies are
    one distribution. For greedy decoding (``temperature == 0``) it is the ``log_softmax`` of the model's
    logits over the vocabulary limit, without temperature, top-k or top-p.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    seed: int = 0
    vocab_limit: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature == 0.0 or self.temperature >= MIN_TEMPERATURE):
            raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE} (float32 logits divided by "
                             f"less overflow), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.vocab_limit is not None and self.vocab_limit < 1:
            raise ValueError(f"vocab_limit must be >= 1 (None: no limit), got {self.vocab_limit}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate_vocab(self, vocab_size: int) -> None:
        """Check the parameters against a model with ``vocab_size`` embedding rows (``ValueError``)."""
        if self.vocab_limit is not None and self.vocab_limit > vocab_size:
            raise ValueError(f"vocab_limit ({self.vocab_limit}) exceeds the model's {vocab_size} embedding rows")
        limit = vocab_size if self.vocab_limit is None else self.vocab_limit
        bad = [t for t in self.stop_token_ids if not 0 <= t < limit]
        if bad:
            raise ValueError(f"unknown stop token ids {bad}: the vocabulary has {limit} tokens")

    @property
    def processing(self) -> tuple:
        """What the processed distribution depends on (compiled steps specialise on it)."""
        return (self.temperature, self.top_p, self.top_k, self.vocab_limit)


def top_k_mask(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Set everything below the k-th largest logit to -inf. logits: [..., V]."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_mask(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``p``; -inf elsewhere.

    logits: [..., V]. The most likely token is always kept. A token is dropped when the mass of itself and
    every less likely token is at most ``1 - p`` (the same rule as dropping it when the strictly more likely
    tokens already reach ``p``), summed from the least likely up, as Hugging Face's ``TopPLogitsWarper``
    does: a float32 sum taken from the most likely down rounds at the boundary, where it is near 1 (at
    151,936 ids and p = 0.999 it kept 82,186 tokens against 82,346 by float64).
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits.detach(), dim=-1, descending=False)
    tail = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)  # mass of each token and every less likely one
    drop_sorted = tail <= 1.0 - p
    drop_sorted[..., -1] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def vocab_mask(logits: torch.Tensor, limit: int | None) -> torch.Tensor:
    """-inf at ids ``>= limit`` (embedding rows with no token). logits: [..., V]."""
    if limit is None or limit >= logits.shape[-1]:
        return logits
    return logits.masked_fill(torch.arange(logits.shape[-1], device=logits.device) >= limit, float("-inf"))


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities of the distribution tokens are sampled from. logits: [..., V] float32."""
    logits = vocab_mask(logits.float(), params.vocab_limit)
    if params.greedy:
        return torch.log_softmax(logits, dim=-1)
    logits = logits / params.temperature
    logits = top_k_mask(logits, params.top_k)
    logits = top_p_mask(logits, params.top_p)
    return torch.log_softmax(logits, dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probability of ``tokens`` [...] under :func:`process_logits` of ``logits`` [..., V]: the trainer's
    side of the behaviour distribution, differentiable in ``logits``. -inf for a token outside the processed
    support (dropped by top-k / top-p under these logits).

    Without top-k / top-p the vocabulary limit is a slice and the log-softmax a fused cross-entropy, so no
    second ``[..., V]`` tensor is made (the trainer evaluates thousands of tokens x 151,936 ids per chunk).

    ``tokens`` must lie below the vocabulary limit (the engine never samples above it; the recipe checks
    the batches it trains on).
    """
    V = logits.shape[-1]
    limit = V if params.vocab_limit is None else min(params.vocab_limit, V)
    if params.greedy or (params.top_k == 0 and params.top_p >= 1.0):
        x = logits[..., :limit].float()
        if not params.greedy and params.temperature != 1.0:
            x = x / params.temperature
        lp = -F.cross_entropy(x.reshape(-1, limit), tokens.reshape(-1), reduction="none")
        return lp.view(tokens.shape)
    return process_logits(logits, params).gather(-1, tokens[..., None]).squeeze(-1)


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
    return bits_to_unit(_mix32(_mix32(keys[..., None] ^ v) ^ salt_c))


def bits_to_unit(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes (int64 holding [0, 2**32)) -> float32 uniforms strictly inside (0, 1): the top 24 bits
    ``b`` give ``(b + 0.5) / 2**24``, except that the largest, ``(2**24 - 0.5) / 2**24``, has no float32 and
    would round to 1.0 — a Gumbel value of +inf that wins any argmax, masked ids included (at 151,936 ids about
    one token in 110 would be that entry, whatever its probability): it is held at the float32 below 1."""
    return (((h >> 8).float() + 0.5) * (1.0 / (1 << 24))).clamp(max=1.0 - 2.0**-24)


def gumbel_noise(keys: torch.Tensor, vocab_size: int, salt: int = 0) -> torch.Tensor:
    return -torch.log(-torch.log(uniform_noise(keys, vocab_size, salt)))


ARGMAX_CHUNK = 2048  # ids per run of :func:`vocab_argmax`'s first step


def vocab_argmax(x: torch.Tensor, chunk: int = ARGMAX_CHUNK) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` (x: [..., V] float; int64 [...]), the same index, in two steps: the maximum of
    each run of ``chunk`` ids and where it stands, then the first run holding the largest of them. Both steps keep
    the first of equal values (and a NaN, as ``argmax`` does), so the pick is the first maximum of the row; a
    maximum is exact, so no rounding differs. Compiled, the first step runs one program per (row, run), where
    a plain ``argmax`` over the vocabulary is one program per row walking every id (Inductor does not split
    arg-reductions): at one row, 151,936 ids through one program."""
    V = x.shape[-1]
    if V <= chunk:
        return torch.argmax(x, dim=-1)
    runs = -(-V // chunk)
    padded = F.pad(x, (0, runs * chunk - V), value=float("-inf"))  # the pad ends the last run: never first
    best, where = padded.unflatten(-1, (runs, chunk)).max(dim=-1)  # [..., runs]
    run = torch.argmax(best, dim=-1, keepdim=True)  # [..., 1]
    return (run * chunk + where.gather(-1, run)).squeeze(-1)


def sample_from_logprobs(logprobs: torch.Tensor, keys: torch.Tensor, greedy: bool) -> torch.Tensor:
    """Draw one token per row. logprobs: [..., V]; keys: [...] (see :func:`row_keys`). Returns int64 [...]."""
    if greedy:
        return vocab_argmax(logprobs)
    return vocab_argmax(logprobs + gumbel_noise(keys, logprobs.shape[-1]))


def sample(
    logits: torch.Tensor, params: SamplingParams, keys: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Process ``logits`` [..., V] and draw tokens; returns (tokens int64 [...], their log-probs float32 [...])."""
    logprobs = process_logits(logits, params)
    tokens = sample_from_logprobs(logprobs, keys, params.greedy)
    return tokens, logprobs.gather(-1, tokens[..., None]).squeeze(-1)

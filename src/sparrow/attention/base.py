"""The :class:`AttentionBackend` interface and the data it exchanges with the model and the engine.

A backend owns one attention layer's KV-cache *layout* and computes that layer's attention in three
regimes:

* ``forward_train`` — dense, differentiable, causal attention over whole sequences (the trainer).
* ``prefill`` — prompts, right-padded to a common length, written into *prefix slots* of the cache.
* ``decode`` — ``T >= 1`` new tokens per active row (``T > 1`` for speculative verification), written
  into the row's *generation slot*, attending to its prompt prefix plus everything it generated.

The cache itself is an explicit value (a ``NamedTuple`` of tensors made by :meth:`init_cache`), held by
the engine and passed in on every call, so compiled steps and CUDA graphs see fixed buffers and no state
hides in the backend. Prompt prefixes and generations live in separate slots: ``n_samples`` rows of one
GRPO group point at one prefix slot, so a prompt is prefilled and stored once.

Metadata (:class:`PrefillMeta`, :class:`DecodeMeta`) is built once per engine step and shared by all
layers. All index tensors are int64 on the cache's device; nothing in them forces a host sync.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from sparrow.kernels.decode_attention import prefix_groups


@dataclass(frozen=True)
class LayerShape:
    """Static shape of one attention layer. ``num_heads % num_kv_heads == 0``."""

    layer_idx: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.num_heads <= 0 or self.num_kv_heads <= 0 or self.head_dim <= 0:
            raise ValueError(f"LayerShape sizes must be positive, got {self}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads


@dataclass(frozen=True)
class CacheSpec:
    """Capacity of one engine's caches.

    Attributes:
        num_prefixes: prompt slots (distinct prompts resident at once).
        max_prefix_len: tokens per prompt slot.
        num_rows: generation slots (sampled sequences resident at once). The engine reserves one more
            slot internally as a scratch row for batch padding.
        max_gen_len: tokens per generation slot (new tokens whose KV is cached, plus draft scratch).
    """

    num_prefixes: int
    max_prefix_len: int
    num_rows: int
    max_gen_len: int

    def __post_init__(self) -> None:
        for name in ("num_prefixes", "max_prefix_len", "num_rows", "max_gen_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"CacheSpec.{name} must be positive, got {getattr(self, name)}")


class PrefillMeta(NamedTuple):
    """Per-prefill-call metadata. ``P`` prompts, right-padded to ``S`` tokens.

    prefix_slot: [P] int64 — prefix slot each prompt is written to.
    prompt_len:  [P] int64 — real length of each prompt (``<= S``); positions past it are padding.
    """

    prefix_slot: torch.Tensor
    prompt_len: torch.Tensor


class DecodeMeta(NamedTuple):
    """Per-decode-step metadata for ``A`` active rows, each feeding ``T`` new tokens.

    row_slot:     [A] int64 — generation slot of each row (the scratch slot for padding rows).
    prefix_slot:  [A] int64 — prefix slot holding the row's prompt.
    prefix_len:   [A] int64 — prompt length of the row.
    cached_len:   [A] int64 — generated tokens of the row already in its generation slot. The new
                  tokens are written at ``cached_len .. cached_len + T - 1`` and sit at absolute
                  positions ``prefix_len + cached_len + t``; token ``t`` attends to the whole prefix,
                  the cached tokens and new tokens ``0..t``.
    prefix_order: [A] int64 or None — the rows sorted by prompt (prefix slot, then length; stable), and
    group_start:  [A] int64 or None — the sorted position where each sorted position's group of rows that
                  share a prompt begins (:func:`sparrow.kernels.decode_attention.prefix_groups`, built on the
                  device from ``prefix_slot`` / ``prefix_len``). With them, a backend's shared-prefix decode reads
                  each prompt once for its whole group; None: no grouping (see :meth:`grouped`).
    """

    row_slot: torch.Tensor
    prefix_slot: torch.Tensor
    prefix_len: torch.Tensor
    cached_len: torch.Tensor
    prefix_order: torch.Tensor | None = None
    group_start: torch.Tensor | None = None

    def grouped(self) -> "DecodeMeta":
        """This metadata with the rows' grouping by prompt (built on the device when absent; no host sync)."""
        if self.prefix_order is not None and self.group_start is not None:
            return self
        return self._replace(**dict(zip(("prefix_order", "group_start"),
                                        prefix_groups(self.prefix_slot, self.prefix_len))))


@dataclass(frozen=True)
class PrefixPackMask:
    """The attention pattern of packed sequences whose first ``prefix_len`` positions are causal among themselves
    (a prompt shared by what follows) and whose later queries attend as ``rest`` says (e.g. a response to the
    prompt and to itself). A query inside the prefix that is padding attends causally too: its output must be
    unused, and no query past the prefix may attend to it (``rest`` False there).

    prefix_len: ``P`` >= 0, the same for every sequence of the batch.
    rest: bool [B, S - P, S], True where query ``P + i`` attends to key ``j``; every row needs a True.

    Raises ``ValueError`` for a negative ``prefix_len`` or a ``rest`` that is not a 3-D bool tensor with at least
    ``P`` more keys than queries (the shapes against the queries are checked where it is used).
    """

    prefix_len: int
    rest: torch.Tensor

    def __post_init__(self) -> None:
        P, r = self.prefix_len, self.rest
        if not isinstance(P, int) or P < 0:
            raise ValueError(f"PrefixPackMask: prefix_len must be an int >= 0, got {P!r}")
        if not isinstance(r, torch.Tensor) or r.dtype != torch.bool or r.dim() != 3 or r.shape[2] != P + r.shape[1]:
            raise ValueError(f"PrefixPackMask: rest must be bool [B, S - P, S] with P = {P}, got "
                             f"{getattr(r, 'dtype', type(r).__name__)}{tuple(getattr(r, 'shape', ()))}")


class AttentionBackend(nn.Module, abc.ABC):
    """One layer's attention: KV-cache layout + train / prefill / decode computation.

    Tensors use the layout ``q: [B, Hq, S, D]``, ``k, v: [B, Hkv, S, D]`` (post-RoPE). ``q_pre`` and
    ``k_pre`` are the same projections *before* RoPE, for backends that index tokens with them
    (RTPurbo); dense backends ignore them. A backend may hold parameters (an indexer); those are not
    part of the model's checkpoint and are saved by the backend's own tooling.
    """

    def __init__(self, shape: LayerShape) -> None:
        super().__init__()
        self.shape = shape

    # -- capabilities ---------------------------------------------------------------------------
    def validate_configuration(self, *, dtype: torch.dtype, device: torch.device) -> list[str]:
        """Reasons this backend cannot run with ``dtype`` on ``device`` (empty list: it can)."""
        return []

    # -- training -------------------------------------------------------------------------------
    @abc.abstractmethod
    def forward_train(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        q_pre: torch.Tensor | None = None,
        k_pre: torch.Tensor | None = None,
        mask: torch.Tensor | PrefixPackMask | None = None,
    ) -> torch.Tensor:
        """Differentiable attention over whole sequences; causal when ``mask`` is None.

        ``mask``: optional bool [B, S, S] (True = attend) or a :class:`PrefixPackMask`. Returns [B, Hq, S, D].
        """

    # -- cache ----------------------------------------------------------------------------------
    @abc.abstractmethod
    def init_cache(self, spec: CacheSpec, *, dtype: torch.dtype, device: torch.device) -> Any:
        """Allocate this layer's cache for ``spec`` (a NamedTuple of tensors; contents undefined)."""

    def cache_nbytes(self, cache: Any) -> int:
        """Bytes held by ``cache``."""
        return sum(t.numel() * t.element_size() for t in cache if isinstance(t, torch.Tensor))

    # -- inference ------------------------------------------------------------------------------
    @abc.abstractmethod
    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: Any,
        meta: PrefillMeta,
        *,
        q_pre: torch.Tensor | None = None,
        k_pre: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention over right-padded prompts; writes their KV into ``meta.prefix_slot``.

        q: [P, Hq, S, D]; k, v: [P, Hkv, S, D]. Returns [P, Hq, S, D] (rows past ``prompt_len`` are
        unspecified).
        """

    @abc.abstractmethod
    def decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: Any,
        meta: DecodeMeta,
        *,
        q_pre: torch.Tensor | None = None,
        k_pre: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of ``T`` new tokens per row; writes their KV into the rows' generation slots.

        q: [A, Hq, T, D]; k, v: [A, Hkv, T, D]. Returns [A, Hq, T, D]. Must not synchronise with the
        host (it runs inside compiled, CUDA-graphed decode steps).
        """

    def extra_repr(self) -> str:
        s = self.shape
        return f"layer={s.layer_idx}, heads={s.num_heads}, kv_heads={s.num_kv_heads}, head_dim={s.head_dim}"

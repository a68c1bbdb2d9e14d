"""RTPurbo: sparse rollout attention — retrieval heads with a 16-dim indexer and top-p block selection,
sink + sliding-window attention for every other head.

Per layer, a :class:`HeadProfile` (from calibration, see :mod:`sparrow.calibrate`) marks some kv heads as
*retrieval* heads (their query heads follow them). For those, the backend keeps the full KV plus 16-dim
*indexer keys* (a low-rank projection of the pre-RoPE keys); each query (decode) or query block (prefill)
scores the key blocks with its indexer query (divided by the head's calibrated temperature), keeps the smallest
set of blocks holding ``top_p`` of the indexer's softmax mass plus the sink block and a short local window, and
attends to them exactly. ``top_p`` lives in device buffers (per generation-length tier, see
:meth:`RTPurboAttention.set_selection`) that the kernels read, so a schedule can change it between steps without
recompiling or re-capturing CUDA graphs. Every
other kv head attends only to ``num_sinks`` sink tokens and a ``window``-token sliding window, held in
ring buffers whose size does not grow with the context.

Training stays dense (:meth:`RTPurboAttention.forward_train` is exact attention): rollouts are sparse,
gradients are not. The indexer's parameters (``indexer_q``, ``indexer_k``) live in this module, not in
the model's checkpoint; :mod:`sparrow.attention.rtpurbo_io` saves and loads them with the profile.

RTPurbo's home, :mod:`sparrow.attention`:

* this module — :class:`RTPurboConfig`, :class:`HeadProfile`, :class:`IndexerWeights`, the cache
  (:class:`RTPurboCache`), the backend (:class:`RTPurboAttention`) and its factories;
* :mod:`~sparrow.attention.rtpurbo_io` — the calibration files (``rtpurbo.json``,
  ``rtpurbo_indexer.safetensors``) and :func:`~sparrow.attention.rtpurbo_io.rtpurbo_from_checkpoint`;
* :mod:`~sparrow.attention.rtpurbo_stats` — selection statistics (measured density);
* :mod:`~sparrow.attention.common` — what it shares with the dense backend (cache writes, causal attention,
  kernel choice, configuration reasons).

Kernels, which take tensors and never import this package: :mod:`sparrow.kernels.sparse_decode` (Triton
indexer scores, top-p threshold, split-KV sparse and local attention), :mod:`sparrow.kernels.sparse_prefill`
(Triton block scores, FlexAttention block-sparse and sliding-window masks), :mod:`sparrow.kernels.topp`
(bisection top-p), each with a PyTorch reference.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.attention.base import AttentionBackend, CacheSpec, DecodeMeta, LayerShape, PrefillMeta
from sparrow.attention.common import (
    SharedPrefix, causal_attention, check_shared_prefix, configuration_reasons, decode_impl, prefix_index, put,
    row_index, shared_prefix_on, train_attention,
)
from sparrow.attention.rtpurbo_stats import SelectionStats, summarize
from sparrow.kernels.common.impl import IMPLS, Impl
from sparrow.kernels.decode_attention import cascade_local_attention
from sparrow.kernels.sparse_decode import SparseDecodeCache, SparseDecodeConfig, sparse_decode_attention
from sparrow.kernels.sparse_prefill import PrefillImpl, SparsePrefillConfig, sparse_prefill_attention
from sparrow.kernels.sparse_prefill.api import PREFILL_IMPLS

__all__ = ["RTPurboConfig", "HeadProfile", "IndexerWeights", "RTPurboAttention", "RTPurboCache",
           "rtpurbo_attention", "rtpurbo_backends", "collect_selection_stats"]


@dataclass(frozen=True)
class RTPurboConfig:
    """RTPurbo parameters (validated on construction).

    Attributes:
        retrieval_ratio: fraction of (layer, kv head) pairs that calibration marks as retrieval heads.
        num_sinks: leading prompt tokens every head always sees (``<= decode_block, prefill_block``).
        window: sliding window of the non-retrieval heads, in tokens (8192 for long-context models;
            :meth:`for_context` scales it down for small ones).
        ret_window: tokens before each query that retrieval heads always keep (rounded out to blocks).
        indexer_dim: indexer projection size (a power of two; 16 = head_dim / 8 at head_dim 128).
        top_p: indexer mass each query (decode) / query block (prefill) keeps; ``1.0`` keeps everything.
        decode_block: selection granularity in decode, tokens.
        prefill_block: query / key block of the prefill selection and of the FlexAttention masks.
        ring_slack: extra slots of the per-row window ring: decode steps may feed up to ``ring_slack + 1``
            tokens (speculative verification) without overwriting what their first token still sees.
        impl: decode kernels and prefill block scoring — ``"triton"``, ``"reference"`` or ``"auto"``
            (Triton on CUDA for power-of-two head dims >= 16).
        prefill_impl: ``"flex"`` (block-sparse FlexAttention), ``"reference"`` (dense masks) or ``"auto"``
            (flex on CUDA).
        dense_prefill_below: prefills whose padded prompt length is below this many tokens attend densely in
            every head (the caches are written exactly as by the sparse prefill; decode stays sparse): selecting
            blocks costs more than it saves on short prompts (measured in ``docs/benchmarks.md``). ``0``: always
            sparse.
        shared_prefix: local heads' decode reads each prompt's sinks + window once for all the rows that share it
            (:func:`sparrow.kernels.decode_attention.cascade_local_attention`; retrieval heads keep their own
            selection per query): ``"auto"`` (when the metadata groups rows by prompt and Triton runs), ``True``
            or ``False``.
    """

    retrieval_ratio: float = 0.15
    num_sinks: int = 4
    window: int = 8192
    ret_window: int = 128
    indexer_dim: int = 16
    top_p: float = 0.9
    decode_block: int = 64
    prefill_block: int = 128
    ring_slack: int = 64
    impl: Impl = "auto"
    prefill_impl: PrefillImpl = "auto"
    dense_prefill_below: int = 0
    shared_prefix: SharedPrefix = "auto"

    def __post_init__(self) -> None:
        check_shared_prefix(self.shared_prefix, "RTPurboConfig")
        if not 0.0 <= self.retrieval_ratio <= 1.0:
            raise ValueError(f"retrieval_ratio must be in [0, 1], got {self.retrieval_ratio}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name in ("window", "ret_window", "indexer_dim", "decode_block", "prefill_block"):
            if getattr(self, name) < 1:
                raise ValueError(f"RTPurboConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_sinks", "ring_slack", "dense_prefill_below"):
            if getattr(self, name) < 0:
                raise ValueError(f"RTPurboConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("indexer_dim", "decode_block", "prefill_block"):
            v = getattr(self, name)
            if v & (v - 1):
                raise ValueError(f"RTPurboConfig.{name} must be a power of two, got {v}")
        if self.num_sinks > min(self.decode_block, self.prefill_block):
            raise ValueError(f"num_sinks ({self.num_sinks}) must fit in one block "
                             f"(decode_block {self.decode_block}, prefill_block {self.prefill_block})")
        if self.impl not in IMPLS:
            raise ValueError(f"impl must be one of {', '.join(map(repr, IMPLS))}, got {self.impl!r}")
        if self.prefill_impl not in PREFILL_IMPLS:
            raise ValueError(f"prefill_impl must be one of {', '.join(map(repr, PREFILL_IMPLS))}, "
                             f"got {self.prefill_impl!r}")

    @classmethod
    def for_context(cls, max_seq_len: int, **overrides: Any) -> "RTPurboConfig":
        """Defaults scaled to a model's context: the window is 1/16 of it (8192 at 128K and beyond, never
        below two decode blocks), the retrieval window and blocks shrink with it for small models."""
        base = cls(**overrides)
        if "window" not in overrides:
            base = replace(base, window=max(2 * base.decode_block, min(8192, max_seq_len // 16)))
        return base


@dataclass
class HeadProfile:
    """Which kv heads of each layer are retrieval heads.

    Attributes:
        scores: [num_layers, num_kv_heads] float32 retrieval score of each (layer, kv head) — the attention
            mass a repeated span's second copy puts on its first copy (higher: more retrieval-like).
        retrieval: [num_layers, num_kv_heads] bool.
        meta: free-form JSON-able facts (ratio, calibration length, ...).
    """

    scores: torch.Tensor
    retrieval: torch.Tensor
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.scores.shape != self.retrieval.shape or self.scores.dim() != 2:
            raise ValueError(f"scores and retrieval must both be [layers, kv_heads], got "
                             f"{tuple(self.scores.shape)} and {tuple(self.retrieval.shape)}")
        self.scores = self.scores.detach().float().cpu()
        self.retrieval = self.retrieval.detach().bool().cpu()

    @property
    def num_layers(self) -> int:
        return self.scores.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.scores.shape[1]

    @property
    def ratio(self) -> float:
        return float(self.retrieval.float().mean())

    def retrieval_heads(self, layer: int) -> list[int]:
        return [int(h) for h in torch.nonzero(self.retrieval[layer]).flatten()]

    @classmethod
    def from_scores(cls, scores: torch.Tensor, ratio: float, meta: dict | None = None) -> "HeadProfile":
        """The ``ceil(ratio * N)`` highest-scoring (layer, kv head) pairs of the whole model."""
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"ratio must be in [0, 1], got {ratio}")
        flat = scores.float().flatten()
        n = min(flat.numel(), math.ceil(ratio * flat.numel() - 1e-9))
        ret = torch.zeros_like(flat, dtype=torch.bool)
        if n > 0:
            ret[torch.topk(flat, n).indices] = True
        return cls(scores.float(), ret.view(scores.shape), dict(meta or {}, ratio=ratio))

    @classmethod
    def uniform(cls, num_layers: int, num_kv_heads: int, retrieval: bool = True) -> "HeadProfile":
        """Every head a retrieval head (``retrieval=True``) or none."""
        return cls(torch.zeros(num_layers, num_kv_heads), torch.full((num_layers, num_kv_heads), retrieval))

    def to_dict(self) -> dict:
        return {"num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
                "scores": self.scores.tolist(), "retrieval": self.retrieval.tolist(), "meta": self.meta}

    @classmethod
    def from_dict(cls, d: dict) -> "HeadProfile":
        return cls(torch.tensor(d["scores"], dtype=torch.float32), torch.tensor(d["retrieval"], dtype=torch.bool),
                   dict(d.get("meta", {})))


@dataclass
class IndexerWeights:
    """Indexer projections per layer: ``q[layer]`` [H_ret, q_per_kv * head_dim, r] (the pre-RoPE queries of a
    kv head's query group, concatenated) and ``k[layer]`` [H_ret, head_dim, r] (its pre-RoPE keys), for the
    layer's retrieval heads in ascending kv-head order; ``temperature[layer]`` [H_ret] float32 divides each head's
    scores before the selection (calibrated by :func:`sparrow.calibrate.fit_indexer`; a missing layer: 1)."""

    q: dict[int, torch.Tensor] = field(default_factory=dict)
    k: dict[int, torch.Tensor] = field(default_factory=dict)
    temperature: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def dim(self) -> int | None:
        for t in self.k.values():
            return int(t.shape[-1])
        return None


def indexer_temperature(temperature: torch.Tensor | None, n: int, layer: int) -> torch.Tensor:
    """``temperature`` (None: ones) as [n] float32 on the host, checked (loading and saving read it this way).

    Raises: ValueError unless it is ``n`` positive finite values.
    """
    t = torch.ones(n) if temperature is None else temperature.detach().float().cpu()
    if t.shape != (n,) or not bool(torch.isfinite(t).all() and (t > 0).all()):  # host values (load/save time)
        raise ValueError(f"layer {layer}: temperature must be {n} positive finite values, got {t.tolist()}")
    return t


class RTPurboCache(SparseDecodeCache):
    """One layer's RTPurbo cache: the tensors :func:`sparrow.kernels.sparse_decode.sparse_decode_attention` reads
    (a :class:`~sparrow.kernels.sparse_decode.SparseDecodeCache`, so it goes to the kernel as it is), allocated
    by :meth:`RTPurboAttention.init_cache` and written by its ``prefill`` / ``decode``.

    Retrieval kv heads (``H_ret``) keep their full KV, in the same two-level layout as dense attention, and
    the indexer keys beside it:

    prefix_k, prefix_v: [num_prefixes, H_ret, max_prefix_len, D]   prefix_ik: [num_prefixes, H_ret, max_prefix_len, r]
    gen_k, gen_v:       [num_rows + 1, H_ret, max_gen_len, D]      gen_ik:    [num_rows + 1, H_ret, max_gen_len, r]

    Local kv heads (``H_loc``) keep sinks + a sliding window only, so their memory is O(window) per prompt
    and per row whatever the context length:

    prefix_lk, prefix_lv: [num_prefixes, H_loc, S + Wp, D] — the prompt's first ``S = num_sinks`` tokens, then a
        ring of its last ``Wp = min(window, max_prefix_len)`` tokens (position ``j`` at ``S + j % Wp``).
    gen_lk, gen_lv: [num_rows + 1, H_loc, Wg, D] — a ring of the row's generated tokens (index ``g`` at
        ``g % Wg``), ``Wg = min(window + ring_slack, max_gen_len)``.

    The last generation slot is the engine's scratch row.
    """

    __slots__ = ()


class RTPurboAttention(AttentionBackend):
    """RTPurbo sparse attention for rollouts, exact attention for training.

    Args:
        shape: the layer's head layout.
        config: :class:`RTPurboConfig`.
        profile: a :class:`HeadProfile` (this layer's row is used), an explicit list of retrieval kv heads,
            or None (every kv head is a retrieval head).
        indexer: projections for this layer's retrieval heads (an :class:`IndexerWeights` or a
            ``(q, k)`` pair); None initialises them to a truncated identity (calibrate before use).

    Parameters ``indexer_q`` [H_ret, q_per_kv * D, r] and ``indexer_k`` [H_ret, D, r]. Float32 buffers that keep
    their dtype when the module is cast (``model.to(torch.bfloat16)``) and move with it: ``score_scale`` [H_ret]
    (1 / the calibrated temperature), and the selection's top-p table ``top_p_lengths`` [K] int64 /
    ``top_p_values`` [K] (:meth:`set_selection`; ``K = SELECTION_TIERS``).
    """

    SELECTION_TIERS = 8
    _FLOAT32_BUFFERS = ("score_scale", "top_p_values")

    def __init__(self, shape: LayerShape, config: RTPurboConfig | None = None,
                 profile: HeadProfile | Sequence[int] | None = None,
                 indexer: IndexerWeights | tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        super().__init__(shape)
        self.config = config = config or RTPurboConfig()
        hkv, d, qpk, r = shape.num_kv_heads, shape.head_dim, shape.q_per_kv, config.indexer_dim
        if profile is None:
            ret = list(range(hkv))
        elif isinstance(profile, HeadProfile):
            if profile.num_kv_heads != hkv or shape.layer_idx >= profile.num_layers:
                raise ValueError(f"profile ({profile.num_layers} layers x {profile.num_kv_heads} kv heads) does not "
                                 f"cover layer {shape.layer_idx} with {hkv} kv heads")
            ret = profile.retrieval_heads(shape.layer_idx)
        else:
            ret = sorted(int(h) for h in profile)
            if len(set(ret)) != len(ret) or any(not 0 <= h < hkv for h in ret):
                raise ValueError(f"retrieval heads {ret} must be distinct kv heads in [0, {hkv})")
        loc = [h for h in range(hkv) if h not in ret]
        self.retrieval_heads = tuple(ret)
        self.local_heads = tuple(loc)
        self.register_buffer("ret_idx", torch.tensor(ret, dtype=torch.int64), persistent=False)
        self.register_buffer("loc_idx", torch.tensor(loc, dtype=torch.int64), persistent=False)
        is_ret = torch.zeros(hkv, dtype=torch.int32)
        is_ret[ret] = 1
        self.register_buffer("head_is_ret", is_ret, persistent=False)
        hr = len(ret)
        eye = torch.eye(d, r) if r <= d else F.pad(torch.eye(d), (0, r - d))
        self.indexer_q = nn.Parameter(eye.repeat(qpk, 1).div(qpk * math.sqrt(d)).expand(hr, qpk * d, r).clone())
        self.indexer_k = nn.Parameter(eye.expand(hr, d, r).clone())
        self.register_buffer("score_scale", torch.ones(hr), persistent=False)
        self.register_buffer("top_p_lengths", torch.zeros(self.SELECTION_TIERS, dtype=torch.int64), persistent=False)
        self.register_buffer("top_p_values", torch.zeros(self.SELECTION_TIERS), persistent=False)
        self.set_selection(config.top_p)
        if indexer is not None:
            temp = None
            if isinstance(indexer, IndexerWeights):
                if hr and shape.layer_idx not in indexer.q:
                    raise ValueError(f"indexer has no weights for layer {shape.layer_idx}")
                wq, wk = indexer.q.get(shape.layer_idx), indexer.k.get(shape.layer_idx)
                temp = indexer.temperature.get(shape.layer_idx)
            else:
                wq, wk = indexer
            if hr:
                self.load_indexer(wq, wk, temp)
        self._stats: SelectionStats | None = None

    def _apply(self, fn, recurse=True):
        # the selection's float32 buffers follow the module's device but never its dtype: a bf16 rollout copy
        # must not round top_p = 0.9 to 0.8984 or a temperature to 3 significant digits
        kept = {n: self._buffers.pop(n) for n in self._FLOAT32_BUFFERS}
        try:
            super()._apply(fn, recurse)
        finally:
            device = self.ret_idx.device
            for n, t in kept.items():
                self._buffers[n] = t.to(device)
        return self

    # -- indexer --------------------------------------------------------------------------------------
    @property
    def num_retrieval(self) -> int:
        return len(self.retrieval_heads)

    def load_indexer(self, wq: torch.Tensor, wk: torch.Tensor, temperature: torch.Tensor | None = None) -> None:
        """Copy ``wq`` [H_ret, q_per_kv * D, r], ``wk`` [H_ret, D, r] and ``temperature`` [H_ret] (None: 1) into the
        indexer, in place (compiled steps and CUDA graphs keep reading the same storage).

        Raises: ValueError on other shapes or a temperature that is not positive and finite.
        """
        if tuple(wq.shape) != tuple(self.indexer_q.shape) or tuple(wk.shape) != tuple(self.indexer_k.shape):
            raise ValueError(f"indexer shapes {tuple(wq.shape)}, {tuple(wk.shape)} do not fit layer "
                             f"{self.shape.layer_idx}: expected {tuple(self.indexer_q.shape)}, "
                             f"{tuple(self.indexer_k.shape)}")
        t = indexer_temperature(temperature, self.num_retrieval, self.shape.layer_idx)
        with torch.no_grad():
            self.indexer_q.copy_(wq)
            self.indexer_k.copy_(wk)
            self.score_scale.copy_(1.0 / t)

    @property
    def temperature(self) -> torch.Tensor:
        """[H_ret] float32 on the host: the temperature each retrieval head's indexer scores are divided by."""
        return 1.0 / self.score_scale.detach().cpu()

    def set_selection(self, top_p: float | Sequence[float], lengths: Sequence[int] = (0,)) -> None:
        """Set the selection's top-p in place: ``top_p[i]`` for the rows that have generated at least
        ``lengths[i]`` tokens (and fewer than ``lengths[i + 1]``); prefill uses ``top_p[0]``. A host-to-device copy
        between steps: the compiled decode step and its CUDA graphs read the new values without recompiling.

        Raises: ValueError when ``lengths`` does not start at 0 and increase strictly, the two differ in length,
        hold more than :attr:`SELECTION_TIERS` tiers, or a top-p is outside (0, 1].
        """
        values = [float(top_p)] if isinstance(top_p, (int, float)) else [float(v) for v in top_p]
        lengths = [int(n) for n in lengths]
        if len(values) != len(lengths) or not 1 <= len(values) <= self.SELECTION_TIERS:
            raise ValueError(f"set_selection needs 1..{self.SELECTION_TIERS} top-p values, one per length, got "
                             f"{values} for lengths {lengths}")
        if lengths[0] != 0 or any(b <= a for a, b in zip(lengths, lengths[1:])):
            raise ValueError(f"lengths must start at 0 and increase strictly, got {lengths}")
        if not all(0.0 < v <= 1.0 for v in values):
            raise ValueError(f"top_p values must be in (0, 1], got {values}")
        pad = self.SELECTION_TIERS - len(values)
        with torch.no_grad():  # unused tiers start past any generation and repeat the last value
            self.top_p_lengths.copy_(torch.tensor(lengths + [torch.iinfo(torch.int64).max] * pad))
            self.top_p_values.copy_(torch.tensor(values + values[-1:] * pad, dtype=torch.float32))

    def selection(self) -> tuple[list[float], list[int]]:
        """The current ``(top_p values, lengths)`` of :meth:`set_selection` (reads the buffers back to the host)."""
        n = int((self.top_p_lengths < torch.iinfo(torch.int64).max).sum())
        return self.top_p_values[:n].tolist(), self.top_p_lengths[:n].tolist()

    def row_top_p(self, generated: torch.Tensor) -> torch.Tensor:
        """[A] float32 top-p of rows that have generated ``generated`` [A] tokens (device ops only)."""
        tier = (generated[:, None] >= self.top_p_lengths[None, :]).sum(-1) - 1
        return self.top_p_values[tier]

    def group_queries(self, q_pre: torch.Tensor) -> torch.Tensor:
        """[B, Hq, S, D] pre-RoPE queries -> [B, H_ret, S, q_per_kv * D] (each retrieval head's group)."""
        B, _, S, D = q_pre.shape
        s = self.shape
        g = q_pre.view(B, s.num_kv_heads, s.q_per_kv, S, D)[:, self.ret_idx]
        return g.permute(0, 1, 3, 2, 4).reshape(B, self.num_retrieval, S, s.q_per_kv * D)

    def index(self, q_pre: torch.Tensor, k_pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Indexer queries and keys [B, H_ret, S, r] from pre-RoPE q [B, Hq, S, D] and k [B, Hkv, S, D]."""
        q_idx = torch.einsum("bhsc,hcr->bhsr", self.group_queries(q_pre), self.indexer_q.to(q_pre.dtype))
        q_idx = q_idx * self.score_scale.to(q_idx.dtype)[None, :, None, None]  # the calibrated temperature
        return q_idx, self.index_keys(k_pre)

    def index_keys(self, k_pre: torch.Tensor) -> torch.Tensor:
        """Indexer keys [B, H_ret, S, r] from pre-RoPE k [B, Hkv, S, D] (what the decode selection reads)."""
        return torch.einsum("bhsd,hdr->bhsr", k_pre[:, self.ret_idx], self.indexer_k.to(k_pre.dtype))

    # -- capabilities ---------------------------------------------------------------------------------
    def validate_configuration(self, *, dtype: torch.dtype, device: torch.device) -> list[str]:
        reasons = configuration_reasons(dtype=dtype, device=device, impl=self.config.impl,
                                        head_dim=self.shape.head_dim)
        if self.config.impl == "triton" and self.config.indexer_dim < 16:
            reasons.append(f"the Triton prefill scores need indexer_dim >= 16, got {self.config.indexer_dim}")
        return reasons

    # -- training (dense) -------------------------------------------------------------------------------
    def forward_train(self, q, k, v, *, q_pre=None, k_pre=None, mask=None):
        return train_attention(q, k, v, mask)

    # -- cache ---------------------------------------------------------------------------------------
    def ring_sizes(self, spec: CacheSpec) -> tuple[int, int]:
        """(prompt ring ``Wp``, generation ring ``Wg``) for ``spec``."""
        c = self.config
        return min(c.window, spec.max_prefix_len), min(c.window + c.ring_slack, spec.max_gen_len)

    def init_cache(self, spec: CacheSpec, *, dtype: torch.dtype, device: torch.device) -> RTPurboCache:
        s, c = self.shape, self.config
        hr, hl, d = self.num_retrieval, len(self.local_heads), s.head_dim
        wp, wg = self.ring_sizes(spec)
        z = lambda *shape: torch.zeros(shape, dtype=dtype, device=device)  # noqa: E731
        P, R = spec.num_prefixes, spec.num_rows + 1
        return RTPurboCache(
            z(P, hr, spec.max_prefix_len, d), z(P, hr, spec.max_prefix_len, d),
            z(R, hr, spec.max_gen_len, d), z(R, hr, spec.max_gen_len, d),
            z(P, hr, spec.max_prefix_len, c.indexer_dim), z(R, hr, spec.max_gen_len, c.indexer_dim),
            z(P, hl, c.num_sinks + wp, d), z(P, hl, c.num_sinks + wp, d),
            z(R, hl, wg, d), z(R, hl, wg, d),
        )

    # -- inference -----------------------------------------------------------------------------------
    def _prefill_cfg(self) -> SparsePrefillConfig:
        c = self.config  # a prompt has generated nothing: the first tier's top-p, read on the device
        return SparsePrefillConfig(self.top_p_values[0], c.prefill_block, c.num_sinks, c.window, c.ret_window)

    def _decode_cfg(self, meta: DecodeMeta) -> SparseDecodeConfig:
        c = self.config  # each row's top-p by its generated length, from the buffers: no value baked into a graph
        return SparseDecodeConfig(self.row_top_p(meta.cached_len), c.decode_block, c.num_sinks, c.window,
                                  c.ret_window)

    def prefill(self, q, k, v, cache: RTPurboCache, meta: PrefillMeta, *, q_pre=None, k_pre=None):
        if self.num_retrieval and (q_pre is None or k_pre is None):
            raise ValueError("RTPurboAttention.prefill needs the pre-RoPE q_pre and k_pre")
        P, _, S, _ = q.shape
        slot, plen = meta.prefix_slot, meta.prompt_len
        dense = S < self.config.dense_prefill_below  # a static shape: no branch on device values
        q_idx = k_idx = None
        if self.num_retrieval:
            if dense:  # only the keys: decode selects from them
                k_idx = self.index_keys(k_pre)
            else:
                q_idx, k_idx = self.index(q_pre, k_pre)
            kr, vr = k[:, self.ret_idx], v[:, self.ret_idx]
            put(prefix_index(kr, slot), (cache.prefix_k, kr), (cache.prefix_v, vr), (cache.prefix_ik, k_idx))
        if self.local_heads:
            self._write_local_prefix(cache, k[:, self.loc_idx], v[:, self.loc_idx], slot, plen)
        if dense:
            if self._stats is not None and self.num_retrieval:
                self._stats.record_prefill(None, plen, S, block=self.config.prefill_block,
                                           num_retrieval=self.num_retrieval)
            return causal_attention(q, k, v)
        res = sparse_prefill_attention(q, k, v, q_idx, k_idx, plen, self.ret_idx, self.loc_idx,
                                       self._prefill_cfg(), impl=self.config.prefill_impl,
                                       score_impl=self._kernel_impl(q.device),
                                       return_selection=self._stats is not None)
        if self._stats is None:
            return res
        out, sel = res
        if sel is not None:
            self._stats.record_prefill(sel, plen, S, block=self.config.prefill_block, num_retrieval=self.num_retrieval)
        return out

    def decode(self, q, k, v, cache: RTPurboCache, meta: DecodeMeta, *, q_pre=None, k_pre=None):
        A, _, T, _ = q.shape
        c = self.config
        if T > c.ring_slack + 1:
            raise ValueError(f"{T} tokens per decode step exceed ring_slack + 1 ({c.ring_slack + 1})")
        if self.num_retrieval and (q_pre is None or k_pre is None):
            raise ValueError("RTPurboAttention.decode needs the pre-RoPE q_pre and k_pre")
        q_idx = q.new_zeros((A, 0, T, c.indexer_dim))
        if self.num_retrieval:
            q_idx, k_idx = self.index(q_pre, k_pre)
            kr, vr = k[:, self.ret_idx], v[:, self.ret_idx]
            put(row_index(kr, meta.row_slot, meta.cached_len), (cache.gen_k, kr), (cache.gen_v, vr),
                (cache.gen_ik, k_idx))
        if self.local_heads:
            kl, vl = k[:, self.loc_idx], v[:, self.loc_idx]
            put(row_index(kl, meta.row_slot, meta.cached_len, ring=cache.gen_lk.shape[2]), (cache.gen_lk, kl),
                (cache.gen_lv, vl))
        impl = self._kernel_impl(q.device)
        if self.local_heads and shared_prefix_on(c.shared_prefix, meta, impl):
            res = self._decode_shared_prefix(q, q_idx, cache, meta.grouped(), impl)
        else:
            res = sparse_decode_attention(
                q, q_idx, cache, meta.row_slot, meta.prefix_slot, meta.prefix_len, meta.cached_len, self.ret_idx,
                self.loc_idx, self.head_is_ret, self._decode_cfg(meta), impl=impl, validate=False,
                return_selection=self._stats is not None,
            )
        if self._stats is None:
            return res
        out, sel = res
        self._stats.record_decode(sel, meta, T, block=c.decode_block, num_sinks=c.num_sinks, window=c.window,
                                  num_retrieval=self.num_retrieval, num_local=len(self.local_heads))
        return out

    def _decode_shared_prefix(self, q, q_idx, cache: RTPurboCache, meta: DecodeMeta, impl: str):
        """Decode with the local heads on the shared-prefix kernel (a group's sinks + prompt window read once) and
        the retrieval heads on the sparse kernel, as :meth:`decode` otherwise does in one call; the outputs go
        back in head order. Returns what ``sparse_decode_attention`` would (with the selection when recording)."""
        A, Hq, T, D = q.shape
        s, c = self.shape, self.config
        q5 = q.view(A, s.num_kv_heads, s.q_per_kv, T, D)
        ol = cascade_local_attention(
            q5[:, self.loc_idx].reshape(A, -1, T, D), cache.prefix_lk, cache.prefix_lv, cache.gen_lk, cache.gen_lv,
            meta.row_slot, meta.prefix_slot, meta.prefix_len, meta.cached_len, meta.prefix_order, meta.group_start,
            num_sinks=c.num_sinks, window=c.window, impl=impl, validate=False)
        out = q5.new_empty(q5.shape)  # the local and retrieval heads together fill every head
        out.index_copy_(1, self.loc_idx, ol.view(A, -1, s.q_per_kv, T, D))
        sel = None
        if self.num_retrieval:
            hr = self.num_retrieval
            none = cache.prefix_lk[:, :0], cache.prefix_lv[:, :0], cache.gen_lk[:, :0], cache.gen_lv[:, :0]
            res = sparse_decode_attention(
                q5[:, self.ret_idx].reshape(A, -1, T, D), q_idx, cache._replace(**dict(zip(
                    ("prefix_lk", "prefix_lv", "gen_lk", "gen_lv"), none))), meta.row_slot, meta.prefix_slot,
                meta.prefix_len, meta.cached_len, torch.arange(hr, device=q.device), self.loc_idx[:0],
                self.head_is_ret[self.ret_idx], self._decode_cfg(meta), impl=impl, validate=False,
                return_selection=self._stats is not None)
            orr, sel = res if self._stats is not None else (res, None)
            out.index_copy_(1, self.ret_idx, orr.view(A, hr, s.q_per_kv, T, D))
        out = out.view(A, Hq, T, D)
        return out if self._stats is None else (out, sel)

    def _kernel_impl(self, device: torch.device) -> str:
        """The decode kernels and prefill block scoring ``config.impl`` stands for on ``device``."""
        return decode_impl(self.config.impl, self.shape.head_dim, device)

    def _write_local_prefix(self, cache: RTPurboCache, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor,
                            plen: torch.Tensor) -> None:
        """Sinks (first ``num_sinks`` tokens) and the ring of each prompt's last ``Wp`` tokens."""
        P, hl, S, _ = k.shape
        ns = self.config.num_sinks
        wp = cache.prefix_lk.shape[2] - ns
        if ns:
            n = min(ns, S)
            ks, vs = k[:, :, :n], v[:, :, :n]
            put(prefix_index(ks, slot), (cache.prefix_lk, ks), (cache.prefix_lv, vs))
        j = plen[:, None] - wp + torch.arange(wp, device=k.device)[None, :]  # [P, Wp] last Wp positions
        src = j.clamp(0, S - 1)[:, None, :, None].expand(P, hl, wp, k.shape[-1])
        h = torch.arange(hl, device=k.device)[None, :, None]
        put((slot[:, None, None], h, (ns + j % wp)[:, None, :]), (cache.prefix_lk, k.gather(2, src)),
            (cache.prefix_lv, v.gather(2, src)))

    # -- selection statistics (eager diagnostics: they read device values back) ------------------------
    def enable_stats(self, on: bool = True) -> None:
        """Record kept / visible token counts of every prefill and decode call from now on, from zero (forces
        host syncs: for evaluation, not inside compiled or graphed steps); ``on=False`` stops recording."""
        self._stats = SelectionStats() if on else None

    @property
    def stats(self) -> dict[str, float] | None:
        """This layer's :class:`~sparrow.attention.rtpurbo_stats.SelectionStats` totals (None: not recording)."""
        return None if self._stats is None else self._stats.as_dict()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, retrieval_kv_heads={list(self.retrieval_heads)}, {self.config!r}"


def rtpurbo_attention(profile: HeadProfile | None = None, indexer: IndexerWeights | None = None,
                      config: RTPurboConfig | None = None) -> Callable[[LayerShape], RTPurboAttention]:
    """A factory for :func:`sparrow.models.use_attention` / the model builders' ``attention=``.

    Raises: ValueError when the indexer's dimension differs from ``config.indexer_dim``.
    """
    config = config or RTPurboConfig()
    if indexer is not None and indexer.dim is not None and indexer.dim != config.indexer_dim:
        raise ValueError(f"indexer dim {indexer.dim} differs from config.indexer_dim {config.indexer_dim}")

    def make(shape: LayerShape) -> RTPurboAttention:
        return RTPurboAttention(shape, config, profile, indexer)

    return make


def rtpurbo_backends(model: nn.Module) -> list[RTPurboAttention]:
    """The model's RTPurbo backends, layer order (ValueError if a layer has another backend)."""
    out = []
    for i, layer in enumerate(model.layers):
        b = getattr(getattr(layer, "attn", None), "backend", None)
        if not isinstance(b, RTPurboAttention):
            raise ValueError(f"layer {i} has {type(b).__name__}, not RTPurboAttention")
        out.append(b)
    return out


def collect_selection_stats(model: nn.Module, reset: bool = False) -> dict[str, float]:
    """Sum the selection statistics of every layer (after :meth:`RTPurboAttention.enable_stats`); ``reset``
    starts every recording layer from zero again.

    Returns kept / visible totals and the derived densities (see :func:`sparrow.attention.rtpurbo_stats.summarize`):
    ``decode_ret_density``, ``decode_density``, ``prefill_ret_density``.
    """
    backends = [b for b in rtpurbo_backends(model) if b.stats is not None]
    out = summarize(b.stats for b in backends)
    if reset:
        for b in backends:
            b.enable_stats(True)
    return out

"""The Sparrow attention module: torchtune's projections, RoPE and norms around an :class:`AttentionBackend`."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torchtune.modules import MultiHeadAttention, TransformerDecoder

from sparrow.attention.base import AttentionBackend, DecodeMeta, LayerShape, PrefillMeta, PrefixPackMask
from sparrow.attention.dense import DenseAttention

AttentionFactory = Callable[[LayerShape], AttentionBackend]


class SparrowAttention(nn.Module):
    """Drop-in replacement for torchtune's :class:`~torchtune.modules.MultiHeadAttention`.

    It keeps torchtune's submodules under the same names (``q_proj``, ``k_proj``, ``v_proj``,
    ``output_proj``, ``pos_embeddings``, ``q_norm``, ``k_norm``), so torchtune / Hugging Face checkpoints
    load unchanged, and hands the core computation to ``backend``. ``forward`` has torchtune's
    signature (training, self-attention only); ``prefill`` and ``decode`` are the engine's entry points
    and take the layer's cache explicitly.
    """

    def __init__(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        q_proj: nn.Module,
        k_proj: nn.Module,
        v_proj: nn.Module,
        output_proj: nn.Module,
        backend: AttentionBackend,
        pos_embeddings: nn.Module | None = None,
        q_norm: nn.Module | None = None,
        k_norm: nn.Module | None = None,
        max_seq_len: int = 4096,
    ) -> None:
        super().__init__()
        if bool(q_norm) ^ bool(k_norm):
            raise ValueError("q_norm and k_norm must be set together")
        s = backend.shape
        if (s.num_heads, s.num_kv_heads, s.head_dim) != (num_heads, num_kv_heads, head_dim):
            raise ValueError(
                f"backend shape {s} does not match the layer (heads={num_heads}, kv_heads={num_kv_heads}, "
                f"head_dim={head_dim})"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.q_proj = q_proj
        self.k_proj = k_proj
        self.v_proj = v_proj
        # optional: one module computing [q | k | v] at once (a drafter's fused int8 projection); when set,
        # it replaces the three projections in the forward passes
        self.qkv_proj: nn.Module | None = None
        self.output_proj = output_proj
        self.pos_embeddings = pos_embeddings
        self.q_norm = q_norm
        self.k_norm = k_norm
        self.backend = backend
        # torchtune's decoder asks its layers about torchtune KV caches; Sparrow's caches are explicit
        self.kv_cache = None
        self.cache_enabled = False

    def setup_cache(self, batch_size: int, dtype: torch.dtype, max_seq_len: int) -> None:
        raise NotImplementedError(
            "Sparrow attention does not use torchtune KV caches: generate with sparrow.rollout.RolloutEngine"
        )

    def reset_cache(self) -> None:
        raise NotImplementedError("Sparrow attention does not use torchtune KV caches")

    @classmethod
    def from_torchtune(cls, mha: MultiHeadAttention, backend: AttentionBackend) -> "SparrowAttention":
        if getattr(mha, "kv_cache", None) is not None:
            raise ValueError("torchtune KV caches are not used by Sparrow; build the model without setup_caches()")
        if not getattr(mha, "is_causal", True):
            raise ValueError("only causal self-attention layers can be converted")
        return cls(
            num_heads=mha.num_heads, num_kv_heads=mha.num_kv_heads, head_dim=mha.head_dim,
            q_proj=mha.q_proj, k_proj=mha.k_proj, v_proj=mha.v_proj, output_proj=mha.output_proj,
            backend=backend, pos_embeddings=mha.pos_embeddings, q_norm=mha.q_norm, k_norm=mha.k_norm,
            max_seq_len=mha.max_seq_len,
        )

    def _qkv(self, x: torch.Tensor, input_pos: torch.Tensor | None):
        # x: [B, S, E] -> q: [B, Hq, S, D]; k, v: [B, Hkv, S, D]; pre-RoPE copies in the same layout
        b, s, _ = x.shape
        if self.qkv_proj is not None:
            kv = self.num_kv_heads * self.head_dim
            q_lin, k_lin, v_lin = self.qkv_proj(x).split([self.num_heads * self.head_dim, kv, kv], dim=-1)
        else:
            q_lin, k_lin, v_lin = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q_pre = q_lin.view(b, s, self.num_heads, self.head_dim)
        k_pre = k_lin.view(b, s, self.num_kv_heads, self.head_dim)
        v = v_lin.view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = q_pre, k_pre
        if self.pos_embeddings is not None:
            q = self.pos_embeddings(q, input_pos=input_pos)
            k = self.pos_embeddings(k, input_pos=input_pos)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if self.q_norm is not None:  # torchtune's order: after RoPE, per head
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v, q_pre.transpose(1, 2), k_pre.transpose(1, 2)

    def _out(self, o: torch.Tensor) -> torch.Tensor:
        b, _, s, _ = o.shape
        return self.output_proj(o.transpose(1, 2).reshape(b, s, -1))

    def forward(
        self,
        x: torch.Tensor,
        y: torch.Tensor | None = None,
        *,
        mask: torch.Tensor | PrefixPackMask | None = None,
        input_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """torchtune-compatible dense forward. x: [B, S, E]; mask: optional bool [B, S, S] or a
        :class:`~sparrow.attention.base.PrefixPackMask`."""
        if y is not None and y is not x:
            raise ValueError("SparrowAttention is self-attention only: y must be None or x")
        if mask is not None and not isinstance(mask, (torch.Tensor, PrefixPackMask)):
            raise ValueError(f"SparrowAttention supports a bool [B, S, S] mask, a PrefixPackMask or None, got "
                             f"{type(mask).__name__}")
        q, k, v, q_pre, k_pre = self._qkv(x, input_pos)
        return self._out(self.backend.forward_train(q, k, v, q_pre=q_pre, k_pre=k_pre, mask=mask))

    def prefill(self, x: torch.Tensor, input_pos: torch.Tensor, cache: Any, meta: PrefillMeta) -> torch.Tensor:
        q, k, v, q_pre, k_pre = self._qkv(x, input_pos)
        return self._out(self.backend.prefill(q, k, v, cache, meta, q_pre=q_pre, k_pre=k_pre))

    def decode(self, x: torch.Tensor, input_pos: torch.Tensor, cache: Any, meta: DecodeMeta) -> torch.Tensor:
        q, k, v, q_pre, k_pre = self._qkv(x, input_pos)
        return self._out(self.backend.decode(q, k, v, cache, meta, q_pre=q_pre, k_pre=k_pre))


def attention_modules(model: TransformerDecoder) -> list[SparrowAttention]:
    mods = [layer.attn for layer in model.layers]
    for i, m in enumerate(mods):
        if not isinstance(m, SparrowAttention):
            raise ValueError(f"layer {i} has {type(m).__name__}, not SparrowAttention: call use_attention(model) first")
    return mods


def use_attention(model: TransformerDecoder, attention: AttentionFactory = DenseAttention) -> TransformerDecoder:
    """Give every self-attention layer of ``model`` a backend made by ``attention(LayerShape)``.

    torchtune :class:`MultiHeadAttention` layers are converted to :class:`SparrowAttention` (weights kept,
    same parameter names); existing Sparrow layers get the new backend. In place; returns ``model``.
    """
    for i, layer in enumerate(model.layers):
        attn = getattr(layer, "attn", None)
        if isinstance(attn, MultiHeadAttention):
            shape = LayerShape(i, attn.num_heads, attn.num_kv_heads, attn.head_dim)
            layer.attn = SparrowAttention.from_torchtune(attn, _make_backend(attention, shape, attn.q_proj))
        elif isinstance(attn, SparrowAttention):
            shape = LayerShape(i, attn.num_heads, attn.num_kv_heads, attn.head_dim)
            attn.backend = _make_backend(attention, shape, attn.q_proj)
        else:
            raise ValueError(f"layer {i}: expected a self-attention layer, got {type(layer).__name__}")
    return model


def _make_backend(attention: AttentionFactory, shape: LayerShape, like: nn.Module) -> AttentionBackend:
    backend = attention(shape)
    if not isinstance(backend, AttentionBackend):
        raise TypeError(f"attention factory returned {type(backend).__name__}, not an AttentionBackend")
    p = next(like.parameters(), None)
    if p is not None:
        backend.to(device=p.device)
    return backend


def policy_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's own parameters, by name: every parameter except those of its attention backends (an RTPurbo
    indexer is the rollout side's own). What a trainer owns and the weight sync sends."""
    return {n: p for n, p in model.named_parameters() if ".backend." not in n}

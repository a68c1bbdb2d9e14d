"""Model forward passes for the engine: prefill and decode through explicit per-layer caches.

torchtune's ``TransformerSelfAttentionLayer.forward`` cannot carry a cache and metadata to attention, so
these walk the same modules in the same order (norm -> attention -> residual -> norm -> MLP -> residual).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torchtune.modules import TransformerDecoder

from sparrow.attention.base import DecodeMeta, PrefillMeta


def _layers(model: TransformerDecoder, h: torch.Tensor, step) -> torch.Tensor:
    for i, layer in enumerate(model.layers):
        h = h + layer.sa_scale(step(layer.attn, layer.sa_norm(h), i))
        h = h + layer.mlp_scale(layer.mlp(layer.mlp_norm(h)))
    return h


def prefill_hidden(
    model: TransformerDecoder, tokens: torch.Tensor, caches: Sequence[Any], meta: PrefillMeta
) -> torch.Tensor:
    """tokens: [P, S] right-padded prompts -> final hidden states [P, S, E] (before the final norm)."""
    P, S = tokens.shape
    pos = torch.arange(S, device=tokens.device)[None, :].expand(P, S)
    h = model.tok_embeddings(tokens)
    return _layers(model, h, lambda attn, x, i: attn.prefill(x, pos, caches[i], meta))


def decode_hidden(
    model: TransformerDecoder, tokens: torch.Tensor, caches: Sequence[Any], meta: DecodeMeta
) -> torch.Tensor:
    """tokens: [A, T] new tokens per row -> final hidden states [A, T, E] (before the final norm).

    Positions are clamped to the RoPE table: only a verify pass's last scratch positions, for a row near the
    end of the model's context, reach past it, and those are never emitted."""
    T = tokens.shape[1]
    pos = (meta.prefix_len + meta.cached_len)[:, None] + torch.arange(T, device=tokens.device)[None, :]
    pos = pos.clamp(max=model.max_seq_len - 1)
    h = model.tok_embeddings(tokens)
    return _layers(model, h, lambda attn, x, i: attn.decode(x, pos, caches[i], meta))


def logits_from_hidden(model: TransformerDecoder, h: torch.Tensor) -> torch.Tensor:
    """[..., E] hidden -> [..., V] float32 logits (final norm + output projection)."""
    return model.output(model.norm(h)).float()

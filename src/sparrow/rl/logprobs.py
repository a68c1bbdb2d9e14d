"""Training-side log-probabilities of response tokens, computed in chunks.

The final hidden states of every position are computed once; the output projection, log-softmax and
gather then run over chunks of response tokens under activation checkpointing, so at most
``chunk_size x vocab`` logits exist at any time, in the forward and in the backward pass.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torchtune.modules import TransformerDecoder


def hidden_states(model: TransformerDecoder, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [N, S] -> final hidden states [N, S, E] (before the final norm), causal, dense."""
    h = model.tok_embeddings(tokens)
    for layer in model.layers:
        h = layer(h)
    return h


def _chunk_logprobs(model: TransformerDecoder, h: torch.Tensor, targets: torch.Tensor, temperature: float):
    logits = model.output(model.norm(h)).float()
    if temperature != 1.0:
        logits = logits / temperature
    return -F.cross_entropy(logits, targets, reduction="none")


def response_logprobs(
    model: TransformerDecoder,
    tokens: torch.Tensor,
    prompt_len: torch.Tensor,
    response_len: torch.Tensor,
    *,
    max_response_len: int,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """Log-probs of each response token under ``model`` at ``temperature``.

    Args:
        tokens: [N, S] prompt followed by response, right-padded.
        prompt_len, response_len: [N] int64.
        max_response_len: ``L``, the width of the output.
        chunk_size: response tokens per logits chunk.

    Returns: [N, L] float32; entry ``(i, j)`` is log p(token at ``prompt_len[i] + j``), zero past
    ``response_len[i]``.
    """
    N, S = tokens.shape
    dev = tokens.device
    j = torch.arange(max_response_len, device=dev)
    mask = j[None, :] < response_len[:, None]  # [N, L]
    pos = (prompt_len[:, None] + j[None, :]).clamp(max=S - 1)  # position of each response token
    h = hidden_states(model, tokens)  # [N, S, E]
    rows, cols = mask.nonzero(as_tuple=True)
    src = pos[rows, cols]
    h_sel = h[rows, src - 1]  # the hidden state that predicts the token
    tgt = tokens[rows, src]
    out = torch.zeros((N, max_response_len), dtype=torch.float32, device=dev)
    parts = []
    for s in range(0, h_sel.shape[0], chunk_size):
        hs, ts = h_sel[s:s + chunk_size], tgt[s:s + chunk_size]
        if torch.is_grad_enabled() and hs.requires_grad:
            parts.append(checkpoint(_chunk_logprobs, model, hs, ts, temperature, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(model, hs, ts, temperature))
    if parts:
        out = out.index_put((rows, cols), torch.cat(parts))
    return out

"""Observe each attention layer's q / k (post- and pre-RoPE) during a dense forward, without copying weights.

:func:`capture_attention` temporarily wraps every layer backend's ``forward_train`` (the dense path the
model's ``forward`` takes), hands the layer's tensors to a callback, and restores the backends on exit.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from sparrow.models.attention import attention_modules

Callback = Callable[[int, dict[str, torch.Tensor]], None]


@contextlib.contextmanager
def _wrapped(model: nn.Module, wrap: Callable[[int, Callable], Callable], layers: set[int] | None) -> Iterator[None]:
    """Within the context, each selected layer backend's ``forward_train`` is ``wrap(layer, original)``."""
    patched = []
    try:
        for i, m in enumerate(attention_modules(model)):
            if layers is not None and i not in layers:
                continue
            m.backend.forward_train = wrap(i, m.backend.forward_train)
            patched.append(m.backend)
        yield
    finally:
        for b in patched:
            del b.forward_train


def capture_attention(model: nn.Module, callback: Callback, layers: set[int] | None = None):
    """Within the context, ``callback(layer, {"q", "k", "v", "q_pre", "k_pre"})`` runs for every forward of
    the selected layers (all by default). Tensors: q [B, Hq, S, D], k / v [B, Hkv, S, D] post-RoPE,
    ``q_pre`` / ``k_pre`` before RoPE."""
    def wrap(i, orig):
        def hooked(q, k, v, *, q_pre=None, k_pre=None, mask=None):
            callback(i, {"q": q, "k": k, "v": v, "q_pre": q_pre, "k_pre": k_pre})
            return orig(q, k, v, q_pre=q_pre, k_pre=k_pre, mask=mask)
        return hooked

    return _wrapped(model, wrap, layers)


def local_head(model: nn.Module, layer: int, kv_head: int, *, window: int, sinks: int):
    """Within the context, the query heads of ``kv_head`` in ``layer`` attend only to the first ``sinks``
    positions and the last ``window`` (themselves included), as a non-retrieval head does; every other head
    stays dense. (The dense forward's mask argument is ignored: for single unpadded sequences.)"""
    def wrap(i, orig):
        def hooked(q, k, v, *, q_pre=None, k_pre=None, mask=None):
            out = orig(q, k, v, q_pre=q_pre, k_pre=k_pre, mask=mask)
            qpk = q.shape[1] // k.shape[1]
            hs = slice(kv_head * qpk, (kv_head + 1) * qpk)
            S = q.shape[2]
            i_, j = torch.arange(S, device=q.device)[:, None], torch.arange(S, device=q.device)[None, :]
            keep = (j <= i_) & ((j < sinks) | (j > i_ - window))
            kv = (k[:, kv_head:kv_head + 1], v[:, kv_head:kv_head + 1])
            local = F.scaled_dot_product_attention(q[:, hs], *(t.expand(-1, qpk, -1, -1) for t in kv), attn_mask=keep)
            return torch.cat([out[:, :hs.start], local.to(out.dtype), out[:, hs.stop:]], dim=1)
        return hooked

    return _wrapped(model, wrap, {layer})

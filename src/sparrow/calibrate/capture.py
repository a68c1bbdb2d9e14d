"""Observe each attention layer's q / k (post- and pre-RoPE) during a dense forward, without copying weights.

:func:`capture_attention` temporarily wraps every layer backend's ``forward_train`` (the dense path the
model's ``forward`` takes), hands the layer's tensors to a callback, and restores the backends on exit.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn

from sparrow.models.attention import attention_modules

Callback = Callable[[int, dict[str, torch.Tensor]], None]


@contextlib.contextmanager
def capture_attention(model: nn.Module, callback: Callback, layers: set[int] | None = None) -> Iterator[None]:
    """Within the context, ``callback(layer, {"q", "k", "v", "q_pre", "k_pre"})`` runs for every forward of
    the selected layers (all by default). Tensors: q [B, Hq, S, D], k / v [B, Hkv, S, D] post-RoPE,
    ``q_pre`` / ``k_pre`` before RoPE."""
    mods = attention_modules(model)
    patched = []
    try:
        for i, m in enumerate(mods):
            if layers is not None and i not in layers:
                continue
            backend = m.backend
            orig = backend.forward_train

            def hooked(q, k, v, *, q_pre=None, k_pre=None, mask=None, _i=i, _orig=orig):
                callback(_i, {"q": q, "k": k, "v": v, "q_pre": q_pre, "k_pre": k_pre})
                return _orig(q, k, v, q_pre=q_pre, k_pre=k_pre, mask=mask)

            backend.forward_train = hooked
            patched.append(backend)
        yield
    finally:
        for b in patched:
            del b.forward_train

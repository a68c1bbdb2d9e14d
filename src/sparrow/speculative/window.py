"""Draft-only attention over a window of the target's dense KV cache: sink tokens + the most recent ones.

A self-drafter that shares the target's cache reads, at every draft step, the same KV bytes as a target
step; at long context those bytes dominate a decode step, so the draft is barely cheaper than the target.
:class:`WindowedDraftAttention` makes the draft's attention cost independent of the context length: each
new token attends to the first ``sink`` tokens of the sequence (attention sinks) and to the last
``window`` tokens (itself included), read in place from the target's :class:`DenseKVCache` (prefix slot
and generation slot), with the keys' original RoPE positions. It writes its K/V at the draft positions
like the dense backend, so the verify pass overwrites them. Acceptance decides whether the shortcut pays;
exactness does not depend on it.
"""

from __future__ import annotations

import torch

from sparrow.attention.base import AttentionBackend, CacheSpec, DecodeMeta, LayerShape
from sparrow.attention.dense import DenseKVCache, write_rows


def window_positions(prefix_len: torch.Tensor, cached_len: torch.Tensor, T: int, window: int, sink: int):
    """Virtual positions read by the new tokens of each row.

    Returns ``(vpos [A, sink + window] int64, valid [A, sink + window] bool)``: sink entries are positions
    ``0..sink-1``, window entries the last ``window`` positions up to the last new token; entries outside the
    sequence or repeating a sink position are invalid.
    """
    total = prefix_len + cached_len + T  # [A]
    j = torch.arange(sink + window, device=total.device)
    is_sink = j < sink
    vpos = torch.where(is_sink[None, :], j[None, :], total[:, None] - window + (j - sink)[None, :])
    valid = (vpos >= 0) & (vpos < total[:, None]) & (is_sink[None, :] | (vpos >= sink))
    return vpos, valid


def gather_window(cache: DenseKVCache, meta: DecodeMeta, vpos: torch.Tensor):
    """K and V at virtual positions ``vpos`` [A, N] of each row -> two [A, Hkv, N, D] tensors."""
    Lp, Lg = cache.prefix_k.shape[2], cache.gen_k.shape[2]
    in_prefix = (vpos < meta.prefix_len[:, None])[:, :, None, None]
    pidx = vpos.clamp(0, Lp - 1)
    gidx = (vpos - meta.prefix_len[:, None]).clamp(0, Lg - 1)
    ps, rs = meta.prefix_slot[:, None], meta.row_slot[:, None]
    k = torch.where(in_prefix, cache.prefix_k[ps, :, pidx], cache.gen_k[rs, :, gidx])  # [A, N, H, D]
    v = torch.where(in_prefix, cache.prefix_v[ps, :, pidx], cache.gen_v[rs, :, gidx])
    return k.transpose(1, 2), v.transpose(1, 2)


class WindowedDraftAttention(AttentionBackend):
    """Decode-only attention of a drafter over ``sink`` + ``window`` tokens of the shared dense cache.

    Args:
        shape: the layer's head layout.
        window: most recent tokens attended (at least the number of tokens fed per call).
        sink: first tokens of the sequence always attended.

    Raises:
        ValueError: ``window < 1`` or ``sink < 0``.
    """

    def __init__(self, shape: LayerShape, *, window: int, sink: int = 4) -> None:
        super().__init__(shape)
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if sink < 0:
            raise ValueError(f"sink must be >= 0, got {sink}")
        self.window, self.sink = int(window), int(sink)

    def forward_train(self, q, k, v, *, q_pre=None, k_pre=None, mask=None):
        raise NotImplementedError("WindowedDraftAttention is a drafter's decode path; train with the target")

    def init_cache(self, spec: CacheSpec, *, dtype: torch.dtype, device: torch.device):
        raise NotImplementedError("WindowedDraftAttention reads the target's DenseKVCache; it has none of its own")

    def prefill(self, q, k, v, cache, meta, *, q_pre=None, k_pre=None):
        raise NotImplementedError("WindowedDraftAttention does not prefill: the target prefills the shared cache")

    def decode(self, q, k, v, cache: DenseKVCache, meta: DecodeMeta, *, q_pre=None, k_pre=None):
        # q: [A, Hq, T, D]; k, v: [A, Hkv, T, D]
        A, Hq, T, D = q.shape
        write_rows(cache.gen_k, cache.gen_v, k, v, meta.row_slot, meta.cached_len)
        vpos, valid = window_positions(meta.prefix_len, meta.cached_len, T, max(self.window, T), self.sink)
        kw, vw = gather_window(cache, meta, vpos)  # [A, Hkv, N, D]
        qpos = (meta.prefix_len + meta.cached_len)[:, None] + torch.arange(T, device=q.device)[None, :]  # [A, T]
        mask = valid[:, None, :] & (vpos[:, None, :] <= qpos[:, :, None])  # [A, T, N]
        # grouped-query attention without repeating K/V: query head h reads kv head h // q_per_kv
        Hkv, G = self.shape.num_kv_heads, self.shape.q_per_kv
        qg = q.reshape(A, Hkv, G * T, D)
        scores = torch.matmul(qg, kw.to(q.dtype).transpose(-1, -2)).float() * (D ** -0.5)  # [A, Hkv, G*T, N]
        mask_g = mask[:, None, None, :, :].expand(A, 1, G, T, mask.shape[-1]).reshape(A, 1, G * T, -1)
        probs = torch.softmax(scores.masked_fill(~mask_g, float("-inf")), dim=-1)
        out = torch.matmul(probs.to(q.dtype), vw.to(q.dtype))  # [A, Hkv, G*T, D]
        return out.reshape(A, Hq, T, D)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", window={self.window}, sink={self.sink}"

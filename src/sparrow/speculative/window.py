"""Draft-only attention over a window of the target's dense KV cache: sink tokens + the most recent ones.

A self-drafter that shares the target's cache reads, at every draft step, the same KV bytes as a target
step; at long context those bytes dominate a decode step, so the draft is barely cheaper than the target.
:class:`WindowedDraftAttention` makes the draft's attention cost independent of the context length: each
new token attends to the first ``sink`` tokens of the sequence (attention sinks) and to the last
``window`` tokens (itself included), read in place from the target's :class:`DenseKVCache` (prefix slot
and generation slot), with the keys' original RoPE positions. It runs the dense split-KV decode kernel with
its window bounds (:func:`sparrow.kernels.decode_attention.decode_attention` with ``window`` / ``sink``): no
copy of the window is made. It writes its K/V at the draft positions like the dense backend, so the verify
pass overwrites them. Acceptance decides whether the shortcut pays; exactness does not depend on it.
"""

from __future__ import annotations

from sparrow.attention.base import AttentionBackend, CacheSpec, DecodeMeta, LayerShape
from sparrow.attention.dense import DenseKVCache, decode_impl, write_rows
from sparrow.kernels.decode_attention import decode_attention


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

    def init_cache(self, spec: CacheSpec, *, dtype, device):
        raise NotImplementedError("WindowedDraftAttention reads the target's DenseKVCache; it has none of its own")

    def prefill(self, q, k, v, cache, meta, *, q_pre=None, k_pre=None):
        raise NotImplementedError("WindowedDraftAttention does not prefill: the target prefills the shared cache")

    def decode(self, q, k, v, cache: DenseKVCache, meta: DecodeMeta, *, q_pre=None, k_pre=None):
        # q: [A, Hq, T, D]; k, v: [A, Hkv, T, D]
        write_rows(cache.gen_k, cache.gen_v, k, v, meta.row_slot, meta.cached_len)
        return decode_attention(
            q, cache.prefix_k, cache.prefix_v, cache.gen_k, cache.gen_v,
            meta.row_slot, meta.prefix_slot, meta.prefix_len, meta.cached_len,
            window=max(self.window, q.shape[2]), sink=self.sink,
            impl=decode_impl("auto", self.shape.head_dim, q.device), validate=False,
        )

    def extra_repr(self) -> str:
        return super().extra_repr() + f", window={self.window}, sink={self.sink}"

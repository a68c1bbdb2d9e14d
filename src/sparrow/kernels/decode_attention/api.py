"""Decode attention over a two-level KV cache: validation and ``impl`` dispatch."""

from __future__ import annotations

import torch

from ..common.impl import Impl, resolve_impl


def _check(q, prefix_k, prefix_v, gen_k, gen_v, row_slot, prefix_slot, prefix_len, cached_len) -> None:
    if q.dim() != 4 or prefix_k.dim() != 4 or gen_k.dim() != 4:
        raise ValueError(
            f"expected q [A,Hq,T,D], prefix_k [P,Hkv,Lp,D], gen_k [R,Hkv,Lg,D]; got {tuple(q.shape)}, "
            f"{tuple(prefix_k.shape)}, {tuple(gen_k.shape)}"
        )
    A, Hq, _, D = q.shape
    if prefix_k.shape != prefix_v.shape or gen_k.shape != gen_v.shape:
        raise ValueError("k and v caches must have the same shape")
    if prefix_k.shape[1] != gen_k.shape[1] or prefix_k.shape[3] != D or gen_k.shape[3] != D:
        raise ValueError(f"cache heads/head_dim {tuple(prefix_k.shape)} / {tuple(gen_k.shape)} do not match q {tuple(q.shape)}")
    if Hq % prefix_k.shape[1] != 0:
        raise ValueError(f"query heads ({Hq}) must be a multiple of kv heads ({prefix_k.shape[1]})")
    for name, t in (("row_slot", row_slot), ("prefix_slot", prefix_slot), ("prefix_len", prefix_len),
                    ("cached_len", cached_len)):
        if t.shape != (A,) or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be an integer tensor of shape ({A},), got {t.dtype} {tuple(t.shape)}")


def decode_attention(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    gen_k: torch.Tensor,
    gen_v: torch.Tensor,
    row_slot: torch.Tensor,
    prefix_slot: torch.Tensor,
    prefix_len: torch.Tensor,
    cached_len: torch.Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
    sink: int = 0,
    impl: Impl = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """Attention of ``T`` new tokens per row over its prefix slot and generation slot.

    Args:
        q: [A, Hq, T, D] queries (post-RoPE). ``T > 1`` is speculative verification: query ``t`` sees the
            new tokens ``0..t``.
        prefix_k, prefix_v: [P, Hkv, Lp, D] prompt caches. gen_k, gen_v: [R, Hkv, Lg, D] generation
            caches, with the new tokens' K/V already written at ``cached_len .. cached_len + T - 1``.
        row_slot, prefix_slot, prefix_len, cached_len: [A] integer tensors (see
            :class:`sparrow.attention.DecodeMeta`).
        window, sink: attend only to each row's first ``sink`` positions and its last ``window`` positions
            (counted up to its last new token; a drafter's cheap attention). ``None``: every position.
        impl: ``"reference"`` (eager PyTorch, any device), ``"triton"`` (CUDA, or CPU under
            ``TRITON_INTERPRET=1``), ``"auto"`` (triton on CUDA, reference elsewhere).

    Returns: [A, Hq, T, D] in ``q.dtype``.

    Raises: ValueError on inconsistent shapes or dtypes (only when ``validate``; the check reads no data).
    """
    if validate:
        _check(q, prefix_k, prefix_v, gen_k, gen_v, row_slot, prefix_slot, prefix_len, cached_len)
        if window is not None and (window < q.shape[2] or sink < 0):
            raise ValueError(f"window ({window}) must cover the {q.shape[2]} new tokens and sink ({sink}) be >= 0")
    if resolve_impl(impl, q) == "triton":
        from .triton_decode import decode_attention_triton

        return decode_attention_triton(q, prefix_k, prefix_v, gen_k, gen_v, row_slot, prefix_slot, prefix_len,
                                       cached_len, scale, window=window, sink=sink)
    from .reference import decode_attention_reference

    return decode_attention_reference(q, prefix_k, prefix_v, gen_k, gen_v, row_slot, prefix_slot, prefix_len,
                                      cached_len, scale, window, sink)

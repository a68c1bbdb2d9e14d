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


def _check_window(q, window, sink) -> None:
    if window is not None and (window < q.shape[2] or sink < 0):
        raise ValueError(f"window ({window}) must cover the {q.shape[2]} new tokens and sink ({sink}) be >= 0")


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
        _check_window(q, window, sink)
    if resolve_impl(impl, q) == "triton":
        from .triton_decode import decode_attention_triton

        return decode_attention_triton(q, prefix_k, prefix_v, gen_k, gen_v, row_slot, prefix_slot, prefix_len,
                                       cached_len, scale, window=window, sink=sink)
    from .reference import decode_attention_reference

    return decode_attention_reference(q, prefix_k, prefix_v, gen_k, gen_v, row_slot, prefix_slot, prefix_len,
                                      cached_len, scale, window, sink)


# -- shared-prefix ("cascade") decode ---------------------------------------------------------------------------

def prefix_groups(prefix_slot: torch.Tensor, prefix_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which rows read the same prompt (same prefix slot and length), as static-shape tensors built on the device
    (no host sync: it runs inside compiled, CUDA-graphed decode steps).

    Args:
        prefix_slot, prefix_len: [A] integer tensors (see :class:`sparrow.attention.DecodeMeta`).

    Returns:
        ``(prefix_order, group_start)``, both [A] int64: ``prefix_order[i]`` is the row at position ``i`` of the
        rows sorted by prompt (stable: rows of a group keep their order); ``group_start[i]`` is the position of the
        first row of position ``i``'s group. A group of ``n`` rows holds positions ``group_start .. group_start +
        n - 1``; a row alone in its group is a group of one.
    """
    key = prefix_slot.long() * 2**32 + prefix_len.long()
    sorted_key, order = torch.sort(key, stable=True)
    pos = torch.arange(key.shape[0], device=key.device)
    prev = sorted_key.gather(0, (pos - 1).clamp(min=0))  # a gather, not a slice or roll: no guard on the batch size
    first = (sorted_key != prev) | (pos == 0)
    return order, torch.where(first, pos, 0).cummax(0).values


def _check_groups(q: torch.Tensor, prefix_order: torch.Tensor, group_start: torch.Tensor) -> None:
    A = q.shape[0]
    for name, t in (("prefix_order", prefix_order), ("group_start", group_start)):
        if t.shape != (A,) or t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be an integer tensor of shape ({A},) (from prefix_groups), got "
                             f"{t.dtype} {tuple(t.shape)}")


def cascade_decode_attention(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    gen_k: torch.Tensor,
    gen_v: torch.Tensor,
    row_slot: torch.Tensor,
    prefix_slot: torch.Tensor,
    prefix_len: torch.Tensor,
    cached_len: torch.Tensor,
    prefix_order: torch.Tensor,
    group_start: torch.Tensor,
    *,
    scale: float | None = None,
    window: int | None = None,
    sink: int = 0,
    impl: Impl = "auto",
    min_rows: int | None = None,
    max_tokens: int | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """:func:`decode_attention` with each prompt read once for all the rows that share it (a GRPO group).

    The rows of a group (``prefix_order`` / ``group_start`` from :func:`prefix_groups`) attend to their shared
    prompt as one multi-query tile — ``rows x T x q_per_kv`` queries per kv head, read once — and each row to its
    own generated tokens; the two softmax states are merged exactly by their log-sum-exps. Same arguments (plus
    the grouping), visibility and result as :func:`decode_attention`; ``T > 1`` (speculative verification) shares
    the prompt among all ``T`` queries of every row of the group.

    Args:
        prefix_order, group_start: [A] integer tensors from :func:`prefix_groups` (rows grouped by prefix slot
            and length; a group's rows must share both).
        impl: ``"reference"`` (eager PyTorch: the two states and the merge spelled out), ``"triton"`` (CUDA, or
            CPU under ``TRITON_INTERPRET=1``), ``"auto"`` (triton on CUDA, reference elsewhere).
        min_rows: (Triton) a batch of fewer rows runs the per-row kernel instead, the same result (one or two
            groups share too little to pay for the tile); ``None``: :data:`.dispatch.CASCADE_MIN_ROWS` on CUDA, 1
            elsewhere (no size hands off); 0: always the cascade, even inside :func:`.dispatch.per_row_decode`,
            which otherwise hands every size off. Decided inside the kernel op, once per captured bucket.
        max_tokens: (Triton) more query tokens per row than this (``T``, speculative verification) run the
            per-row kernel too, unless ``min_rows`` is 0; ``None``: :data:`.dispatch.CASCADE_MAX_TOKENS` on CUDA,
            0 (no limit) elsewhere.

    Returns: [A, Hq, T, D] in ``q.dtype``.

    Raises: ValueError on inconsistent shapes or dtypes (only when ``validate``; the check reads no data).
    """
    if validate:
        _check(q, prefix_k, prefix_v, gen_k, gen_v, row_slot, prefix_slot, prefix_len, cached_len)
        _check_groups(q, prefix_order, group_start)
        _check_window(q, window, sink)
    if resolve_impl(impl, q) == "triton":
        from .triton_cascade import cascade_attention_triton

        return cascade_attention_triton(q, prefix_k, prefix_v, gen_k, gen_v, row_slot, prefix_slot, prefix_len,
                                        cached_len, prefix_order, group_start, scale, window=window, sink=sink,
                                        min_rows=min_rows, max_tokens=max_tokens)
    from .reference import cascade_decode_attention_reference

    return cascade_decode_attention_reference(q, prefix_k, prefix_v, gen_k, gen_v, row_slot, prefix_slot,
                                              prefix_len, cached_len, scale, window, sink)


def cascade_local_attention(
    q: torch.Tensor,
    prefix_lk: torch.Tensor,
    prefix_lv: torch.Tensor,
    gen_lk: torch.Tensor,
    gen_lv: torch.Tensor,
    row_slot: torch.Tensor,
    prefix_slot: torch.Tensor,
    prefix_len: torch.Tensor,
    cached_len: torch.Tensor,
    prefix_order: torch.Tensor,
    group_start: torch.Tensor,
    *,
    num_sinks: int,
    window: int,
    scale: float | None = None,
    impl: Impl = "auto",
    validate: bool = True,
) -> torch.Tensor:
    """RTPurbo's local-head decode attention (sinks + a sliding window, from ring buffers) with each prompt's
    window read once for all the rows that share it, merged with each row's own ring by log-sum-exp.

    Semantics of :mod:`sparrow.kernels.sparse_decode` for local heads: query ``t`` of a row (at position ``pos =
    prefix_len + cached_len + t``) sees the first ``min(num_sinks, prefix_len)`` prompt tokens and the positions
    ``pos - window < j <= pos``.

    Args:
        q: [A, Hq, T, D] queries of the local heads, grouped by local kv head (``h // (Hq / H_loc)``).
        prefix_lk, prefix_lv: [P, H_loc, num_sinks + Wp, D] — a prompt's sinks, then a ring of its last ``Wp``
            tokens (position ``j`` at ``num_sinks + j % Wp``).
        gen_lk, gen_lv: [R, H_loc, Wg, D] — a ring of each row's generated tokens (index ``g`` at ``g % Wg``), the
            new tokens already written; ``Wg >= window + T - 1`` unless it holds every generated token.
        row_slot, prefix_slot, prefix_len, cached_len, prefix_order, group_start: as
            :func:`cascade_decode_attention`.

    Returns: [A, Hq, T, D] in ``q.dtype``.

    Raises: ValueError on inconsistent shapes or parameters (only when ``validate``; reads no data).
    """
    if validate:
        _check(q, prefix_lk, prefix_lv, gen_lk, gen_lv, row_slot, prefix_slot, prefix_len, cached_len)
        _check_groups(q, prefix_order, group_start)
        if window < q.shape[2] or not 0 <= num_sinks < prefix_lk.shape[2]:
            raise ValueError(f"window ({window}) must cover the {q.shape[2]} new tokens and num_sinks ({num_sinks}) "
                             f"lie in [0, {prefix_lk.shape[2]})")
    if resolve_impl(impl, q) == "triton":
        from .triton_cascade import cascade_attention_triton

        return cascade_attention_triton(q, prefix_lk, prefix_lv, gen_lk, gen_lv, row_slot, prefix_slot, prefix_len,
                                        cached_len, prefix_order, group_start, scale, window=window, sink=num_sinks,
                                        local=True)
    from .reference import cascade_local_attention_reference

    return cascade_local_attention_reference(q, prefix_lk, prefix_lv, gen_lk, gen_lv, row_slot, prefix_slot,
                                             prefix_len, cached_len, num_sinks=num_sinks, window=window, scale=scale)

"""Shared-prefix ("cascade") decode attention: a GRPO group's prompt KV read once for all of its rows.

The rows of one group attend to the same prompt. The per-row kernel (:mod:`.triton_decode`) streams that prompt
from memory once per row; here one launch runs two kinds of programs over a grid ``(A, Hkv, NS_P + NS_S)``:

* a *prefix tile* program (``split < NS_P``; axis 0 a position in the rows sorted by prompt): the queries of up
  to ``ROWS`` rows of one group — ``ROWS x T x q_per_kv`` of them, one ``[BLOCK_M, D]`` tile — walk the split's
  share of the shared prompt once, with an online softmax and per-query masks (each row's own length and
  window); only the program at the first position of each tile works, the others return at once;
* a *suffix* program (``split >= NS_P``; axis 0 a row): the row's ``T x q_per_kv`` queries over its own
  generated tokens (the new ones included, causally).

Every program writes a partial output and log-sum-exp (log2 domain, ``-inf`` for a split that saw nothing) per
query and split; a second kernel merges each query's ``NS_P + NS_S`` partial states exactly. Rows are grouped by
:func:`sparrow.kernels.decode_attention.prefix_groups` on the device (a stable sort by prompt): no host sync, a
static grid whatever the grouping, so one captured CUDA graph serves every mix of groups (a row alone in its group
is a tile of one row).

Two cache layouts, one kernel: the dense two-level cache (position ``j`` at index ``j``; optional window + sinks
counted up to a row's last new token, as :func:`.decode_attention`) and RTPurbo's local-head rings (``LOCAL``:
sinks then a ring of the prompt's last ``WP`` tokens; a ring of ``WG`` generated tokens; a window per query).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from sparrow.kernels.common.triton_merge import merge_splits

from .dispatch import CASCADE_MAX_TOKENS, CASCADE_MIN_ROWS, per_row_forced
from .triton_decode import _attend_block, _sm_count, decode_attention_triton, splits_for_batch

BIG = tl.constexpr(2147483647)  # above any position (a constexpr: compiled Triton reads no other globals)


@triton.jit
def _bounds(plen, clen, t, window, sink, T: tl.constexpr, LOCAL: tl.constexpr):
    """(n_sink, lo, hi) of queries at token ``t`` of rows with ``plen`` / ``clen``: a query sees positions
    ``j < n_sink`` and ``lo <= j <= hi``. Dense: window (``window > 0``) and sinks per row, counted up to its last
    new token. Local (RTPurbo): sinks are prompt tokens, the window ends at the query."""
    hi = plen + clen + t
    if LOCAL:
        n_sink = tl.minimum(plen, sink)
        lo = tl.maximum(hi - window + 1, n_sink)
    else:
        total = plen + clen + T
        lo = tl.where(window > 0, tl.maximum(total - window, 0), 0)
        n_sink = tl.minimum(lo, sink)
    return n_sink + 0 * hi, lo + 0 * hi, hi  # one value per query


@triton.jit
def _walk(acc, m_i, l_i, q, k_base, v_base, stride_l, start, end, n_first, shift1, shift2, base, lim, n_sink, q_lo,
          m_valid, offs_n, offs_d, qk_scale, RING: tl.constexpr, RING_OFF: tl.constexpr, RING_LEN: tl.constexpr,
          BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Online softmax over the virtual indices ``start .. end - 1`` of two ranges of positions: index ``v`` is
    position ``j = v + shift1`` below ``n_first``, ``v + shift2`` from there on. Position ``j``'s K/V sit at index
    ``j - base`` (the second range of a ring: ``RING_OFF + (j - base) % RING_LEN``). Query ``m`` sees ``j`` when
    ``j <= lim[m]`` and (``j < n_sink[m]`` or ``j >= q_lo[m]``)."""
    for v0 in range(start, end, BLOCK_N):
        v = v0 + offs_n
        kv_mask = v < end
        first = v < n_first
        j = tl.where(first, v + shift1, v + shift2)
        if RING:
            idx = tl.where(first, j - base, RING_OFF + (j - base) % RING_LEN)
        else:
            idx = j - base
        jj = j[None, :]
        visible = (kv_mask[None, :] & m_valid[:, None] & (jj <= lim[:, None])
                   & ((jj < n_sink[:, None]) | (jj >= q_lo[:, None])))
        off = idx[:, None] * stride_l + offs_d[None, :]
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k_base + off, v_base + off, kv_mask, visible, qk_scale, IEEE)
    return acc, m_i, l_i


@triton.jit
def _store(O_PART, LSE_PART, acc, m_i, l_i, o_off, l_off, m_valid, offs_d, wrote):
    """A partial state: output (only when the split attended to something) and log2-domain log-sum-exp."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
    if wrote:
        tl.store(O_PART + o_off[:, None] + offs_d[None, :], acc / l_safe[:, None], mask=m_valid[:, None])
    tl.store(LSE_PART + l_off, lse, mask=m_valid)


@triton.jit
def _prefix_tile(
    Q, PK, PV, PREFIX_SLOT, PREFIX_LEN, CACHED_LEN, ORDER, GROUP_START, O_PART, LSE_PART, A, i, h, split, gs,
    stride_qa, stride_qh, stride_qt, stride_pks, stride_pkh, stride_pkl, stride_oa, stride_oh, stride_ot, stride_os,
    stride_la, stride_lh, stride_lt, qk_scale, window, sink, offs_d, offs_n,
    T: tl.constexpr, QPK: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, NS_P: tl.constexpr, CHUNK_P: tl.constexpr, LOCAL: tl.constexpr, SINKS: tl.constexpr, WP: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Prefix split ``split`` of the tile at sorted positions ``i .. i + ROWS - 1`` of one group: all their
    queries over the group's prompt, read once."""
    offs_m = tl.arange(0, BLOCK_M)
    r_of_m = offs_m // (T * QPK)
    t_of_m = (offs_m // QPK) % T
    g_of_m = offs_m % QPK
    sp = i + r_of_m
    in_tile = (r_of_m < ROWS) & (sp < A)
    sp = tl.where(in_tile, sp, i)
    m_valid = in_tile & (tl.load(GROUP_START + sp) == gs)
    a_m = tl.load(ORDER + sp)  # the row of each query
    plen = tl.load(PREFIX_LEN + a_m)
    n_sink, q_lo, _ = _bounds(plen, tl.load(CACHED_LEN + a_m), t_of_m, window, sink, T, LOCAL)
    # the tile reads the union of its queries' prompt positions: sinks [0, ns), then [w_lo, w_hi)
    has_win = m_valid & (q_lo < plen)
    w_hi = tl.max(tl.where(has_win, plen, 0), 0)
    w_lo = tl.min(tl.where(has_win, q_lo, BIG), 0)
    ns = tl.max(tl.where(m_valid, tl.minimum(n_sink, plen), 0), 0)
    no_win = w_lo >= w_hi  # no query's window reaches into the prompt: only sinks
    w_lo = tl.where(no_win, ns, w_lo)
    w_hi = tl.where(no_win, ns, w_hi)
    ns = tl.minimum(ns, w_lo)
    n_vis = ns + w_hi - w_lo
    chunk = tl.cdiv(tl.maximum(tl.cdiv(n_vis, NS_P), CHUNK_P), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, n_vis)
    heads = h * QPK + g_of_m
    q = tl.load(Q + a_m[:, None] * stride_qa + heads[:, None] * stride_qh + t_of_m[:, None] * stride_qt
                + offs_d[None, :], mask=m_valid[:, None], other=0.0)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    pslot = tl.load(PREFIX_SLOT + tl.load(ORDER + i))
    acc, m_i, l_i = _walk(acc, m_i, l_i, q, PK + pslot * stride_pks + h * stride_pkh,
                          PV + pslot * stride_pks + h * stride_pkh, stride_pkl, start, end, ns, 0, w_lo - ns, 0,
                          plen - 1, n_sink, q_lo, m_valid, offs_n, offs_d, qk_scale, LOCAL, SINKS, WP, BLOCK_N, IEEE)
    o_off = a_m * stride_oa + heads * stride_oh + t_of_m * stride_ot + split * stride_os
    l_off = a_m * stride_la + heads * stride_lh + t_of_m * stride_lt + split
    _store(O_PART, LSE_PART, acc, m_i, l_i, o_off, l_off, m_valid, offs_d, start < n_vis)


@triton.jit
def _suffix_row(
    Q, GK, GV, ROW_SLOT, PREFIX_LEN, CACHED_LEN, O_PART, LSE_PART, i, h, s2,
    stride_qa, stride_qh, stride_qt, stride_gks, stride_gkh, stride_gkl, stride_oa, stride_oh, stride_ot, stride_os,
    stride_la, stride_lh, stride_lt, qk_scale, window, sink, offs_d, offs_n,
    T: tl.constexpr, QPK: tl.constexpr, D: tl.constexpr, BLOCK_MS: tl.constexpr, BLOCK_N: tl.constexpr,
    NS_P: tl.constexpr, NS_S: tl.constexpr, CHUNK_S: tl.constexpr, LOCAL: tl.constexpr, WG: tl.constexpr, IEEE: tl.constexpr,
):
    """Suffix split ``s2`` of row ``i``: its queries over its own generated tokens."""
    offs_m = tl.arange(0, BLOCK_MS)
    t_of_m = offs_m // QPK
    g_of_m = offs_m % QPK
    m_valid = offs_m < T * QPK
    plen = tl.load(PREFIX_LEN + i)
    clen = tl.load(CACHED_LEN + i)
    n_sink, q_lo, q_hi = _bounds(plen, clen, t_of_m, window, sink, T, LOCAL)
    total = plen + clen + T
    # generated sinks [plen, s_hi) (a prompt shorter than the dense sinks), then [g_lo, total)
    g_lo = tl.maximum(tl.min(tl.where(m_valid, q_lo, BIG), 0), plen)
    s_hi = tl.maximum(tl.minimum(tl.max(tl.where(m_valid, n_sink, 0), 0), g_lo), plen)
    n1 = s_hi - plen
    n_vis = n1 + tl.maximum(total - g_lo, 0)
    chunk = tl.cdiv(tl.maximum(tl.cdiv(n_vis, NS_S), CHUNK_S), BLOCK_N) * BLOCK_N
    start = s2 * chunk
    end = tl.minimum(start + chunk, n_vis)
    heads = h * QPK + g_of_m
    q = tl.load(Q + i * stride_qa + heads[:, None] * stride_qh + t_of_m[:, None] * stride_qt + offs_d[None, :],
                mask=m_valid[:, None], other=0.0)
    acc = tl.zeros([BLOCK_MS, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_MS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_MS], dtype=tl.float32)
    rslot = tl.load(ROW_SLOT + i)
    acc, m_i, l_i = _walk(acc, m_i, l_i, q, GK + rslot * stride_gks + h * stride_gkh,
                          GV + rslot * stride_gks + h * stride_gkh, stride_gkl, start, end, n1, plen, g_lo - n1,
                          plen, q_hi, n_sink, q_lo, m_valid, offs_n, offs_d, qk_scale, LOCAL, 0, WG, BLOCK_N, IEEE)
    o_off = i * stride_oa + heads * stride_oh + t_of_m * stride_ot + (NS_P + s2) * stride_os
    l_off = i * stride_la + heads * stride_lh + t_of_m * stride_lt + NS_P + s2
    _store(O_PART, LSE_PART, acc, m_i, l_i, o_off, l_off, m_valid, offs_d, start < n_vis)


@triton.jit
def _cascade_kernel(
    Q, PK, PV, GK, GV, ROW_SLOT, PREFIX_SLOT, PREFIX_LEN, CACHED_LEN, ORDER, GROUP_START, O_PART, LSE_PART, A,
    stride_qa, stride_qh, stride_qt,
    stride_pks, stride_pkh, stride_pkl,
    stride_gks, stride_gkh, stride_gkl,
    stride_oa, stride_oh, stride_ot, stride_os,
    stride_la, stride_lh, stride_lt,
    qk_scale, window, sink,
    T: tl.constexpr, QPK: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_MS: tl.constexpr, BLOCK_N: tl.constexpr, NS_P: tl.constexpr, NS_S: tl.constexpr,
    CHUNK_P: tl.constexpr, CHUNK_S: tl.constexpr, LOCAL: tl.constexpr, SINKS: tl.constexpr, WP: tl.constexpr,
    WG: tl.constexpr, IEEE: tl.constexpr,
):
    """Program (position i, kv head h, split): prefix splits (the first ``NS_P``) of the tile starting at sorted
    position ``i``, or suffix splits of row ``i``. The two kinds are separate functions: the branches of one ``if``
    may not define a name with two block shapes."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    gs = tl.load(GROUP_START + i)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    if split < NS_P:
        if (i - gs) % ROWS == 0:  # a prefix program at the first row of its tile (the others have no work)
            _prefix_tile(Q, PK, PV, PREFIX_SLOT, PREFIX_LEN, CACHED_LEN, ORDER, GROUP_START, O_PART, LSE_PART, A, i,
                         h, split, gs, stride_qa, stride_qh, stride_qt, stride_pks, stride_pkh, stride_pkl, stride_oa,
                         stride_oh, stride_ot, stride_os, stride_la, stride_lh, stride_lt, qk_scale, window, sink,
                         offs_d, offs_n, T, QPK, D, ROWS, BLOCK_M, BLOCK_N, NS_P, CHUNK_P, LOCAL, SINKS, WP, IEEE)
    else:
        _suffix_row(Q, GK, GV, ROW_SLOT, PREFIX_LEN, CACHED_LEN, O_PART, LSE_PART, i, h, split - NS_P, stride_qa,
                    stride_qh, stride_qt, stride_gks, stride_gkh, stride_gkl, stride_oa, stride_oh, stride_ot,
                    stride_os, stride_la, stride_lh, stride_lt, qk_scale, window, sink, offs_d, offs_n, T, QPK, D,
                    BLOCK_MS, BLOCK_N, NS_P, NS_S, CHUNK_S, LOCAL, WG, IEEE)


@triton.jit
def _merge_kernel(
    O_PART, LSE_PART, OUT,
    stride_oa, stride_oh, stride_ot, stride_os,
    stride_la, stride_lh, stride_lt,
    stride_a, stride_h, stride_t,
    D: tl.constexpr, NS: tl.constexpr, SPLITS_P2: tl.constexpr,
):
    """Program (row, query head, token): its ``NS`` partial states merged (:func:`merge_splits`; a split that saw
    nothing wrote no output and is never read)."""
    a = tl.program_id(0)
    h = tl.program_id(1)
    t = tl.program_id(2)
    merge_splits(O_PART, LSE_PART, OUT, a * stride_oa + h * stride_oh + t * stride_ot,
                 a * stride_la + h * stride_lh + t * stride_lt, a * stride_a + h * stride_h + t * stride_t,
                 stride_os, NS, D, SPLITS_P2)


PREFIX_MIN_CHUNK = 512  # a tile's split writes BLOCK_M partial outputs: longer chunks keep that traffic small
SUFFIX_MIN_CHUNK = 256
MAX_SPLITS = 64


def tile_rows(tokens: int, q_per_kv: int) -> int:
    """Rows of one group per prefix tile: as many as fit ``64`` queries for one token per row (a GRPO group of 8
    at 7 or 8 query heads per kv head is one tile), ``128`` for verify steps (``tokens`` > 1)."""
    return max(1, (64 if tokens == 1 else 128) // (tokens * q_per_kv))


def cascade_splits(rows: int, kv_heads: int, tokens: int, per_tile: int, prefix_len: int, gen_len: int,
                   sm_count: int | None) -> tuple[int, int]:
    """(prefix splits, suffix splits) per (tile or row, kv head): each bounded by its length (chunks of at least
    :data:`PREFIX_MIN_CHUNK` / :data:`SUFFIX_MIN_CHUNK` tokens) and, with ``sm_count``, cut to what fills the GPU
    (:func:`.triton_decode.splits_for_batch`; the prefix counted as ``rows / per_tile`` full tiles)."""
    ns_p = max(1, min(MAX_SPLITS, -(-prefix_len // PREFIX_MIN_CHUNK)))
    ns_s = max(1, min(MAX_SPLITS, -(-gen_len // SUFFIX_MIN_CHUNK)))
    if sm_count is not None:
        ns_p = splits_for_batch(ns_p, -(-rows // per_tile), kv_heads, sm_count, per_tile * tokens)
        ns_s = splits_for_batch(ns_s, rows, kv_heads, sm_count, tokens)
    return ns_p, ns_s


def cascade_attention_triton(
    q: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor, gen_k: torch.Tensor, gen_v: torch.Tensor,
    row_slot: torch.Tensor, prefix_slot: torch.Tensor, prefix_len: torch.Tensor, cached_len: torch.Tensor,
    prefix_order: torch.Tensor, group_start: torch.Tensor, scale: float | None = None, *, window: int | None = None,
    sink: int = 0, local: bool = False, splits: tuple[int, int] | None = None, rows_per_tile: int | None = None,
    min_chunk: tuple[int, int] = (PREFIX_MIN_CHUNK, SUFFIX_MIN_CHUNK), min_rows: int | None = None,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """Launch the cascade kernel and the merge (as the custom op ``sparrow::cascade_decode_attention``: opaque to
    ``torch.compile``, safe inside CUDA graphs). Arguments as :func:`.api.cascade_decode_attention` (``local``:
    RTPurbo's ring layout, :func:`.api.cascade_local_attention`, with ``sink`` its ``num_sinks``). ``splits``
    (prefix, suffix) and ``rows_per_tile`` fix what :func:`cascade_splits` / :func:`tile_rows` would choose
    (decided inside the op, i.e. once per captured graph); ``min_chunk``: least tokens per split. ``min_rows``: a
    dense (not ``local``) batch of fewer rows runs the per-row kernel (:func:`.triton_decode.decode_attention_triton`)
    instead, and so does every dense batch inside :func:`.dispatch.per_row_decode` unless ``min_rows`` is 0; default
    :data:`.dispatch.CASCADE_MIN_ROWS` on CUDA, 1 elsewhere, and 0 (always the cascade) with explicit ``splits`` /
    ``rows_per_tile``. ``max_tokens``: a dense batch of more query tokens per row (``T``) runs the per-row kernel
    too (unless ``min_rows`` is 0); default :data:`.dispatch.CASCADE_MAX_TOKENS` on CUDA, 0 (no limit) elsewhere and
    with explicit ``splits`` / ``rows_per_tile``. The batch size and the context are read inside the op, so a graph
    compiled for symbolic sizes still decides per captured bucket and per capture."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    ns_p, ns_s = splits or (0, 0)
    if min_rows is None:
        min_rows = 0 if splits is not None or rows_per_tile is not None else CASCADE_MIN_ROWS if q.is_cuda else 1
    if max_tokens is None:
        max_tokens = 0 if splits is not None or rows_per_tile is not None or not q.is_cuda else CASCADE_MAX_TOKENS
    return _cascade_op(q, prefix_k, prefix_v, gen_k, gen_v, row_slot, prefix_slot, prefix_len, cached_len,
                       prefix_order, group_start, float(scale), int(window or 0), int(sink), bool(local), int(ns_p),
                       int(ns_s), int(rows_per_tile or 0), int(min_chunk[0]), int(min_chunk[1]), int(min_rows),
                       int(max_tokens))


@torch.library.custom_op("sparrow::cascade_decode_attention", mutates_args=())
def _cascade_op(
    q: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor, gen_k: torch.Tensor, gen_v: torch.Tensor,
    row_slot: torch.Tensor, prefix_slot: torch.Tensor, prefix_len: torch.Tensor, cached_len: torch.Tensor,
    prefix_order: torch.Tensor, group_start: torch.Tensor, scale: float, window: int, sink: int, local: bool,
    prefix_splits: int, suffix_splits: int, rows_per_tile: int, min_chunk_prefix: int, min_chunk_suffix: int,
    min_rows: int = 0, max_tokens: int = 0,
) -> torch.Tensor:
    A, Hq, T, D = q.shape
    # here the batch is a plain int and the context the caller's: one decision per captured graph
    if not local and A > 0 and min_rows > 0 and (A < min_rows or 0 < max_tokens < T or per_row_forced()):
        return decode_attention_triton(q, prefix_k, prefix_v, gen_k, gen_v, row_slot, prefix_slot, prefix_len,
                                       cached_len, scale, window=window or None, sink=sink)
    Hkv = prefix_k.shape[1]
    qpk = Hq // Hkv
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    if A == 0 or Hkv == 0:
        return out
    q = q.contiguous()
    rows = rows_per_tile or tile_rows(T, qpk)
    Lp, Lg = prefix_k.shape[2], gen_k.shape[2]
    if local:  # the rings hold what any query can see
        p_bound, g_bound = Lp, Lg
    else:
        p_bound, g_bound = (Lp, Lg) if window <= 0 else (min(Lp, window + sink), min(Lg, window + sink))
    ns_p, ns_s = cascade_splits(A, Hkv, T, rows, p_bound, g_bound, _sm_count(q.device))
    ns_p, ns_s = prefix_splits or ns_p, suffix_splits or ns_s
    block_m = max(16, triton.next_power_of_2(rows * T * qpk))
    block_ms = max(16, triton.next_power_of_2(T * qpk))
    block_n = 64 if D <= 64 or block_m <= 64 else 32
    ns = ns_p + ns_s
    o_part = torch.empty((A, Hq, T, ns, D), device=q.device, dtype=torch.float32)
    lse_part = torch.empty((A, Hq, T, ns), device=q.device, dtype=torch.float32)
    _cascade_kernel[(A, Hkv, ns)](
        q, prefix_k, prefix_v, gen_k, gen_v, row_slot, prefix_slot, prefix_len, cached_len, prefix_order, group_start,
        o_part, lse_part, A,
        q.stride(0), q.stride(1), q.stride(2),
        prefix_k.stride(0), prefix_k.stride(1), prefix_k.stride(2),
        gen_k.stride(0), gen_k.stride(1), gen_k.stride(2),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
        lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
        scale * 1.4426950408889634, window, sink,
        T=T, QPK=qpk, D=D, ROWS=rows, BLOCK_M=block_m, BLOCK_MS=block_ms, BLOCK_N=block_n, NS_P=ns_p, NS_S=ns_s,
        CHUNK_P=min_chunk_prefix, CHUNK_S=min_chunk_suffix, LOCAL=local, SINKS=sink if local else 0,
        WP=max(Lp - sink, 1) if local else 1, WG=max(Lg, 1), IEEE=q.dtype == torch.float32,
        num_warps=8 if block_m * D >= 128 * 128 else 4,
    )
    _merge_kernel[(A, Hq, T)](
        o_part, lse_part, out,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
        lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        D=D, NS=ns, SPLITS_P2=max(2, triton.next_power_of_2(ns)),
    )
    return out


@_cascade_op.register_fake
def _(q, prefix_k, prefix_v, gen_k, gen_v, row_slot, prefix_slot, prefix_len, cached_len, prefix_order, group_start,
      scale, window, sink, local, prefix_splits, suffix_splits, rows_per_tile, min_chunk_prefix, min_chunk_suffix,
      min_rows=0, max_tokens=0):
    return q.new_empty(q.shape)  # contiguous, as the real op's output

"""Split-KV ("flash-decoding") Triton kernel for decode attention over a two-level cache.

One program per (row, kv head, split): it loads the ``T * q_per_kv`` queries that share the kv head as
one ``[BLOCK_M, D]`` tile, walks its share of the row's virtual sequence — prompt tokens read in place
from the row's prefix slot, then generated tokens from its generation slot — with an online softmax,
and writes a partial output and log-sum-exp; a second kernel merges the splits that ran. A row's
sequence is cut into chunks of at least ``MIN_CHUNK`` tokens, so short rows use few splits.
Rows of one GRPO group read the same prefix slot: no copy of the prompt's KV is ever made.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from sparrow.kernels.common.triton_dot import dot
from sparrow.kernels.common.triton_merge import merge_splits


@triton.jit
def _chunk_len(total, NUM_SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr):
    chunk = tl.maximum(tl.cdiv(total, NUM_SPLITS), MIN_CHUNK)
    return tl.cdiv(chunk, BLOCK_N) * BLOCK_N


@triton.jit
def _attend_block(acc, m_i, l_i, q, k_ptrs, v_ptrs, kv_mask, visible, qk_scale, IEEE: tl.constexpr):
    k = tl.load(k_ptrs, mask=kv_mask[:, None], other=0.0)  # [BLOCK_N, D]
    v = tl.load(v_ptrs, mask=kv_mask[:, None], other=0.0)
    s = dot(q, tl.trans(k), IEEE) * qk_scale  # [BLOCK_M, BLOCK_N], log2 domain
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, IEEE)
    return acc, m_new, l_i


@triton.jit
def _attend_range(acc, m_i, l_i, q, lo, hi, plen, pk_base, pv_base, gk_base, gv_base, stride_pkl, stride_gkl,
                  q_limit, m_valid, offs_n, offs_d, qk_scale, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Attend to the row's positions ``lo .. hi - 1``: prompt ones in place from the prefix slot, generated
    ones (the new tokens included, causally) from the generation slot."""
    p_end = tl.minimum(hi, plen)
    for j0 in range(lo, p_end, BLOCK_N):
        j = j0 + offs_n
        kv_mask = j < p_end
        visible = kv_mask[None, :] & m_valid[:, None]
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q,
            pk_base + j[:, None] * stride_pkl + offs_d[None, :],
            pv_base + j[:, None] * stride_pkl + offs_d[None, :],
            kv_mask, visible, qk_scale, IEEE,
        )
    for j0 in range(tl.maximum(lo, plen), hi, BLOCK_N):
        j = j0 + offs_n
        kv_mask = j < hi
        jg = j - plen
        visible = kv_mask[None, :] & (j[None, :] <= q_limit[:, None]) & m_valid[:, None]
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q,
            gk_base + jg[:, None] * stride_gkl + offs_d[None, :],
            gv_base + jg[:, None] * stride_gkl + offs_d[None, :],
            kv_mask, visible, qk_scale, IEEE,
        )
    return acc, m_i, l_i


@triton.jit
def _visible_len(total, window, sink):
    """(tokens a row attends to, first window position, sink tokens before it): with ``window > 0`` the
    first ``sink`` positions and the last ``window``, else all ``total``."""
    w_lo = tl.where(window > 0, tl.maximum(total - window, 0), 0)
    n_sink = tl.minimum(sink, w_lo)
    return n_sink + total - w_lo, w_lo, n_sink


@triton.jit
def _decode_split_kernel(
    Q, PK, PV, GK, GV, ROW_SLOT, PREFIX_SLOT, PREFIX_LEN, CACHED_LEN, O_PART, LSE_PART,
    stride_qa, stride_qh, stride_qt,
    stride_pks, stride_pkh, stride_pkl,
    stride_gks, stride_gkh, stride_gkl,
    stride_oa, stride_oh, stride_ot, stride_os,
    stride_la, stride_lh, stride_lt,
    qk_scale, window, sink,
    T: tl.constexpr, QPK: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr,
    IEEE: tl.constexpr,
):
    a = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)

    pslot = tl.load(PREFIX_SLOT + a)
    rslot = tl.load(ROW_SLOT + a)
    plen = tl.load(PREFIX_LEN + a)
    clen = tl.load(CACHED_LEN + a)
    total = plen + clen + T

    offs_m = tl.arange(0, BLOCK_M)
    t_of_m = offs_m // QPK
    g_of_m = offs_m % QPK
    m_valid = offs_m < T * QPK
    offs_d = tl.arange(0, D)
    q_ptrs = Q + a * stride_qa + (h * QPK + g_of_m)[:, None] * stride_qh + t_of_m[:, None] * stride_qt + offs_d[None, :]
    q = tl.load(q_ptrs, mask=m_valid[:, None], other=0.0)
    q_limit = plen + clen + t_of_m  # last visible virtual position of each query row

    # the visible tokens as one virtual sequence: sinks 0..n_sink-1, then positions w_lo..total-1
    n_vis, w_lo, n_sink = _visible_len(total, window, sink)
    chunk = _chunk_len(n_vis, NUM_SPLITS, MIN_CHUNK, BLOCK_N)
    start = split * chunk
    if start >= n_vis:  # an empty split: the merge kernel never reads it
        return
    end = tl.minimum(start + chunk, n_vis)

    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    pk_base = PK + pslot * stride_pks + h * stride_pkh
    pv_base = PV + pslot * stride_pks + h * stride_pkh
    gk_base = GK + rslot * stride_gks + h * stride_gkh
    gv_base = GV + rslot * stride_gks + h * stride_gkh
    acc, m_i, l_i = _attend_range(acc, m_i, l_i, q, start, tl.minimum(end, n_sink), plen, pk_base, pv_base,
                                  gk_base, gv_base, stride_pkl, stride_gkl, q_limit, m_valid, offs_n, offs_d,
                                  qk_scale, BLOCK_N, IEEE)
    shift = w_lo - n_sink  # virtual index -> position past the sinks
    acc, m_i, l_i = _attend_range(acc, m_i, l_i, q, tl.maximum(start, n_sink) + shift, end + shift, plen, pk_base,
                                  pv_base, gk_base, gv_base, stride_pkl, stride_gkl, q_limit, m_valid, offs_n,
                                  offs_d, qk_scale, BLOCK_N, IEEE)

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))  # log2 domain
    o_ptrs = (O_PART + a * stride_oa + (h * QPK + g_of_m)[:, None] * stride_oh + t_of_m[:, None] * stride_ot
              + split * stride_os + offs_d[None, :])
    tl.store(o_ptrs, out, mask=m_valid[:, None])
    l_ptrs = LSE_PART + a * stride_la + (h * QPK + g_of_m) * stride_lh + t_of_m * stride_lt + split
    tl.store(l_ptrs, lse, mask=m_valid)


@triton.jit
def _merge_kernel(
    O_PART, LSE_PART, OUT, PREFIX_LEN, CACHED_LEN,
    stride_oa, stride_oh, stride_ot, stride_os,
    stride_la, stride_lh, stride_lt,
    stride_a, stride_h, stride_t, window, sink,
    T: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, MIN_CHUNK: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLITS_P2: tl.constexpr,
):
    a = tl.program_id(0)
    h = tl.program_id(1)
    t = tl.program_id(2)
    total = tl.load(PREFIX_LEN + a) + tl.load(CACHED_LEN + a) + T
    n_vis, _, _ = _visible_len(total, window, sink)
    n_valid = tl.cdiv(n_vis, _chunk_len(n_vis, NUM_SPLITS, MIN_CHUNK, BLOCK_N))
    merge_splits(O_PART, LSE_PART, OUT, a * stride_oa + h * stride_oh + t * stride_ot,
                 a * stride_la + h * stride_lh + t * stride_lt, a * stride_a + h * stride_h + t * stride_t,
                 stride_os, n_valid, D, SPLITS_P2)


MIN_CHUNK = 256


def num_splits_for(max_len: int, *, max_splits: int = 64) -> int:
    """Splits per (row, kv head) for a cache of ``max_len`` tokens (a static choice per cache).

    A row uses ``ceil(len / chunk)`` of them, chunks being at least ``MIN_CHUNK`` tokens, so short rows
    launch few active programs and the merge reads only the splits that ran.
    """
    return max(1, min(max_splits, -(-max_len // MIN_CHUNK)))


PROGRAMS_PER_SM = 4  # split programs to aim for per streaming multiprocessor (verify: several query tokens)
DECODE_PROGRAMS_PER_SM = 16  # the same for one decode token per row, whose partial outputs are small
LONGEST_CUT = 16  # a batch cuts the splits by at most this factor (long rows stay spread over programs)
INTERPRETER_SM_COUNT: int | None = None  # multiprocessors assumed off the GPU (None: no batch cut; tests set it)


@functools.lru_cache(maxsize=None)
def _cuda_sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sm_count(device: torch.device) -> int | None:
    return _cuda_sm_count(device.index or 0) if device.type == "cuda" else INTERPRETER_SM_COUNT


def splits_for_batch(max_splits: int, rows: int, kv_heads: int, sm_count: int | None, tokens: int = 1) -> int:
    """Splits per (row, kv head): ``max_splits`` (the cache-length bound of :func:`num_splits_for`), cut
    down to what fills ``sm_count`` multiprocessors with ``PROGRAMS_PER_SM`` programs each
    (``DECODE_PROGRAMS_PER_SM`` for ``tokens == 1`` new token per row: its partial outputs cost little, and
    more programs balance rows of different lengths better) when the ``rows x kv_heads`` programs of one
    split already go a long way, but not below ``max_splits / LONGEST_CUT`` (so one program never walks a
    long row alone: the longest program sets the time). ``sm_count`` None: no cut."""
    if sm_count is None:
        return max_splits
    per_sm = DECODE_PROGRAMS_PER_SM if tokens == 1 else PROGRAMS_PER_SM
    want = -(-per_sm * sm_count // (rows * kv_heads))
    return max(1, -(-max_splits // LONGEST_CUT), min(max_splits, want))


def decode_attention_triton(
    q: torch.Tensor,
    prefix_k: torch.Tensor,
    prefix_v: torch.Tensor,
    gen_k: torch.Tensor,
    gen_v: torch.Tensor,
    row_slot: torch.Tensor,
    prefix_slot: torch.Tensor,
    prefix_len: torch.Tensor,
    cached_len: torch.Tensor,
    scale: float | None = None,
    num_splits: int | None = None,
    min_chunk: int = MIN_CHUNK,
    window: int | None = None,
    sink: int = 0,
) -> torch.Tensor:
    """Launch the split + merge kernels (as the custom op ``sparrow::decode_attention``, opaque to
    ``torch.compile`` and safe inside CUDA graphs). ``window``: attend only to the first ``sink`` and the
    last ``window`` positions of each row (``None``: all). ``num_splits``: splits per (row, kv head),
    exactly; default: bounded by the cache length (:func:`num_splits_for`) and, on a GPU, by the batch
    (:func:`splits_for_batch`, decided when the op runs, i.e. once per captured CUDA graph)."""
    fit_batch = num_splits is None
    if num_splits is None:
        longest = prefix_k.shape[2] + gen_k.shape[2]
        num_splits = num_splits_for(longest if window is None else min(longest, window + sink))
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _decode_attention_op(q, prefix_k, prefix_v, gen_k, gen_v, row_slot, prefix_slot, prefix_len, cached_len,
                                float(scale), int(num_splits), int(min_chunk), int(window or 0), int(sink),
                                bool(fit_batch))


@torch.library.custom_op("sparrow::decode_attention", mutates_args=())
def _decode_attention_op(
    q: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor, gen_k: torch.Tensor, gen_v: torch.Tensor,
    row_slot: torch.Tensor, prefix_slot: torch.Tensor, prefix_len: torch.Tensor, cached_len: torch.Tensor,
    scale: float, num_splits: int, min_chunk: int, window: int, sink: int, fit_batch: bool = False,
) -> torch.Tensor:
    A, Hq, T, D = q.shape
    Hkv = prefix_k.shape[1]
    qpk = Hq // Hkv
    if fit_batch:  # here the batch is a plain int, whatever the caller's compiled graph holds symbolically
        num_splits = splits_for_batch(num_splits, A, Hkv, _sm_count(q.device), T)
    q = q.contiguous()
    block_m = max(16, triton.next_power_of_2(T * qpk))
    block_n = 64 if D <= 64 or block_m <= 64 else 32
    o_part = torch.empty((A, Hq, T, num_splits, D), device=q.device, dtype=torch.float32)
    lse_part = torch.empty((A, Hq, T, num_splits), device=q.device, dtype=torch.float32)
    _decode_split_kernel[(A, Hkv, num_splits)](
        q, prefix_k, prefix_v, gen_k, gen_v, row_slot, prefix_slot, prefix_len, cached_len, o_part, lse_part,
        q.stride(0), q.stride(1), q.stride(2),
        prefix_k.stride(0), prefix_k.stride(1), prefix_k.stride(2),
        gen_k.stride(0), gen_k.stride(1), gen_k.stride(2),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
        lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
        scale * 1.4426950408889634, window, sink,
        T=T, QPK=qpk, D=D, BLOCK_M=block_m, BLOCK_N=block_n, NUM_SPLITS=num_splits, MIN_CHUNK=min_chunk,
        IEEE=q.dtype == torch.float32,
    )
    out = torch.empty_like(q)
    _merge_kernel[(A, Hq, T)](
        o_part, lse_part, out, prefix_len, cached_len,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), o_part.stride(3),
        lse_part.stride(0), lse_part.stride(1), lse_part.stride(2),
        out.stride(0), out.stride(1), out.stride(2), window, sink,
        T=T, D=D, NUM_SPLITS=num_splits, MIN_CHUNK=min_chunk, BLOCK_N=block_n,
        SPLITS_P2=max(2, triton.next_power_of_2(num_splits)),
    )
    return out


@_decode_attention_op.register_fake
def _(q, prefix_k, prefix_v, gen_k, gen_v, row_slot, prefix_slot, prefix_len, cached_len, scale, num_splits,
      min_chunk, window, sink, fit_batch=False):
    return q.new_empty(q.shape)  # contiguous, as the real op's output (q may arrive as a strided view)

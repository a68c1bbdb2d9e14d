"""Top-p block selection without a sort: a bisection on the score threshold, then an in-order compaction.

One program per selection row (a query in decode, a query block in prefill). It reads the row's block
log-masses ``x_b`` (valid for blocks ``b < n_valid``), finds by bisection the largest threshold ``tau``
with ``sum_{x_b >= tau} exp(x_b - max) >= top_p * sum_b exp(x_b - max)`` — the blocks at or above
``tau`` are then the smallest set reaching mass ``top_p``, up to scores closer than the final
bracket (below fp32 resolution after 32 halvings of an 80-nat range) — and writes the ids of the
kept blocks, forced blocks (sinks, local window) included, in ascending order, with their count.
Nothing leaves the device: the threshold, the list and the count stay in device memory.

``top_p`` is a Python float (a launch constant) or a float32 device tensor the program reads: one value for
every row (0-dim) or one per batch entry (decode: per cache row, prefill: per prompt, explicit: per selection
row). A tensor is read when the kernel runs, so a CUDA graph that captured the launch follows in-place updates.

A row of at most 4096 blocks (256K tokens at 64-token blocks) is read once into registers and exponentiated
once; each bisection step is then a compare and a sum in registers. Longer rows are re-read at every step.
At batch 1 the selection is a single program, so these serial steps are the latency of a sparse decode step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MODE_EXPLICIT, MODE_DECODE, MODE_PREFILL = 0, 1, 2


@triton.jit
def top_p_threshold(x, top_p, ITERS: tl.constexpr, KEEP_ALL: tl.constexpr, TOP_P_PTR: tl.constexpr):
    """The score threshold of a row held in registers (``x``, -inf where invalid): the largest ``tau`` (by
    ``ITERS`` bisection steps) whose blocks ``x >= tau`` hold ``top_p`` of the softmax mass; -inf keeps all."""
    tau = tl.full([], float("-inf"), dtype=tl.float32)
    if not KEEP_ALL:
        m = tl.max(x, 0)
        mn = tl.min(tl.where(x > float("-inf"), x, float("inf")), 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        e = tl.exp(x - m_safe)  # the same terms _mass_above sums: its results, bit for bit
        target = top_p * tl.sum(e, 0)
        lo = tl.maximum(mn, m_safe - 80.0)
        lo = tl.where(tl.sum(tl.where(x >= lo, e, 0.0), 0) >= target, lo, mn)
        hi = m_safe + 1.0
        for _ in range(ITERS):
            mid = (lo + hi) * 0.5
            ok = tl.sum(tl.where(x >= mid, e, 0.0), 0) >= target
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        tau = tl.where(m == float("-inf"), float("-inf"), lo)
        if TOP_P_PTR:  # a mass that float32 stores as 1: every block (KEEP_ALL of a launch constant)
            tau = tl.where(top_p >= 1.0, float("-inf"), tau)
    return tau


@triton.jit
def _row_bounds(n, A0, A1, H_INNER, INNER, MODE: tl.constexpr, QBLOCK: tl.constexpr):
    """First and last query position of selection row ``n``, and its batch entry (the index of a per-entry
    ``top_p``)."""
    if MODE == 0:  # explicit bounds
        q_lo = tl.load(A0 + n).to(tl.int64)
        q_hi = tl.load(A1 + n).to(tl.int64)
        e = n
    elif MODE == 1:  # decode: n = (row * H + head) * T + t; A0 = prefix_len, A1 = cached_len
        e = n // H_INNER
        t = n % INNER
        q_lo = tl.load(A0 + e).to(tl.int64) + tl.load(A1 + e).to(tl.int64) + t
        q_hi = q_lo
    else:  # prefill: n = (prompt * H + head) * Qb + qb; A0 = prompt_len
        e = n // H_INNER
        qb = n % INNER
        q_lo = qb * QBLOCK
        q_hi = tl.maximum(q_lo, tl.minimum(q_lo + QBLOCK, tl.load(A0 + e).to(tl.int64)) - 1)
    return q_lo, q_hi, e


@triton.jit
def _mass_above(row, n_valid, thr, m_safe, CHUNK: tl.constexpr):
    offs = tl.arange(0, CHUNK)
    f = tl.zeros([], dtype=tl.float32)
    for c0 in range(0, n_valid, CHUNK):
        o = c0 + offs
        x = tl.load(row + o, mask=o < n_valid, other=float("-inf"))
        f += tl.sum(tl.where(x >= thr, tl.exp(x - m_safe), 0.0), 0)
    return f


@triton.jit
def _topp_kernel(
    SCORES, SEL_IDX, SEL_CNT, A0, A1,
    NB, stride_s, stride_i, H_INNER, INNER, TOP_P, stride_p,
    MODE: tl.constexpr, BLOCK: tl.constexpr, QBLOCK: tl.constexpr, SINK_BLOCKS: tl.constexpr,
    LOCAL_WINDOW: tl.constexpr, CHUNK: tl.constexpr, ITERS: tl.constexpr, KEEP_ALL: tl.constexpr,
    ONE_CHUNK: tl.constexpr, TOP_P_PTR: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    q_lo, q_hi, e = _row_bounds(n, A0, A1, H_INNER, INNER, MODE, QBLOCK)
    if TOP_P_PTR:  # a device value (0-dim: stride 0; per batch entry: stride 1), read now
        top_p = tl.load(TOP_P + e * stride_p).to(tl.float32)
    else:
        top_p = TOP_P
    n_valid = tl.minimum(q_hi // BLOCK + 1, NB)
    if LOCAL_WINDOW > 0:
        first_local = tl.maximum(q_lo - LOCAL_WINDOW + 1, 0) // BLOCK
    else:
        first_local = n_valid  # no local window: nothing forced
    offs = tl.arange(0, CHUNK)
    row = SCORES + n * stride_s

    if ONE_CHUNK:  # the whole row in registers: loaded once, exponentiated once, bisected without reloads
        valid = offs < n_valid
        x = tl.load(row + offs, mask=valid, other=float("-inf"))
        tau = top_p_threshold(x, top_p, ITERS, KEEP_ALL, TOP_P_PTR)
        sel = valid & ((x >= tau) | (offs < SINK_BLOCKS) | (offs >= first_local))
        pos = tl.cumsum(sel.to(tl.int32), 0) - 1
        tl.store(SEL_IDX + n * stride_i + pos, offs.to(tl.int32), mask=sel)
        tl.store(SEL_CNT + n, tl.sum(sel.to(tl.int32), 0))
    else:
        _select_chunked(row, SEL_IDX + n * stride_i, SEL_CNT + n, n_valid, first_local, top_p, offs,
                        SINK_BLOCKS, CHUNK, ITERS, KEEP_ALL, TOP_P_PTR)


@triton.jit
def _select_chunked(row, out, cnt_ptr, n_valid, first_local, top_p, offs, SINK_BLOCKS: tl.constexpr,
                    CHUNK: tl.constexpr, ITERS: tl.constexpr, KEEP_ALL: tl.constexpr, TOP_P_PTR: tl.constexpr):
    """Rows longer than one chunk: every bisection step re-reads the row."""
    tau = tl.full([], float("-inf"), dtype=tl.float32)
    if not KEEP_ALL:
        m = tl.full([], float("-inf"), dtype=tl.float32)
        mn = tl.full([], float("inf"), dtype=tl.float32)
        for c0 in range(0, n_valid, CHUNK):
            o = c0 + offs
            x = tl.load(row + o, mask=o < n_valid, other=float("-inf"))
            m = tl.maximum(m, tl.max(x, 0))
            mn = tl.minimum(mn, tl.min(tl.where(x > float("-inf"), x, float("inf")), 0))
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        z = _mass_above(row, n_valid, float("-inf"), m_safe, CHUNK)
        target = top_p * z
        # bracket: f(lo) >= target > f(hi). Blocks more than 80 nats below the maximum carry < e^-80 of
        # the mass each; the check falls back to the minimum when even that matters.
        lo = tl.maximum(mn, m_safe - 80.0)
        lo = tl.where(_mass_above(row, n_valid, lo, m_safe, CHUNK) >= target, lo, mn)
        hi = m_safe + 1.0
        for _ in range(ITERS):
            mid = (lo + hi) * 0.5
            ok = _mass_above(row, n_valid, mid, m_safe, CHUNK) >= target
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        tau = tl.where(m == float("-inf"), float("-inf"), lo)  # no finite score: keep every valid block
        if TOP_P_PTR:
            tau = tl.where(top_p >= 1.0, float("-inf"), tau)

    cnt = tl.zeros([], dtype=tl.int32)
    for c0 in range(0, n_valid, CHUNK):
        o = c0 + offs
        valid = o < n_valid
        x = tl.load(row + o, mask=valid, other=float("-inf"))
        sel = valid & ((x >= tau) | (o < SINK_BLOCKS) | (o >= first_local))
        pos = cnt + tl.cumsum(sel.to(tl.int32), 0) - 1
        tl.store(out + pos, o.to(tl.int32), mask=sel)
        cnt += tl.sum(sel.to(tl.int32), 0)
    tl.store(cnt_ptr, cnt)


def topp_select_triton(
    scores: torch.Tensor,
    a0: torch.Tensor,
    a1: torch.Tensor,
    top_p: float | torch.Tensor,
    *,
    mode: int,
    block: int,
    sink_blocks: int,
    local_window: int,
    inner: int = 1,
    h_inner: int = 1,
    qblock: int = 1,
    iters: int = 32,
    sel_idx: torch.Tensor | None = None,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """scores: [N, NB] float32 (row stride free, unit column stride). Returns (idx [N, NB] int32, cnt [N] int32).

    ``mode`` picks how a row's query positions are found: explicit ``a0 = q_lo, a1 = q_hi`` [N];
    decode (``a0 = prefix_len, a1 = cached_len`` [A], rows ``(a * H + h) * T + t`` with ``inner = T``,
    ``h_inner = H * T``); prefill (``a0 = prompt_len`` [P], rows ``(p * H + h) * Qb + qb`` with
    ``inner = Qb``, ``h_inner = H * Qb``, query blocks of ``qblock`` tokens). ``top_p``: a float, or a float32
    tensor read by the kernel — 0-dim, or ``[E]`` with one value per batch entry (decode: ``A`` rows, prefill:
    ``P`` prompts, explicit: ``N`` rows); not validated (no host read). ``chunk`` (a power of two, at least 16)
    overrides the blocks read per step (tests: rows longer than one chunk at small sizes).
    """
    N, NB = scores.shape
    if sel_idx is None:
        sel_idx = torch.empty((N, NB), dtype=torch.int32, device=scores.device)
    cnt = torch.empty((N,), dtype=torch.int32, device=scores.device)
    chunk = chunk or min(4096, max(16, triton.next_power_of_2(NB)))
    on_device = isinstance(top_p, torch.Tensor)
    if on_device:
        tp, stride_p, keep_all = top_p.float(), (top_p.stride(0) if top_p.dim() else 0), False
    else:  # a mass that float32 stores as 1 keeps every block
        tp, stride_p, keep_all = float(top_p), 0, top_p >= 1.0 - 2.0**-25
    _topp_kernel[(N,)](
        scores, sel_idx, cnt, a0, a1, NB, scores.stride(0), sel_idx.stride(0), h_inner, inner, tp, stride_p,
        MODE=mode, BLOCK=block, QBLOCK=qblock, SINK_BLOCKS=sink_blocks, LOCAL_WINDOW=local_window, CHUNK=chunk,
        ITERS=iters, KEEP_ALL=keep_all, ONE_CHUNK=NB <= chunk, TOP_P_PTR=on_device,
        num_warps=4 if chunk <= 1024 else 8,
    )
    return sel_idx, cnt

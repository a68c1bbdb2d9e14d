"""Triton kernel for the weight-only int8 linear at decode-sized batches.

One program per (output tile, row tile, K split): it streams its ``[BLOCK_N, K / SPLIT_K]`` slice of the int8
weight once, converts it in registers to the activation dtype (exact: |q| <= 127), and accumulates
``x @ w.T`` in float32 with ``tl.dot``. Decode batches have few rows, so the grid is widened along K
(``SPLIT_K``) until it covers the GPU; partial sums then go to a float32 workspace and a second kernel adds
them, applies the per-channel scale and the bias, and casts. With one split the first kernel does that itself.
The weight is read at one byte per element, half of what a bf16 linear reads.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from sparrow.kernels.common.triton_dot import dot


@triton.jit
def _int8_linear_kernel(
    X, W, S, B, Y, WS,
    M, N, K,
    stride_xm, stride_wn, stride_ym, stride_wsk, stride_wsm,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    k_per = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per
    k_hi = tl.minimum(k_lo + k_per, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < k_hi
        x = tl.load(X + offs_m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + offs_n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        acc += dot(x, tl.trans(w.to(x.dtype)), IEEE)
    if SPLIT_K == 1:
        y = acc * tl.load(S + offs_n, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:
            y += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(Y.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.store(WS + pid_k * stride_wsk + offs_m[:, None] * stride_wsm + offs_n[None, :], acc,
                 mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _splitk_reduce_kernel(
    WS, S, B, Y, N, stride_wsk, stride_wsm, stride_ym,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
):
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(WS + s * stride_wsk + m * stride_wsm + offs, mask=ok, other=0.0)
    y = acc * tl.load(S + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(B + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + m * stride_ym + offs, y.to(Y.dtype.element_ty), mask=ok)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: small grids, but still exercise the split path


def launch_config(M: int, N: int, K: int, num_sms: int, split_k: int | None = None) -> dict:
    """Tile sizes and K split for an ``[M, K] x [N, K]^T`` product: row tiles of 16-128 (each row tile reads the
    weight once), 64 output columns, 128-wide K steps; a grid of less than one program per SM is split along K
    up to about two programs per SM (at most one K step per split)."""
    block_m = 16 if M <= 16 else (32 if M <= 32 else (64 if M <= 64 else 128))
    block_n = 64 if N >= 64 else max(16, triton.next_power_of_2(N))
    block_k = min(128, max(16, triton.next_power_of_2(K)))
    tiles = triton.cdiv(N, block_n) * triton.cdiv(M, block_m)
    if split_k is None:  # split only grids of less than one wave
        split_k = 1 if tiles >= num_sms else max(1, min(triton.cdiv(2 * num_sms, tiles), triton.cdiv(K, block_k)))
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT_K=int(split_k),
                num_warps=8 if block_m == 128 else 4)


def int8_linear_triton(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                       split_k: int | None = None) -> torch.Tensor:
    """Launch the kernels (as the custom op ``sparrow::int8_linear``: opaque to ``torch.compile``, safe in
    CUDA graphs). ``split_k`` forces the K split (tests); default: :func:`launch_config`'s."""
    return _int8_linear_op(x, qweight, scale, bias, -1 if split_k is None else int(split_k))


@torch.library.custom_op("sparrow::int8_linear", mutates_args=())
def _int8_linear_op(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                    split_k: int) -> torch.Tensor:
    N, K = qweight.shape
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0:
        return y.view(*x.shape[:-1], N)
    cfg = launch_config(M, N, K, _num_sms(x.device), None if split_k < 0 else split_k)
    sk = cfg["SPLIT_K"]
    ws = torch.empty((sk, M, N), device=x.device, dtype=torch.float32) if sk > 1 else y
    b = bias if bias is not None else scale  # a placeholder pointer when there is no bias
    grid = (triton.cdiv(N, cfg["BLOCK_N"]), triton.cdiv(M, cfg["BLOCK_M"]), sk)
    _int8_linear_kernel[grid](
        x2, qweight, scale, b, y, ws, M, N, K,
        x2.stride(0), qweight.stride(0), y.stride(0), ws.stride(0) if sk > 1 else 0, ws.stride(1) if sk > 1 else 0,
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32, num_stages=3, **cfg,
    )
    if sk > 1:
        block = 256
        _splitk_reduce_kernel[(M, triton.cdiv(N, block))](
            ws, scale, b, y, N, ws.stride(0), ws.stride(1), y.stride(0),
            HAS_BIAS=bias is not None, SPLIT_K=sk, BLOCK=block,
        )
    return y.view(*x.shape[:-1], N)


@_int8_linear_op.register_fake
def _(x, qweight, scale, bias, split_k):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))

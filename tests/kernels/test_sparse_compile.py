"""The RTPurbo Triton kernels (and the dense decode and drafter int8 linear kernels) compile for an sm_90 GPU
(offline, no device needed), at the shapes the H200 benchmarks use (bf16, head_dim 128, 8 query heads per kv
head, indexer dim 16, 64/128-token blocks) and at the unit tests' small float32 shapes (8- and 16-token
blocks, head_dim 16). The installed Triton may accept dot shapes that the GPU's older Triton rejects (K < 16):
the kernels pad such blocks to 16 lanes anyway.

Catches what the interpreter accepts but the compiler rejects (tl.dot shapes, dtype mismatches, loop-carried
type changes). Runs in a subprocess without ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r'''
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
try:
    import triton.backends.nvidia  # noqa: F401
except ImportError:
    print("SKIP no CUDA backend"); sys.exit(0)
from sparrow.kernels.topp import triton_topp as tp
from sparrow.kernels.sparse_decode import triton_sparse_decode as sd
from sparrow.kernels.sparse_prefill import triton_block_scores as bs
from sparrow.kernels.sparse_prefill import triton_local_merge as lm
from sparrow.kernels.int8_linear import triton_int8_linear as il
from sparrow.kernels.decode_attention import triton_decode as dd


def compile_(fn, args, constexprs, **options):
    sig = {k: v for k, v in args.items()}
    for k in constexprs:
        sig[k] = "constexpr"
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs),
                       target=GPUTarget("cuda", 90, 32), options=options)
    assert "ptx" in k.asm
    print("ok", fn.__name__, k.metadata.shared)


i64, i32, f32 = "i64", "i32", "fp32"
P64, P32, PF, PB = "*i64", "*i32", "*fp32", "*bf16"
for mode, ncol in ((0, 4096), (1, 4096), (2, 1024)):
    for keep_all, top_p in ((False, f32), (True, f32), (False, PF)):  # top_p a launch constant or a tensor
        for one_chunk in (False, True):
            compile_(tp._topp_kernel,
                     dict(SCORES=PF, SEL_IDX=P32, SEL_CNT=P32, A0=P64, A1=P64, NB=i32, stride_s=i32, stride_i=i32,
                          H_INNER=i32, INNER=i32, TOP_P=top_p, stride_p=i32),
                     dict(MODE=mode, BLOCK=64, QBLOCK=128, SINK_BLOCKS=1, LOCAL_WINDOW=128, CHUNK=ncol, ITERS=32,
                          KEEP_ALL=keep_all, ONE_CHUNK=one_chunk, TOP_P_PTR=top_p == PF), num_warps=8)
strides = lambda *names: {n: i64 for n in names}
for T in (1, 2):
    for project in (False, True)[:3 - T]:  # q_idx given, or (T=1) projected from the pre-RoPE queries in the kernel
        compile_(sd._score_kernel,
                 dict(QI=PB, QP=PB, WQ=PF, QSCALE=PF, RET_HEADS=P64, PIK=PB, GIK=PB, ROW_SLOT=P64, PREFIX_SLOT=P64,
                      PREFIX_LEN=P64, CACHED_LEN=P64, BS=PF, COUNTERS=P32,
                      **strides("stride_qa", "stride_qh", "stride_qt", "stride_ps", "stride_ph", "stride_pl",
                                "stride_gs", "stride_gh", "stride_gl", "stride_bn", "stride_wh", "stride_wc"),
                      H_RET=i32, NG=i32),
                 dict(T=T, R=16, BLOCK=64, BB=8, NUM_SPLITS=128, MIN_BLOCKS=16, PROJECT=project, QPK=8, D=128,
                      ZERO=project, NG_P2=8))
    # the benchmark shapes (bf16, head_dim 128, 64-token blocks) and the unit tests' (float32 with exact
    # float32 dots, head_dim 16, 8-token blocks padded to 16 lanes: tl.dot needs K >= 16 on the GPU) in the staged
    # pipeline (the top-p kernel's list, a merge launch); at the benchmark shape and T=1 also the fused one
    # (selection and merge in the launch, top_p on the device)
    for PT, D, QPK, BLOCK, ieee in ((PB, 128, 8, 64, False), (PF, 16, 2, 8, True)):
        modes = ((False, False, f32),) + (((True, True, PF),) if D == 128 and T == 1 else ())
        for select, merge, top_p in modes:
            compile_(sd._attn_kernel,
                     dict(Q=PT, PK=PT, PV=PT, GK=PT, GV=PT, BS=PF, SEL_IDX=P32, SEL_CNT=P32, RET_HEADS=P64, PLK=PT,
                          PLV=PT, GLK=PT, GLV=PT, LOC_HEADS=P64, ROW_SLOT=P64, PREFIX_SLOT=P64, PREFIX_LEN=P64,
                          CACHED_LEN=P64, O_PART=PF, LSE_PART=PF, OUT=PT, COUNTERS=P32,
                          **strides("stride_qa", "stride_qh", "stride_qt", "stride_ps", "stride_ph", "stride_pl",
                                    "stride_gs", "stride_gh", "stride_gl", "stride_si", "stride_bn", "stride_lps",
                                    "stride_lph", "stride_lpl", "stride_lgs", "stride_lgh", "stride_lgl",
                                    "stride_oa", "stride_oh", "stride_ot", "stride_os", "stride_la", "stride_lh",
                                    "stride_lt", "stride_a", "stride_h", "stride_t"),
                          qk_scale=f32, TOP_P=top_p, stride_tp=i32, H_RET=i32, NB=i32, NG=i32),
                     dict(T=T, QPK=QPK, D=D, IEEE=ieee, RET_BLOCK_M=16, BLOCK=BLOCK, RET_BLOCK_N=max(16, BLOCK),
                          NS_RET=64, MIN_BLOCKS=4, LOC_BLOCK_M=max(16, QPK * T), LOC_BLOCK_N=64, NS_LOC=32,
                          MIN_CHUNK=256, SINKS=4, SINK_P2=16, WINDOW=8192, WP=8192, WG=8256, SELECT=select,
                          MERGE=merge, CHUNK=4096 if select else 16, ITERS=32, KEEP_ALL=False, SINK_BLOCKS=1,
                          RET_WINDOW=128, RET_SPL=sd.merge_splits_per_step(16, D),
                          LOC_SPL=sd.merge_splits_per_step(max(16, QPK * T), D), TOP_P_PTR=top_p == PF),
                     num_warps=8)
    compile_(sd._merge_kernel,
             dict(O_PART=PF, LSE_PART=PF, OUT=PB, HEAD_IS_RET=P32,
                  **strides("stride_oa", "stride_oh", "stride_ot", "stride_os", "stride_la", "stride_lh",
                            "stride_lt", "stride_a", "stride_h", "stride_t")),
             dict(QPK=8, D=128, NS_RET=64, NS_LOC=32, SPLITS_P2=64))
# the chunked local prefill's merge at the benchmark shape (bf16, head_dim 128, 4 sinks)
for PT, D in ((PB, 128),):
    compile_(lm._local_merge_kernel,
             dict(Q=PT, KS=PT, VS=PT, OUT=PT, HEAD_MAP=P64, X1_O=PT, X1_L=PF, X2_O=PT, X2_L=PF, X3_O=PT, X3_L=PF,
                  **strides("stride_qp", "stride_qh", "stride_qs", "stride_kp", "stride_kh", "stride_ks", "stride_op",
                            "stride_oh", "stride_os", *(f"x{k}_{n}" for k in (1, 2, 3)
                                                        for n in ("ob", "oh", "or", "lb", "lh", "lr"))),
                  R0=i32, R=i32, CL=i32, X1_NCH=i32, X2_NCH=i32, X2_FIRST=i32, X3_NCH=i32, HQ=i32, WINDOW=i32,
                  qk_scale=f32),
             dict(QPK=8, D=D, BLOCK_M=32 if D > 64 else 64, NS=4, HAS2=True, HAS3=True, FLIP2=True), num_warps=4)
for PT, BLOCK, ieee in ((PB, 128, False), (PF, 16, True)):
    compile_(bs._block_mass_kernel,
             dict(QI=PT, KI=PT, PLEN=P64, OUT=PF,
                  **strides("stride_qp", "stride_qh", "stride_qs", "stride_kp", "stride_kh", "stride_ks",
                            "stride_op", "stride_oh", "stride_oq"), H=i32),
             dict(R=16, BLOCK=BLOCK, IEEE=ieee), num_warps=8)
# the dense decode kernel (target steps; drafter steps with a window), Qwen2.5-0.5B heads, verify T up to 9
for T in (1, 9):
    compile_(dd._decode_split_kernel,
             dict(Q=PB, PK=PB, PV=PB, GK=PB, GV=PB, ROW_SLOT=P64, PREFIX_SLOT=P64, PREFIX_LEN=P64, CACHED_LEN=P64,
                  O_PART=PF, LSE_PART=PF,
                  **strides("stride_qa", "stride_qh", "stride_qt", "stride_pks", "stride_pkh", "stride_pkl",
                            "stride_gks", "stride_gkh", "stride_gkl", "stride_oa", "stride_oh", "stride_ot",
                            "stride_os", "stride_la", "stride_lh", "stride_lt"), qk_scale=f32, window=i32, sink=i32),
             dict(T=T, QPK=7, D=64, BLOCK_M=max(16, triton.next_power_of_2(7 * T)), BLOCK_N=64, NUM_SPLITS=64,
                  MIN_CHUNK=256, IEEE=False))
compile_(dd._merge_kernel,
         dict(O_PART=PF, LSE_PART=PF, OUT=PB, PREFIX_LEN=P64, CACHED_LEN=P64,
              **strides("stride_oa", "stride_oh", "stride_ot", "stride_os", "stride_la", "stride_lh", "stride_lt",
                        "stride_a", "stride_h", "stride_t"), window=i32, sink=i32),
         dict(T=1, D=64, NUM_SPLITS=64, MIN_CHUNK=256, BLOCK_N=64, SPLITS_P2=64))
# the drafter's int8 linear at Qwen2.5-0.5B decode shapes (bf16 activations), both split modes
P8 = "*i8"
for M, N, K in ((8, 896, 896), (256, 4864, 896)):
    cfg = il.launch_config(M, N, K, 132)
    warps = cfg.pop("num_warps")
    for split in sorted({1, cfg["SPLIT_K"]}):
        for has_bias in (False, True):
            compile_(il._int8_linear_kernel,
                     dict(X=PB, W=P8, S=PF, B=PB, Y=PB, WS=PF, M=i32, N=i32, K=i32,
                          **strides("stride_xm", "stride_wn", "stride_ym", "stride_wsk", "stride_wsm")),
                     dict(HAS_BIAS=has_bias, IEEE=False, **{**cfg, "SPLIT_K": split}), num_warps=warps, num_stages=3)
compile_(il._splitk_reduce_kernel,
         dict(WS=PF, S=PF, B=PB, Y=PB, N=i32, **strides("stride_wsk", "stride_wsm", "stride_ym")),
         dict(HAS_BIAS=True, SPLIT_K=4, BLOCK=256))
'''


def test_rtpurbo_kernels_compile_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    if "SKIP" in proc.stdout:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("ok ") == 18 + (2 + 3 + 1) + (1 + 2 + 1) + 1 + 2 + 3 + 7

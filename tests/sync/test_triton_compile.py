"""The Triton kernels compile for an sm_90 GPU (offline, no device needed): catches what the Triton
interpreter accepts but the compiler rejects (e.g. non-constexpr globals, type mismatches). One variant per
kernel and element width where the code differs (the 32-bit paths share their integer log2 with the scan).

Runs in a subprocess without ``TRITON_INTERPRET`` (the interpreter replaces ``@triton.jit`` functions)
and loads the kernels module by path, so the check does not depend on the rest of the package.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

KERNELS = Path(__file__).resolve().parents[2] / "src" / "sparrow" / "kernels" / "sync"

SCRIPT = r'''
import importlib.util, sys, types
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
try:
    import triton.backends.nvidia  # noqa: F401
except ImportError:
    print("SKIP no CUDA backend"); sys.exit(0)
pkg = types.ModuleType("_sync_kernels"); pkg.__path__ = [sys.argv[1]]; sys.modules["_sync_kernels"] = pkg
spec = importlib.util.spec_from_file_location("_sync_kernels.triton_kernels", sys.argv[1] + "/triton_kernels.py")
tk = importlib.util.module_from_spec(spec); sys.modules[spec.name] = tk; spec.loader.exec_module(tk)
def compile_(fn, signature, constexprs, **options):
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    assert "ptx" in k.asm
    print("ok", fn.__name__)

p64, p32, p8 = "*i64", "*i32", "*u8"
S17 = 1 << 17
scan = dict(old_addr_ptr=p64, new_addr_ptr=p64, n_ptr=p64, block_cum_ptr=p64, blk_slice_ptr=p32, mask_off_ptr=p64,
            mask_ptr=p32, cnt_ptr=p32, kbits_ptr=p32, words_ptr=p64, slice_acc_ptr=p64, nslices="i32")
enc = dict(old_addr_ptr=p64, new_addr_ptr=p64, n_ptr=p64, start_ptr=p64, block_cum_ptr=p64, blk_slice_ptr=p32,
           mask_off_ptr=p64, mask_ptr=p32, cnt_ptr=p32, kbits_ptr=p32, cnt_cum_ptr=p64, words_ptr=p64,
           words_cum_ptr=p64, b0="i64", mode_ptr=p32, out_off_ptr=p64, hash_row_ptr=p32, out_ptr=p8, scratch_ptr=p32,
           hash_ptr=p32, hash_stride="i32")
chk = dict(words_ptr=p32, woff_ptr=p64, nwords_ptr=p64, n_ptr=p64, m_ptr=p64, block_cum_ptr=p64, nentries="i32",
           nblocks="i32", gate_ptr=p32)
app = dict(words_ptr=p32, woff_ptr=p64, n_ptr=p64, m_ptr=p64, block_cum_ptr=p64, rank_base_ptr=p64, addr_ptr=p64,
           start_ptr=p64, nentries="i32", gate_ptr=p32, ngate="i32", err_ptr=p32, scr_h_ptr=p32, scr_p_ptr=p32,
           hash_ptr=p32)
rec = dict(addr_ptr=p64, rec_off_ptr=p64, m_ptr=p64, tile_cum_ptr=p64, nslices="i32", pos_ptr=p32, val_ptr=p32,
           start_ptr=p64, hash_ptr=p32, gate_ptr=p32, ngate="i32", undo_ptr=p32)
hsh = dict(addr_ptr=p64, n_ptr=p64, start_ptr=p64, tile_cum_ptr=p64, prog_cum_ptr=p64, prog_slice_ptr=p32, out_ptr=p32)
cases = [
    (tk._hash_group_kernel, hsh, dict(EBITS=16, TILE=1024, TPP=8, ALIGNED=True), {}),
    (tk._hash_group_kernel, hsh, dict(EBITS=32, TILE=1024, TPP=8, ALIGNED=False), {}),
    (tk._scan_kernel, scan, dict(EBITS=16, SPAN=S17, TILE=4096, ALIGNED=True), dict(num_warps=8)),
    (tk._scan_kernel, scan, dict(EBITS=32, SPAN=1 << 10, TILE=1024, ALIGNED=False), dict(num_warps=8)),
    (tk._encode_kernel, enc, dict(EBITS=16, SPAN=S17, WL=1024, CH=1024, CH_LOG2=10, UPDATE_OLD=True, HASH=True),
     dict(num_warps=4)),
    (tk._check_headers_kernel, chk, dict(EBITS=16, SPAN=S17, BLK=256, STEPS=8), {}),
    (tk._apply_kernel, app, dict(EBITS=16, SPAN=S17, TB=2048, CH=1024, STEPS=8, NEGATE=False, HASH=True),
     dict(num_warps=8)),
    (tk._apply_records_kernel, rec, dict(EBITS=16, BLOCK=1024, DELTA=False, NEGATE=False, STEPS=8, HASH=True,
                                         UNDO=True), {}),
    (tk._apply_records_kernel, rec, dict(EBITS=32, BLOCK=1024, DELTA=True, NEGATE=True, STEPS=8, HASH=False,
                                         UNDO=False), {}),
]
for fn, sig, consts, opts in cases:
    compile_(fn, sig, consts, **opts)
'''


def test_kernels_compile_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(KERNELS)], env=env, capture_output=True, text=True,
                          timeout=300)
    if "SKIP" in proc.stdout:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("ok ") == 9

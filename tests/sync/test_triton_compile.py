"""The Triton kernels compile for an sm_90 GPU (offline, no device needed): catches what the Triton
interpreter accepts but the compiler rejects (e.g. non-constexpr globals, type mismatches).

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
from _sync_kernels.common import DIFF_TILE, RANK_BLOCK, slot_words

def compile_(fn, signature, constexprs, **options):
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    assert "ptx" in k.asm
    print("ok", fn.__name__)

E = 16
p64, p32 = "*i64", "*i32"
TPP = 8
full = dict(n_ptr=p64, start_ptr=p64, tile_cum_ptr=p64, prog_cum_ptr=p64, prog_slice_ptr=p32)
cases = [
    (tk._hash_group_kernel, dict(addr_ptr=p64, **full, out_ptr=p32), dict(EBITS=E, TILE=DIFF_TILE, TPP=TPP, ALIGNED=True), {}),
    (tk._hash_group_kernel, dict(addr_ptr=p64, **full, out_ptr=p32), dict(EBITS=32, TILE=DIFF_TILE, TPP=TPP, ALIGNED=False), {}),
    (tk._diff_count_group_kernel, dict(old_addr_ptr=p64, new_addr_ptr=p64, **full, counts_ptr=p32, maskw_ptr=p32,
                                       slice_counts_ptr=p32, hash_ptr=p32),
     dict(EBITS=E, TILE=DIFF_TILE, TPP=TPP, HASH=True, ALIGNED=True), {}),
    (tk._diff_count_group_kernel, dict(old_addr_ptr=p64, new_addr_ptr=p64, **full, counts_ptr=p32, maskw_ptr=p32,
                                       slice_counts_ptr=p32, hash_ptr=p32),
     dict(EBITS=E, TILE=DIFF_TILE, TPP=TPP, HASH=False, ALIGNED=False), {}),
    (tk._diff_collect_group_kernel, dict(old_addr_ptr=p64, new_addr_ptr=p64, **full, prog0="i64", counts_ptr=p32,
                                         offsets_ptr=p64, rec_base="i64", maskw_ptr=p32, pos_ptr=p32, val_ptr=p32,
                                         hash_ptr=p32),
     dict(EBITS=E, TILE=DIFF_TILE, TPP=TPP, DELTA=True, UPDATE_OLD=True, HASH=True), {}),
    (tk._diff_collect_group_kernel, dict(old_addr_ptr=p64, new_addr_ptr=p64, **full, prog0="i64", counts_ptr=p32,
                                         offsets_ptr=p64, rec_base="i64", maskw_ptr=p32, pos_ptr=p32, val_ptr=p32,
                                         hash_ptr=p32),
     dict(EBITS=32, TILE=DIFF_TILE, TPP=TPP, DELTA=False, UPDATE_OLD=False, HASH=True), {}),
    (tk._pack_group_kernel, dict(pos_ptr=p32, val_ptr=p32, m_ptr=p64, rec_off_ptr=p64, block_cum_ptr=p64,
                                 nslices="i32", slots_ptr=p32, sizes_ptr=p64, meta_ptr=p32, scratch_ptr=p32),
     dict(EBITS=E, R=RANK_BLOCK, SLOT=slot_words(E), WT=128, SEARCH_STEPS=12, STEPS=4), dict(num_warps=8)),
    (tk._assemble_group_kernel, dict(slots_ptr=p32, sizes_ptr=p64, size_excl_ptr=p64, block_cum_ptr=p64,
                                     base_ptr=p64, nslices="i32", meta_ptr=p32, out_ptr=p32),
     dict(SLOT=slot_words(E), CT=512, STEPS=4), {}),
    (tk._unpack_group_kernel, dict(words_ptr=p32, word_off_ptr=p64, total_ptr=p64, n_ptr=p64, m_ptr=p64,
                                   rec_off_ptr=p64, block_cum_ptr=p64, nslices="i32", pos_ptr=p32, val_ptr=p32,
                                   err_ptr=p32), dict(EBITS=E, R=RANK_BLOCK, STEPS=4), dict(num_warps=8)),
]
for delta, neg, hsh, eb in ((True, True, False, E), (True, False, True, E), (False, False, True, 32)):
    cases.append((tk._apply_group_kernel, dict(addr_ptr=p64, rec_off_ptr=p64, m_ptr=p64, tile_cum_ptr=p64,
                                               nslices="i32", pos_ptr=p32, val_ptr=p32, start_ptr=p64, hash_ptr=p32),
                  dict(EBITS=eb, BLOCK=1024, DELTA=delta, NEGATE=neg, STEPS=4, HASH=hsh), {}))
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
    assert proc.stdout.count("ok ") == 12

"""Every Triton launch the kernel packages make compiles for an sm_90 (Hopper) GPU — checked on the CPU.

CI has no GPU, so the kernel tests run the Triton interpreter, which accepts code the compiler rejects (a plain
module global read in a kernel; ``if``/``else`` branches that give a variable two block shapes). Here each
package's public launchers run at small shapes under the interpreter while :func:`tests.triton_compile.
record_launches` records every launch (kernel, argument types, constexprs, launch options); each distinct launch
is then compiled by the real Triton compiler for sm_90, to a cubin, and every failure is reported with its
kernel and configuration. The configurations cover what picks different code: bf16 (tensor-core dots) and
float32 (exact dots), head_dim 64 and 128, decode (``T = 1``) and verify (``T > 1``) steps, the cascade kernel's
dense and local (ring) layouts, the sparse decode's fused and staged pipelines, and the sync codec's modes.

The launchers' shapes are small (the interpreter's speed), so tile sizes and split counts are the small-shape
ones the launchers pick; launchers whose configuration follows only the shapes are recorded without running
the kernels (``execute=False``), the sync codec (which reads counts back) runs them.

Negative controls: a synthetic kernel whose ``if``/``else`` gives ``acc`` two block shapes runs under the
interpreter and fails to compile with "Mismatched type", its correct twin compiles; a plain-global kernel fails.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from triton.runtime.jit import KernelInterface  # noqa: E402  (JITFunction, or the interpreter's stand-in)

from tests.triton_compile import (  # noqa: E402
    Launch, Result, compile_launches, describe_arg, interpreting, launch_of, record_launches,
)

pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(),
                       reason="with a GPU the kernels are compiled for real by the other kernel tests"),
    pytest.mark.skipif(not torch.cuda.is_available() and not interpreting(),
                       reason="launches are recorded from the Triton interpreter: needs TRITON_INTERPRET=1"),
]

CPU = torch.device("cpu")
_RESULTS: dict[tuple, Result] = {}  # by Launch.key: shared by the packages (top-p runs in three of them)
_LAUNCHES: dict[str, list[Launch]] = {}  # recorded launches per package


def _compile(launches: list[Launch]) -> list[Result]:
    todo = list({x.key: x for x in launches if x.key not in _RESULTS}.values())
    if todo:
        try:
            _RESULTS.update(zip((x.key for x in todo), compile_launches(todo)))
        except NotImplementedError as e:
            pytest.skip(f"Triton cannot compile for sm_90 here: {e}")
    return [_RESULTS[x.key] for x in launches]


def _failures(results: list[Result]) -> str:
    def short(err: str) -> str:  # the error's last line: the assertion under a CompilationError's source excerpt
        return err.strip().splitlines()[-1]

    return "\n".join(f"  {r.kernel}\n    {r.launch}\n      {short(r.error)}" for r in results if not r.ok)


# -- what each package launches -----------------------------------------------------------------------------------

def _decode_attention():
    """Per-row decode (with and without a window) and the cascade kernel in both layouts (dense, plain and
    windowed; local: RTPurbo rings), each at bf16 and float32 by head_dim 64 and 128, two of the four as decode
    steps (``T = 1``) and two as verify steps (``T = 4`` and 3: 128-query tiles)."""
    from sparrow.kernels.decode_attention import (
        cascade_decode_attention, cascade_local_attention, decode_attention, prefix_groups,
    )
    from tests.kernels.test_cascade_attention import _grouped_inputs, _ring_inputs

    for dtype, D, T in ((torch.bfloat16, 128, 1), (torch.float32, 64, 1), (torch.bfloat16, 64, 4),
                        (torch.float32, 128, 3)):
        args = _grouped_inputs([3, 2, 1], 8, 2, T, D, 70, 24, dtype=dtype)
        groups = prefix_groups(args[6], args[7])
        decode_attention(*args, impl="triton")
        decode_attention(*args, window=16, sink=4, impl="triton")
        cascade_decode_attention(*args, *groups, impl="triton")
        cascade_decode_attention(*args, *groups, window=16, sink=4, impl="triton")
        ring = _ring_inputs([3, 2], 8, 2, T, D, 4, 16, 20, 60, 30)
        ring = tuple(t.to(dtype) if t.is_floating_point() else t for t in ring)
        cascade_local_attention(*ring, *prefix_groups(ring[6], ring[7]), num_sinks=4, window=16, impl="triton")


def _sparse_decode():
    """RTPurbo decode. bf16 at head_dim 128 (8 query heads per kv head, 64-token blocks), a decode step: the
    engine's fused op (selection, attention and merge in one launch, top_p on the device), the same with the
    indexer queries projected in the score kernel, the fused launch taking the top-p kernel's list, the staged
    pipeline (scores, top-p, attention, merge); a bf16 verify step (``T = 2``) on the fused op. float32 at
    head_dim 64 (16-token blocks), a verify step (``T = 3``): the fused op, and a float ``top_p`` of 1 (keep all)
    with the selection returned."""
    from sparrow.kernels.sparse_decode import SparseDecodeConfig, sparse_decode_attention
    from sparrow.kernels.sparse_decode.triton_sparse_decode import sparse_decode_triton
    from tests.kernels.test_sparse_decode import _make

    def case(dtype, D, qpk, block, T):
        args, _ = _make(A=2, Hkv=3, ret=(0, 2), qpk=qpk, T=T, D=D, P=2, Lp=150, R=3, Lg=40, dtype=dtype, W=32)
        return args, SparseDecodeConfig(top_p=0.6, block=block, num_sinks=4, window=32, ret_window=block)

    args, cfg = case(torch.bfloat16, 128, 8, 64, 1)
    q, _, cache, *_, ret, _, _ = args
    sparse_decode_attention(*args, cfg, impl="triton")
    wq = torch.randn(len(ret), 8 * 128, cache.prefix_ik.shape[-1])  # float32, as the backend keeps it
    sparse_decode_attention(q, None, *args[2:], cfg, impl="triton", q_pre=q.clone(), indexer_q=wq,
                            q_scale=torch.ones(len(ret)))
    sparse_decode_triton(*args, top_p=0.6, block=64, num_sinks=4, window=32, ret_window=64, select_chunk=1)
    sparse_decode_attention(*args, cfg, impl="triton", fused=False)
    args, cfg = case(torch.bfloat16, 128, 8, 64, 2)
    sparse_decode_attention(*args, cfg, impl="triton")
    args, cfg = case(torch.float32, 64, 2, 16, 3)
    sparse_decode_attention(*args, cfg, impl="triton")
    sparse_decode_attention(*args, SparseDecodeConfig(1.0, 16, 4, 32, 16), impl="triton", return_selection=True)


def _sparse_prefill():
    """RTPurbo prefill: block scores (bf16 with 128-token blocks, float32 with 16), the selection (top-p kernel in
    prefill mode, top_p a float or per prompt on the device) and the chunked local attention's merge (two and
    three pieces, one reversed; bf16 at head_dim 128, float32 at 64; window 1: one piece)."""
    from sparrow.kernels.sparse_prefill import SparsePrefillConfig, local_prefill_attention, prefill_block_scores
    from sparrow.kernels.sparse_prefill.api import select_prefill_blocks
    from tests.kernels.test_sparse_prefill import _idx, _qkv

    qi, ki = _idx(2, 2, 130)
    plen = torch.tensor([130, 77])
    for dtype, block in ((torch.bfloat16, 128), (torch.float32, 16)):
        prefill_block_scores(qi.to(dtype), ki.to(dtype), plen, block, impl="triton")
    for top_p in (0.7, torch.tensor([0.7, 0.9])):
        cfg = SparsePrefillConfig(top_p=top_p, block=16, num_sinks=4, window=32, ret_window=16)
        select_prefill_blocks(qi, ki, plen, cfg, impl="triton")
    for dtype, D in ((torch.bfloat16, 128), (torch.float32, 64)):
        q, k, v = (t.to(dtype) for t in _qkv(1, 4, 2, 100, D))
        local_prefill_attention(q, k, v, num_sinks=4, window=20, impl="chunked")
        if dtype == torch.bfloat16:
            local_prefill_attention(q[:, :, :70], k[:, :, :70], v[:, :, :70], num_sinks=4, window=1, impl="chunked")


def _topp():
    """Top-p selection through its API: a float mass (and 1.0: keep all), a per-row mass on the device, rows of
    one chunk and (a small chunk forced) of several."""
    from sparrow.kernels.topp import topp_select
    from sparrow.kernels.topp.triton_topp import MODE_EXPLICIT, topp_select_triton

    g = torch.Generator().manual_seed(0)
    scores = torch.randn(6, 40, generator=g)
    lo = torch.tensor([0, 5, 100, 300, 17, 639])
    hi = lo + torch.tensor([0, 3, 20, 1, 0, 0])
    for top_p in (0.7, 1.0, torch.full((6,), 0.8)):
        topp_select(scores, lo, hi, top_p, block=16, sink_blocks=1, local_window=32, impl="triton")
    topp_select_triton(scores, lo, hi, 0.7, mode=MODE_EXPLICIT, block=16, sink_blocks=1, local_window=32, chunk=16)


def _int8_linear():
    """Weight-only int8 linear: each row-tile size (16 to 128 rows, 8 warps at 128), two with bf16 activations and
    two with float32, with and without a bias; 16-, 32- and 64-row tiles split along K (fewer tiles than the
    interpreter's 4 "SMs": the reduce kernel runs), 128 rows not."""
    from sparrow.kernels.int8_linear import int8_linear
    from tests.kernels.test_int8_linear import _case

    for dtype, lead, N, K, bias in ((torch.bfloat16, (1,), 40, 72, True), (torch.bfloat16, (70,), 130, 200, False),
                                    (torch.float32, (17,), 64, 128, False), (torch.float32, (33,), 96, 300, True)):
        (x, q, s, b), _ = _case(lead, N, K, dtype, bias)
        int8_linear(x, q, s, b, impl="triton")


def _sync():
    """SparseRL-Sync: the block scan, the fused encode in compact / COO / dense modes (with the hash changes), the
    header check and the fused decode + apply (bf16 also its undo), the record diff and apply (new values and
    deltas, with an undo capture) and the group hash; 16-bit (bf16, the default span) and 32-bit (float32)
    elements."""
    from sparrow.kernels.sync import DEFAULT_SPAN_LOG2, api
    from sparrow.kernels.sync.common import bits_view
    from tests.sync.conftest import make_pair
    from tests.sync.test_kernels_triton_vs_reference import encode_group

    for dtype, span, negates in ((torch.bfloat16, DEFAULT_SPAN_LOG2, (False, True)), (torch.float32, 11, (False,))):
        pairs = [make_pair(dtype, n, d, seed=k) for k, (n, d) in enumerate([(1500, 0.1), (3, 1.0), (2049, 0.0)])]
        olds, news = [bits_view(b) for b, _ in pairs], [bits_view(x) for _, x in pairs]
        encode_group(olds, news, ["coo", "dense", "compact"], span, "triton")
        counts, nwords, out, offs, _, _ = encode_group(olds, news, ["compact"] * 3, span, "triton")
        words = out.view(torch.int32)
        entries = [(offs[k] // 4, nwords[k], olds[k].numel(), counts[k]) for k in range(len(olds))]
        for negate in negates:
            targets = [o.clone() for o in olds]
            api.apply_compact(targets, words, entries, span_log2=span, gate=torch.zeros(2, dtype=torch.int32),
                              err=torch.zeros(1, dtype=torch.int32), hash_starts=[0, 5, 9],
                              hash_out=api.hash_zeros(3, CPU), negate=negate, impl="triton")
        for values in ("new", "delta"):
            pos, val = api.diff_records(olds[0], news[0], values=values, impl="triton")
            api.group_apply_records([olds[0].clone()], pos, val, [pos.numel()], values=values, impl="triton",
                                    undo_out=torch.empty_like(pos))
        api.group_hash_bits(news, [0, 5, 9], impl="triton")


# package -> (what launches its kernels, whether the kernels must run: the sync codec reads counts back).
# sparrow.kernels.common launches nothing: test_common_building_blocks_are_compiled checks it.
PACKAGES = {
    "decode_attention": (_decode_attention, False),
    "sparse_decode": (_sparse_decode, False),
    "sparse_prefill": (_sparse_prefill, False),
    "topp": (_topp, False),
    "int8_linear": (_int8_linear, False),
    "sync": (_sync, True),
}


def _launches(package: str) -> list[Launch]:
    if package not in _LAUNCHES:
        drive, execute = PACKAGES[package]
        torch.manual_seed(0)
        with record_launches(execute=execute) as found:
            drive()
        _LAUNCHES[package] = found
    return _LAUNCHES[package]


@pytest.fixture(scope="module")
def batch(request):
    """The launches of every package this session tests, compiled in one batch (one set of compiler processes,
    each importing torch once, instead of one set per package); the tests then read their results."""
    selected: set[str] = set()
    for item in request.session.items:
        if getattr(item, "module", None) is not request.module:
            continue
        name = getattr(item, "originalname", None)
        if name == "test_every_launch_compiles_for_sm90":
            selected.add(item.callspec.params["package"])
        elif name == "test_common_building_blocks_are_compiled":
            selected |= set(PACKAGES)
    launches = [x for kernel in CONTROLS for x in _run_and_record(kernel)]
    for package in PACKAGES:
        if package in selected:
            try:
                launches += _launches(package)
            except Exception:  # noqa: BLE001  (the package's own test runs it again and reports the error)
                pass
    _compile(launches)


@pytest.mark.parametrize("package", list(PACKAGES), ids=list(PACKAGES))
def test_every_launch_compiles_for_sm90(package, batch):
    """Each distinct launch of the package's kernels compiles for sm_90; the failures are listed with the
    kernel and its configuration. The package's own kernels must all have been launched (an untested kernel
    would pass silently)."""
    launches = _launches(package)
    own = {x.kernel for x in launches if x.module.startswith(f"sparrow.kernels.{package}.")}
    assert own >= _package_kernels(package), f"kernels never launched: {_package_kernels(package) - own}"
    results = _compile(launches)
    failed = [r for r in results if not r.ok]
    if failed:
        pytest.fail(f"{len(failed)} of {len(results)} launches fail to compile for sm_90:\n{_failures(results)}",
                    pytrace=False)


def _package_kernels(package: str) -> set[str]:
    """The ``@triton.jit`` functions of ``sparrow.kernels.<package>`` that are launched (named ``*_kernel``)."""
    pkg = importlib.import_module(f"sparrow.kernels.{package}")
    found = set()
    for info in pkgutil.iter_modules(pkg.__path__, f"{pkg.__name__}."):
        if info.name.rsplit(".", 1)[-1].startswith("triton_"):
            module = importlib.import_module(info.name)
            found |= {f"{info.name}.{n}" for n, v in vars(module).items()
                      if n.endswith("_kernel") and isinstance(v, KernelInterface)
                      and getattr(v, "fn", None) is not None and v.fn.__module__ == info.name}
    return found


def test_common_building_blocks_are_compiled(batch):
    """``sparrow.kernels.common``'s ``dot`` (both precisions: ``IEEE`` true and false) and ``merge_splits`` are
    inlined into launched kernels that compiled (it launches nothing itself)."""
    from sparrow.kernels.common import triton_dot, triton_merge

    launches = [x for p in PACKAGES for x in _launches(p)]
    results = dict(zip(launches, _compile(launches)))
    calls = {"dot": triton_dot.dot, "merge_splits": triton_merge.merge_splits}
    reached: dict[str, set] = {name: set() for name in calls}
    for launch in launches:
        if not results[launch].ok:
            continue
        module = importlib.import_module(launch.module)
        for name, fn in calls.items():
            if _calls(getattr(module, launch.name), fn):
                reached[name].add(dict(launch.constexprs).get("IEEE"))
    assert {True, False} <= reached["dot"], f"dot compiled only with IEEE in {reached['dot']}"
    assert reached["merge_splits"], "no compiled kernel calls merge_splits"


def _calls(kernel, target, depth: int = 4) -> bool:
    """Whether ``kernel`` calls the jit function ``target``, directly or through other jit functions."""
    fn = kernel.fn
    for name in fn.__code__.co_names:
        g = fn.__globals__.get(name)
        if g is target or (depth and isinstance(g, KernelInterface) and g is not kernel
                           and _calls(g, target, depth - 1)):
            return True
    return False


# -- negative controls --------------------------------------------------------------------------------------------

@triton.jit
def _branch_shapes_differ(X, N: tl.constexpr):
    """``acc`` is [4 * N, N] in one branch and [N, N] in the other: the interpreter runs one branch and is content,
    the compiler must give ``acc`` one type across both (the cascade kernel's bug)."""
    offs = tl.arange(0, N)
    if tl.program_id(0) == 0:
        acc = tl.zeros([4 * N, N], dtype=tl.float32) + 1.0
    else:
        acc = tl.zeros([N, N], dtype=tl.float32)
    tl.store(X + tl.program_id(0) * N + offs, tl.sum(acc, 0))


@triton.jit
def _branch_shapes_agree(X, N: tl.constexpr):
    """The correct twin: both branches give ``acc`` the shape [4 * N, N]."""
    offs = tl.arange(0, N)
    if tl.program_id(0) == 0:
        acc = tl.zeros([4 * N, N], dtype=tl.float32) + 1.0
    else:
        acc = tl.zeros([4 * N, N], dtype=tl.float32)
    tl.store(X + tl.program_id(0) * N + offs, tl.sum(acc, 0))


LIMIT = 2147483647  # a plain global: compiled Triton refuses to read it


@triton.jit
def _reads_a_plain_global(X, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(X + offs, tl.minimum(tl.load(X + offs), LIMIT))


CONTROLS = (_branch_shapes_differ, _branch_shapes_agree, _reads_a_plain_global)


def _run_and_record(kernel) -> list[Launch]:
    x = torch.zeros(2 * 16)
    with record_launches() as found:
        kernel[(2,)](x, N=16)
    return found


def test_a_branch_shape_mismatch_fails_to_compile_and_its_fix_compiles(batch):
    """The synthetic bug runs under the interpreter (it writes the rows' sums: 64 in program 0, 0 in program 1)
    and fails to compile with "Mismatched type for acc"; the twin with agreeing shapes compiles."""
    bad = _run_and_record(_branch_shapes_differ)
    good = _run_and_record(_branch_shapes_agree)
    assert len(bad) == len(good) == 1
    (bad_result,), (good_result,) = _compile(bad), _compile(good)
    assert not bad_result.ok and "Mismatched type for acc" in bad_result.error, bad_result.error[-2000:]
    assert good_result.ok, good_result.error[-2000:]


def test_a_plain_global_fails_to_compile(batch):
    (result,) = _compile(_run_and_record(_reads_a_plain_global))
    assert not result.ok and "global" in result.error.lower(), result.error[-2000:]


# -- the recorder's argument types are the JIT's ------------------------------------------------------------------

@pytest.mark.parametrize("value", [
    torch.zeros(4), torch.zeros(5, dtype=torch.bfloat16)[1:], torch.zeros(3, dtype=torch.int8), torch.zeros(2,
    dtype=torch.int64), 1, 16, 17, -3, 2**31, 2**40, 1.5, None,
], ids=["fp32", "bf16-unaligned", "i8", "i64", "one", "16", "17", "neg", "2^31", "2^40", "float", "none"])
def test_argument_types_match_triton_specialization(value):
    """:func:`describe_arg` gives the type, constant and divisibility Triton's own launcher specializes on (where
    this Triton exposes it), with and without specialization."""
    native = getattr(pytest.importorskip("triton._C.libtriton"), "native_specialize_impl", None)
    if native is None:
        pytest.skip("this Triton does not expose native_specialize_impl")
    pytest.importorskip("triton.backends.nvidia")
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", 90, 32))
    for specialize in (True, False):
        ty, attr = native(backend, value, False, specialize, True)
        got, const, div16 = describe_arg(value, specialize=specialize)
        assert got == ty and div16 == (attr == "D"), (value, specialize)
        if ty == "constexpr":
            assert const == attr


def test_launch_records_constexprs_options_and_specialized_ints():
    launch = launch_of(_branch_shapes_agree, (torch.zeros(32),), dict(N=16, num_warps=2))
    assert launch.signature == (("X", "*fp32"), ("N", "constexpr"))
    assert launch.constexprs == (("N", 16),) and launch.options == (("num_warps", 2),)
    assert launch.aligned == ("X",) and launch.specialized == ()

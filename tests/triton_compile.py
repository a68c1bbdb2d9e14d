"""Record the Triton launches a piece of library code makes under ``TRITON_INTERPRET=1``, then compile each one
for an sm_90 (Hopper) GPU with the real Triton compiler, on the CPU.

The interpreter runs a kernel's Python body as plain Python, so it accepts code the compiler rejects (a plain
module global, ``if``/``else`` branches giving a variable two block shapes, ...). Recording what the library
actually launches — each kernel with its argument types and the constexpr values and launch options its
launcher chose — and compiling exactly those specializations catches that class of bug without a GPU.

* :func:`record_launches` wraps ``InterpretedFunction.run`` (every ``kernel[grid](...)`` goes through it) and
  collects one :class:`Launch` per distinct (kernel, signature, constexprs, options); launches differing only in
  divisibility hints count once. Argument types follow the JIT's own specialization: a tensor is a pointer to its
  dtype (16-byte aligned or not), an int is ``i32`` / ``i64`` / ``u64`` by range (an int equal to 1 is the
  constant 1, one divisible by 16 is marked so, both unless the kernel says ``do_not_specialize``), a float
  ``fp32``, a bool ``i1``, ``None`` a constexpr.
* :func:`compile_launches` compiles the launches in subprocesses (one per core, at most 8) without
  ``TRITON_INTERPRET`` (where ``@triton.jit`` gives real ``JITFunction`` objects) through
  ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``, all the way to PTX and a cubin
  (``ptxas`` ships with the Triton wheel), and returns one :class:`Result` per launch (a kernel that needs more
  shared memory than sm_90 has fails too: its launch would).

``python -m tests.triton_compile`` (used by :func:`compile_launches`) reads the launches as JSON on stdin and
writes the results as JSON on stdout.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

ROOT = Path(__file__).resolve().parents[1]
TARGET = ("cuda", 90, 32)  # Hopper (sm_90), 32-thread warps
MAX_SHARED = 232448  # shared memory one sm_90 program may use (227 KiB)
SKIP_EXIT = 3  # the compiler process's exit status when it cannot compile for the target at all

_TORCH_TO_TRITON = {
    "float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64", "bool": "i1",
    "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64", "uint8": "u8", "uint16": "u16",
    "uint32": "u32", "uint64": "u64", "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5",
}


@dataclass(frozen=True)
class Launch:
    """One specialization of a kernel, as the JIT would compile it: ``signature`` (parameter, type) in order,
    ``constexprs`` (parameter, value) of the ``tl.constexpr`` parameters, ``specialized`` (parameter, value) of
    the arguments the JIT turns into constants (ints equal to 1, ``None``), ``aligned`` the parameters known
    divisible by 16 (pointers and ints), ``options`` the launch options (``num_warps``, ``num_stages``, ...)."""

    module: str
    name: str
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, Any], ...]
    specialized: tuple[tuple[str, Any], ...]
    aligned: tuple[str, ...]
    options: tuple[tuple[str, Any], ...]

    @property
    def kernel(self) -> str:
        return f"{self.module}.{self.name}"

    @property
    def key(self) -> tuple:
        """What makes the compiler's front end see different code: all but the divisibility hints."""
        return self.module, self.name, self.signature, self.constexprs, self.specialized, self.options

    def describe(self) -> str:
        """The kernel, its constexprs and options, and the pointer types it was launched with."""
        consts = ", ".join(f"{k}={v!r}" for k, v in self.constexprs)
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options)
        ptrs = ",".join(sorted({t for _, t in self.signature if t.startswith("*")}))
        return f"{self.name}[{consts}]({opts}{'; ' if opts else ''}{ptrs})"


@dataclass(frozen=True)
class Result:
    launch: str  # Launch.describe()
    kernel: str
    ok: bool
    error: str
    seconds: float


def _python_fn(fn):
    while not inspect.isfunction(fn):  # autotuner / heuristics -> jit -> the Python function
        fn = fn.fn
    return fn


def _int_type(v: int) -> str:
    if -2**31 <= v < 2**31:
        return "i32"
    if -2**63 <= v < 2**63:
        return "i64"
    return "u64"


def describe_arg(value, *, specialize: bool = True, align: bool = True) -> tuple[str, Any, bool]:
    """(type, constant value or None, divisible by 16) of a launch argument, as Triton's JIT specializes it."""
    if value is None:
        return "constexpr", None, False
    if isinstance(value, bool):
        return "i1", None, False
    if isinstance(value, int):
        if specialize and value == 1:
            return "constexpr", 1, False
        return _int_type(value), None, specialize and value % 16 == 0
    if isinstance(value, float):
        return "fp32", None, False
    if hasattr(value, "data_ptr") and hasattr(value, "dtype"):
        name = str(value.dtype).removeprefix("torch.")
        if name not in _TORCH_TO_TRITON:
            raise TypeError(f"no Triton pointer type for a {value.dtype} tensor")
        return "*" + _TORCH_TO_TRITON[name], None, specialize and align and value.data_ptr() % 16 == 0
    raise TypeError(f"cannot type a launch argument of type {type(value).__name__}")


def _is_constexpr(param: inspect.Parameter) -> bool:
    return param.annotation is not inspect.Parameter.empty and "constexpr" in str(param.annotation)


def _names(spec, params: list[str]) -> set[str]:
    return {params[s] if isinstance(s, int) else s for s in (spec or ())}


def launch_of(kernel, args: tuple, kwargs: dict) -> Launch:
    """The :class:`Launch` of ``kernel[grid](*args, **kwargs)`` (``kernel`` an interpreted or JIT function)."""
    fn = _python_fn(kernel)
    sig = inspect.signature(fn)
    params = list(sig.parameters)
    extra = getattr(kernel, "kwargs", None) or {}
    dns = _names(extra.get("do_not_specialize") or getattr(kernel, "do_not_specialize", ()), params)
    dnsa = _names(extra.get("do_not_specialize_on_alignment")
                  or getattr(kernel, "do_not_specialize_on_alignment", ()), params)
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in sig.parameters))
    bound = sig.bind(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
    bound.apply_defaults()
    signature, constexprs, specialized, aligned = [], [], [], []
    for name, value in bound.arguments.items():
        if _is_constexpr(sig.parameters[name]):
            signature.append((name, "constexpr"))
            constexprs.append((name, value.value if hasattr(value, "value") else value))
            continue
        ty, const, div16 = describe_arg(value, specialize=name not in dns, align=name not in dnsa)
        signature.append((name, ty))
        if ty == "constexpr":
            specialized.append((name, const))
        if div16:
            aligned.append(name)
    return Launch(fn.__module__, fn.__qualname__, tuple(signature), tuple(constexprs), tuple(specialized),
                  tuple(aligned), options)


@contextlib.contextmanager
def record_launches(*, execute: bool = True) -> Iterator[list[Launch]]:
    """Collect the distinct launches made inside the block (in first-launch order) into the yielded list.

    Launches that differ only in which arguments are divisible by 16 count once (the first seen): divisibility
    steers vectorization, not the types and shapes the compiler checks, and the duplicates would double the
    compile time.

    ``execute=False`` records without running the kernels: outputs stay as allocated (garbage), which is enough
    for launchers whose configuration follows shapes only, and spares the interpreter's time. Launchers that read
    results back (sizes, counts) need ``execute=True``.

    Raises: RuntimeError when Triton is not in interpreter mode (on a GPU the kernels compile for real)."""
    from triton.runtime import interpreter

    if not interpreting():
        raise RuntimeError("record_launches needs TRITON_INTERPRET=1 (kernels are interpreted functions)")
    real = interpreter.InterpretedFunction.run
    seen: set[tuple] = set()
    found: list[Launch] = []

    def run(self, *args, grid, warmup, **kwargs):
        launch = launch_of(self, args, kwargs)
        if launch.key not in seen:
            seen.add(launch.key)
            found.append(launch)
        if execute:
            return real(self, *args, grid=grid, warmup=warmup, **kwargs)
        return None

    interpreter.InterpretedFunction.run = run
    try:
        yield found
    finally:
        interpreter.InterpretedFunction.run = real


def interpreting() -> bool:
    """Whether ``@triton.jit`` gives interpreted functions (``TRITON_INTERPRET=1``)."""
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):
        return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _to_json(launch: Launch) -> dict:
    d = asdict(launch)
    d["describe"] = launch.describe()
    return d


def compile_launches(launches: list[Launch], *, jobs: int | None = None, timeout: float = 600) -> list[Result]:
    """Compile every launch for sm_90 without ``TRITON_INTERPRET``, in ``jobs`` subprocesses (default: one per
    available core, at most 8); one :class:`Result` per launch, in order.

    Raises: NotImplementedError (with the reason) when this Triton cannot compile for the target at all (no
    NVIDIA backend, or an ``ASTSource`` / ``GPUTarget`` API this code does not know) — callers skip."""
    if not launches:
        return []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    jobs = max(1, min(jobs or min(cores, 8), len(launches)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the default the GPU's Triton compiles with
    shares = [list(range(j, len(launches), jobs)) for j in range(jobs)]  # round robin: the kernels mix
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for j, share in enumerate(shares):  # files, not pipes: every process runs while we wait for the first
            (Path(tmp) / f"in{j}").write_text(json.dumps([_to_json(launches[i]) for i in share]))
            with open(Path(tmp) / f"in{j}") as fin, open(Path(tmp) / f"out{j}", "w") as fout, \
                    open(Path(tmp) / f"err{j}", "w") as ferr:
                procs.append(subprocess.Popen([sys.executable, "-m", "tests.triton_compile"], stdin=fin,
                                              stdout=fout, stderr=ferr, env=env, cwd=ROOT))
        try:
            for p in procs:
                p.wait(timeout=timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        results: list[Result | None] = [None] * len(launches)
        for j, (p, share) in enumerate(zip(procs, shares)):
            out, err = (Path(tmp) / f"out{j}").read_text(), (Path(tmp) / f"err{j}").read_text()
            if p.returncode == SKIP_EXIT:
                raise NotImplementedError(out.strip() or err.strip()[-2000:])
            if p.returncode != 0:
                raise RuntimeError(f"the compiler process failed (exit {p.returncode}):\n{err[-4000:]}")
            for i, r in zip(share, json.loads(out)):
                results[i] = Result(**r)
    return results  # type: ignore[return-value]


def _error_text(e: BaseException) -> str:
    """The error with its chain (a ``CompilationError`` wraps the front end's assertion, e.g. "Mismatched
    type for acc between then block ... and else block ...")."""
    parts, seen = [], set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__ or e.__context__
    return "\n".join(parts)


def _main() -> int:
    """Compile the launches given on stdin (JSON list of :class:`Launch` fields); results as JSON on stdout
    (anything else the imports print goes to stderr)."""
    out, sys.stdout = sys.stdout, sys.stderr
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from triton.runtime.jit import JITFunction
        import triton.backends.nvidia  # noqa: F401
        target = GPUTarget(*TARGET)
        from triton.compiler.compiler import make_backend
        backend = make_backend(target)
        div16 = backend.parse_attr("D") if hasattr(backend, "parse_attr") else [["tt.divisibility", 16]]
    except Exception as e:  # noqa: BLE001  (an older or newer Triton, or one without the NVIDIA backend)
        print(f"Triton cannot compile for {TARGET} here: {type(e).__name__}: {e}", file=out)
        return SKIP_EXIT
    if "ASTSource" not in dir(triton.compiler) or "constexprs" not in inspect.signature(ASTSource).parameters:
        print("Triton's ASTSource takes no constexprs= (an API this test does not know)", file=out)
        return SKIP_EXIT
    results = []
    for d in json.load(sys.stdin):
        t0 = time.perf_counter()
        try:
            fn = importlib.import_module(d["module"])
            for part in d["name"].split("."):
                fn = getattr(fn, part)
            if not isinstance(fn, JITFunction):
                fn = JITFunction(_python_fn(fn))
            names = list(inspect.signature(_python_fn(fn)).parameters)
            src = ASTSource(fn, dict(map(tuple, d["signature"])),
                            constexprs={(names.index(k),): v for k, v in d["constexprs"] + d["specialized"]},
                            attrs={(names.index(k),): div16 for k in d["aligned"]})
            kernel = triton.compile(src, target=target, options=dict(map(tuple, d["options"])))
            if "cubin" not in kernel.asm:
                raise RuntimeError(f"no cubin produced (stages: {sorted(kernel.asm)})")
            if kernel.metadata.shared > MAX_SHARED:  # the launch would fail with OutOfResources on the GPU
                raise RuntimeError(f"needs {kernel.metadata.shared} bytes of shared memory, sm_90 has {MAX_SHARED}")
            ok, err = True, ""
        except Exception as e:  # noqa: BLE001  (every failure is reported, with the kernel and configuration)
            ok, err = False, _error_text(e)
        results.append(dict(launch=d["describe"], kernel=f"{d['module']}.{d['name']}", ok=ok, error=err,
                            seconds=round(time.perf_counter() - t0, 3)))
    json.dump(results, out)
    return 0


if __name__ == "__main__":
    sys.exit(_main())

"""Compiled Triton reads no module global but a ``tl.constexpr`` (a plain ``BIG = 2**31 - 1`` compiles under
TRITON_INTERPRET=1 and fails on the GPU with "Cannot access global variable"): every ``@triton.jit`` function of
``sparrow.kernels`` is checked here, on the CPU, before a GPU run finds it."""
import importlib
import pkgutil
import types

import pytest

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from triton.runtime.jit import KernelInterface  # noqa: E402  (JITFunction, or the interpreter's stand-in)

import sparrow.kernels  # noqa: E402


def _python(fn: KernelInterface) -> types.FunctionType:
    while not isinstance(fn, types.FunctionType):  # autotuner -> jit -> the Python function
        fn = fn.fn
    return fn


def _plain_globals(fn: KernelInterface) -> list[str]:
    """The globals ``fn`` names that compiled Triton refuses: numbers and strings not wrapped in ``tl.constexpr``."""
    code, env = _python(fn).__code__, _python(fn).__globals__
    names: set[str] = set()
    stack = [code]
    while stack:  # nested code objects (comprehensions, lambdas) read globals too
        c = stack.pop()
        names |= set(c.co_names)
        stack += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    return sorted(n for n in names if n in env and isinstance(env[n], (bool, int, float, str)))


def _kernels() -> list[tuple[str, KernelInterface]]:
    found = []
    for info in pkgutil.walk_packages(sparrow.kernels.__path__, "sparrow.kernels."):
        module = importlib.import_module(info.name)
        found += [(f"{info.name}.{name}", obj) for name, obj in vars(module).items()
                  if isinstance(obj, KernelInterface) and _python(obj).__module__ == info.name]
    return found


def test_the_package_has_triton_kernels_to_check():
    assert len(_kernels()) >= 20


@pytest.mark.parametrize("name,fn", _kernels(), ids=lambda v: v if isinstance(v, str) else "")
def test_kernels_read_only_constexpr_globals(name, fn):
    assert _plain_globals(fn) == [], f"{name} reads plain module globals (wrap them in tl.constexpr)"


# negative control: a kernel reading a plain global is caught; the constexpr spelling of the same is not
LIMIT = 2147483647
LIMIT_C = tl.constexpr(2147483647)


@triton.jit
def _reads_a_plain_global(X):
    tl.store(X, tl.minimum(tl.load(X), LIMIT))


@triton.jit
def _reads_a_constexpr_global(X):
    tl.store(X, tl.minimum(tl.load(X), LIMIT_C))


def test_a_plain_global_is_caught_and_a_constexpr_one_is_not():
    assert _plain_globals(_reads_a_plain_global) == ["LIMIT"]
    assert _plain_globals(_reads_a_constexpr_global) == []

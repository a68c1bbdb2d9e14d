"""The package's import graph has no circles: every module of ``src/sparrow`` reaches others only downwards
(imports inside functions count too; only ``if TYPE_CHECKING:`` blocks, which never run, do not)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The sparrow modules ``path`` imports, resolved to modules that exist (``from pkg import mod`` names
    the submodule when there is one)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # an attribute of a module: the module itself
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("sparrow"):
                out.add(t)
    return out


def import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    names = set(files)
    graph: dict[str, set[str]] = {}
    for n, p in files.items():
        deps = set()
        for t in _imports(p, n, names):
            # importing a.b.c first runs a/__init__ and a/b/__init__: edges to them too, except to the packages
            # that contain the importer (they are running already)
            parts = t.split(".")
            for i in range(2, len(parts) + 1):
                pkg = ".".join(parts[:i])
                if pkg in names and pkg != n and not n.startswith(pkg + "."):
                    deps.add(pkg)
        graph[n] = deps
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_circles():
    circle = find_circle(import_graph())
    assert circle is None, " -> ".join(circle)


def test_the_check_finds_a_circle():
    """Negative control: the rollout and speculative packages, circle-free, get one back edge (the model
    forward passes import the engine): the check finds the circle through it."""
    keep = ("sparrow.rollout", "sparrow.speculative", "sparrow.sampling")
    graph = {n: {m for m in deps if m.startswith(keep)} for n, deps in import_graph().items() if n.startswith(keep)}
    assert find_circle(graph) is None and "sparrow.rollout.forward" in graph["sparrow.rollout.engine"]
    graph["sparrow.rollout.forward"] = graph["sparrow.rollout.forward"] | {"sparrow.rollout.engine"}
    circle = find_circle(graph)
    assert circle is not None and circle[0] == circle[-1] and "sparrow.rollout.engine" in circle


def _imported_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.add(node.module or "")
    return names


def _bad_imports(path: Path, forbidden: set[str]) -> set[str]:
    return {n for n in _imported_names(path) if n.split(".")[0] in forbidden}


def test_tests_and_benchmarks_import_no_benchmark_script(tmp_path):
    """Tests exercise the library, never a benchmark script; a benchmark reaches shared code through ``sparrow.*``
    and the installed recipe modules (``sparrow_grpo``: what a user runs), never through tests (so a helper lives where
    it is typed, documented and tested). Negative controls: a benchmark importing a test helper or another benchmark
    is reported."""
    root = SRC.parent
    scripts = {p.stem for p in (root / "benchmarks").glob("*.py")} | {"benchmarks", "runner"}
    project = scripts | {"tests", "recipes"}
    for path in (root / "tests").rglob("*.py"):
        assert not _bad_imports(path, scripts), f"{path.relative_to(root)} imports {_bad_imports(path, scripts)}"
    for path in (root / "benchmarks").glob("*.py"):
        assert not _bad_imports(path, project), f"{path.relative_to(root)} imports {_bad_imports(path, project)}"
    text = (root / "benchmarks" / "bench_topp.py").read_text()
    for extra in ("import tests.helpers\n", "from bench_engine import plot\n", "from recipes import sparrow_grpo\n"):
        probe = tmp_path / "bench_probe.py"
        probe.write_text(text + extra)
        assert _bad_imports(probe, project), extra

"""The package's import graph has no circles: every module of ``src/sparrow`` reaches others only downwards, and so
does every package reach its sibling packages (``sparrow.a.*`` never imports ``sparrow.b.*`` when ``sparrow.b.*``
imports ``sparrow.a.*``). Every import counts: inside functions, and inside ``if TYPE_CHECKING:`` blocks (which never
run, but a type named in a signature is still a dependency of the design). Library modules never import the benchmark
harness ``sparrow.bench``."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
HARNESS = "sparrow.bench"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The sparrow modules ``path`` imports anywhere in it, resolved to modules that exist (``from pkg import mod``
    names the submodule when there is one)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
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


def import_graph(root: Path = SRC) -> dict[str, set[str]]:
    """Module -> the modules it imports, over the ``sparrow`` package under ``root``."""
    files = {_module_name(p, root): p for p in (root / "sparrow").rglob("*.py")}
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


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Sibling -> sibling: each import ``a -> b`` of ``graph`` as an edge between the two children of their deepest
    common package that contain them (``sparrow.rl.launch -> sparrow.rollout.config``: ``sparrow.rl ->
    sparrow.rollout``); a circle here is one between packages, even where no two modules import each other."""
    out: dict[str, set[str]] = {}
    for a, deps in graph.items():
        for b in deps:
            pa, pb = a.split("."), b.split(".")
            i = next(i for i in range(min(len(pa), len(pb)) + 1) if i == min(len(pa), len(pb)) or pa[i] != pb[i])
            if i < len(pa) and i < len(pb):
                out.setdefault(".".join(pa[: i + 1]), set()).add(".".join(pb[: i + 1]))
    return out


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


def test_no_package_circles():
    circle = find_circle(package_graph(import_graph()))
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


def _write_package(root: Path, files: dict[str, str]) -> Path:
    """``files`` (paths under ``root/sparrow``, their text) written, every folder a package; returns ``root``."""
    base = root / "sparrow"
    for rel, text in {"__init__.py": "", **files}.items():
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        for folder in Path(rel).parents:
            (base / folder / "__init__.py").touch()
        (base / rel).write_text(text)
    return root


def test_type_only_imports_make_circles(tmp_path):
    """Negative control: two modules that import each other only for their annotations (``if TYPE_CHECKING:``, in
    both spellings) form a circle the check reports; a check that skips those blocks fails this."""
    root = _write_package(tmp_path, {
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from sparrow.b import B\nclass A: ...\n",
        "b.py": "import typing\nif typing.TYPE_CHECKING:\n    from .a import A\nclass B: ...\n",
    })
    circle = find_circle(import_graph(root))
    assert circle is not None and set(circle) == {"sparrow.a", "sparrow.b"}, circle


def test_the_check_finds_a_package_circle(tmp_path):
    """Negative control: ``sparrow.x.one`` imports ``sparrow.y.two`` and ``sparrow.y.three`` imports
    ``sparrow.x.four`` (under ``TYPE_CHECKING``): no two modules import each other, but the packages do."""
    root = _write_package(tmp_path, {
        "x/one.py": "from sparrow.y.two import T\n", "x/four.py": "F = 4\n", "y/two.py": "T = 2\n",
        "y/three.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from sparrow.x.four import F\n",
    })
    graph = import_graph(root)
    assert find_circle(graph) is None
    circle = find_circle(package_graph(graph))
    assert circle is not None and set(circle) == {"sparrow.x", "sparrow.y"}, circle


def harness_importers(graph: dict[str, set[str]]) -> list[str]:
    """The modules of ``graph`` other than the harness that import the benchmark harness."""
    return sorted(n for n, deps in graph.items() if HARNESS in deps and n != HARNESS)


def test_library_never_imports_the_benchmark_harness(tmp_path):
    """``sparrow.bench`` (timing, JSON results, option tables, figures of the benchmarks) may import the library; no
    library module imports it (what the library measures or draws with lives in the library). Negative controls: a
    library module importing it, in any spelling, in a function or for annotations only, is reported."""
    graph = import_graph()
    assert HARNESS in graph and harness_importers(graph) == []
    text = (SRC / "sparrow" / "sync" / "roundtrip.py").read_text()
    probes = ("from sparrow.bench import measure\n", "import sparrow.bench as b\n", "from sparrow import bench\n",
              "def _probe():\n    from ..bench import measure\n",
              "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from sparrow.bench import measure\n")
    for k, extra in enumerate(probes):
        root = _write_package(tmp_path / str(k), {"bench.py": "", "sync/roundtrip.py": text + extra})
        assert harness_importers(import_graph(root)) == ["sparrow.sync.roundtrip"], extra


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

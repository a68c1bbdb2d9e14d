"""Turn every ``docs/benchmarks/<name>.json`` into ``docs/benchmarks/<name>.png``.

The JSON's ``benchmark`` field names the module ``benchmarks/bench_<name>.py`` whose ``plot(result, png)``
draws it. Usage: ``python benchmarks/make_plots.py [json ...]``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from sparrow.bench import RESULTS_DIR, load_json

HERE = Path(__file__).resolve().parent


def main(paths: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    files = [Path(p) for p in paths] or sorted(RESULTS_DIR.glob("*.json"))
    for path in files:
        result = load_json(path)
        name = result["benchmark"]
        module_path = HERE / f"bench_{name}.py"
        if not module_path.exists():
            print(f"skip {path.name}: no {module_path.name}")
            continue
        spec = importlib.util.spec_from_file_location(f"bench_{name}", module_path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if not hasattr(module, "plot"):
            print(f"skip {path.name}: {module_path.name} has no plot()")
            continue
        png = path.with_suffix(".png")
        module.plot(result, png)
        print(f"wrote {png}")


if __name__ == "__main__":
    main(sys.argv[1:])

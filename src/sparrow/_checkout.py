"""The source checkout Sparrow runs from (``src/sparrow`` in it): its ``recipes/`` and ``src/`` go on a launched
recipe's path, its ``docs/benchmarks`` holds the benchmarks' results."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

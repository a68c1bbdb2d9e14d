"""The GPU test pass (``.ci/gpu``) runs every test."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def uncovered(parts_text: str) -> set[str]:
    """The test files under ``tests/`` that no part names, by themselves or through a folder above them."""
    named = set(re.findall(r"tests/[\w./]+", parts_text))
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")}
    return {f for f in files if not any(f == n or f.startswith(n.rstrip("/") + "/") for n in named)}


def missing(parts_text: str) -> set[str]:
    """The paths the parts name that do not exist (a moved or deleted file would stop its part with an error)."""
    return {n for n in re.findall(r"tests/[\w./]+", parts_text) if not (ROOT / n).exists()}


def test_the_gpu_pass_covers_every_test_file():
    """``.ci/gpu`` runs the suite in parts (folders, or files where a folder is split): a test file missing from
    them would never run on a GPU, and a path that no longer exists would stop its part. Negative controls: a part
    list without a folder, without one file of a split folder, or naming a file that does not exist, is reported."""
    block = re.search(r"PARTS=\((.*?)\n\)", (ROOT / ".ci" / "gpu").read_text(), re.S).group(1)
    assert uncovered(block) == set()
    assert missing(block) == set() and missing(block + ' "tests/no_such_test.py"') == {"tests/no_such_test.py"}
    assert uncovered(block.replace('"tests/kernels"', '""')) >= {"tests/kernels/test_cascade_attention.py"}
    one = "tests/recipes/test_sft_recipe.py"
    assert one in block and uncovered(block.replace(one, "")) == {one}

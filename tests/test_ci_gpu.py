"""The GPU test pass (``.ci/gpu``) runs every test."""

import re
from pathlib import Path


def test_the_gpu_pass_covers_every_test_folder_and_file():
    """``.ci/gpu`` runs the suite in parts: a test folder or top-level test file missing from them would never run
    on a GPU. Negative control: a part list without one folder is reported."""
    root = Path(__file__).resolve().parents[1]

    def uncovered(parts_text: str) -> set[str]:
        named = set(re.findall(r"tests/[\w./]+", parts_text))
        have = {f"tests/{p.name}" for p in (root / "tests").iterdir()
                if (p.is_dir() and any(p.glob("test_*.py"))) or (p.is_file() and p.name.startswith("test_"))}
        return have - named

    block = re.search(r"PARTS=\((.*?)\n\)", (root / ".ci" / "gpu").read_text(), re.S).group(1)
    assert uncovered(block) == set()
    assert uncovered(block.replace('"tests/recipes"', '""')) == {"tests/recipes"}

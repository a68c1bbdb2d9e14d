"""The committed benchmark results (``docs/benchmarks/*.json``) name no path of the machine that made them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MACHINE_PATH = re.compile(r"(?<![\w.:/])/(?:tmp|root|home|work|opt|usr|var|mnt|Users)/")


def test_the_pattern_finds_machine_paths():
    assert MACHINE_PATH.search('"checkpoint": "/tmp/e2e/model.safetensors"')
    assert not MACHINE_PATH.search("tokens/s, time/step_s, https://github.com/pytorch/ao/issues/2919")


@pytest.mark.parametrize("path", sorted((REPO / "docs" / "benchmarks").glob("*.json")), ids=lambda p: p.name)
def test_committed_results_name_no_machine_path(path):
    text = path.read_text()
    hit = MACHINE_PATH.search(text)
    assert not hit, f"{path.name} names a machine path near {text[max(0, hit.start() - 40):hit.end() + 40]!r}"
    assert str(REPO) not in text, f"{path.name} names the repository's absolute path"

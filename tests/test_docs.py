"""Every ```python block in docs/*.md runs (the pages' examples are real programs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
BLOCKS = [(p, i, code) for p in sorted(DOCS.glob("*.md"))
          for i, code in enumerate(re.findall(r"```python\n(.*?)```", p.read_text(), re.S))]


@pytest.mark.parametrize("page,index,code", BLOCKS, ids=[f"{p.stem}-{i}" for p, i, _ in BLOCKS])
def test_docs_example_runs(page, index, code, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(code, f"{page.name}[{index}]", "exec"), {"__name__": f"docs_{page.stem}"})

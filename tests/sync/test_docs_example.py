"""The runnable example in docs/sync.md runs and its assertions hold."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "sync.md"


def test_docs_example_runs(capsys):
    code = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)[0]
    exec(compile(code, str(DOC), "exec"), {"__name__": "docs_example"})
    out = capsys.readouterr().out
    assert out.startswith("compact ")

"""The runnable examples in docs/sync.md run and their assertions hold."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "sync.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def test_docs_example_runs(capsys):
    code = _blocks()[0]
    exec(compile(code, str(DOC), "exec"), {"__name__": "docs_example"})
    out = capsys.readouterr().out
    assert out.startswith("compact ")


def test_docs_user_codec_example_runs(capsys):
    code = next(c for c in _blocks() if "class XorCodec(sync.WeightCodec)" in c)
    exec(compile(code, str(DOC), "exec"), {"__name__": "docs_user_codec"})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and all(line.startswith("{'xor': ") for line in lines[:3])
    assert lines[3] == "UnknownCodecError True"

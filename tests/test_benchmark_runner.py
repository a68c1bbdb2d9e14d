"""The benchmarks' shared runner: JSON that names no path of the machine that produced it (``scrub_paths`` in
``write_json``), and the engine batch buckets."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

from runner import REPO, RESULTS_DIR, batch_buckets, scrub_paths, write_json  # noqa: E402

MACHINE_PATH = re.compile(r"(?<![\w.:/])/(?:tmp|root|home|work|opt|usr|var|mnt|Users)/")


@pytest.mark.parametrize("raw,clean", [
    (f"{REPO}/src/sparrow/rollout/engine.py", "src/sparrow/rollout/engine.py"),
    ('  File "/opt/x/.venv/lib/python3.12/site-packages/torch/fx/a.py", line 3',
     '  File "site-packages/torch/fx/a.py", line 3'),
    ("/tmp/e2e/model.safetensors", "model.safetensors"),
    ("/root/out/g1", "g1"),
    # not paths: left alone
    ("see https://github.com/pytorch/ao/issues/2919", "see https://github.com/pytorch/ao/issues/2919"),
    ("tokens/s, time/step_s, 1/16 of the context, a / b", "tokens/s, time/step_s, 1/16 of the context, a / b"),
])
def test_scrub_paths(raw, clean):
    assert scrub_paths({"k": [raw, (raw,)], "n": 3}) == {"k": [clean, [clean]], "n": 3}


def test_scrub_paths_of_path_objects():
    assert scrub_paths([Path("/tmp/run/out"), REPO / "docs" / "a.json"]) == ["out", "docs/a.json"]


def test_write_json_scrubs(tmp_path):
    path = write_json("x", {"out": str(tmp_path), "ckpt": f"{tmp_path}/m.safetensors"}, [{"f": str(REPO / "a.py")}],
                      tmp_path)
    assert not MACHINE_PATH.search(path.read_text()) and str(tmp_path) not in path.read_text()


@pytest.mark.parametrize("path", sorted(RESULTS_DIR.glob("*.json")), ids=lambda p: p.name)
def test_committed_results_name_no_machine_path(path):
    text = path.read_text()
    hit = MACHINE_PATH.search(text) or (str(REPO) in text and str(REPO))
    assert not hit, f"{path.name} names a machine path near {text[max(0, hit.start() - 40):hit.end() + 40]!r}" \
        if hasattr(hit, "start") else f"{path.name} names the repository's absolute path"


def test_batch_buckets():
    assert batch_buckets(256, 4, smallest=2) == [4, 16, 64, 256]
    assert batch_buckets(64, 4) == [1, 4, 16, 64] and batch_buckets(48, 2) == [1, 2, 4, 8, 16, 32, 48]
    assert batch_buckets(1, 4) == [1] and batch_buckets(4, 4, smallest=2) == [4]

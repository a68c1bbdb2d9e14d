"""Three processes over gloo: one sender, two receivers; bitwise equal after every sync (built-in codec, then
a user codec that only one receiver knows)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

WORKER = Path(__file__).with_name("_dist_worker.py")
TIMEOUT_S = 150


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")
def test_three_process_gloo_sync(tmp_path):
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), "3", str(port), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(3)]
    deadline = time.monotonic() + TIMEOUT_S
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out.decode(errors="replace"))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"gloo workers did not finish within {TIMEOUT_S} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} failed:\n{outputs[r][-3000:]}"
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(3)]
    sender, r1, r2 = res
    # 30 AdamW steps: both receivers equal the sender's bf16 weights bit for bit after every sync
    assert len(r1["equal"]) == 33 and all(r1["equal"]) and r1["version"] == 33
    assert all(r2["equal"][:30])
    # rank 2 then diverges by one bit: sync 31 is refused and undone, sync 32 is a dense anchor
    assert r2["errors"] == [[30, "HashMismatchError"]]
    assert r2["equal"][30:] == [False, True, True] and r2["version"] == 33
    anchors = [k for k, a in enumerate(sender["anchors"]) if a]
    assert anchors == [9, 19, 29, 31]
    assert all(b < d for b, d, a in zip(sender["bytes"], sender["dense"], sender["anchors"]) if not a)
    # then a user codec over the same transport: rank 1 has it, rank 2 refuses each delta and is resynced
    assert r1["user_equal"] == [True] * 3 and r1["user_errors"] == []
    assert r2["user_errors"] == [[0, "UnknownCodecError"], [2, "UnknownCodecError"]]
    assert r2["user_equal"] == [False, True, False]
    assert sender["user_anchors"] == [False, True, False]

"""Several training runs at once, one per seed, and the best of them kept.

Leaving the tasks' plateau is partly luck: several seeds in one budget make a usable model far more likely.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Mapping, Sequence

from sparrow.training.checkpoint import MODEL_FILE, read_report, write_report
from sparrow.training.evaluate import model_score


def seed_devices(n_seeds: int, device: str, n_gpus: int) -> list[str | None]:
    """The ``CUDA_VISIBLE_DEVICES`` of each seed's process: round-robin over the GPUs when training on ``cuda``
    with several of them (None: inherit the caller's, e.g. for ``cuda:1``, one GPU or the CPU)."""
    if device != "cuda" or n_gpus < 2:
        return [None] * n_seeds
    return [str(i % n_gpus) for i in range(n_seeds)]


def best_of_seeds(commands: Mapping[int, Sequence[str]], dirs: Mapping[int, Path], out: Path,
                  device: str = "cpu") -> dict:
    """Run ``commands[seed]`` (each writing a trained model into ``dirs[seed]``) all at once, spread over the GPUs
    (:func:`seed_devices`), each logging to ``dirs[seed]/train.log``; copy the best (:func:`model_score`) into
    ``out`` with its report, which gains ``chosen_seed`` and ``candidates`` (every run's score). Returns it.

    Raises:
        RuntimeError: every run failed.
    """
    import torch

    out.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    procs = {}
    for (seed, cmd), gpu in zip(commands.items(), seed_devices(len(commands), device, gpus)):
        dirs[seed].mkdir(parents=True, exist_ok=True)
        log = (dirs[seed] / "train.log").open("w")
        env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {}))
        procs[seed] = (subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, env=env), log)
    candidates = []
    for seed, (proc, log) in procs.items():
        proc.wait()
        log.close()
        row = {"seed": seed, "returncode": proc.returncode, "dir": dirs[seed].name}
        if proc.returncode == 0:
            report = read_report(dirs[seed])
            row["handled_context"], row["mean_accuracy"] = model_score(report)
            row["accuracy"] = report["accuracy"]
        candidates.append(row)
    good = [c for c in candidates if c["returncode"] == 0]
    if not good:
        raise RuntimeError(f"every seed failed: see {out}/*/train.log")
    best = max(good, key=lambda c: (c["handled_context"], c["mean_accuracy"]))
    shutil.copy2(dirs[best["seed"]] / MODEL_FILE, out / MODEL_FILE)
    report = read_report(dirs[best["seed"]])
    report["chosen_seed"], report["candidates"] = best["seed"], candidates
    write_report(out, report)
    return report

"""A metric logger for the recipes that writes JSON lines: one record per ``log_dict`` call."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class JsonlLogger:
    """torchtune's metric-logger interface (``metric_logger._component_: sparrow.rl.JsonlLogger``): appends
    every ``log_dict`` call as one JSON line ``{"step": N, "name": value, ...}`` to ``<log_dir>/metrics.jsonl``
    and keeps the records in :attr:`records` (for in-process runs). Easier to read back than text logs.

    Args:
        log_dir: folder of ``metrics.jsonl`` (created if missing).
    """

    def __init__(self, log_dir: str | Path) -> None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(log_dir) / "metrics.jsonl"
        self._file = self.path.open("a")
        self.records: list[dict[str, float]] = []

    def log_config(self, config: Any) -> None:
        pass

    def log(self, name: str, data: float, step: int) -> None:
        self.log_dict({name: data}, step)

    def log_dict(self, payload: dict[str, float], step: int) -> None:
        rec = {"step": int(step), **{k: float(v) for k, v in payload.items()}}
        self.records.append(rec)
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_metrics(log_dir: str | Path) -> list[dict[str, float]]:
    """The records a :class:`JsonlLogger` wrote to ``<log_dir>/metrics.jsonl``."""
    path = Path(log_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: was the run's metric_logger a sparrow.rl.JsonlLogger?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

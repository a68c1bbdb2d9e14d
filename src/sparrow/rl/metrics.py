"""A metric logger for the recipes that writes JSON lines (one record per ``log_dict`` call), and the reward
curve of a run's history."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sparrow._report import save_figure


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


def plot_history(history: list[dict[str, float]], png: Path, title: str = "") -> None:
    """Reward (and greedy eval accuracy, when measured) against steps."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is a dependency; keep training results regardless
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    tr = [h for h in history if "reward" in h]
    ev = [h for h in history if "eval" in h]
    if tr:
        ax.plot([h["step"] for h in tr], [h["reward"] for h in tr], lw=1, alpha=0.5, label="sampled reward (T=1)")
        k = max(1, len(tr) // 15)
        sm = [sum(h["reward"] for h in tr[max(0, i - k + 1): i + 1]) / len(tr[max(0, i - k + 1): i + 1])
              for i in range(len(tr))]
        ax.plot([h["step"] for h in tr], sm, lw=2, label=f"sampled reward, mean of {k}")
    if ev:
        ax.plot([h["step"] for h in ev], [h["eval"] for h in ev], "o-", label="greedy accuracy (held out)")
    ax.set(xlabel="step", ylabel="reward / accuracy", ylim=(0, 1.02), title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, png)

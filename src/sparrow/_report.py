"""How the library shows results: text tables and matplotlib figures (pyplot imported only once a figure is drawn).

Imports nothing of Sparrow's; the benchmark harness ``sparrow.bench`` re-exports it beside its own plot helpers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence


def format_table(rows: list[dict[str, Any]], cols: Sequence[str]) -> str:
    """``rows`` as right-aligned columns ``cols`` under a header (floats to 4 significant digits, a missing
    key as ``None``)."""
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) if rows else len(c) for c in cols}
    lines = ["  ".join(c.rjust(widths[c]) for c in cols)]
    lines += ["  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def subplots(*args: Any, **kw: Any) -> tuple[Any, Any]:
    """``matplotlib.pyplot.subplots(*args, **kw)``: ``(figure, axes)``, with pyplot imported only once a figure is
    drawn (a module that draws imports without matplotlib until it draws); :func:`save_figure` finishes it."""
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kw)


def save_figure(fig, path: Path | str, title: str | None = None, dpi: int = 120) -> None:
    """A figure's last step: title, layout, PNG (its folder made), and the figure closed (a script may draw many)."""
    import matplotlib.pyplot as plt

    if title is not None:
        fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)

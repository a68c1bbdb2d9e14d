"""Shared benchmark runner: timing, environment record, JSON output, the task model of a run.

* :func:`measure` times a callable with CUDA events (warm-up excluded, median with p20/p80 over many runs);
  without CUDA it falls back to ``time.perf_counter`` (CPU figures are smoke runs, never speed claims).
* :func:`environment` records GPU, library versions, git revision and time; :func:`write_json` writes
  ``{"benchmark", "environment", "config", "rows"}`` under ``docs/benchmarks/`` (or ``--out``) with no path of
  the machine in it, :func:`load_json` reads it back for plotting.
* :func:`task_model` gives the trained model a benchmark runs on (``--model DIR``, or a tiny one for ``--quick``).

Each benchmark module may define ``plot(result: dict, png_path: Path) -> None``; ``make_plots.py`` calls it.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

if not torch.cuda.is_available():  # the CPU smoke runs: Triton through its interpreter, set before sparrow imports it
    os.environ.setdefault("TRITON_INTERPRET", "1")
from sparrow.rl.runs import mean, median  # noqa: E402, F401 (the benchmarks' summaries)

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "docs" / "benchmarks"
T0 = time.perf_counter()


def log(msg: str) -> None:
    """A progress line stamped with the seconds since the benchmark started."""
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def task_model(model_dir: str | None, work: Path, quick: bool) -> str:
    """``model_dir`` (a trained model: ``tune run sparrow_sft --config ... output_dir=DIR``), or for a ``--quick``
    run a tiny one trained now, for seconds, into ``work/task_model``."""
    if model_dir is not None:
        return model_dir
    if not quick:
        raise SystemExit("give --model DIR (tune run sparrow_sft --config recipes/configs/task_model_8k_sft.yaml "
                         "output_dir=DIR)")
    out = Path(work) / "task_model"
    cmd = [sys.executable, "-m", "torchtune._cli.tune", "run", "sparrow_sft", "--config",
           str(REPO / "recipes" / "configs" / "tiny_task_model_sft.yaml"), f"output_dir={out}", "minutes=0.05"]
    subprocess.run(cmd, check=True)
    return str(out)


def triton_interpreter_without_cuda() -> None:
    """On a machine without CUDA, run Triton kernels through the interpreter (CPU smoke runs). Call it before
    triton is first imported (``import torch`` does not import it; Sparrow's kernel modules do)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def git_revision() -> str:
    """``SPARROW_GIT_REVISION`` when set (a copy of the tree whose ``.git`` is not the one it came from), else
    the checkout's short HEAD, ``+dirty`` with uncommitted changes to tracked files."""
    if os.environ.get("SPARROW_GIT_REVISION"):
        return os.environ["SPARROW_GIT_REVISION"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True).stdout.strip()
        return out + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("SPARROW_GIT_REVISION", "unknown")


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_revision": git_revision(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["sm_count"] = props.multi_processor_count
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    return env


def _quantiles(samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    q = lambda f: s[min(len(s) - 1, max(0, round(f * (len(s) - 1))))]  # noqa: E731
    return {"median_ms": statistics.median(s), "p20_ms": q(0.2), "p80_ms": q(0.8), "n": len(s)}


def measure(fn: Callable[[], Any], *, warmup: int = 3, iters: int = 20, min_time_s: float = 0.0,
            setup: Callable[[], Any] | None = None) -> dict[str, float]:
    """Time ``fn()``; returns median / p20 / p80 in milliseconds.

    ``setup`` (untimed) runs before every call, e.g. to rotate inputs or reset a cache. With CUDA the
    region is bracketed by CUDA events; ``min_time_s`` keeps repeating past ``iters`` until that much
    time has been measured.
    """
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    samples: list[float] = []
    total = 0.0
    while len(samples) < iters or total < min_time_s * 1e3:
        if setup is not None:
            setup()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        samples.append(ms)
        total += ms
        if len(samples) >= 10 * max(iters, 1):
            break
    return _quantiles(samples)


def graphed(fn):
    """A CUDA graph replaying ``fn`` (warm-up on a side stream first); eager ``fn`` without CUDA."""
    if not torch.cuda.is_available():
        return fn
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second, GB/s) measured now."""
    if not torch.cuda.is_available():
        nbytes = min(nbytes, 256 << 20)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = measure(lambda: dst.copy_(src), warmup=3, iters=20)
    return 2 * nbytes / (t["median_ms"] * 1e-3) / 1e9


_SITE = re.compile(r"(?<![\w.:/])/(?:[\w.+-]+/)*?(site|dist)-packages/")
_ABS = re.compile(r"(?<![\w.:/])/(?:[\w.+-]+/)+([\w.+-]+)")


def scrub_paths(obj: Any) -> Any:
    """``obj`` (JSON-like) with no path of the machine it ran on: files of this repository become
    repository-relative, installed packages' files ``site-packages/...``, any other absolute path its last
    component (an output or scratch folder named on the command line)."""
    if isinstance(obj, dict):
        return {k: scrub_paths(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [scrub_paths(v) for v in obj]
    if isinstance(obj, Path):
        obj = str(obj)
    if not isinstance(obj, str):
        return obj
    obj = obj.replace(str(REPO) + "/", "")
    obj = _SITE.sub(lambda m: f"{m.group(1)}-packages/", obj)
    return _ABS.sub(lambda m: m.group(1), obj)


def write_json(name: str, config: dict[str, Any], rows: list[dict[str, Any]], out_dir: Path | None = None,
               extra: dict[str, Any] | None = None) -> Path:
    out_dir = Path(out_dir) if out_dir is not None else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    doc = {"benchmark": name, "environment": environment(), "config": config, "rows": rows}
    if extra:
        doc.update(extra)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(scrub_paths(doc), indent=1, default=str))
    tmp.replace(path)
    print(f"wrote {path}")
    return path


def batch_buckets(rows: int, growth: int, smallest: int = 1) -> list[int]:
    """Engine batch buckets: the powers of ``growth`` from ``smallest`` below ``rows``, then ``rows`` (growth 4
    keeps every other power of two: about half the compiled steps and CUDA graphs of 2)."""
    out, b = [], 1
    while b < rows:
        if b >= smallest:
            out.append(b)
        b *= growth
    return out + [rows]


def save_figure(fig, path: Path | str, title: str | None = None, dpi: int = 120) -> None:
    """A benchmark plot's last step: title, layout, PNG, and the figure closed (``make_plots`` draws many)."""
    import matplotlib.pyplot as plt

    if title is not None:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def load_json(path: Path | str) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def density_arg(value: str | None, key: str) -> list[float]:
    """A benchmark's ``--density``: numbers (``"0.89,0.55"``), or the JSON of ``bench_rtpurbo_accuracy.py`` read by
    ``key`` — a top-level value, else the largest over its summary / rows at their longest ``context``."""
    if not value:
        return []
    if not value.endswith(".json"):
        return [float(x) for x in value.split(",")]
    doc = load_json(value)
    if key in doc:
        return [float(doc[key])]
    rows = [r for part in ("summary", "rows") for r in doc.get(part, [])
            if isinstance(r, dict) and r.get(key) is not None]
    if not rows:
        raise SystemExit(f"{value} has no {key!r}: give the measured density as a number (--density 0.9)")
    longest = max(r.get("context", 0) for r in rows)
    return [max(float(r[key]) for r in rows if r.get("context", 0) == longest)]


def base_parser(description: str, options: list[tuple] = ()) -> argparse.ArgumentParser:
    """``--out``, ``--quick`` and ``options``: rows ``(flag, type, default, help)``; a list as ``type`` is the
    choices (strings)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", type=Path, default=None, help="folder for the JSON (default docs/benchmarks/)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run that checks the script works")
    for flag, kind, default, text in options:
        kw = {"choices": kind} if isinstance(kind, list) else {"type": kind}
        p.add_argument(flag, default=default, help=text, **kw)
    return p


def print_table(rows: list[dict[str, Any]], cols: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) if rows else len(c) for c in cols}
    print("  ".join(c.rjust(widths[c]) for c in cols))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in cols))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)

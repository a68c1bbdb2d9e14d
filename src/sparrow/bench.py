"""Benchmark harness: timing, the environment record, JSON results, tables and figures.

What Sparrow's own ``benchmarks/`` scripts are made of, for a user measuring their own setup the same way:

* :func:`measure` times a callable with CUDA events (warm-up excluded; median, p20 and p80 over many runs);
  without CUDA it falls back to ``time.perf_counter`` (CPU figures are smoke runs, never speed claims).
  :func:`graphed` replays a callable as a CUDA graph, :func:`copy_bandwidth_gbs` measures the device's copy speed.
* :func:`environment` records device, library versions, git revision and time; :func:`write_json` writes
  ``{"benchmark", "environment", "config", "rows", ...}`` with no path of the machine in it
  (:func:`scrub_paths`), :func:`load_json` reads it back, :func:`merge_results` joins the results of one script
  run over parts of its rows in several calls (:func:`result_devices`: where their rows were measured).
* :func:`base_parser` (``--out``, ``--quick`` and a table of options), :func:`fill_defaults` (an option's
  ``--quick`` and full values), :func:`keyword_args` (options passed to the library function they configure),
  :func:`int_or_auto` and :func:`device_arg` (option types), :func:`out_or_temp` (a smoke run's JSON folder);
  :func:`density_arg` and :func:`planted_and_measured` (a ``--density`` option); :func:`print_table`, :func:`log`;
  :func:`first_working` tries variants of a setup in order, :func:`free_memory` cleans up after one.
* :func:`subplots` starts a figure, :func:`plot_series`, :func:`bar_groups` and :func:`stacked_bars` draw rows of
  results; :func:`save_figure` finishes it.
* :func:`task_model` gives the trained model a benchmark runs on (a folder, or a tiny one trained now).

What the library measures and draws with lives in the library and is re-exported here: :func:`measure`,
:func:`quantiles`, :func:`synchronize`, :func:`free_memory` (``sparrow._device``), :func:`rel_err`
(``sparrow._numerics``), :func:`format_table`, :func:`subplots`, :func:`save_figure` (``sparrow._report``),
and :data:`REPO` (``sparrow._checkout``); engine batch buckets are :func:`sparrow.rollout.batch_buckets`. The
harness imports the library; no library module imports the harness.

A script's :func:`triton_interpreter_without_cuda`, called before anything imports triton, runs Triton kernels
through the interpreter on a machine without CUDA, as the CPU smoke runs need.

Example::

    from sparrow.bench import base_parser, measure, write_json

    args = base_parser("my question").parse_args()
    t = measure(lambda: model(x), warmup=3, iters=20)          # {"median_ms", "p20_ms", "p80_ms", "n"}
    write_json("mine", {"batch": 8}, [{"batch": 8, **t}], out_dir=args.out)
"""

from __future__ import annotations

import argparse
import datetime as _dt
import inspect
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

# what the library measures and draws with lives in the library; the harness re-exports it (each of these modules
# imports only torch: importing the harness leaves Triton unimported)
from sparrow._checkout import REPO
from sparrow._device import free_memory, measure, quantiles, synchronize  # noqa: F401
from sparrow._numerics import rel_err  # noqa: F401
from sparrow._report import format_table, save_figure, subplots  # noqa: F401

#: results go to the checkout's ``docs/benchmarks`` (benchmarks run from one)
RESULTS_DIR = REPO / "docs" / "benchmarks"
T0 = time.perf_counter()


def log(msg: str) -> None:
    """Print a progress line stamped with the seconds since this module was imported."""
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def device_dtype() -> tuple[torch.device, torch.dtype]:
    """``(cuda, bfloat16)`` with CUDA, else ``(cpu, float32)``: the device and precision a benchmark runs at."""
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def task_model(model_dir: str | None, work: Path, quick: bool) -> str:
    """``model_dir`` (a trained model: ``tune run sparrow_sft --config ... output_dir=DIR``), or for a ``--quick``
    run a tiny one trained now, for seconds, into ``work/task_model``. Without either: ``SystemExit`` naming the
    command that trains one."""
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


def first_working(variants: Iterable[Any], build: Callable[[Any], Any], what: str = "variant") -> tuple[Any, Any]:
    """``(variant, build(variant))`` for the first of ``variants`` whose ``build`` returns (e.g. a drafter that
    compiles and captures, simpler ones after it); a failing one's traceback is printed and logged, and its
    memory freed (:func:`free_memory`) before the next. ``RuntimeError`` when none works."""
    import traceback

    for v in variants:
        try:
            return v, build(v)
        except Exception:  # noqa: BLE001 - report, free, try the next
            traceback.print_exc()
            log(f"{what} {v} failed; trying the next")
            free_memory()
    raise RuntimeError(f"no {what} worked")


def triton_interpreter_without_cuda() -> None:
    """On a machine without CUDA, run Triton kernels through the interpreter (CPU smoke runs). Call it before
    triton is first imported (``import torch`` does not import it; Sparrow's kernel modules do)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def git_revision() -> str:
    """``SPARROW_GIT_REVISION`` when set (a copy of the tree whose ``.git`` is not the one it came from), else
    the checkout's short HEAD, ``+dirty`` with uncommitted changes to tracked files; ``unknown`` without git."""
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
        return "unknown"


def environment() -> dict[str, Any]:
    """Where a result was measured: timestamp (UTC), git revision, Python / torch / CUDA / Triton versions, the
    device name and, with CUDA, its SM count and memory (GiB)."""
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


def graphed(fn: Callable[[], Any]) -> Callable[[], Any]:
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
    """Device-to-device copy bandwidth (bytes read + written per second, GB/s) measured now (on the CPU: at most
    256 MiB copied)."""
    if not torch.cuda.is_available():
        nbytes = min(nbytes, 256 << 20)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = measure(lambda: dst.copy_(src), warmup=3, iters=20)
    return 2 * nbytes / (t["median_ms"] * 1e-3) / 1e9


def kernel_times(fn: Callable[[], Any], runs: int, top: int = 15) -> dict[str, Any]:
    """``fn()`` under ``torch.profiler``, its time per run grouped by name, largest first: CUDA kernels' device time
    with CUDA, CPU operators' self time without. Returns ``{"kernel_us_per_step", "calls_per_step" (kernel launches, or
    operator calls, per run: with the step time, how launch-bound it is), "kernels": [{"name", "us", "calls"}]}``
    (the ``top`` largest names, cut to 120 characters); ``runs``: the calls ``fn`` makes."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        fn()
    if cuda:
        events = [(e.name, e.device_time_total, 1) for e in prof.events() if e.device_type == DeviceType.CUDA]
    else:
        events = [(a.key, a.self_cpu_time_total, a.count) for a in prof.key_averages()]
    per_name: dict[str, list[float]] = {}
    for name, us, n in events:
        t = per_name.setdefault(name[:120], [0.0, 0.0])
        t[0], t[1] = t[0] + us / runs, t[1] + n / runs
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][0])
    return {"kernel_us_per_step": sum(v[0] for _, v in ranked), "calls_per_step": sum(v[1] for _, v in ranked),
            "kernels": [{"name": k, "us": v[0], "calls": v[1]} for k, v in ranked[:top]]}


KERNEL_KINDS = ("matmul", "attention", "sampling", "other Inductor kernels", "other kernels", "idle (launch gaps)")


def kernel_kind(name: str) -> str:
    """The part of a decode step a CUDA kernel belongs to, by its name: cuBLAS / nvjet matmuls, Sparrow's own Triton
    attention kernels (``_*_kernel``), the sampling reduction over the vocabulary (an Inductor kernel with a
    log-softmax or argmax), the rest of Inductor's fused kernels (norms, RoPE, cache writes, activations)."""
    if any(k in name for k in ("nvjet", "gemm", "cublas", "cutlass")):  # cuBLAS(Lt) and CUTLASS kernel names
        return "matmul"
    if name.startswith("triton_"):
        return "sampling" if "softmax" in name or "argmax" in name else "other Inductor kernels"
    return "attention" if name.startswith("_") and name.endswith("_kernel") else "other kernels"


def step_shares(step: dict[str, Any]) -> dict[str, float]:
    """One profiled step (:func:`kernel_times`' result and the step's wall time ``step_ms``) as microseconds per
    :data:`KERNEL_KINDS`: the named kernels by :func:`kernel_kind`, the kernels outside the ``top`` named ones as
    "other kernels", and the wall time that no kernel covers as idle. The shares sum to the wall time (or to the
    kernel time, where kernels overlap to more than it)."""
    us = dict.fromkeys(KERNEL_KINDS, 0.0)
    for k in step["kernels"]:
        us[kernel_kind(k["name"])] += k["us"]
    us["other kernels"] += step["kernel_us_per_step"] - sum(k["us"] for k in step["kernels"])
    us["idle (launch gaps)"] = max(0.0, step["step_ms"] * 1e3 - step["kernel_us_per_step"])
    return us


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
    """Write ``<out_dir>/<name>.json`` (default :data:`RESULTS_DIR`) atomically: ``{"benchmark": name,
    "environment": environment(), "config", "rows"}`` and the keys of ``extra``, through :func:`scrub_paths`
    (values JSON cannot hold as their ``str``). Returns the path."""
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


def load_json(path: Path | str) -> dict[str, Any]:
    """A result :func:`write_json` wrote."""
    return json.loads(Path(path).read_text())


def merge_results(name: str, paths: Sequence[Path | str], identity: Sequence[str],
                  parts: Mapping[str, str] | None = None, out_dir: Path | None = None) -> Path:
    """One result ``<out_dir>/<name>.json`` (:func:`write_json`) from results of one script run in several calls,
    each over a part of its rows (a call's time limit may hold only some runs). Their settings must be equal but for
    the ``config`` keys of ``parts`` (``{config key: row field}``, e.g. ``{"configs": "config"}``: which rows a call
    ran; the result's key lists the rows' values of that field), and no row may appear twice (its ``identity``
    fields). A row's figures stand alone, so each keeps the device and the revision of the run that made it; the
    result's ``environment`` is the first file's. Keys beside ``rows`` join (later files win).

    Raises:
        SystemExit: naming the file whose settings differ (and the keys), or the row found twice.
    """
    parts = dict(parts or {})
    docs = [load_json(p) for p in paths]
    settings = [{k: v for k, v in d["config"].items() if k not in parts} for d in docs]
    for path, s in zip(paths, settings):
        if s != settings[0]:
            raise SystemExit(f"{path}: other settings than {paths[0]}: "
                             f"{sorted(k for k in s.keys() | settings[0].keys() if s.get(k) != settings[0].get(k))}")
    rows, seen, extra = [], set(), {}
    for path, d in zip(paths, docs):
        env = d["environment"]
        for r in d["rows"]:
            key = tuple(r.get(k) for k in identity)
            if key in seen:
                label = f"{key[0]} ({', '.join(map(str, key[1:]))})" if len(key) > 1 else str(key[0])
                raise SystemExit(f"{path}: the row {label} is in an earlier file too")
            seen.add(key)
            rows.append({**r, "device": r.get("device", env.get("device")),
                         "git_revision": r.get("git_revision", env.get("git_revision"))})
        extra.update({k: v for k, v in d.items() if k not in ("benchmark", "environment", "config", "rows")})
    config = docs[0]["config"] | {k: list(dict.fromkeys(r.get(f) for r in rows)) for k, f in parts.items()}
    extra["environment"] = docs[0]["environment"]  # where the runs were made (the first's), not where they were joined
    return write_json(name, config, rows, out_dir=out_dir, extra=extra)


def result_devices(doc: Mapping[str, Any]) -> str:
    """The devices a result's rows were measured on, in order of appearance, comma-separated (a row of a
    :func:`merge_results` result names its own; otherwise the result's ``environment`` does)."""
    return ", ".join(dict.fromkeys(r.get("device") or doc["environment"].get("device") for r in doc["rows"]))


def density_arg(value: str | None, key: str) -> list[float]:
    """A benchmark's ``--density``: numbers (``"0.89,0.55"``), or the JSON of ``bench_rtpurbo_accuracy.py`` read by
    ``key`` — a top-level value, else the largest over its summary / rows at their longest ``context``
    (``SystemExit`` when it has none)."""
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


def planted_and_measured(planted: Iterable[float], value: str | None, key: str) -> list[tuple[float, str]]:
    """The densities a synthetic RTPurbo benchmark sweeps, as ``(density, source)``: each of ``planted`` as
    ``"planted"``, then each of ``--density`` ``value`` (:func:`density_arg`, by ``key``) as ``"measured"``;
    ``SystemExit`` from :func:`density_arg` for a JSON without ``key``."""
    return [(x, "planted") for x in planted] + [(x, "measured") for x in density_arg(value, key)]


def base_parser(description: str, options: Iterable[tuple] = ()) -> argparse.ArgumentParser:
    """``--out``, ``--quick`` and ``options``: rows ``(flag, type, default, help)`` (a list as ``type`` is the
    choices, strings), or ``(flag, kwargs)`` for :meth:`argparse.ArgumentParser.add_argument`."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", type=Path, default=None, help="folder for the JSON (default docs/benchmarks/)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run that checks the script works")
    for flag, *row in options:
        if len(row) == 1:
            p.add_argument(flag, **row[0])
            continue
        kind, default, text = row
        kw = {"choices": kind} if isinstance(kind, list) else {"type": kind}
        p.add_argument(flag, default=default, help=text, **kw)
    return p


def fill_defaults(args: argparse.Namespace, quick: bool, **defaults: tuple[Any, Any]) -> argparse.Namespace:
    """Set each option ``name=(quick_value, full_value)`` of ``defaults`` that ``args`` holds as None (not given on
    the command line) to its value for a ``--quick`` run when ``quick``, else to its full value; options given are
    kept. Returns ``args``. ``AttributeError`` for a name ``args`` has no option of."""
    for name, (quick_value, full_value) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick_value if quick else full_value)
    return args


def keyword_args(fn: Callable[..., Any], args: argparse.Namespace, **over: Any) -> dict[str, Any]:
    """The keyword-only parameters of ``fn`` that ``args`` has an option of (same name), with the options' values,
    then ``over`` (which wins: also for an option whose name means something else to ``fn``):
    ``fn(..., **keyword_args(fn, args))`` passes a script's options on to the library function they configure."""
    names = [p.name for p in inspect.signature(fn).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    return {n: getattr(args, n) for n in names if hasattr(args, n)} | over


def int_or_auto(text: str) -> int | str:
    """An option type (``argparse`` ``type=``): a whole number, or the word ``auto`` (the script picks the value).
    ``argparse.ArgumentTypeError`` for anything else."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a whole number or 'auto', not {text!r}") from None


def device_arg(text: str) -> str:
    """An option type for ``--device``: ``auto`` becomes ``cuda`` when CUDA is available, else ``cpu``; any other
    name is kept (argparse converts a string default too, so ``default="auto"`` arrives resolved)."""
    if text == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return text


def out_or_temp(out: Path | str | None, prefix: str, temporary: bool = True) -> Path | str | None:
    """Where a run writes its JSON: ``out`` when given; else, when ``temporary`` (e.g. a ``--quick`` smoke run, which
    must never overwrite the committed results), a new temporary folder whose name starts with ``prefix``; else
    None (:func:`write_json` then writes to :data:`RESULTS_DIR`). ``OSError`` when the folder cannot be made."""
    if out is not None or not temporary:
        return out
    return Path(tempfile.mkdtemp(prefix=prefix))


def print_table(rows: list[dict[str, Any]], cols: Sequence[str]) -> None:
    """Print :func:`format_table`."""
    print(format_table(rows, cols))


def plot_series(ax, rows: Iterable[dict[str, Any]], x: str, y: str | Callable[[dict], Any],
                by: str | Callable[[dict], Any] | None = None, *, label: str | Callable[[Any], str] = "{}",
                style: str = "o-", yerr: str | Callable[[dict], Any] | None = None, **kw) -> list:
    """One line on the matplotlib axes ``ax`` per distinct value of ``by`` (a key, or a function of a row; None:
    one line) of ``y`` (a key or a function) against ``x`` over ``rows``, points in ``x`` order; rows whose ``y``
    is missing or None are left out. ``label`` formats the group's value (a format string or a function), groups
    in sorted order, ``style`` and ``kw`` go to ``ax.plot``; with ``yerr`` (a key or a function of a row: the
    half-height of each point's error bar) to ``ax.errorbar`` instead. Returns the lines drawn (with error bars:
    each data line; the label is its errorbar container's). A row without ``x`` (or, with ``yerr``, without it) raises
    ``KeyError``."""
    key = (lambda r: r[by]) if isinstance(by, str) else by or (lambda r: None)
    get = (lambda r: r.get(y)) if isinstance(y, str) else y
    err = (lambda r: r[yerr]) if isinstance(yerr, str) else yerr
    rows = [r for r in rows if get(r) is not None]
    lines = []
    for g in sorted({key(r) for r in rows}, key=lambda v: (v is None, v)):
        pts = sorted(((r[x], get(r), err(r) if err else None) for r in rows if key(r) == g), key=lambda p: p[:2])
        name = label(g) if callable(label) else label.format(g)
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        if err is None:
            lines += ax.plot(xs, ys, style, label=name, **kw)
        else:
            lines.append(ax.errorbar(xs, ys, yerr=[p[2] for p in pts], fmt=style, label=name, **kw).lines[0])
    return lines


def stacked_bars(ax, labels: Sequence[str], layers: dict[str, Sequence[float]], colors: Sequence[str] | None = None,
                 bottom: Sequence[float] | None = None) -> list[float]:
    """One bar per label on ``ax``, ``layers`` stacked in order (each name a legend label, its values one per
    label) from ``bottom`` (default 0), layer ``k`` coloured ``colors[k]`` (default the colour cycle's ``Ck``);
    the ticks carry ``labels``. Returns each bar's top. ``ValueError`` when a layer or ``bottom`` has not one
    value per label."""
    tops = [0.0] * len(labels) if bottom is None else [float(b) for b in bottom]
    for k, (name, vals) in enumerate(layers.items()):
        if len(vals) != len(labels) or len(tops) != len(labels):
            raise ValueError(f"layer {name!r}: {len(vals)} values (bottom {len(tops)}) for {len(labels)} labels")
        ax.bar(range(len(labels)), list(vals), bottom=tops, label=name, color=colors[k] if colors else f"C{k}")
        tops = [t + v for t, v in zip(tops, vals)]
    ax.set_xticks(range(len(labels)), list(labels))
    return tops


def pick(rows: Iterable[dict[str, Any]], key: str, default: Any = None, **where: Any) -> Any:
    """``row[key]`` of the first of ``rows`` whose items include ``where``; ``default`` when none does (or that row
    has no ``key``)."""
    return next((r.get(key, default) for r in rows if all(r.get(k) == v for k, v in where.items())), default)


def bar_groups(ax, labels: Sequence[str], series: dict[str, Sequence[float]], width: float = 0.8) -> None:
    """Grouped bars on ``ax``: one group per label, one bar per ``series`` entry (its name the legend label, its
    values one per label), the groups' ticks at their centres."""
    w = width / max(1, len(series))
    for k, (name, vals) in enumerate(series.items()):
        ax.bar([i + (k - (len(series) - 1) / 2) * w for i in range(len(labels))], list(vals), w, label=name)
    ax.set_xticks(range(len(labels)), list(labels))

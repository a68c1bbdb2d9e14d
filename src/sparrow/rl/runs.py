"""Comparing GRPO runs: the records a recipe logs per step, turned into per-step rows, per-run medians, speedups
against a baseline configuration (same seed) and one figure (reward per step and per second, and where a step's
time goes).

A *record* is one ``metric_logger.log_dict`` call of ``sparrow_grpo`` (``time/step_s``, ``time/rollout_s``,
``reward/mean``, ...); :func:`step_rows` keeps the training steps, :func:`run_summary` reduces one run,
:func:`add_speedups` and :func:`compare` relate runs to the baseline, :func:`plot_runs` draws them;
:func:`partial_costs` reduces partial rollout's records, :func:`merge_results` joins results of several seeds
(:func:`merge_files` the files of them);
:func:`run_line` and the ``*_COLUMNS`` tuples report them.

Example::

    from sparrow.rl import read_metrics
    from sparrow.rl.runs import compare, run_summary, step_rows

    steps = step_rows("all_off", 0, read_metrics("outputs/run/logs"), warmup=1)
    row = run_summary("all_off", 0, steps)
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any, Iterable, Sequence

from sparrow._report import save_figure

# seconds the recipe logs per step as time/<phase>_s
PHASES = ("prefill", "decode", "logprob", "train", "sync", "sync_apply", "drafter_refresh", "rollout", "step")
# disjoint phases of one step (the rest: rewards, batching, the drafter's refresh)
STACKED = ("prefill", "decode", "logprob", "train", "sync")
# cumulative counts the recipe logs per step: growth over a step means it compiled or captured graphs
COMPILE_COUNTS = ("compile/graphs", "engine/captured_graphs")


def median(xs: Iterable[float | None]) -> float | None:
    """The median of the finite numbers of ``xs`` (None skipped); None if there are none."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(xs) if xs else None


def mean(xs: Iterable[float | None]) -> float | None:
    """The mean of the finite numbers of ``xs`` (None skipped); None if there are none."""
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either is missing or ``b`` is 0."""
    return a / b if a is not None and b else None


def step_rows(name: str, seed: int, records: list[dict[str, Any]], warmup: int) -> list[dict[str, Any]]:
    """One row per training step of a run: its record plus ``config``, ``seed``, ``timed`` (after the first
    ``warmup`` steps and not ``profiled``: a step run under the profiler carries its overhead), cumulative
    ``wall_s`` over every step and ``timed_wall_s`` over the timed ones, and
    ``compiled``: whether a count of :data:`COMPILE_COUNTS` grew over the step (None for the first step, or when
    the recipe logged no counts). Records without ``time/step_s`` (evaluations before the first step) are
    skipped."""
    out, wall, timed_wall, last = [], 0.0, 0.0, None
    for r in records:
        if "time/step_s" not in r:
            continue
        timed = r["step"] > warmup and not r.get("profiled")
        wall += r["time/step_s"]
        timed_wall += r["time/step_s"] if timed else 0.0
        counts = tuple(r.get(k) for k in COMPILE_COUNTS)
        compiled = None
        if last is not None and any(c is not None for c in counts):
            compiled = any(c is not None and p is not None and c > p for c, p in zip(counts, last))
        last = counts
        out.append({"config": name, "seed": seed, "timed": timed, "wall_s": wall,
                    "timed_wall_s": timed_wall if timed else None, "compiled": compiled, **r})
    return out


def run_summary(name: str, seed: int, steps: list[dict[str, Any]], records: list[dict[str, Any]] | None = None,
                **extra: Any) -> dict[str, Any]:
    """One run reduced: median time per phase (``<phase>_s``, ``median_step_s``) over the timed steps (every
    step when none is timed), means of the training signals over every step, the first and last held-out
    accuracy (``eval/accuracy`` in ``records``), sync bytes. ``extra`` is copied into the row."""
    timed = [s for s in steps if s["timed"]] or steps
    col = lambda key, rows=timed: [s.get(key) for s in rows]  # noqa: E731
    evals = [r["eval/accuracy"] for r in (records or steps) if "eval/accuracy" in r]
    spec = [s for s in steps if s.get("spec/cycles")]  # steps where the toggle ran speculative cycles
    row: dict[str, Any] = {"config": name, "seed": seed, **extra, "steps": len(steps), "timed_steps": len(timed),
                           "compiled_timed_steps": sum(bool(s.get("compiled")) for s in timed)}
    for ph in PHASES:
        row[f"{ph}_s"] = median(col(f"time/{ph}_s"))
    row["median_step_s"] = row.pop("step_s")
    wire, dense = col("sync/wire_bytes", steps), col("sync/dense_bytes", steps)
    row.update(
        mean_step_s=mean(col("time/step_s")), wall_s=sum(x or 0.0 for x in col("time/step_s")),
        wall_s_all=sum(x or 0.0 for x in col("time/step_s", steps)),
        rollout_tokens_per_s=median(col("rollout/tokens_per_s")),
        response_len=mean(col("response/len_mean", steps)),
        reward_mean=mean(col("reward/mean", steps)),
        reward_last_half=mean(col("reward/mean", steps[len(steps) // 2:])),
        eval_start=evals[0] if len(evals) > 1 else None, eval_final=evals[-1] if evals else None,
        mismatch_kl=mean(col("mismatch_kl", steps)), is_clip_frac=mean(col("is_clip_frac", steps)),
        policy_clip_frac=mean(col("policy_clip_frac", steps)),
        tail_agreement_p5=mean(col("mismatch/tail_agreement_p5", steps)),
        spec_acceptance=mean(s.get("spec/acceptance") for s in spec),
        spec_tokens_per_cycle=mean(s.get("spec/tokens_per_cycle") for s in spec),
        spec_cycles=sum(s.get("spec/cycles") or 0 for s in steps) if any("spec/cycles" in s for s in steps) else None,
        decode_density=mean(col("attention/decode_density", steps)),
        decode_ret_density=mean(col("attention/decode_ret_density", steps)),
        prefill_ret_density=mean(col("attention/prefill_ret_density", steps)),
        sync_wire_mb=mean(x / 1e6 for x in wire if x is not None),
        sync_dense_mb=mean(x / 1e6 for x in dense if x is not None),
    )
    row["sync_ratio"] = ratio(row["sync_dense_mb"], row["sync_wire_mb"])
    tps = row["rollout_tokens_per_s"]
    row["rollout_ms_per_token"] = 1e3 / tps if tps else None  # equal work when the runs sample other lengths
    return row


#: the columns of a run's time table, its training-signal table and the per-configuration summary table
TIME_COLUMNS = ("config", "seed", "median_step_s", "speedup", "prefill_s", "decode_s", "logprob_s", "train_s",
                "sync_s", "drafter_refresh_s", "rollout_s", "rollout_tokens_per_s", "wall_s", "wall_s_all")
SIGNAL_COLUMNS = ("config", "seed", "reward_mean", "reward_last_half", "eval_start", "eval_final", "mismatch_kl",
                  "is_clip_frac", "spec_acceptance", "decode_density", "prefill_ret_density", "sync_wire_mb",
                  "sync_dense_mb")
SUMMARY_COLUMNS = ("config", "seeds", "median_step_s", "speedup", "median_rollout_s", "rollout_speedup",
                   "reward_last_half", "eval_final", "mismatch_kl", "spec_acceptance", "sync_wire_mb")


def run_line(row: dict[str, Any]) -> str:
    """One line about a :func:`run_summary` row: the median step and its phases, the reward, the held-out
    evaluation before and after, the run's and its setup's seconds. ``KeyError`` when a field is missing."""
    r = row
    return (f"median step {r['median_step_s']:.3f} s (prefill {r['prefill_s']:.3f}, decode {r['decode_s']:.3f}, "
            f"train {r['train_s']:.3f}, sync {r['sync_s']:.3f}), reward {r['reward_mean']:.3f}, eval "
            f"{r['eval_start']} -> {r['eval_final']}, run {r['run_s']:.1f} s (setup {r['setup_s']:.1f})")


def add_speedups(rows: list[dict[str, Any]], baseline: str = "all_off") -> None:
    """In place: ``speedup`` = the baseline run's median step time / this run's (same seed); likewise
    ``rollout_speedup`` for the rollout phase, ``per_token_rollout_speedup`` for rollout time per generated token
    and ``fixed_rollout_speedup`` for a fixed-length rollout (rows with ``fixed_rollout_s``); None where the seed
    has no baseline run."""
    base = {r["seed"]: r for r in rows if r["config"] == baseline}
    for r in rows:
        b = base.get(r["seed"])
        r["speedup"] = ratio(b["median_step_s"], r["median_step_s"]) if b else None
        r["rollout_speedup"] = ratio(b["rollout_s"], r["rollout_s"]) if b else None
        r["per_token_rollout_speedup"] = ratio(b["rollout_ms_per_token"], r["rollout_ms_per_token"]) if b else None
        if "fixed_rollout_s" in r:  # the same prompts decoded to a fixed length (no stop token): equal work
            r["fixed_rollout_speedup"] = ratio(b.get("fixed_rollout_s"), r["fixed_rollout_s"]) if b else None


SUMMARY_MEANS = ("wall_s", "reward_last_half", "eval_start", "eval_final", "mismatch_kl", "tail_agreement_p5",
                 "stale_token_frac", "is_clip_frac", "spec_acceptance", "decode_density", "sync_wire_mb",
                 "rollout_ms_per_token", "per_token_rollout_speedup", "fixed_rollout_s", "fixed_rollout_speedup")


def compare(rows: list[dict[str, Any]], steps: list[dict[str, Any]], baseline: str = "all_off") -> list[dict[str, Any]]:
    """Per configuration (in order of first appearance), over its seeds: the median of the pooled timed step
    and rollout times, their ratio to the baseline's (``speedup``, ``rollout_speedup``) with the spread of the
    per-seed speedups (``speedup_min`` / ``speedup_max``), and the means of :data:`SUMMARY_MEANS`."""
    names = list(dict.fromkeys(r["config"] for r in rows))
    out, med = [], {}
    for name in names:
        rs = [r for r in rows if r["config"] == name]
        ts = [s for s in steps if s["config"] == name and s["timed"]]
        med[name] = (median(s["time/step_s"] for s in ts), median(s.get("time/rollout_s") for s in ts))
        per_seed = [r.get("speedup") for r in rs if r.get("speedup") is not None]
        out.append({"config": name, "seeds": len(rs), "median_step_s": med[name][0], "median_rollout_s": med[name][1],
                    "speedup_min": min(per_seed, default=None), "speedup_max": max(per_seed, default=None),
                    **{k: mean(r.get(k) for r in rs) for k in SUMMARY_MEANS}})
    for s in out:
        b = med.get(baseline)
        s["speedup"] = ratio(b[0], s["median_step_s"]) if b else None
        s["rollout_speedup"] = ratio(b[1], s["median_rollout_s"]) if b else None
    return out


def partial_costs(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """What partial rollout cost over a run's :func:`step_rows`: ``stale_token_frac``, the mean share of trained
    tokens an older policy sampled (None without ``partial/staleness_0`` records), and ``dropped_groups``, the
    groups dropped (0 without partial rollout)."""
    stale = [1.0 - s["partial/staleness_0"] for s in steps if "partial/staleness_0" in s]
    return {"stale_token_frac": sum(stale) / len(stale) if stale else None,
            "dropped_groups": sum(s.get("partial/dropped_groups", 0.0) for s in steps)}


def merge_results(docs: list[dict[str, Any]], benchmark: str, free: Iterable[str] = ("configs", "seeds")
                  ) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """Join complete results of one comparison benchmark run with other seeds: ``(config, rows, steps)``, the
    config the first document's with ``configs`` and ``seeds`` of all, the rows with :func:`add_speedups` again
    (each seed's speedup still compares runs of one process). ``ValueError`` when a document is not a complete
    ``benchmark`` result, when settings other than the ``free`` config keys or the device differ, or unless every
    (configuration, seed) appears once and the baseline ``all_off`` for every seed."""
    free = set(free)
    settings = [{k: v for k, v in d["config"].items() if k not in free} for d in docs]
    for i, (d, s) in enumerate(zip(docs, settings)):
        if d.get("benchmark") != benchmark or not d.get("complete"):
            raise ValueError(f"result {i}: not a complete {benchmark} result")
        if s != settings[0] or d["environment"].get("device") != docs[0]["environment"].get("device"):
            raise ValueError(f"result {i}: settings or device differ from result 0")
    rows, steps = [r for d in docs for r in d["rows"]], [s for d in docs for s in d["steps"]]
    pairs = [(r["config"], r["seed"]) for r in rows]
    if len(set(pairs)) < len(pairs) or any(("all_off", s) not in pairs for _, s in pairs):
        raise ValueError("every (configuration, seed) once, and all_off for every seed")
    add_speedups(rows)
    config = dict(docs[0]["config"], configs=list(dict.fromkeys(r["config"] for r in rows)),
                  seeds=sorted({r["seed"] for r in rows}))
    return config, rows, steps


def merge_files(paths: Sequence[Path | str], benchmark: str, free: Iterable[str] = ("configs", "seeds"),
                keep: Iterable[str] = ()) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """The JSON results at ``paths`` (complete runs of the comparison benchmark ``benchmark`` with other seeds)
    joined by :func:`merge_results` (``free``: its config keys that may differ): ``(config, rows, extra)``, where
    ``extra`` is the rest of the merged result: the :func:`compare` ``summary``, the ``steps``, the first
    value of each key in ``keep`` that a document holds (None where none does), ``complete``, the summed ``seconds`` and
    the ``sources`` (each file's name and git revision). ``ValueError`` from :func:`merge_results`; ``OSError`` and
    ``json.JSONDecodeError`` for a file that cannot be read."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    config, rows, steps = merge_results(docs, benchmark, free=free)
    extra = {"summary": compare(rows, steps), "steps": steps,
             **{k: next((d[k] for d in docs if d.get(k) is not None), None) for k in keep}, "complete": True,
             "seconds": round(sum(d.get("seconds") or 0.0 for d in docs), 1),
             "sources": [{"file": Path(p).name, "git_revision": d["environment"].get("git_revision")}
                         for p, d in zip(paths, docs)]}
    return config, rows, extra


def plot_runs(steps: list[dict[str, Any]], png: Path | str, title: str = "", warmup: int = 1) -> None:
    """Three panels: sampled reward per step, reward against cumulative timed step time, and the mean time per
    phase (:data:`STACKED`, plus ``other``) over the timed steps of each configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (ax_s, ax_t, ax_p) = plt.subplots(1, 3, figsize=(16, 4.2), gridspec_kw={"width_ratios": [1, 1, 0.8]})
    names = list(dict.fromkeys(s["config"] for s in steps))
    seeds = sorted({s["seed"] for s in steps})
    for i, name in enumerate(names):
        for j, seed in enumerate(seeds):
            pts = [s for s in steps if s["config"] == name and s["seed"] == seed]
            kw = dict(color=f"C{i}", ls=["-", "--", ":", "-."][j % 4], marker="o", ms=3,
                      label=name if len(seeds) == 1 else f"{name} seed {seed}")
            if pts:
                ax_s.plot([p["step"] for p in pts], [p["reward/mean"] for p in pts], **kw)
                timed = [p for p in pts if p["timed"]]
                ax_t.plot([p["timed_wall_s"] for p in timed], [p["reward/mean"] for p in timed], **kw)
    ax_s.set(xlabel="GRPO step", ylabel="mean sampled reward (T=1)", title="reward per step")
    ax_t.set(xlabel=f"cumulative step time, s (first {warmup} step(s) left out)", ylabel="mean sampled reward (T=1)",
             title="reward per wall-clock second")
    ax_s.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (ax_s, ax_t):
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    ax_s.legend(fontsize=7)
    timed = {n: [s for s in steps if s["config"] == n and s.get("timed")] for n in names}
    bottoms = [0.0] * len(names)
    for i, phase in enumerate(STACKED + ("other",)):
        if phase == "other":
            vals = [mean(s["time/step_s"] - sum(s.get(f"time/{p}_s") or 0.0 for p in STACKED) for s in timed[n])
                    for n in names]
        else:
            vals = [mean(s.get(f"time/{phase}_s") or 0.0 for s in timed[n]) for n in names]
        vals = [max(0.0, v or 0.0) for v in vals]
        ax_p.bar(range(len(names)), vals, bottom=bottoms, color=f"C{i}", label=phase)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax_p.set_xticks(range(len(names)), [n.replace("_", "\n", 1) for n in names], fontsize=8)
    ax_p.set(ylabel="seconds (mean over the timed steps)", title="where a step's time goes")
    ax_p.legend(fontsize=7)
    ax_p.grid(alpha=0.3, axis="y")
    save_figure(fig, png, title=title or None)

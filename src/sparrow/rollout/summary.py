"""What one :meth:`~sparrow.rollout.RolloutEngine.generate` call did, as a flat record, and runs side by side.

:func:`generation_summary` turns a :class:`~sparrow.rollout.Generation` and its wall time into the figures a
rollout benchmark reports (latency, throughput, speculative acceptance, response lengths, per-bucket tokens/s);
:func:`bucket_comparison` puts several such summaries side by side per batch bucket, against the first.
:func:`timed_generate` times one call; :func:`policy_runs` compares decoding policies (toggles) on one rollout
(:func:`phase_tables` reports them), :func:`fixed_batch_runs` at batch sizes held fixed. :func:`engine_before`
builds the engine as it was before fused projections and shared-prefix decode, and :func:`engine_speedups` puts
the two side by side.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import time
from functools import partial
from typing import Any, Callable, Sequence

from torchtune.modules import TransformerDecoder

from sparrow._device import synchronize
from sparrow._report import format_table
from sparrow.attention import DenseAttention
from sparrow.models.attention import use_attention
from sparrow.rollout.engine import EngineConfig, Generation, RolloutEngine
from sparrow.sampling import SamplingParams
from sparrow.speculative.base import ToggleController
from sparrow.speculative.toggle import CostModelToggle

Policies = Sequence[tuple[str, ToggleController]]


def generation_summary(name: str, gen: Generation, total_s: float) -> dict[str, Any]:
    """The record of one ``generate`` call named ``name`` that took ``total_s`` wall seconds (prefill included).

    Keys: ``run``, ``latency_s``, ``prefill_s``, ``decode_s`` (``total_s`` minus the prefill), ``tokens``,
    ``decode_tok_s``, ``acceptance`` and ``tokens_per_cycle`` (None without speculation), ``spec_cycles``,
    ``steps``, ``steps_apart`` (of those, steps whose rows shared their prompts too little for the shared-prefix
    kernel, so each read its own), ``draft_len_hist``, response lengths ``len_p50`` / ``len_p90`` / ``len_max``
    (nearest rank), ``stop_frac`` (share of samples that ended on a stop token), ``bucket_tok_s`` (batch bucket ->
    tokens/s of the decode blocks run at it), ``bucket_steps`` and ``bucket_spec_steps`` (bucket -> steps,
    speculative cycles).
    ``ValueError`` for a generation without samples."""
    if not len(gen):
        raise ValueError("generation_summary: the generation has no samples")
    st, lengths = gen.stats, sorted(s.length for s in gen)
    decode_s = total_s - st.prefill_s
    return {
        "run": name, "latency_s": total_s, "prefill_s": st.prefill_s, "decode_s": decode_s,
        "tokens": st.generated_tokens, "decode_tok_s": st.generated_tokens / decode_s if decode_s else 0.0,
        "acceptance": st.acceptance_rate if st.draft_proposed else None,
        "tokens_per_cycle": st.tokens_per_cycle if st.spec_row_cycles else None,
        "spec_cycles": st.spec_cycles, "steps": st.decode_steps, "steps_apart": st.apart_steps,
        "draft_len_hist": dict(sorted(st.draft_len_hist.items())),
        "len_p50": lengths[len(lengths) // 2], "len_p90": lengths[int(0.9 * (len(lengths) - 1))],
        "len_max": lengths[-1], "stop_frac": sum(s.finish_reason == "stop" for s in gen) / len(gen),
        "bucket_tok_s": {b: st.block_tokens[b] / st.block_time_s[b] for b in sorted(st.block_tokens)
                         if st.block_time_s[b] > 0},
        "bucket_steps": dict(sorted(st.active_hist.items())), "bucket_spec_steps": dict(sorted(st.spec_hist.items())),
    }


def bucket_comparison(rows: list[dict[str, Any]], toggled: str = "SD toggle") -> list[dict[str, Any]]:
    """Per batch bucket of :func:`generation_summary` records ``rows`` (the first is the baseline): each run's
    tokens/s (key: its ``run``), each later run's ratio to the first (``"<run> /AR"``; None where either has no
    blocks at that bucket) and, of the first run whose name starts with ``toggled``, the share of its steps at the
    bucket that were speculative (``"toggle SD frac"``)."""
    tog = next((r for r in rows if r["run"].startswith(toggled)), None)
    table = []
    for b in sorted({b for r in rows for b in r["bucket_tok_s"]}):
        t, base = {"bucket": b}, rows[0]["bucket_tok_s"].get(b)
        for r in rows:
            t[r["run"]] = v = r["bucket_tok_s"].get(b)
            if r is not rows[0]:
                t[r["run"] + " /AR"] = v / base if v is not None and base else None
        steps = tog["bucket_steps"].get(b, 0) if tog else 0
        t["toggle SD frac"] = tog["bucket_spec_steps"].get(b, 0) / steps if steps else None
        table.append(t)
    return table


def phase_tables(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """The report of :func:`policy_runs` rows per ``phase`` (sorted), as printed: a heading ``Phase '<phase>':``
    after a blank line, the phase's rows in ``columns`` (:func:`~sparrow._report.format_table`) and its
    :func:`bucket_comparison` table (a lone ``bucket`` header when no run has bucket times). ``KeyError`` for a
    row without ``phase``, ``run`` or ``bucket_tok_s``."""
    out = []
    for phase in sorted({r["phase"] for r in rows}):
        rs = [r for r in rows if r["phase"] == phase]
        bt = bucket_comparison(rs)
        out += [f"\nPhase '{phase}':", format_table(rs, columns), format_table(bt, list(bt[0]) if bt else ["bucket"])]
    return "\n".join(out)


def timed_generate(engine: RolloutEngine, prompts: Sequence, samples: int,
                   params: SamplingParams) -> tuple[Generation, float]:
    """``engine.generate(prompts, samples, params)`` and its wall seconds, the device synchronized before and after
    (work queued earlier does not count, the call's own does). Raises what ``engine.generate`` raises."""
    synchronize()
    t0 = time.perf_counter()
    gen = engine.generate(prompts, samples, params)
    synchronize()
    return gen, time.perf_counter() - t0


def policy_runs(label: str, engine: RolloutEngine, prompts: Sequence, samples: int, params: SamplingParams,
                policies: Policies, *, save: Callable[[list[dict[str, Any]]], None] | None = None,
                deadline: float | None = None, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """One rollout (``prompts`` x ``samples`` under ``params``) through ``engine`` per decoding policy of
    ``policies`` (``(name, toggle)`` pairs, each toggle fresh), in order, the first the baseline (plain decoding):
    a :func:`generation_summary` row each, with ``phase=label``, ``speedup_vs_ar`` and ``latency_reduction``
    against the first run (every row updated as runs finish) and, for a
    :class:`~sparrow.speculative.CostModelToggle`, the acceptance it ended on (``final_alpha_estimate``). Garbage
    is collected before each run, ``save(rows)`` called after it; a run is skipped (logged) once the time the
    first took would carry it past ``deadline`` (a ``time.perf_counter()`` value; None: no limit). ``ValueError``
    from :func:`generation_summary` for a rollout without samples."""
    out: list[dict[str, Any]] = []
    for name, toggle in policies:
        if out and deadline is not None and time.perf_counter() + out[0]["latency_s"] > deadline:
            log(f"  {label} / {name}: skipped (deadline)")
            continue
        engine.toggle = toggle
        gc.collect()
        gen, seconds = timed_generate(engine, prompts, samples, params)
        row = generation_summary(name, gen, seconds) | {"phase": label}
        if isinstance(toggle, CostModelToggle):
            row["final_alpha_estimate"] = toggle.adaptive.alpha
        out.append(row)
        for r in out:
            r["speedup_vs_ar"] = out[0]["latency_s"] / r["latency_s"]
            r["latency_reduction"] = 1.0 - r["latency_s"] / out[0]["latency_s"]
        if save is not None:
            save(out)
        log(f"  {label} / {name}: latency {row['latency_s']:.2f}s (prefill {row['prefill_s']:.2f}s), {row['tokens']} "
            f"tokens, acceptance {row['acceptance']}, tokens/cycle {row['tokens_per_cycle']}, draft lengths "
            f"{row['draft_len_hist']}, lengths p50/p90/max {row['len_p50']}/{row['len_p90']}/{row['len_max']}")
    return out


def fixed_batch_runs(engine: RolloutEngine, buckets: Sequence[int], prompts: Sequence, samples: int,
                     params: SamplingParams, policies: Callable[[], Policies], *, deadline: float | None = None,
                     log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Decode speed at batch sizes held fixed: at each ``b`` of ``buckets``, ``b`` rows (the first ``b // n`` of
    ``prompts``, ``n = min(b, samples)`` samples each) decode under ``params`` (give no stop token, so the batch
    never shrinks) once per policy of ``policies()`` (called per bucket, for fresh toggles; the first is the
    baseline ``AR``). A row per bucket: ``batch``, ``prompts``, ``samples``, ``new_tokens``, and per policy
    ``"<name> tok/s"`` (generated tokens per second of decoding, the prefill left out) and ``"<name> compiled"``
    (sampling modes and CUDA graphs the run added: it compiled inside the clock), for the later ones also
    ``"<name> /AR"`` (their speed over the first's) and ``"<name> acceptance"`` (None without drafts). Buckets
    reached past ``deadline`` (a ``time.perf_counter()`` value) are skipped (logged). ``IndexError`` when
    ``policies()`` gives none."""
    out = []
    for b in buckets:
        if deadline is not None and time.perf_counter() > deadline:
            log(f"  per-batch {b}: skipped (deadline)")
            continue
        n_s = min(b, samples)
        row: dict[str, Any] = {"batch": b, "prompts": b // n_s, "samples": n_s, "new_tokens": params.max_new_tokens}
        runs = policies()
        base = runs[0][0]
        for name, toggle in runs:
            engine.toggle = toggle
            graphs = engine.sampling_modes + engine.captured_graphs  # a new mode or graph would compile here
            gen, seconds = timed_generate(engine, prompts[:b // n_s], n_s, params)
            row[f"{name} compiled"] = engine.sampling_modes + engine.captured_graphs - graphs
            row[f"{name} tok/s"] = gen.stats.generated_tokens / (seconds - gen.stats.prefill_s)
            if name != base:
                row[f"{name} /AR"] = row[f"{name} tok/s"] / row[f"{base} tok/s"]
                row[f"{name} acceptance"] = gen.stats.acceptance_rate if gen.stats.draft_proposed else None
        out.append(row)
        log(f"  per-batch {b}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items() if k.endswith("/AR") and v))
    return out


def engine_before(model: TransformerDecoder, config: EngineConfig) -> RolloutEngine:
    """The baseline of the engine benchmarks: ``config``'s engine as it was before fused projections and
    shared-prefix decode, on a deep copy of the dense ``model`` (``model`` itself is left as it is). Its q / k / v
    and gate / up projections stay separate matmuls (``fuse_projections=False``) and every row reads its own prompt
    (``DenseAttention(shared_prefix=False)`` in every layer)."""
    old = use_attention(copy.deepcopy(model), partial(DenseAttention, shared_prefix=False))
    return RolloutEngine(old, dataclasses.replace(config, fuse_projections=False))


def engine_speedups(after: dict[str, Any], before: dict[str, Any], after_fixed: Sequence[dict[str, Any]] = (),
                    before_fixed: Sequence[dict[str, Any]] = (), policy: str = "AR") -> dict[str, Any]:
    """One decoding policy through two engines on the same rollout: ``after`` / ``before`` are
    :func:`generation_summary` rows, ``*_fixed`` the :func:`fixed_batch_runs` rows of each (matched by ``batch``).
    Returns ``latency_speedup`` (before's latency over after's), ``decode_tok_s_speedup`` (per generated token: the
    two may sample other tokens, so other lengths), ``same_token_count`` (whether they generated as many tokens;
    ``same_tokens`` in JSONs written before the rename), and ``fixed`` (per batch held fixed, equal work: ``batch``,
    both tokens/s and ``speedup``). ``KeyError`` for a fixed row without ``"<policy> tok/s"``."""
    fixed_before = {r["batch"]: r[f"{policy} tok/s"] for r in before_fixed}
    return {"latency_speedup": before["latency_s"] / after["latency_s"],
            "decode_tok_s_speedup": after["decode_tok_s"] / before["decode_tok_s"],
            "same_token_count": after["tokens"] == before["tokens"],
            "fixed": [{"batch": b, "after_tok_s": t, "before_tok_s": fixed_before[b], "speedup": t / fixed_before[b]}
                      for b, t in ((r["batch"], r[f"{policy} tok/s"]) for r in after_fixed) if b in fixed_before]}


__all__ = ["bucket_comparison", "engine_before", "engine_speedups", "fixed_batch_runs", "generation_summary",
           "phase_tables", "policy_runs", "timed_generate"]

"""What one :meth:`~sparrow.rollout.RolloutEngine.generate` call did, as a flat record, and runs side by side.

:func:`generation_summary` turns a :class:`~sparrow.rollout.Generation` and its wall time into the figures a
rollout benchmark reports (latency, throughput, speculative acceptance, response lengths, per-bucket tokens/s);
:func:`bucket_comparison` puts several such summaries side by side per batch bucket, against the first.
"""

from __future__ import annotations

from typing import Any

from sparrow.rollout.engine import Generation


def generation_summary(name: str, gen: Generation, total_s: float) -> dict[str, Any]:
    """The record of one ``generate`` call named ``name`` that took ``total_s`` wall seconds (prefill included).

    Keys: ``run``, ``latency_s``, ``prefill_s``, ``decode_s`` (``total_s`` minus the prefill), ``tokens``,
    ``decode_tok_s``, ``acceptance`` and ``tokens_per_cycle`` (None without speculation), ``spec_cycles``,
    ``steps``, ``draft_len_hist``, response lengths ``len_p50`` / ``len_p90`` / ``len_max`` (nearest rank),
    ``stop_frac`` (share of samples that ended on a stop token), ``bucket_tok_s`` (batch bucket -> tokens/s of the
    decode blocks run at it), ``bucket_steps`` and ``bucket_spec_steps`` (bucket -> steps, speculative cycles).
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
        "spec_cycles": st.spec_cycles, "steps": st.decode_steps,
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


__all__ = ["bucket_comparison", "generation_summary"]

"""Calibrating several RTPurbo configurations of one model at once, and measuring what each selects.

The retrieval heads are scored once (by ablation or attention mass) and one indexer is fitted per
``(decode_block, top_p)`` for the largest head set; a configuration with fewer heads takes its heads' part of that
indexer (:func:`~sparrow.calibrate.data.subset_indexer`). Each configuration's selection is then measured against
the dense top-p set on held-out sequences (:func:`selection_record`; :func:`selection_rows` flattens it,
:func:`plot_selection` draws it).

:func:`variant_configs` builds the configurations of a variant spec (:func:`parse_variants`),
:func:`variant_densities` reads what one read while answering; :func:`calibration_options` are a script's
options of a calibration.

Example::

    cfgs = {"ratio=0.25": RTPurboConfig.for_context(4096, retrieval_ratio=0.25)}
    variants, record = calibrate_variants(model, cfgs, 4096, profile_seqs=8, fit_seqs=8, selection_seqs=8)
    profile, indexer, config = variants["ratio=0.25"]
    sparse = rtpurbo_model(model, profile, indexer, config)
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from sparrow._report import save_figure, subplots
from sparrow.attention.rtpurbo import (
    HeadProfile, IndexerWeights, RTPurboConfig, rtpurbo_attention, rtpurbo_backends,
)
from sparrow.attention.rtpurbo_io import save_rtpurbo
from sparrow.calibrate.data import (
    CALIBRATION_SEED, calibration_sequences, fit_sequences, kv_calibration_sequence, subset_indexer,
)
from sparrow.calibrate.indexer import fit_indexer, mean_over
from sparrow.calibrate.profile import ablation_scores, head_scores
from sparrow.calibrate.selection import measure_selection
from sparrow.models import use_attention

Variant = tuple[HeadProfile, IndexerWeights, RTPurboConfig]


def rtpurbo_model(model: nn.Module, profile: HeadProfile, indexer: IndexerWeights, config: RTPurboConfig,
                  stats: bool = True) -> nn.Module:
    """A deep copy of ``model`` whose attention is RTPurbo (``profile``'s retrieval heads, ``indexer``, ``config``),
    with its selection statistics on when ``stats`` (read them with
    :func:`~sparrow.attention.rtpurbo.collect_selection_stats`); ``model`` itself is left as it is."""
    m = use_attention(copy.deepcopy(model), rtpurbo_attention(profile, indexer, config))
    for b in rtpurbo_backends(m) if stats else ():
        b.enable_stats()
    return m


def selection_record(model: nn.Module, profile: HeadProfile, indexer: IndexerWeights, sequences: Sequence,
                     config: RTPurboConfig, last: int, log: Callable[[str], None] = print) -> dict[str, Any]:
    """:func:`~sparrow.calibrate.selection.measure_selection` of ``indexer`` at its calibrated temperature and at 1,
    over every query and over each sequence's last ``last`` positions (what decode steps see), at ``config``'s
    ``top_p`` and blocks: ``{"<calibrated|t1>_<all|decode>": {**summary, "heads": [per head dicts]}}``; each
    report's table goes to ``log``."""
    out = {}
    for temp, w in (("calibrated", indexer), ("t1", IndexerWeights(indexer.q, indexer.k))):
        for queries, n in (("all", None), ("decode", last)):
            r = measure_selection(model, profile, w, sequences, top_p=config.top_p, block=config.decode_block,
                                  prefill_block=config.prefill_block, last=n)
            log(f"selection, temperature {temp}, {queries} queries:\n{r.table()}")
            out[f"{temp}_{queries}"] = {**r.summary(), "heads": [vars(h) for h in r.heads]}
    return out


def selection_rows(record: Mapping[str, Any]) -> list[dict[str, Any]]:
    """:func:`calibrate_variants`' record as rows: one per configuration, measurement of :func:`selection_record`
    and retrieval head, ``{"config", "run", **the head's statistics}`` (``run``: ``"<calibrated|t1>_<all|decode>"``).
    ``KeyError`` for a record without ``configs`` or their ``selection``."""
    return [dict(config=name, run=run, **h) for name, rec in record["configs"].items()
            for run, sel in rec["selection"].items() for h in sel["heads"]]


def plot_selection(rows: Sequence[Mapping[str, Any]], png_path: Path | str, title: str) -> None:
    """Density of the dense top-p set and of the indexer's (temperature 1, calibrated), per granularity (token,
    decode block, prefill block; the mean over ``rows``' heads, :func:`selection_rows`), over all queries and the
    decode ones, with the indexer's recall of the dense set's mass over its bars; written to ``png_path``.
    ``ZeroDivisionError`` when a measurement has no row."""
    grans = ("token", "block", "prefill")
    fig, axes = subplots(1, 2, figsize=(11, 4), squeeze=False)
    for ax, queries in zip(axes[0], ("all", "decode")):
        for i, (label, temp, key) in enumerate((("dense top-p", "t1", "dense"), ("indexer, T=1", "t1", "indexer"),
                                                ("indexer, calibrated T", "calibrated", "indexer"))):
            rs = [r for r in rows if r["run"] == f"{temp}_{queries}"]
            vals = [sum(r[f"{key}_{g}"] for r in rs) / len(rs) for g in grans]
            bars = ax.bar([j + 0.27 * (i - 1) for j in range(3)], vals, width=0.27, label=label, color=f"C{i}")
            for b, g in zip(bars, grans) if key == "indexer" else ():
                rec = sum(r[f"recall_{g}"] for r in rs) / len(rs)
                ax.annotate(f"{rec:.2f}", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                            fontsize=7)
        ax.set_xticks(range(3), list(grans))
        ax.set(ylim=(0, 1.1), ylabel="kept / causal (mean over retrieval heads)",
               title=f"{queries} queries (labels: recall of the dense set's mass)")
        ax.legend(fontsize=7, loc="upper left")
    save_figure(fig, png_path, title)


def calibrate_variants(model: nn.Module, configs: Mapping[str, RTPurboConfig], context: int, *,
                       profile_seqs: int, fit_seqs: int, selection_seqs: int, fit_steps: int = 300,
                       queries_per_seq: int = 256, lr: float = 3e-3, scores: str = "ablation",
                       decode_queries: int = 16, kv_task=None,
                       log: Callable[[str], None] = print) -> tuple[dict[str, Variant], dict[str, Any]]:
    """Calibrate every configuration of ``configs`` (name -> config) on task sequences of about ``context`` tokens.

    Heads are scored once on ``profile_seqs`` examples per task (:func:`~sparrow.calibrate.data.calibration_sequences`;
    ``scores``: ``"ablation"`` at the smallest window and sinks of the configurations, the strictest test, or
    ``"attention"`` mass), one indexer is fitted per ``(decode_block, top_p)`` on ``fit_seqs`` sequences for the
    largest ratio's heads, and each configuration's selection is measured on ``selection_seqs`` held-out ones
    (:func:`selection_record`, the last ``decode_queries`` positions as decode). ``kv_task``: a multi-key retrieval
    task (:class:`~sparrow.rl.KVRetrieval`) to calibrate on alone, for a model trained on it only.

    Returns ``({name: (profile, indexer, config)}, record)``; the record (JSON-ready) holds the seconds, the
    sequence counts, the head scores and per configuration its heads, indexer fit and selection.
    """
    t = time.perf_counter()
    if kv_task is None:
        seqs, fseqs = calibration_sequences(context, profile_seqs), fit_sequences(context, fit_seqs)
        held = fit_sequences(context, selection_seqs, seed=CALIBRATION_SEED + 7)
    else:
        seqs, fseqs, held = ([kv_calibration_sequence(kv_task, CALIBRATION_SEED + k, i) for i in range(n)]
                             for k, n in ((0, profile_seqs), (1, fit_seqs), (7, selection_seqs)))
        fseqs, held = [x.tokens for x in fseqs], [x.tokens for x in held]
    if scores == "ablation":
        head = ablation_scores(model, seqs, window=min(c.window for c in configs.values()),
                               sinks=min(c.num_sinks for c in configs.values()))
    else:
        head = head_scores(model, seqs)
    spans = "kv pair / question" + ("; vt statement / question; vt number / answer" if kv_task is None else "")
    meta = {"method": f"{scores}; task spans ({spans})", "num_sequences": len(seqs), "seq_len": context + 1}
    big = HeadProfile.from_scores(head, max(c.retrieval_ratio for c in configs.values()), meta=meta)
    fits = {}
    for c in configs.values():
        key = (c.decode_block, c.top_p)
        if key not in fits:
            fits[key] = fit_indexer(model, big, fseqs, steps=fit_steps, dim=c.indexer_dim, block=c.decode_block,
                                    top_p=c.top_p, queries_per_seq=queries_per_seq, lr=lr)
            log(f"indexer fit (block {key[0]}, top_p {key[1]}), {fit_steps} steps:\n{fits[key][1].table()}")
    record: dict[str, Any] = {
        "seconds": round(time.perf_counter() - t, 1), "context": context, "profile_sequences": len(seqs),
        "fit_sequences": len(fseqs), "fit_steps": fit_steps, "queries_per_seq": queries_per_seq,
        "head_scores": head.tolist(), "configs": {}}
    variants: dict[str, Variant] = {}
    for name, c in configs.items():
        prof = HeadProfile.from_scores(head, c.retrieval_ratio, meta=meta)
        w_big, rep = fits[(c.decode_block, c.top_p)]
        heads = {(layer, h) for layer in range(prof.num_layers) for h in prof.retrieval_heads(layer)}
        hr = [h for h in rep.heads if (h.layer, h.kv_head) in heads]
        variants[name] = (prof, subset_indexer(big, prof, w_big), c)
        record["configs"][name] = {
            "rtpurbo_config": {k: getattr(c, k) for k in c.__dataclass_fields__},
            "retrieval_heads": sorted([list(x) for x in heads]), "num_retrieval_heads": len(heads),
            **{f"indexer_{k}": mean_over(hr, k) for k in ("recall", "mass", "density", "dense_density", "temperature")},
            "kl_init": mean_over(hr, "kl_init"), "kl_final": mean_over(hr, "kl_final"),
            "per_head": [vars(h) for h in hr],
            "selection": selection_record(model, prof, variants[name][1], held, c, decode_queries, log)}
        rec = record["configs"][name]
        log(f"{name}: retrieval kv heads {sorted(heads)}; indexer recall {rec['indexer_recall']:.3f}, mass "
            f"{rec['indexer_mass']:.3f}, density {rec['indexer_density']:.3f}; window {c.window}, top_p {c.top_p}, "
            f"blocks {c.decode_block}/{c.prefill_block}, ret_window {c.ret_window}")
    return variants, record


def local_prefill_fraction(S: int, window: int, sinks: int) -> float:
    """Fraction of the causal (query, key) pairs of an ``S``-token prompt that a local head (``sinks`` first keys
    and a ``window`` of the latest) reads."""
    i = torch.arange(S, dtype=torch.float64)
    kept = torch.minimum(i + 1, torch.tensor(float(window))) + (i + 1 - window).clamp(min=0).clamp(max=sinks)
    return float(kept.sum() / ((i + 1).sum()))


def variant_densities(stats: Mapping[str, float], profile: HeadProfile, config: RTPurboConfig,
                      context: int) -> dict[str, Any]:
    """What a variant read while answering prompts of ``context`` tokens (``context + 1`` with ``<bos>``), from its
    backends' selection statistics ``stats`` (:func:`~sparrow.attention.rtpurbo.collect_selection_stats`):
    ``decode_density``, ``decode_ret_density`` and ``prefill_ret_density`` as measured; ``prefill_density`` over all
    heads (the retrieval heads' measured density, the local heads' sinks + window exactly:
    :func:`local_prefill_fraction`); the ``window``, its share ``window_frac`` of the prompt, and the number of
    ``retrieval_heads`` of ``profile``. ``KeyError`` when ``stats`` lacks one of the densities."""
    n_ret, n_all = int(profile.retrieval.sum()), profile.retrieval.numel()
    pre_ret = stats["prefill_ret_density"] if n_ret else 0.0
    local = local_prefill_fraction(context + 1, config.window, config.num_sinks)
    return dict(decode_density=stats["decode_density"], decode_ret_density=stats["decode_ret_density"],
                prefill_ret_density=stats["prefill_ret_density"],
                prefill_density=(n_ret * pre_ret + (n_all - n_ret) * local) / n_all,
                window=config.window, window_frac=config.window / (context + 1), retrieval_heads=n_ret)


def calibrate_and_save(model: nn.Module, config: RTPurboConfig, context: int, out: str | Path, *, profile_seqs: int,
                       fit_seqs: int, fit_steps: int, queries_per_seq: int, lr: float) -> dict[str, Any]:
    """One RTPurbo calibration of ``model`` on task sequences at ``context``, written to ``out`` (what the
    ``attention: sparrow.attention.rtpurbo`` recipe section reads): retrieval heads by ablation (``profile_seqs``
    examples per task, ``config``'s window and sinks) at ``config.retrieval_ratio``, then the indexer fitted for
    ``fit_steps`` steps on ``fit_seqs`` sequences (``queries_per_seq``, learning rate ``lr``; ``config``'s indexer
    dim, decode block and top-p). Returns ``{"seconds", "context", "retrieval_heads": [[layer, kv_head], ...],
    "rtpurbo_config": {field: value}, "indexer": the fit report's summary}``. ``ValueError`` from the data (``n``
    below 1) and the fit."""
    t = time.perf_counter()
    scores = ablation_scores(model, calibration_sequences(context, profile_seqs), window=config.window,
                             sinks=config.num_sinks)
    profile = HeadProfile.from_scores(scores, config.retrieval_ratio, meta={"method": "ablation"})
    indexer, report = fit_indexer(model, profile, fit_sequences(context, fit_seqs), steps=fit_steps,
                                  dim=config.indexer_dim, block=config.decode_block, top_p=config.top_p,
                                  queries_per_seq=queries_per_seq, lr=lr)
    save_rtpurbo(out, profile, indexer, config=config, report=report.summary())
    heads = sorted([layer, h] for layer in range(profile.num_layers) for h in profile.retrieval_heads(layer))
    return {"seconds": round(time.perf_counter() - t, 1), "context": context, "retrieval_heads": heads,
            "rtpurbo_config": {k: getattr(config, k) for k in config.__dataclass_fields__}, "indexer": report.summary()}


#: the RTPurbo settings a variant spec (:func:`parse_variants`) may set, and their types
VARIANT_KEYS: dict[str, type] = {"ratio": float, "top_p": float, "decode_block": int, "prefill_block": int,
                                 "ret_window": int, "window": int}


def parse_variants(text: str) -> dict[str, dict[str, float | int]]:
    """RTPurbo variants from ``';'``-separated entries of ``key=value`` pairs, e.g. ``"ratio=0.15;ratio=0.25,
    top_p=0.95"`` -> ``{"ratio=0.15": {"ratio": 0.15}, "ratio=0.25,top_p=0.95": {...}}``: each named by its pairs in
    key order, values typed by :data:`VARIANT_KEYS`. Empty entries are skipped. Raises ``ValueError`` for a key
    not in :data:`VARIANT_KEYS`, a pair without ``=`` or a value of the wrong type."""
    out = {}
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        try:
            c = {k.strip(): v.strip() for k, v in (kv.split("=") for kv in entry.split(","))}
        except ValueError:
            raise ValueError(f"variant {entry!r}: give key=value pairs separated by ','") from None
        unknown = sorted(set(c) - set(VARIANT_KEYS))
        if unknown:
            raise ValueError(f"unknown variant keys {unknown} (known: {sorted(VARIANT_KEYS)})")
        out[",".join(f"{k}={c[k]}" for k in sorted(c))] = {k: VARIANT_KEYS[k](v) for k, v in c.items()}
    return out


def variant_configs(text: str, context: int, *, default_ratio: float = 0.15, **base: Any) -> dict[str, RTPurboConfig]:
    """The RTPurbo configuration of every variant of the spec ``text`` (:func:`parse_variants`), under its name
    there: :meth:`~sparrow.attention.rtpurbo.RTPurboConfig.for_context` at ``context`` with the settings ``base``
    (e.g. ``top_p``, ``impl``) overridden by the variant's own, its ``ratio`` the retrieval ratio (``default_ratio``
    without one). ``ValueError`` from :func:`parse_variants` and from the configuration's checks."""
    return {name: RTPurboConfig.for_context(context, retrieval_ratio=v.get("ratio", default_ratio),
                                            **(base | {k: x for k, x in v.items() if k != "ratio"}))
            for name, v in parse_variants(text).items()}


def calibration_options(fit_steps: int = 300, prefill_impl: str = "auto") -> list[tuple]:
    """Command-line options of an RTPurbo calibration, as :func:`~sparrow.bench.base_parser` rows: ``--top-p``, the
    kernels (``--decode-impl``, ``--prefill-impl`` defaulting to ``prefill_impl``), the data (``--profile-seqs``
    examples per task for the head scores, ``--fit-seqs`` sequences and ``--queries-per-seq`` queries for the
    indexer fit) and the fit (``--fit-steps``, its help naming the full default ``fit_steps``, and ``--fit-lr``).
    The counts default to None: :data:`CALIBRATION_DEFAULTS` and ``fit_steps=(20, fit_steps)`` are their
    ``--quick`` and full values (:func:`~sparrow.bench.fill_defaults`)."""
    return [("--top-p", float, 0.9, None), ("--decode-impl", ["auto", "reference", "triton"], "auto", None),
            ("--prefill-impl", ["auto", "reference", "flex"], prefill_impl,
             "reference: the selection with dense masks"),
            ("--profile-seqs", int, None, "examples per task for the head scores (default 8; quick 2)"),
            ("--fit-seqs", int, None, "indexer fit sequences (default 8; quick 2)"),
            ("--fit-steps", int, None, f"indexer fit steps (default {fit_steps}; quick 20)"),
            ("--fit-lr", float, 3e-3, None), ("--queries-per-seq", int, None, "default 256; quick 64")]


#: the ``(--quick, full)`` values of :func:`calibration_options`' counts (``fit_steps`` is the caller's)
CALIBRATION_DEFAULTS: dict[str, tuple[int, int]] = {"profile_seqs": (2, 8), "fit_seqs": (2, 8),
                                                    "queries_per_seq": (64, 256)}

"""RTPurbo vs dense accuracy on the synthetic long-context tasks, with a model trained on them.

The model comes from ``train_task_model.py`` (``--model DIR``), or is trained first in this process
(``--train-minutes M``). Dense accuracy is measured first at every context; then:

1. **Calibration** (``sparrow.calibrate``) at the longest context where a task's dense accuracy reaches
   ``--handled``: the retrieval-head profile (``--head-scores``: ``ablation``, the default, scores a kv head
   by how much the answer spans' loss rises when that head alone keeps only sinks + the window
   (``ablation_scores``); ``attention`` by the attention mass the second copy puts on the first
   (``head_scores``); computed once and cut at each configuration's ratio) on task prompts with their
   answers appended, where a span really is
   repeated — the multi-key pair ``key=value`` in the context and ``?key=`` + answer at the end; for
   variable tracking the asked variable's statement / the question, and the chain's number / the answer —
   and ``fit_indexer`` (forward-KL distillation) on other task sequences. Its per-head report gives the
   indexer's recall of the dense top-p block set, the teacher mass it covers and its density.
2. **Accuracy**: greedy decoding through the :class:`~sparrow.rollout.RolloutEngine` (prefill, then
   cached decode; ``compile=False``, as the selection statistics read device values back) on held-out
   examples of multi-key retrieval (:class:`~sparrow.rl.KVRetrieval`, every pair filled) and variable
   tracking (:class:`~sparrow.rl.VariableTracking`) at several context lengths, dense attention against an
   RTPurbo copy of the same weights. Exact match of the answer. The prompts of a row are spread over the
   ``--jitter`` (128) characters below its context length, so the question ends at every offset inside a
   128-token prefill selection block (at one aligned length it would always end the same block, which can
   favour or hurt the block-mean prefill selection). Each row gives the number of examples,
   the binomial standard errors, and the paired comparison (examples only dense / only RTPurbo got right,
   and the standard error of the paired difference).
3. **Density** measured by the RTPurbo backends (``enable_stats`` / ``collect_selection_stats``): per decode
   query the fraction of the visible KV read, retrieval heads and all heads; in prefill the kept / causal
   key blocks of the retrieval heads, and over all heads (local heads' sink + window counted exactly).

RTPurbo settings: ``RTPurboConfig.for_context(calibration context)`` (local window = 1/16 of it) with the
``--configs`` overrides (each ``;``-separated entry is one configuration). The summary reports, per task,
the longest context at which dense accuracy reaches ``--handled`` and RTPurbo's difference there. RTPurbo
rows run longest context first; past ``--deadline-minutes`` the rest are skipped (and listed).
Results: ``docs/benchmarks/rtpurbo_accuracy.json`` (or ``--out``); ``plot()`` draws accuracy per context,
dense and RTPurbo, with the decode density on a second axis.

Usage: ``python benchmarks/bench_rtpurbo_accuracy.py --model DIR`` or ``--train-minutes 6``; ``--quick``
(CPU: a tiny model trained for seconds, so accuracies mean nothing; it checks the pipeline).
"""

from __future__ import annotations

import copy
import math
import shlex
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runner import base_parser, print_table, save_figure, triton_interpreter_without_cuda, write_json  # noqa: E402

triton_interpreter_without_cuda()  # before anything imports triton
import train_task_model as ttm  # noqa: E402

from sparrow.attention.rtpurbo import (  # noqa: E402
    HeadProfile,
    IndexerWeights,
    RTPurboConfig,
    collect_selection_stats,
    rtpurbo_attention,
    rtpurbo_backends,
)
from sparrow.calibrate import CalibrationSequence, ablation_scores, fit_indexer, head_scores  # noqa: E402
from sparrow.models import use_attention  # noqa: E402
from sparrow.rl.tokenizer import CharTokenizer  # noqa: E402
from sparrow.rollout import EngineConfig, RolloutEngine, SamplingParams  # noqa: E402

NAME = "rtpurbo_accuracy"
CALIBRATION_SEED = 2_000_003  # neither the training seed nor the evaluation seed
TOK = CharTokenizer()
CONFIG_KEYS = {"ratio": float, "top_p": float, "decode_block": int, "prefill_block": int, "ret_window": int,
               "window": int}


# -- calibration data ---------------------------------------------------------------------------------

def _ids(text: str) -> list[int]:
    return TOK.encode(text, add_bos=False)


def calibration_sequences(context: int, n: int, seed: int = CALIBRATION_SEED) -> list[CalibrationSequence]:
    """Task prompts + answers (bos first, no eos) with the positions of a span that occurs twice.

    Multi-key retrieval: ``key=value`` in the context and ``key=`` + answer after ``?``. Variable tracking
    gives two: the asked variable's statement ``var=`` and the question's ``var=``; the chain's number and
    the answer.
    """
    out = []
    for i in range(n):
        ex = ttm.EVAL_TASKS["kv_retrieval"](context).example(seed, i)
        p = ex.prompt
        key = p[p.rindex("?") + 1:-1]
        toks = torch.tensor([TOK.bos_id] + _ids(p) + _ids(ex.answer))
        span = len(key) + 1 + len(ex.answer)
        out.append(CalibrationSequence(toks, 1 + p.index(key + "="), 1 + len(p) - len(key) - 1, span))
        ex = ttm.EVAL_TASKS["variable_tracking"](context).example(seed, i)
        p = ex.prompt
        var = p[p.rindex("?") + 1:-1]
        toks = torch.tensor([TOK.bos_id] + _ids(p) + _ids(ex.answer))
        out.append(CalibrationSequence(toks, 1 + p.index(var + "="), 1 + len(p) - len(var) - 1, len(var) + 1))
        out.append(CalibrationSequence(toks, 1 + p.index("=" + ex.answer + ";") + 1, 1 + len(p), len(ex.answer)))
    return out


def fit_sequences(context: int, n: int, seed: int = CALIBRATION_SEED + 1) -> list[torch.Tensor]:
    """``n`` task sequences (prompt + answer), alternating the two tasks."""
    names = list(ttm.EVAL_TASKS)
    out = []
    for i in range(n):
        ex = ttm.EVAL_TASKS[names[i % len(names)]](context).example(seed, i)
        out.append(torch.tensor([TOK.bos_id] + _ids(ex.prompt) + _ids(ex.answer)))
    return out


def subset_indexer(big: HeadProfile, small: HeadProfile, w: IndexerWeights) -> IndexerWeights:
    """The indexer of ``small``'s retrieval heads, taken from one fitted for ``big`` (a superset)."""
    out = IndexerWeights()
    for layer in range(small.num_layers):
        hs, hb = small.retrieval_heads(layer), big.retrieval_heads(layer)
        if not hs:
            continue
        if not set(hs) <= set(hb):
            raise ValueError(f"layer {layer}: heads {hs} are not among the fitted {hb}")
        idx = torch.tensor([hb.index(h) for h in hs])
        out.q[layer], out.k[layer] = w.q[layer][idx], w.k[layer][idx]
    return out


def parse_configs(text: str) -> list[dict]:
    configs = []
    for entry in text.split(";"):
        entry = entry.strip()
        if not entry:
            continue
        c = {}
        for kv in entry.split(","):
            k, v = (s.strip() for s in kv.split("="))
            if k not in CONFIG_KEYS:
                raise SystemExit(f"unknown config key {k!r} (known: {sorted(CONFIG_KEYS)})")
            c[k] = CONFIG_KEYS[k](v)
        configs.append(c)
    return configs


def config_name(c: dict) -> str:
    return ",".join(f"{k}={c[k]}" for k in sorted(c))


# -- evaluation ----------------------------------------------------------------------------------------

def eval_examples(task: str, context: int, n: int, jitter: int = 0) -> list:
    """``n`` held-out examples; example ``i`` has ``context - (37 i mod jitter)`` characters, so the prompts
    end at every offset inside a selection block (as real prompts do) instead of one aligned length."""
    sizes = [context - (37 * i) % jitter if jitter > 1 else context for i in range(n)]
    return [ttm.EVAL_TASKS[task](size).example(ttm.EVAL_SEED, i) for i, size in enumerate(sizes)]


def generate_answers(model, task: str, context: int, n: int, *, rows: int, prefill_tokens: int,
                     jitter: int = 0) -> tuple[list[bool], list[bool]]:
    """Greedy answers of ``n`` held-out examples (:func:`eval_examples`) through the rollout engine:
    exact-match hits, and hits of the first answer token alone (it comes from the prefill's last position;
    the rest from decode)."""
    exs = eval_examples(task, context, n, jitter)
    prompts = [TOK.encode(e.prompt) for e in exs]
    new = max(len(e.answer) for e in exs) + 1  # the answer and <eos>
    engine = RolloutEngine(model, EngineConfig(max_rows=min(rows, n), max_prompt_len=max(map(len, prompts)),
                                               max_new_tokens=new, compile=False, cuda_graphs=False,
                                               prefill_tokens=max(prefill_tokens, context + 1)))
    out = engine.generate(prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=new,
                                                     stop_token_ids=(TOK.eos_id,)))
    hits = [TOK.decode(s.tokens.tolist()) == e.answer for s, e in zip(out, exs)]
    first = [int(s.tokens[0]) == _ids(e.answer)[0] for s, e in zip(out, exs)]
    return hits, first


def local_prefill_fraction(S: int, window: int, sinks: int) -> float:
    """Fraction of the causal (query, key) pairs of an ``S``-token prompt a local head reads."""
    i = torch.arange(S, dtype=torch.float64)
    kept = torch.minimum(i + 1, torch.tensor(float(window))) + (i + 1 - window).clamp(min=0).clamp(max=sinks)
    return float(kept.sum() / ((i + 1).sum()))


def paired_delta_se(b: int, c: int, n: int) -> float:
    """Standard error of the paired accuracy difference, ``b`` examples right only dense, ``c`` only sparse."""
    var = (b + c) / n - ((c - b) / n) ** 2
    return math.sqrt(max(var, 0.0) / n)


def paired(dense: list[bool], sparse: list[bool]) -> dict:
    n = len(dense)
    b = sum(d and not s for d, s in zip(dense, sparse))
    c = sum(s and not d for d, s in zip(dense, sparse))
    return {"dense_only": b, "sparse_only": c, "both": sum(d and s for d, s in zip(dense, sparse)),
            "delta": (c - b) / n, "delta_se": paired_delta_se(b, c, n)}


def summarise(rows: list[dict], threshold: float, calibration: dict | None = None) -> list[dict]:
    """Per config and task (and both tasks pooled): the longest context with dense accuracy >= threshold,
    the accuracies there, and the configuration's indexer recall (from the fit report)."""
    out = []
    for cfg in sorted({r["config"] for r in rows}):
        rs = [r for r in rows if r["config"] == cfg]
        for task in sorted({r["task"] for r in rs}) + ["both"]:
            by_ctx: dict[int, dict] = {}
            for r in rs:
                if task != "both" and r["task"] != task:
                    continue
                a = by_ctx.setdefault(r["context"], {"n": 0, "dense": 0.0, "sparse": 0.0, "b": 0, "c": 0,
                                                     "decode_density": [], "tasks": 0})
                a["n"] += r["n"]
                a["dense"] += r["dense_acc"] * r["n"]
                a["sparse"] += r["sparse_acc"] * r["n"]
                a["b"] += r["dense_only"]
                a["c"] += r["sparse_only"]
                a["decode_density"].append(r["decode_density"])
                a["tasks"] += 1
            need = 2 if task == "both" else 1
            ok = [c for c, a in by_ctx.items() if a["tasks"] >= need and a["dense"] / a["n"] >= threshold]
            cal = ((calibration or {}).get("configs") or {}).get(cfg, {})
            row = {"config": cfg, "task": task, "threshold": threshold, "indexer_recall": cal.get("indexer_recall"),
                   "window": (cal.get("rtpurbo_config") or {}).get("window")}
            if not ok:
                row.update(longest_handled=None)
            else:
                L = max(ok)
                a = by_ctx[L]
                n = a["n"]
                delta = (a["sparse"] - a["dense"]) / n
                row.update(longest_handled=L, n=n, dense_acc=a["dense"] / n, sparse_acc=a["sparse"] / n,
                           delta=delta, delta_se=paired_delta_se(a["b"], a["c"], n), within_1pt=abs(delta) <= 0.01,
                           decode_density=sum(a["decode_density"]) / len(a["decode_density"]))
            out.append(row)
    return out


def run(args) -> dict:
    t_start = time.perf_counter()
    cuda = torch.cuda.is_available() and args.device != "cpu"
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    out_dir = args.out
    if args.quick and out_dir is None:  # never overwrite the committed results with a smoke run
        out_dir = Path(tempfile.mkdtemp(prefix="rtpurbo_accuracy_quick_"))
    deadline = t_start + args.deadline_minutes * 60 if args.deadline_minutes else None
    late = lambda: deadline is not None and time.perf_counter() > deadline  # noqa: E731
    stamp = lambda: f"[{time.perf_counter() - t_start:.0f} s]"  # noqa: E731

    # -- model
    model_dir = args.model
    train_s = 0.0
    if model_dir is None:
        minutes = args.train_minutes if args.train_minutes is not None else (0.08 if args.quick else None)
        if minutes is None:
            raise SystemExit("give --model DIR (from train_task_model.py) or --train-minutes M")
        model_dir = args.model_out or str(Path(out_dir if out_dir is not None else ".") / "task_model")
        t = time.perf_counter()
        ttm.main(shlex.split(args.train_args) + ["--minutes", str(minutes), "--out", model_dir]
                 + (["--quick"] if args.quick else []))
        train_s = time.perf_counter() - t
    report = ttm.read_report(model_dir)
    model = ttm.load_task_model(model_dir, device, dtype)
    trained_to = int(report["train"].get("final_max_context") or report["train"]["max_context"])
    if args.lengths:
        lengths = sorted(int(x) for x in args.lengths.split(","))
    elif args.quick:
        lengths = [128, int(report["train"]["max_context"])]
    else:
        lengths, n = [], 512
        while n < trained_to:
            lengths.append(n)
            n *= 2
        lengths.append(trained_to)
    lengths = sorted(set(lengths))
    if lengths[-1] + 8 > model.max_seq_len:
        raise SystemExit(f"context {lengths[-1]} does not fit the model's max_seq_len {model.max_seq_len}")
    print(f"model {model_dir}: {report['params'] / 1e6:.1f}M parameters, trained up to {trained_to} tokens "
          f"({report['train']['steps']} steps, {report['train']['tokens_seen'] / 1e6:.0f}M tokens); "
          f"contexts {lengths}", flush=True)
    jitter = args.jitter if args.jitter is not None else (16 if args.quick else 128)
    eval_kw = dict(rows=args.rows, prefill_tokens=args.prefill_tokens, jitter=jitter)

    # -- dense accuracy everywhere first (cheap); calibrate at the longest context the model handles
    dense: dict[tuple[str, int], tuple[list[bool], list[bool], float]] = {}
    for L in sorted(lengths, reverse=True):
        for task in ttm.EVAL_TASKS:
            t = time.perf_counter()
            hits, first = generate_answers(model, task, L, args.examples, **eval_kw)
            dense[(task, L)] = (hits, first, time.perf_counter() - t)
            print(f"dense {task:>17} @ {L:5d}: {sum(hits) / len(hits):.3f} (n={len(hits)}) {stamp()}", flush=True)
    best_acc = {L: max(sum(dense[(t, L)][0]) / len(dense[(t, L)][0]) for t in ttm.EVAL_TASKS) for L in lengths}
    handled = [L for L in lengths if best_acc[L] >= args.handled]
    calib_len = args.calibration_context or (max(handled) if handled else lengths[-1])
    print(f"longest context where a task's dense accuracy is >= {args.handled}: {max(handled) if handled else None}; "
          f"calibrating at {calib_len}", flush=True)

    # -- RTPurbo configurations: defaults scaled to the calibration context (local window = 1/16 of it)
    quick = args.quick
    base = dict(top_p=args.top_p, decode_block=16 if quick else args.decode_block,
                prefill_block=16 if quick else args.prefill_block, ret_window=16 if quick else args.ret_window)
    configs = parse_configs(args.configs or ("ratio=0.5" if quick else "ratio=0.15;ratio=0.25"))
    rt_configs = {}
    for c in configs:
        kw = {**base, **{k: v for k, v in c.items() if k != "ratio"}}
        if args.window is not None and "window" not in kw:
            kw["window"] = args.window
        rt_configs[config_name(c)] = RTPurboConfig.for_context(
            calib_len, retrieval_ratio=c.get("ratio", 0.15), impl=args.decode_impl, prefill_impl=args.prefill_impl,
            **kw)

    # -- calibration: profile once, fit one indexer per (block, top_p) for the largest head set
    t = time.perf_counter()
    seqs = calibration_sequences(calib_len, args.profile_seqs)
    if args.head_scores == "ablation":  # the smallest window and sinks of the configurations: the strictest test
        scores = ablation_scores(model, seqs, window=min(c.window for c in rt_configs.values()),
                                 sinks=min(c.num_sinks for c in rt_configs.values()))
    else:
        scores = head_scores(model, seqs)
    ratios = sorted({c.retrieval_ratio for c in rt_configs.values()})
    meta = {"method": f"{args.head_scores}; task spans (kv pair / question; vt statement / question; vt number / answer)",
            "num_sequences": len(seqs), "seq_len": calib_len + 1}
    big = HeadProfile.from_scores(scores, ratios[-1], meta=meta)
    fits: dict[tuple[int, float], tuple[IndexerWeights, object]] = {}
    fseqs = fit_sequences(calib_len, args.fit_seqs)
    for c in rt_configs.values():
        key = (c.decode_block, c.top_p)
        if key not in fits:
            fits[key] = fit_indexer(model, big, fseqs, steps=args.fit_steps, dim=c.indexer_dim, block=c.decode_block,
                                    top_p=c.top_p, queries_per_seq=args.queries_per_seq, lr=args.fit_lr)
            print(f"indexer fit (block {key[0]}, top_p {key[1]}), {args.fit_steps} steps {stamp()}:\n"
                  f"{fits[key][1].table()}", flush=True)
    calibration = {"seconds": round(time.perf_counter() - t, 1), "context": calib_len,
                   "profile_sequences": len(seqs), "fit_sequences": len(fseqs), "fit_steps": args.fit_steps,
                   "queries_per_seq": args.queries_per_seq, "head_scores": scores.tolist(), "configs": {}}
    variants = {}
    for name, c in rt_configs.items():
        prof = HeadProfile.from_scores(scores, c.retrieval_ratio, meta=meta)
        w_big, rep = fits[(c.decode_block, c.top_p)]
        w = subset_indexer(big, prof, w_big)
        heads = {(l, h) for l in range(prof.num_layers) for h in prof.retrieval_heads(l)}
        hr = [h for h in rep.heads if (h.layer, h.kv_head) in heads]
        mean = lambda k: sum(getattr(h, k) for h in hr) / len(hr) if hr else float("nan")  # noqa: E731
        calibration["configs"][name] = {
            "rtpurbo_config": {k: getattr(c, k) for k in c.__dataclass_fields__},
            "retrieval_heads": sorted([list(x) for x in heads]), "num_retrieval_heads": len(heads),
            "indexer_recall": mean("recall"), "indexer_mass": mean("mass"), "indexer_density": mean("density"),
            "kl_init": mean("kl_init"), "kl_final": mean("kl_final"),
            "per_head": [vars(h) for h in hr]}
        variants[name] = (prof, w, c)
        print(f"{name}: retrieval kv heads (layer, head) {sorted(heads)}; indexer recall {mean('recall'):.3f}, "
              f"mass {mean('mass'):.3f}, density {mean('density'):.3f}; window {c.window}, top_p {c.top_p}, "
              f"blocks {c.decode_block}/{c.prefill_block}, ret_window {c.ret_window}", flush=True)

    # -- RTPurbo accuracy and density, longest context first (what matters most is measured before a deadline)
    rows: list[dict] = []
    skipped: list[str] = []
    fallbacks: list[dict] = []
    hq = model.layers[0].attn.num_heads
    hkv = model.layers[0].attn.num_kv_heads
    sparse_models = {}
    for name, (prof, w, c) in variants.items():
        m = use_attention(copy.deepcopy(model), rtpurbo_attention(prof, w, c))
        for b in rtpurbo_backends(m):
            b.enable_stats()
        sparse_models[name] = m
    config_doc = dict(
        model_dir=Path(model_dir).name, dtype=str(dtype).replace("torch.", ""), device=str(device), lengths=lengths,
        examples=args.examples, jitter=jitter,
        tasks={t: repr(ttm.EVAL_TASKS[t](lengths[-1])) for t in ttm.EVAL_TASKS},
        eval_seed=ttm.EVAL_SEED, handled_threshold=args.handled, calibration_context=calib_len,
        decode_impl=args.decode_impl, prefill_impl=args.prefill_impl, quick=args.quick, heads=hq, kv_heads=hkv,
        layers=len(model.layers),
        note="greedy exact match through the RolloutEngine (compile off); density: fraction of the visible KV "
             "read per query (decode: measured per query; prefill: retrieval heads' kept/causal blocks, all "
             "heads adds the local heads' sinks + window exactly); first_acc: the first answer token alone "
             "(produced by prefill); context: the longest prompt of a row, its examples spread over the "
             "jitter below it")
    dense_rows = []
    for L in lengths:
        for t in ttm.EVAL_TASKS:
            hits, first, secs = dense[(t, L)]
            acc = sum(hits) / len(hits)
            dense_rows.append(dict(task=t, context=L, n=len(hits), accuracy=acc,
                                   se=ttm.binomial_se(acc, len(hits)), first_acc=sum(first) / len(first),
                                   seconds=round(secs, 2)))

    def save(final: bool) -> None:
        trained = {k: report[k] for k in ("model", "params", "train", "accuracy") if k in report}
        extra = {"summary": summarise(rows, args.handled, calibration), "dense": dense_rows,
                 "calibration": calibration, "model": trained,
                 "skipped": skipped, "kernel_fallbacks": fallbacks, "train_s": round(train_s, 1),
                 "seconds": round(time.perf_counter() - t_start, 1), "complete": final}
        write_json(NAME, config_doc, rows, out_dir=out_dir, extra=extra)

    for L in sorted(lengths, reverse=True):
        for task in ttm.EVAL_TASKS:
            d_hits, d_first, _ = dense[(task, L)]
            dacc = sum(d_hits) / len(d_hits)
            for name in list(sparse_models):
                m = sparse_models[name]
                if late():
                    skipped.append(f"{name}:{task}@{L}")
                    continue
                prof, w, c = variants[name]
                collect_selection_stats(m, reset=True)
                t = time.perf_counter()
                try:
                    hits, first = generate_answers(m, task, L, args.examples, **eval_kw)
                except Exception as e:  # a kernel that fails here: fall back to the PyTorch reference path
                    if c.impl == "reference" and c.prefill_impl == "reference":
                        raise
                    print(f"{name}: {type(e).__name__}: {str(e)[:300]} -- retrying with the reference kernels",
                          flush=True)
                    fallbacks.append({"config": name, "task": task, "context": L,
                                      "error": f"{type(e).__name__}: {str(e)[:500]}"})
                    c = replace(c, impl="reference", prefill_impl="reference")
                    variants[name] = (prof, w, c)
                    m = use_attention(copy.deepcopy(model), rtpurbo_attention(prof, w, c))
                    for b in rtpurbo_backends(m):
                        b.enable_stats()
                    sparse_models[name] = m
                    t = time.perf_counter()
                    hits, first = generate_answers(m, task, L, args.examples, **eval_kw)
                t_sparse = time.perf_counter() - t
                st = collect_selection_stats(m, reset=True)
                sacc = sum(hits) / len(hits)
                n_ret = int(prof.retrieval.sum())
                n_all = prof.retrieval.numel()
                loc = local_prefill_fraction(L + 1, c.window, c.num_sinks)
                pre_ret = st["prefill_ret_density"] if n_ret else 0.0
                rows.append(dict(
                    config=name, task=task, context=L, n=len(hits), dense_acc=dacc,
                    dense_se=ttm.binomial_se(dacc, len(hits)), sparse_acc=sacc,
                    sparse_se=ttm.binomial_se(sacc, len(hits)), **paired(d_hits, hits),
                    dense_first_acc=sum(d_first) / len(d_first), sparse_first_acc=sum(first) / len(first),
                    decode_density=st["decode_density"], decode_ret_density=st["decode_ret_density"],
                    prefill_ret_density=st["prefill_ret_density"],
                    prefill_density=(n_ret * pre_ret + (n_all - n_ret) * loc) / n_all,
                    window=c.window, window_frac=c.window / (L + 1), retrieval_heads=n_ret, impl=c.impl,
                    prefill_impl=c.prefill_impl,
                    sparse_s=round(t_sparse, 2)))
                r = rows[-1]
                print(f"{task:>17} @ {L:5d}  dense {dacc:.3f}  {name} {sacc:.3f}  (n={len(hits)}, "
                      f"delta {r['delta']:+.3f} +- {r['delta_se']:.3f}; first token {r['dense_first_acc']:.3f} -> "
                      f"{r['sparse_first_acc']:.3f})  decode density {r['decode_density']:.3f} "
                      f"(retrieval heads {r['decode_ret_density']:.3f}), prefill {r['prefill_density']:.3f} "
                      f"{stamp()}", flush=True)
        save(final=False)
    save(final=True)
    print()
    print_table(rows, ["config", "task", "context", "n", "dense_acc", "sparse_acc", "delta", "delta_se",
                       "sparse_first_acc", "decode_density", "decode_ret_density", "prefill_density"])
    print()
    summary = summarise(rows, args.handled, calibration)
    print_table(summary, ["config", "task", "longest_handled", "n", "dense_acc", "sparse_acc", "delta", "delta_se",
                          "within_1pt", "decode_density", "indexer_recall", "window"])
    if skipped:
        print(f"skipped at the deadline: {skipped}")
    return {"rows": rows, "summary": summary, "calibration": calibration, "dense": dense_rows, "out": out_dir}


def plot(result: dict, png_path: Path) -> None:
    import matplotlib.pyplot as plt

    rows = result["rows"]
    tasks = sorted({r["task"] for r in rows})
    configs = sorted({r["config"] for r in rows})
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 4), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        rs = [r for r in rows if r["task"] == task]
        ctx = sorted({r["context"] for r in rs})
        first = {c: next(r for r in rs if r["context"] == c) for c in ctx}
        ax.errorbar(ctx, [first[c]["dense_acc"] for c in ctx], yerr=[first[c]["dense_se"] for c in ctx],
                    marker="o", color="black", label="dense", capsize=3)
        ax2 = ax.twinx()
        for i, cfg in enumerate(configs):
            pts = sorted((r["context"], r) for r in rs if r["config"] == cfg)
            color = f"C{i}"
            ax.errorbar([p[0] for p in pts], [p[1]["sparse_acc"] for p in pts],
                        yerr=[p[1]["sparse_se"] for p in pts], marker="s", color=color, capsize=3,
                        label=f"RTPurbo {cfg}")
            ax2.plot([p[0] for p in pts], [p[1]["decode_density"] for p in pts], ls="--", marker=".", color=color,
                     alpha=0.6)
        ax.set_xscale("log", base=2)
        ax.set_ylim(-0.02, 1.02)
        ax2.set_ylim(0, 1)
        ax2.set_ylabel("decode density (dashed)")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("greedy exact-match accuracy")
        ax.set_title(task)
        ax.legend(fontsize=7, loc="lower left")
    save_figure(fig, png_path, "RTPurbo vs dense on a model trained on the tasks")


def build_parser():
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="trained model folder (train_task_model.py --out)")
    p.add_argument("--train-minutes", type=float, default=None, help="train a model first, for this long")
    p.add_argument("--model-out", default=None, help="where --train-minutes saves the model (default OUT/task_model)")
    p.add_argument("--train-args", default="", help="more train_task_model.py options for --train-minutes, "
                                                    "e.g. '--max-context 4096 --lr 2e-3'")
    p.add_argument("--device", default="auto")
    p.add_argument("--lengths", default="", help="comma-separated contexts (default 512, 1024, ... trained max)")
    p.add_argument("--examples", type=int, default=None, help="held-out examples per task and context")
    p.add_argument("--configs", default="",
                   help="';'-separated RTPurbo variants, e.g. 'ratio=0.15;ratio=0.25,top_p=0.95' (keys: "
                        + ", ".join(CONFIG_KEYS) + "; default 'ratio=0.15;ratio=0.25')")
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--decode-block", type=int, default=64)
    p.add_argument("--prefill-block", type=int, default=128)
    p.add_argument("--ret-window", type=int, default=128)
    p.add_argument("--window", type=int, default=None, help="local window (default 1/16 of the longest context)")
    p.add_argument("--decode-impl", default="auto", choices=["auto", "reference", "triton"])
    p.add_argument("--prefill-impl", default="reference", choices=["auto", "reference", "flex"],
                   help="reference: same selection with dense masks (no FlexAttention compilation)")
    p.add_argument("--profile-seqs", type=int, default=None, help="examples per task for head profiling")
    p.add_argument("--head-scores", default="ablation", choices=["ablation", "attention"],
                   help="how retrieval heads are chosen: loss when a head is made local, or attention mass")
    p.add_argument("--fit-seqs", type=int, default=None)
    p.add_argument("--fit-steps", type=int, default=None)
    p.add_argument("--fit-lr", type=float, default=3e-3)
    p.add_argument("--queries-per-seq", type=int, default=None)
    p.add_argument("--jitter", type=int, default=None,
                   help="example i of context L has L - (37 i mod JITTER) characters (default 128; 0: exactly L)")
    p.add_argument("--rows", type=int, default=64, help="engine rows (prompts decoded at once)")
    p.add_argument("--prefill-tokens", type=int, default=32768)
    p.add_argument("--handled", type=float, default=0.9, help="dense accuracy that counts as handling a context")
    p.add_argument("--calibration-context", type=int, default=None,
                   help="calibrate (and scale the window) at this context (default: the longest handled)")
    p.add_argument("--deadline-minutes", type=float, default=None,
                   help="minutes after the start (training included) past which the remaining RTPurbo rows are "
                        "skipped (the results so far are written)")
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    q = args.quick
    defaults = dict(examples=(8 if q else 200), profile_seqs=(2 if q else 8), fit_seqs=(2 if q else 8),
                    fit_steps=(20 if q else 300), queries_per_seq=(64 if q else 256))
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return run(args)


if __name__ == "__main__":
    main()

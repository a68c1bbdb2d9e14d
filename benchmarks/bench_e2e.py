"""End to end: GRPO with and without Sparrow's techniques, same model, data, seeds and steps, in one process.

Question: how much faster does a GRPO step run with RTPurbo sparse rollout attention, self-speculative
decoding and sparse weight sync switched on, what does each technique contribute on its own, and does the
training signal (reward, held-out accuracy, the rollout/trainer mismatch) stay the same?

Model and workload. The task model of ``train_task_model.py`` (``--model DIR``, or ``--train-minutes M``
trains one first in this process), a Qwen2 model over the character vocabulary of
:class:`~sparrow.rl.CharTokenizer`. Its bf16 shards are merged into one safetensors file, the recipe's
``checkpoint``. Task: :class:`~sparrow.rl.KVRetrieval` (or ``--task variable_tracking``, or ``--task kv_list``:
:class:`~sparrow.rl.KVListRetrieval`, up to 32 keys asked at once, response lengths with a long tail up to
128 tokens, where decoding and speculation matter; train the model with the ``kvl`` family in its mix for it,
e.g. ``--train-args "--mix kv_mq=0.3,kv_vary_mq=0.1,vt_mq=0.2,kv=0.1,vt=0.1,kvl=0.2"``; ``--max-asked 256``
with the ``kvl_long`` family: responses up to 1K tokens, so that decoding weighs more in a step) with prompts of
``--context`` characters (= tokens, plus ``<bos>``), exact-match reward (``--reward``), ``--prompts-per-step`` x
``--group`` samples per step at temperature 1, at most ``--max-new`` new tokens.

Runs. The GRPO recipe (``recipes/sparrow_grpo.py``, :class:`GRPORecipe`: setup, train, cleanup) once per
configuration and seed, all in this process, each from the same checkpoint, data order and sampling seeds:

* ``all_off``: dense attention, autoregressive decoding, dense sync codec;
* ``all_on``: RTPurbo attention (calibrated once, before the runs), speculative decoding (int8 self-drafter,
  ``--spec-toggle``, ``--draft-lengths``), sparse sync (``sync.codec: auto``);
* ``rtpurbo_only``, ``spec_only``, ``sparse_sync_only``: one technique on.

Every run uses the same engine settings (``compile`` + CUDA graphs on a GPU) and the same trainer (by default
``shared_prefix``: each prompt computed once per group, the same log-probs and gradients as one row per sample,
so the long prompts do not make the trainer G times the work; ``--no-shared-prefix`` for one row per sample).
Compiled code is dropped between runs (``torch.compiler.reset()``), so each run compiles its own steps, in its
first ``--warmup-steps`` steps, which the timed figures leave out. Held-out greedy accuracy is measured at the
start and at the end only (``eval.every = steps``): the recipe evaluates through the rollout engine, so it
uses the run's attention. RTPurbo calibration: retrieval heads chosen by ablation
(``sparrow.calibrate.ablation_scores``) and indexer distillation on task sequences at ``--context``, with the
calibration data of ``bench_rtpurbo_accuracy.py``.

Reported, per step (``steps`` in the JSON) and per run (``rows``): seconds per phase (``time/prefill_s``,
``time/decode_s``, ``time/logprob_s``, ``time/train_s``, ``time/sync_s``, ``time/rollout_s``,
``time/step_s``, drafter refresh, sync apply), rollout tokens/s, reward, ``mismatch_kl`` and
``is_clip_frac`` of the GRPO loss, speculative acceptance, sync bytes on the wire and dense, attention
density, the run's wall clock over the timed steps (``wall_s``) and over all steps (``wall_s_all``), and
whether a step compiled or captured graphs (``compiled`` per step, ``compiled_timed_steps`` per run: the recipe
compiles at setup, so a timed step that compiles is flagged, and logged as a warning).
Attention density is recorded by the recipe only when the decode step is not compiled; for compiled runs,
``--density-probe`` runs one uncompiled ``all_on`` step after the timed runs (toggle ``always``) to measure
it. Summary (``summary``), per configuration over seeds: median step time, the speedup all_off / config
(step and rollout), mean reward over the last half of the steps, final held-out accuracy. Single process:
sync travels through an in-process queue, so ``time/sync_s`` is encode + verify work and the bytes saved
by the sparse codec are reported, not timed on a link.

The JSON (``docs/benchmarks/e2e.json`` or ``--out``) is rewritten after every finished run; past
``--deadline-minutes`` (counted from the start, model training included) a run that would not finish in
time, judged by the longest finished run, is skipped and listed in ``skipped``. ``plot()`` draws reward
against step and against cumulative timed wall-clock seconds, one line per configuration and seed.

Usage (H200): ``python benchmarks/train_task_model.py --minutes 6 --out task_model`` once, then, for a
9-minute slot, ``python benchmarks/bench_e2e.py --model task_model --steps 6 --deadline-minutes 8.5
--density-probe`` (the deadline skips what would not fit; ``--context auto`` runs at the longest context the
model handles, from its accuracy table). CPU smoke run (a tiny model trained for seconds,
context 256, 2 steps, compile off, character-accuracy reward; figures mean nothing):
``python benchmarks/bench_e2e.py --quick``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from runner import (  # noqa: E402
    REPO, base_parser, batch_buckets, print_table, save_figure, triton_interpreter_without_cuda, write_json,
)

triton_interpreter_without_cuda()  # before anything imports triton
import bench_rtpurbo_accuracy as acc  # noqa: E402
import train_task_model as ttm  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from sparrow.rl.recipe_config import RECIPE_KEYS, check_config  # noqa: E402

NAME = "e2e"
# configuration -> which techniques are on
CONFIGS: dict[str, dict[str, bool]] = {
    "all_off": {"rtpurbo": False, "spec": False, "sparse_sync": False},
    "all_on": {"rtpurbo": True, "spec": True, "sparse_sync": True},
    "rtpurbo_only": {"rtpurbo": True, "spec": False, "sparse_sync": False},
    "spec_only": {"rtpurbo": False, "spec": True, "sparse_sync": False},
    "sparse_sync_only": {"rtpurbo": False, "spec": False, "sparse_sync": True},
}
TASKS = {"kv_retrieval": "sparrow.rl.KVRetrieval", "variable_tracking": "sparrow.rl.VariableTracking",
         "kv_list": "sparrow.rl.KVListRetrieval"}
REWARDS = {"exact_match": "sparrow.rl.ExactMatch", "char_accuracy": "sparrow.rl.CharAccuracy"}
PHASES = ("prefill", "decode", "logprob", "train", "sync", "sync_apply", "drafter_refresh", "rollout", "step")


def log(msg: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)


# -- setup: model, merged checkpoint, RTPurbo calibration, recipe configs ---------------------------------

def prepare_model(args, work: Path) -> tuple[str, dict, float]:
    """The task-model folder (trained now with ``--train-minutes``), its report and the training seconds."""
    if args.model is not None:
        return args.model, ttm.read_report(args.model), 0.0
    minutes = args.train_minutes if args.train_minutes is not None else (0.05 if args.quick else None)
    if minutes is None:
        raise SystemExit("give --model DIR (from train_task_model.py) or --train-minutes M")
    model_dir = args.model_out or str(work / "task_model")
    t = time.perf_counter()
    ttm.main(shlex.split(args.train_args) + ["--minutes", str(minutes), "--out", model_dir]
             + (["--quick"] if args.quick else []))
    return model_dir, ttm.read_report(model_dir), time.perf_counter() - t


def merge_shards(model_dir: str, report: dict, path: Path) -> Path:
    """The model's safetensors shards as one file (the recipe's ``checkpoint``)."""
    from safetensors.torch import save_file

    save_file(ttm.load_shards(model_dir, report), str(path))
    return path


def calibrate_rtpurbo(model_dir: str, args, device: torch.device, out: Path) -> dict:
    """Profile retrieval heads and fit the indexer on task sequences at ``--context``; save to ``out``."""
    from sparrow.attention.rtpurbo import HeadProfile, RTPurboConfig
    from sparrow.calibrate import ablation_scores, fit_indexer, save_rtpurbo

    t = time.perf_counter()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = ttm.load_task_model(model_dir, device, dtype)
    blocks = dict(decode_block=16, prefill_block=16, ret_window=16) if args.quick else {}
    cfg = RTPurboConfig.for_context(args.context, retrieval_ratio=args.ratio, top_p=args.top_p,
                                    dense_prefill_below=args.dense_prefill_below,
                                    impl=args.decode_impl, prefill_impl=args.prefill_impl, **blocks)
    # heads chosen by what making them local changes in the answers (see bench_rtpurbo_accuracy.py)
    scores = ablation_scores(model, acc.calibration_sequences(args.context, args.profile_seqs), window=cfg.window,
                             sinks=cfg.num_sinks)
    profile = HeadProfile.from_scores(scores, cfg.retrieval_ratio, meta={"method": "ablation"})
    indexer, report = fit_indexer(model, profile, acc.fit_sequences(args.context, args.fit_seqs), steps=args.fit_steps,
                                  dim=cfg.indexer_dim, block=cfg.decode_block, top_p=cfg.top_p,
                                  queries_per_seq=args.queries_per_seq, lr=args.fit_lr)
    summary = report.summary()
    save_rtpurbo(out, profile, indexer, config=cfg, report=summary)
    del model
    heads = sorted([layer, h] for layer in range(profile.num_layers) for h in profile.retrieval_heads(layer))
    return {"seconds": round(time.perf_counter() - t, 1), "context": args.context, "retrieval_heads": heads,
            "rtpurbo_config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}, "indexer": summary}


def base_config(args, report: dict, checkpoint: Path, device: torch.device) -> dict:
    """The recipe config every run starts from (all techniques off)."""
    cuda = device.type == "cuda"
    rows = args.group * args.prompts_per_step
    return {
        "name": "bench_e2e", "output_dir": None, "seed": 0, "device": str(device),
        "trainer_precision": "bf16-mixed" if cuda else "fp32", "dist_timeout_s": 600,
        "tokenizer": {"_component_": "sparrow.rl.CharTokenizer"},
        "task": {"_component_": TASKS[args.task], "context_len": args.context,
                 **({"max_asked": args.max_asked} if args.max_asked else {})},
        "reward": {"_component_": REWARDS[args.reward]},
        "model": {"_component_": "sparrow.models.qwen2", **report["model"]},
        "checkpoint": str(checkpoint),
        "attention": {"_component_": "sparrow.attention.dense"},
        "engine": {"max_rows": rows, "max_prompts": max(args.prompts_per_step, min(args.eval_prompts, rows)),
                   "max_prompt_len": args.context + 1, "max_new_tokens": args.max_new, "sync_every": args.sync_every,
                   "compile": args.compile, "cuda_graphs": args.compile and cuda,
                   # speculation captures a draft and a verify graph per bucket and draft length
                   "batch_buckets": batch_buckets(rows, args.bucket_growth)},
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": args.max_new},
        "group_size": args.group, "prompts_per_step": args.prompts_per_step, "ppo_epochs": 1,
        "minibatches": args.minibatches, "micro_batch_size": args.micro_batch, "logprob_chunk": 4096,
        "shared_prefix": args.shared_prefix, "max_grad_norm": 1.0,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": args.lr, "betas": [0.9, 0.999], "weight_decay": 0.0,
                      **({"fused": True} if cuda else {})},
        "loss": {"clip_low": 0.2, "clip_high": 0.28, "aggregation": "token_mean", "advantage_scale": "group",
                 "kl_beta": 0.0, "is_level": "token", "is_threshold": 2.0, "is_mode": "truncate"},
        "sync": {"codec": "dense", "bucket_bytes": 256 << 20, "anchor_every": 0, "verify": True,
                 "check_bitwise": args.steps},  # bit-exactness checked once, at the last step
        "total_steps": args.steps, "checkpoint_every": 0, "resume_from_checkpoint": False,
        # held-out accuracy at the start and at the end (--eval-prompts 0: none)
        "eval": {"every": args.steps if args.eval_prompts else 0, "prompts": max(1, args.eval_prompts)},
        "metric_logger": {"_component_": "sparrow.rl.JsonlLogger", "log_dir": None},
        "plot": False,
    }


def run_config(base: dict, name: str, seed: int, args, rtpurbo_dir: Path, work: Path) -> dict:
    """``base`` with configuration ``name``'s techniques switched on, for ``seed``."""
    on = CONFIGS[name]
    cfg = copy.deepcopy(base)
    cfg["seed"] = seed
    cfg["output_dir"] = str(work / f"{name}_seed{seed}")
    cfg["metric_logger"]["log_dir"] = cfg["output_dir"]
    if on["rtpurbo"]:
        cfg["attention"] = {"_component_": "sparrow.attention.rtpurbo", "path": str(rtpurbo_dir)}
        if args.indexer_refresh_every:
            cfg["indexer_refresh"] = {"every": args.indexer_refresh_every, "steps": 20, "sequences": 8}
    if on["spec"]:
        drafter = {"_component_": "sparrow.speculative.DrafterConfig", "weight": args.draft_weight}
        if args.draft_window and not on["rtpurbo"]:  # a windowed draft needs dense caches
            drafter["window"] = args.draft_window
        lengths = [int(x) for x in args.draft_lengths.split(",") if x]
        cfg["speculative"] = speculative_section(drafter, args.spec_toggle, lengths, args.max_active)
    if on["sparse_sync"]:
        cfg["sync"]["codec"] = "auto"
    return cfg


# -- run --------------------------------------------------------------------------------------------------

def recipe_class():
    try:
        from sparrow_grpo import GRPORecipe
    except ImportError:  # not installed: the recipe file itself
        sys.path.insert(0, str(REPO / "recipes"))
        from sparrow_grpo import GRPORecipe
    return GRPORecipe


def run_recipe(cfg_dict: dict) -> dict:
    """setup -> train -> cleanup of one recipe config; every logged metrics dict and the phase times."""
    cfg = OmegaConf.create(cfg_dict)
    _free_memory()  # what an earlier (failed) run left behind
    torch.compiler.reset()  # each run compiles its own steps (and never meets the recompile limit)
    t0 = time.perf_counter()
    recipe = recipe_class()(cfg)
    try:
        recipe.setup(cfg)
        setup_s = time.perf_counter() - t0
        recipe.train()
        recipe.cleanup()
        records = list(recipe.metric_logger.records)
    finally:
        if getattr(recipe, "metric_logger", None) is not None:
            recipe.metric_logger.close()
        del recipe
        _free_memory()
    return {"records": records, "setup_s": setup_s, "run_s": time.perf_counter() - t0}


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- summarise --------------------------------------------------------------------------------------------

def _median(xs):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return statistics.median(xs) if xs else None


def _mean(xs):
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(xs) / len(xs) if xs else None


def _ratio(a, b):
    return a / b if a is not None and b else None


COMPILE_COUNTS = ("compile/graphs", "engine/captured_graphs")  # cumulative counts the recipe logs per step


def step_records(name: str, seed: int, records: list[dict], warmup: int) -> list[dict]:
    """One row per training step with its metrics, cumulative wall clock (all steps, and timed steps only), and
    ``compiled``: whether the step compiled or captured graphs (a count of :data:`COMPILE_COUNTS` grew over the
    step before; None for the first step or when the recipe logs no counts)."""
    out, wall, timed_wall, last = [], 0.0, 0.0, None
    for r in records:
        if "time/step_s" not in r:
            continue  # the start-of-run evaluation
        timed = r["step"] > warmup
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


def run_row(name: str, seed: int, steps: list[dict], records: list[dict], timing: dict) -> dict:
    """The run's summary: median phase times over the timed steps, means of the training signals."""
    timed = [s for s in steps if s["timed"]] or steps
    col = lambda key, rows=timed: [s.get(key) for s in rows]  # noqa: E731
    evals = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    on = CONFIGS[name]
    row: dict[str, Any] = {"config": name, "seed": seed, "rtpurbo": on["rtpurbo"], "speculative": on["spec"],
                           "sparse_sync": on["sparse_sync"], "steps": len(steps), "timed_steps": len(timed),
                           "compiled_timed_steps": sum(bool(s.get("compiled")) for s in timed)}
    for ph in PHASES:
        row[f"{ph}_s"] = _median(col(f"time/{ph}_s"))
    row["median_step_s"] = row.pop("step_s")
    row.update(
        mean_step_s=_mean(col("time/step_s")),
        wall_s=sum(col("time/step_s")), wall_s_all=sum(col("time/step_s", steps)),
        setup_s=timing["setup_s"], run_s=timing["run_s"],
        rollout_tokens_per_s=_median(col("rollout/tokens_per_s")),
        response_len=_mean(col("response/len_mean", steps)),
        reward_mean=_mean(col("reward/mean", steps)),
        reward_last_half=_mean(col("reward/mean", steps[len(steps) // 2:])),
        eval_start=evals[0] if len(evals) > 1 else None, eval_final=evals[-1] if evals else None,
        mismatch_kl=_mean(col("mismatch_kl", steps)), is_clip_frac=_mean(col("is_clip_frac", steps)),
        policy_clip_frac=_mean(col("policy_clip_frac", steps)),
        # steps that ran no speculative cycle measured no acceptance (the toggle kept SD off): left out
        spec_acceptance=_mean([r.get("spec/acceptance") for r in steps if r.get("spec/cycles")]),
        spec_tokens_per_cycle=_mean([r.get("spec/tokens_per_cycle") for r in steps if r.get("spec/cycles")]),
        spec_cycles=sum(r.get("spec/cycles") or 0 for r in steps) if any("spec/cycles" in r for r in steps) else None,
        decode_density=_mean(col("attention/decode_density", steps)),
        decode_ret_density=_mean(col("attention/decode_ret_density", steps)),
        prefill_ret_density=_mean(col("attention/prefill_ret_density", steps)),
        sync_wire_mb=_mean([x / 1e6 for x in col("sync/wire_bytes", steps) if x is not None]),
        sync_dense_mb=_mean([x / 1e6 for x in col("sync/dense_bytes", steps) if x is not None]),
    )
    row["sync_ratio"] = _ratio(row["sync_dense_mb"], row["sync_wire_mb"])
    return row


def add_speedups(rows: list[dict]) -> None:
    """speedup = all_off's median step time / this run's (same seed); rollout_speedup likewise."""
    base = {r["seed"]: r for r in rows if r["config"] == "all_off"}
    for r in rows:
        b = base.get(r["seed"])
        r["speedup"] = _ratio(b["median_step_s"], r["median_step_s"]) if b else None
        r["rollout_speedup"] = _ratio(b["rollout_s"], r["rollout_s"]) if b else None


def summarise(rows: list[dict], steps: list[dict]) -> list[dict]:
    """Per configuration, over its seeds: median of the pooled timed step times and the speedup against
    all_off, mean reward over the last half of the steps, final held-out accuracy."""
    out = []
    med = {}
    for name in CONFIGS:
        rs = [r for r in rows if r["config"] == name]
        if not rs:
            continue
        ts = [s for s in steps if s["config"] == name and s["timed"]]
        med[name] = (_median([s["time/step_s"] for s in ts]), _median([s.get("time/rollout_s") for s in ts]))
        mean = lambda key: _mean([r[key] for r in rs])  # noqa: E731
        out.append({"config": name, "seeds": len(rs), "median_step_s": med[name][0], "median_rollout_s": med[name][1],
                    **{k: mean(k) for k in ("wall_s", "reward_last_half", "eval_start", "eval_final", "mismatch_kl",
                                            "is_clip_frac", "spec_acceptance", "decode_density", "sync_wire_mb")}})
    if "all_off" in med:
        for s in out:
            s["speedup"] = _ratio(med["all_off"][0], s["median_step_s"])
            s["rollout_speedup"] = _ratio(med["all_off"][1], s["median_rollout_s"])
    return out


# -- main -------------------------------------------------------------------------------------------------

def speculative_section(drafter: dict, toggle: str, lengths: list[int], max_active: int) -> dict:
    """The recipe's ``speculative`` section with the keys ``toggle`` reads (the recipe refuses any other)."""
    if toggle == "always":
        return {"drafter": drafter, "toggle": toggle, "num_draft": max(lengths)}
    if toggle == "threshold":
        return {"drafter": drafter, "toggle": toggle, "num_draft": max(lengths), "draft_lengths": lengths,
                "max_active": max_active}
    return {"drafter": drafter, "toggle": toggle, "draft_lengths": lengths}


def density_probe(base: dict, seed: int, args, rtpurbo_dir: Path, work: Path) -> dict:
    """One uncompiled step of all_on (toggle ``always``): the attention density the compiled runs cannot record."""
    cfg = run_config(base, "all_on", seed, args, rtpurbo_dir, work / "probe")
    cfg["engine"].update(compile=False, cuda_graphs=False)
    cfg.update(total_steps=1, eval={"every": 0, "prompts": 1})
    cfg["sync"]["check_bitwise"] = 0
    spec = cfg["speculative"]
    cfg["speculative"] = speculative_section(spec["drafter"], "always", spec.get("draft_lengths") or
                                             [spec["num_draft"]], 0)
    out = run_recipe(cfg)
    step = [r for r in out["records"] if "time/step_s" in r][-1]
    return {"config": "all_on", "compile": False, "toggle": "always",
            **{k: v for k, v in step.items() if k.startswith(("attention/", "spec/", "time/prefill", "time/decode"))}}


def build_parser():
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="trained model folder (train_task_model.py --out)")
    p.add_argument("--merge", nargs="+", type=Path, default=None, metavar="JSON",
                   help="join finished results of this script (same settings, other seeds) into one, then stop")
    p.add_argument("--train-minutes", type=float, default=None, help="train a model first, for this long")
    p.add_argument("--model-out", default=None, help="where --train-minutes saves the model (default WORK/task_model)")
    p.add_argument("--train-args", default="", help="more train_task_model.py options for --train-minutes")
    p.add_argument("--work-dir", default=None, help="merged checkpoint, calibration, metric logs (default: a temp dir)")
    p.add_argument("--device", default="auto")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma list of " + ", ".join(CONFIGS))
    p.add_argument("--seeds", default="0", help="comma list, e.g. 0,1")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps per run (default 8; quick 2)")
    p.add_argument("--warmup-steps", type=int, default=1, help="first steps left out of the timed figures")
    p.add_argument("--task", default="kv_retrieval", choices=list(TASKS))
    p.add_argument("--context", type=_context, default=None,
                   help="prompt characters = tokens (default 8192; quick 256), or 'auto': the longest context at "
                        "which the model's held-out accuracy on the task (kv_retrieval for kv_list) reaches 0.5")
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompts-per-step", type=int, default=None, help="default 8; quick 2")
    p.add_argument("--max-new", type=int, default=None,
                   help="sampling max_new_tokens (default 8, quick 4; kv_list: its longest answer and <eos>)")
    p.add_argument("--max-asked", type=int, default=None,
                   help="kv_list: most keys asked at once (default the task's 32; 256 for responses up to 1K tokens, "
                        "with a model trained on the kvl_long family)")
    p.add_argument("--minibatches", type=int, default=2, help="policy updates per step (>1: a separate π_old pass)")
    p.add_argument("--micro-batch", type=int, default=32,
                   help="trainer rows per forward / backward (at 8, log-probs and training were 87%% of an H200 step)")
    p.add_argument("--shared-prefix", action=argparse.BooleanOptionalAction, default=True,
                   help="trainer computes each prompt once per group (recipe's shared_prefix; in every configuration)")
    p.add_argument("--reward", default=None, choices=list(REWARDS),
                   help="also the held-out score (default exact_match; quick char_accuracy: a signal for a tiny model)")
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default 1e-5; quick 1e-3)")
    p.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts (default 64; quick 8; 0: no eval)")
    p.add_argument("--sync-every", type=int, default=16, help="engine decode steps between host checks")
    p.add_argument("--bucket-growth", type=int, default=4, choices=[2, 4],
                   help="engine batch buckets are powers of this (4: about half the CUDA graphs of 2)")
    p.add_argument("--no-compile", dest="compile", action="store_false", default=None,
                   help="eager decode steps (default on CUDA: compile + CUDA graphs; CPU / quick: eager)")
    p.add_argument("--spec-toggle", default=None, choices=["always", "threshold", "cost_model"],
                   help="speculative toggle (default cost_model; quick always)")
    p.add_argument("--draft-lengths", default=None, help="comma list (default 2,4; quick 2)")
    p.add_argument("--draft-weight", default="int8", choices=["int8", "int4", "fp8", "none"])
    p.add_argument("--draft-window", type=int, default=0, help="windowed draft in spec_only (dense caches only)")
    p.add_argument("--max-active", type=int, default=32, help="threshold toggle: speculate at or below this many rows")
    p.add_argument("--ratio", type=float, default=None, help="RTPurbo retrieval-head ratio (default 0.25; quick 0.5)")
    p.add_argument("--dense-prefill-below", type=int, default=0,
                   help="RTPurbo prefills shorter prompts densely (decode stays sparse; 0: always sparse)")
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--decode-impl", default="auto", choices=["auto", "reference", "triton"])
    p.add_argument("--prefill-impl", default="auto", choices=["auto", "reference", "flex"])
    p.add_argument("--profile-seqs", type=int, default=None, help="calibration examples per task (default 8; quick 2)")
    p.add_argument("--fit-seqs", type=int, default=None, help="indexer fit sequences (default 8; quick 2)")
    p.add_argument("--fit-steps", type=int, default=None, help="indexer fit steps (default 200; quick 20)")
    p.add_argument("--fit-lr", type=float, default=3e-3)
    p.add_argument("--queries-per-seq", type=int, default=None, help="default 256; quick 64")
    p.add_argument("--indexer-refresh-every", type=int, default=0,
                   help="RTPurbo indexer refresh every N steps (0: off)")
    p.add_argument("--density-probe", action="store_true",
                   help="after the runs, one uncompiled all_on step to measure attention density (for compiled runs)")
    p.add_argument("--deadline-minutes", type=float, default=None,
                   help="skip runs that would end past this many minutes after the start")
    return p


def _context(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--context takes a number of tokens or 'auto', not {text!r}") from None


def handled_context(report: dict, task: str, bar: float = 0.5) -> int:
    """The longest context of the model's accuracy table at which the task's accuracy reaches ``bar`` (the
    shortest measured one if none does)."""
    name = "variable_tracking" if task == "variable_tracking" else "kv_retrieval"
    contexts = [r["context"] for r in report["accuracy"] if r["task"] == name]
    if not contexts:
        raise SystemExit(f"the model's report has no {name} accuracy: give --context explicitly")
    return ttm.longest_handled(report, bar, [name]) or min(contexts)


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.merge:
        return {"out": merge(args.merge, args.out)}
    q = args.quick
    defaults = dict(steps=2 if q else 8, context=256 if q else 8192, prompts_per_step=2 if q else 8,
                    max_new=None if args.task == "kv_list" else (4 if q else 8), eval_prompts=8 if q else 64,
                    spec_toggle="always" if q else "cost_model",
                    draft_lengths="2" if q else "2,4", ratio=0.5 if q else 0.25, profile_seqs=2 if q else 8,
                    fit_seqs=2 if q else 8, fit_steps=20 if q else 200, queries_per_seq=64 if q else 256,
                    reward="char_accuracy" if q else "exact_match", lr=1e-3 if q else 1e-5)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.max_asked is not None and (args.task != "kv_list" or args.max_asked < 1):
        raise SystemExit("--max-asked takes a positive number, with --task kv_list")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    if args.compile is None:
        args.compile = device.type == "cuda" and not q
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configs {unknown} (known: {list(CONFIGS)})")
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.warmup_steps >= args.steps:
        raise SystemExit(f"--warmup-steps ({args.warmup_steps}) leaves no timed step of --steps {args.steps}")
    return run(args, names, seeds, device)


def run(args, names: list[str], seeds: list[int], device: torch.device) -> dict:
    t_start = time.perf_counter()
    out_dir = args.out
    if args.quick and out_dir is None:  # never overwrite the committed results with a smoke run
        out_dir = Path(tempfile.mkdtemp(prefix="e2e_quick_"))
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="sparrow_e2e_"))
    work.mkdir(parents=True, exist_ok=True)
    deadline = t_start + args.deadline_minutes * 60 if args.deadline_minutes else None

    # -- setup
    model_dir, report, train_s = prepare_model(args, work)
    if args.context == "auto":
        args.context = handled_context(report, args.task)
        log(f"--context auto: {args.context} tokens (the longest the model handles)", t_start)
    if args.max_new is None:  # kv_list: room for the longest answer the task can ask for, and <eos>
        from sparrow.rl import KVListRetrieval

        kvl = KVListRetrieval(args.context, **({"max_asked": args.max_asked} if args.max_asked else {}))
        args.max_new = kvl.most_asked * (kvl.value_len + 1) + 1
    need = args.context + 1 + args.max_new
    if need > report["model"]["max_seq_len"]:
        raise SystemExit(f"context {args.context} + <bos> + {args.max_new} new tokens does not fit the model's "
                         f"max_seq_len {report['model']['max_seq_len']}")
    log(f"model {model_dir}: {report['params'] / 1e6:.1f}M parameters, trained to "
        f"{report['train'].get('final_max_context')} tokens", t_start)
    checkpoint = merge_shards(model_dir, report, work / "model.safetensors")
    calibration = None
    rtpurbo_dir = work / "rtpurbo"
    if any(CONFIGS[n]["rtpurbo"] for n in names):
        calibration = calibrate_rtpurbo(model_dir, args, device, rtpurbo_dir)
        log(f"RTPurbo calibrated in {calibration['seconds']} s: retrieval kv heads {calibration['retrieval_heads']}, "
            f"indexer recall {calibration['indexer']['recall']:.3f}, density {calibration['indexer']['density']:.3f}",
            t_start)
    base = base_config(args, report, checkpoint, device)
    for seed in seeds:  # every run's config is valid before any run starts
        for name in names:
            check_config(OmegaConf.create(run_config(base, name, seed, args, rtpurbo_dir, work)), RECIPE_KEYS)
    config_doc = dict(
        model_dir=Path(model_dir).name, params=report["params"], model=report["model"], device=str(device),
        configs=names, seeds=seeds, switches={n: CONFIGS[n] for n in names}, steps=args.steps,
        warmup_steps=args.warmup_steps, task=args.task, context=args.context, group=args.group,
        prompts_per_step=args.prompts_per_step, max_new=args.max_new, compile=args.compile, quick=args.quick,
        spec_toggle=args.spec_toggle, draft_lengths=args.draft_lengths, draft_weight=args.draft_weight,
        draft_window=args.draft_window, indexer_refresh_every=args.indexer_refresh_every, reward=args.reward,
        recipe_base=base, work_dir=str(work),
        note="times in seconds: medians over the timed steps (after the warm-up steps, which compile); wall_s sums "
             "the timed steps, wall_s_all every step; evaluation (start and end) is outside the step times; "
             "attention density is recorded only with compile off (see density_probe); single process: sync goes "
             "through an in-process queue, so the sparse codec's saving shows in bytes, not in time")

    # -- run
    rows: list[dict] = []
    steps: list[dict] = []
    skipped: list[str] = []
    failed: list[dict] = []
    durations: list[float] = []
    probe = None

    def save(final: bool) -> None:
        add_speedups(rows)
        extra = {"summary": summarise(rows, steps), "steps": steps, "calibration": calibration,
                 "density_probe": probe, "skipped": skipped, "failed": failed, "train_s": round(train_s, 1),
                 "seconds": round(time.perf_counter() - t_start, 1), "complete": final}
        write_json(NAME, config_doc, rows, out_dir=out_dir, extra=extra)

    for seed in seeds:
        for name in names:
            tag = f"{name}:seed{seed}"
            if deadline is not None and time.perf_counter() + max(durations, default=0.0) > deadline:
                skipped.append(tag)
                log(f"{tag}: skipped (deadline)", t_start)
                continue
            log(f"{tag}: start", t_start)
            t = time.perf_counter()
            try:
                out = run_recipe(run_config(base, name, seed, args, rtpurbo_dir, work))
            except Exception as e:  # one failing configuration must not lose the others
                failed.append({"run": tag, "error": f"{type(e).__name__}: {str(e)[:1000]}",
                               "traceback": traceback.format_exc()[-4000:]})
                log(f"{tag}: FAILED {type(e).__name__}: {str(e)[:300]}", t_start)
                save(final=False)
                continue
            durations.append(time.perf_counter() - t)
            st = step_records(name, seed, out["records"], args.warmup_steps)
            steps.extend(st)
            rows.append(run_row(name, seed, st, out["records"], out))
            r = rows[-1]
            log(f"{tag}: median step {r['median_step_s']:.3f} s (prefill {r['prefill_s']:.3f}, decode "
                f"{r['decode_s']:.3f}, train {r['train_s']:.3f}, sync {r['sync_s']:.3f}), reward "
                f"{r['reward_mean']:.3f}, eval {r['eval_start']} -> {r['eval_final']}, run {r['run_s']:.1f} s "
                f"(setup {r['setup_s']:.1f})", t_start)
            if r["compiled_timed_steps"]:
                log(f"{tag}: WARNING {r['compiled_timed_steps']} timed step(s) compiled or captured graphs "
                    "(see 'compiled' in the steps)", t_start)
            save(final=False)
    if args.density_probe and calibration is not None:
        if deadline is not None and time.perf_counter() + max(durations, default=0.0) / 2 > deadline:
            skipped.append("density_probe")
        else:
            try:
                probe = density_probe(base, seeds[0], args, rtpurbo_dir, work)
                log(f"density probe: {probe}", t_start)
            except Exception as e:
                failed.append({"run": "density_probe", "error": f"{type(e).__name__}: {str(e)[:1000]}",
                               "traceback": traceback.format_exc()[-4000:]})
    save(final=True)

    # -- summarise
    print()
    print_table(rows, ["config", "seed", "median_step_s", "speedup", "prefill_s", "decode_s", "logprob_s", "train_s",
                       "sync_s", "drafter_refresh_s", "rollout_s", "rollout_tokens_per_s", "wall_s", "wall_s_all"])
    print()
    print_table(rows, ["config", "seed", "reward_mean", "reward_last_half", "eval_start", "eval_final", "mismatch_kl",
                       "is_clip_frac", "spec_acceptance", "decode_density", "prefill_ret_density", "sync_wire_mb",
                       "sync_dense_mb"])
    print()
    summary = summarise(rows, steps)
    print_table(summary, ["config", "seeds", "median_step_s", "speedup", "median_rollout_s", "rollout_speedup",
                          "reward_last_half", "eval_final", "mismatch_kl", "spec_acceptance", "sync_wire_mb"])
    if skipped:
        print(f"skipped at the deadline: {skipped}")
    if failed:
        print(f"failed: {[f['run'] for f in failed]}")
    return {"rows": rows, "summary": summary, "steps": steps, "out": out_dir, "skipped": skipped, "failed": failed}


# -- merge ------------------------------------------------------------------------------------------------

# settings that may differ between runs merged into one result (everything else must be equal)
MERGE_FREE = ("configs", "seeds", "switches", "work_dir", "recipe_base")


def merge(paths: list[Path], out_dir: Path | None = None) -> Path:
    """One result from runs of this script made with the same settings but other seeds (e.g. one seed per GPU,
    or per device call): rows and steps joined, speedups and summary recomputed. Each speedup still compares
    runs of one process (a seed's configuration against the all_off run of that seed), so every part must
    hold all_off for each of its seeds. Refuses parts whose settings, model or device differ, incomplete
    parts, and (configuration, seed) pairs given twice. ``sources`` in the JSON lists the parts."""
    docs = [json.loads(Path(p).read_text()) for p in paths]
    if len(docs) < 2:
        raise SystemExit("--merge needs at least two result files")
    for p, d in zip(paths, docs):
        if d.get("benchmark") != NAME:
            raise SystemExit(f"{p}: not a {NAME} result (benchmark {d.get('benchmark')!r})")
        if not d.get("complete"):
            raise SystemExit(f"{p}: an incomplete run (it stopped before its last configuration)")
        for seed in {r["seed"] for r in d["rows"]}:
            if not any(r["seed"] == seed and r["config"] == "all_off" for r in d["rows"]):
                raise SystemExit(f"{p}: seed {seed} has no all_off run in the same process to compare against")
    settings = lambda d: {k: v for k, v in d["config"].items() if k not in MERGE_FREE}  # noqa: E731
    ref = docs[0]
    for p, d in zip(paths[1:], docs[1:]):
        diff = sorted(k for k in set(settings(ref)) | set(settings(d)) if settings(ref).get(k) != settings(d).get(k))
        if diff:
            raise SystemExit(f"{p}: settings differ from {paths[0]}: {diff}")
        if d["environment"].get("device") != ref["environment"].get("device"):
            raise SystemExit(f"{p}: device {d['environment'].get('device')!r}, not {ref['environment'].get('device')!r}")
    rows = [r for d in docs for r in d["rows"]]
    pairs = [(r["config"], r["seed"]) for r in rows]
    dup = sorted({x for x in pairs if pairs.count(x) > 1})
    if dup:
        raise SystemExit(f"(configuration, seed) given twice: {dup}")
    steps = [s for d in docs for s in d["steps"]]
    add_speedups(rows)
    names = [c for c in CONFIGS if any(r["config"] == c for r in rows)]
    config = dict(ref["config"], configs=names, switches={n: CONFIGS[n] for n in names},
                  seeds=sorted({r["seed"] for r in rows}))
    config.pop("work_dir", None)
    extra = {
        "environment": ref["environment"], "summary": summarise(rows, steps), "steps": steps,
        "calibration": ref.get("calibration"),
        "density_probe": next((d["density_probe"] for d in docs if d.get("density_probe")), None),
        "skipped": [x for d in docs for x in d.get("skipped", [])],
        "failed": [x for d in docs for x in d.get("failed", [])],
        "train_s": ref.get("train_s"), "seconds": round(sum(d.get("seconds") or 0.0 for d in docs), 1),
        "complete": True,
        "sources": [{"file": Path(p).name, "configs": [c for c in CONFIGS if any(r["config"] == c for r in d["rows"])],
                     "seeds": sorted({r["seed"] for r in d["rows"]}),
                     "git_revision": d["environment"].get("git_revision"), "seconds": d.get("seconds"),
                     "calibration_retrieval_heads": (d.get("calibration") or {}).get("retrieval_heads")}
                    for p, d in zip(paths, docs)],
    }
    return write_json(NAME, config, rows, out_dir=out_dir, extra=extra)


# -- plot -------------------------------------------------------------------------------------------------

def plot(result: dict, png_path: Path) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = result.get("steps") or []
    warm = result.get("config", {}).get("warmup_steps", 1)
    fig, (ax_s, ax_t, ax_p) = plt.subplots(1, 3, figsize=(16, 4.2), gridspec_kw={"width_ratios": [1, 1, 0.8]})
    names = [n for n in CONFIGS if any(s["config"] == n for s in steps)]
    seeds = sorted({s["seed"] for s in steps})
    styles = ["-", "--", ":", "-."]
    for i, name in enumerate(names):
        for j, seed in enumerate(seeds):
            pts = [s for s in steps if s["config"] == name and s["seed"] == seed]
            if not pts:
                continue
            label = name if len(seeds) == 1 else f"{name} seed {seed}"
            kw = dict(color=f"C{i}", ls=styles[j % len(styles)], marker="o", ms=3, label=label)
            ax_s.plot([p["step"] for p in pts], [p["reward/mean"] for p in pts], **kw)
            timed = [p for p in pts if p["timed"]]
            ax_t.plot([p["timed_wall_s"] for p in timed], [p["reward/mean"] for p in timed], **kw)
    ax_s.set(xlabel="GRPO step", ylabel="mean sampled reward (T=1)", title="reward per step")
    ax_t.set(xlabel=f"cumulative step time, s (first {warm} step(s) with compilation left out)",
             ylabel="mean sampled reward (T=1)", title="reward per wall-clock second")
    ax_s.xaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in (ax_s, ax_t):
        ax.set_ylim(-0.02, 1.02)  # both rewards lie in [0, 1]
        ax.grid(alpha=0.3)
    ax_s.legend(fontsize=7)
    _plot_phases(ax_p, steps, names)
    cfg = result.get("config", {})
    device = result.get("environment", {}).get("device")
    save_figure(fig, png_path,
                f"GRPO end to end: {cfg.get('task')} at {cfg.get('context')} tokens, "
                f"{cfg.get('prompts_per_step')}x{cfg.get('group')} samples/step ({device})")

STACKED = ("prefill", "decode", "logprob", "train", "sync")  # disjoint phases of a step


def _plot_phases(ax, steps: list[dict], names: list[str]) -> None:
    """Stacked mean time per phase over the timed steps (every seed) of each configuration; ``other`` is the
    rest of the step (rewards, batching, the drafter's refresh). Means, not medians: they add up to the step."""
    mean = lambda xs: sum(xs) / max(1, len(xs))  # noqa: E731
    timed = {n: [s for s in steps if s["config"] == n and s.get("timed")] for n in names}
    bottoms = [0.0] * len(names)
    for i, phase in enumerate(STACKED + ("other",)):
        vals = []
        for n in names:
            if phase == "other":
                v = mean([s["time/step_s"] - sum(s.get(f"time/{p}_s") or 0.0 for p in STACKED) for s in timed[n]])
            else:
                v = mean([s.get(f"time/{phase}_s") or 0.0 for s in timed[n]])
            vals.append(max(0.0, v))
        ax.bar(range(len(names)), vals, bottom=bottoms, color=f"C{i}", label=phase)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax.set_xticks(range(len(names)), [n.replace("_", "\n", 1) for n in names], fontsize=8)
    ax.set(ylabel="seconds (mean over the timed steps)", title="where a step's time goes")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")


if __name__ == "__main__":
    main()

"""Launching the shipped recipes as a user types them: ``tune run sparrow_grpo ...`` in its own process, its metric
log read back, and the command-line overrides that switch Sparrow's techniques on.

* :func:`launch_recipe` runs ``tune run [--nproc_per_node N] <recipe> --config <file> <overrides>`` (through
  ``python -m torchtune._cli.tune``, so no console script is needed), output to a log file, and returns a
  :class:`Launch`: exit status, wall clock, the moment the first step's record appeared, the records.
* :func:`log_overrides` are the overrides every measured launch takes (a JSONL metric log, no evaluation, no
  checkpoints, no plot); :func:`technique_overrides` switch RTPurbo, speculative decoding and the sparse sync codec
  on (``all_on``) or off (``all_off``); :func:`speculative_section` is the recipe's ``speculative`` section.
* :func:`grpo_base_config` is a whole GRPO recipe config with every technique off (the end-to-end benchmark's;
  :func:`grpo_options` its command-line options), :func:`technique_config` one run of it with techniques switched
  on (RTPurbo, speculation, sparse sync, partial rollout), :func:`configuration` the run of a named configuration
  of :data:`CONFIGS` (:func:`configuration_names` reads a list of them).
* :func:`calibrate` runs ``sparrow calibrate`` on a model in its own process; :func:`run_in_process` runs a
  recipe's setup, training and cleanup in this one, :func:`fixed_rollout` times an equal-work rollout after it.

Example::

    from sparrow.rl.launch import launch_recipe, log_overrides, technique_overrides

    out = Path("runs/all_off")
    run = launch_recipe("recipes/configs/qwen2_5_0_5b_long_context.yaml",
                        ["model_dir=MODEL", *log_overrides(out, steps=4), *technique_overrides("all_off")], out=out)
    steps = [r for r in run.records if "time/step_s" in r]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from sparrow._checkout import REPO
from sparrow._device import free_memory
from sparrow.rollout.config import batch_buckets, smallest_bucket


TOGGLES = ("always_on", "threshold", "cost_model")


class LaunchError(RuntimeError):
    """A launched process exited with an error; the message ends with the tail of its output."""


@dataclass
class Launch:
    """One finished launch of a recipe.

    ``argv``: the command after ``tune`` (``["run", "sparrow_grpo", ...]``); ``returncode``; ``wall_s``: from the
    start to the exit; ``first_step_s``: from the start to the first record with ``time/step_s`` in the run's
    ``metrics.jsonl`` (polled every 50 ms; None if none appeared); ``records``: every record of that log;
    ``output``: the process's stdout and stderr.
    """

    argv: list[str]
    returncode: int
    wall_s: float
    first_step_s: float | None
    records: list[dict[str, Any]] = field(default_factory=list)
    output: str = ""

    @property
    def command(self) -> str:
        """The command line as a user types it: ``tune run ...``."""
        return "tune " + shlex.join(self.argv)

    @property
    def steps(self) -> list[dict[str, Any]]:
        """The records of training steps (those with ``time/step_s``)."""
        return [r for r in self.records if "time/step_s" in r]


def recipe_env(**extra: str) -> dict[str, str]:
    """The environment of a launch: this one, unbuffered output, the checkout's ``recipes/`` and ``src/`` on
    ``PYTHONPATH`` (when this module runs from a checkout, so that the recipe and the library import whether or not
    they are installed), then ``extra``."""
    paths = [str(p) for p in (REPO / "recipes", REPO / "src") if p.is_dir()]
    path = os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])
    return dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path, **extra)


def log_overrides(out: Path | str, steps: int) -> list[str]:
    """The overrides of a measured launch writing into ``out``: ``steps`` GRPO steps, no evaluation, no checkpoints,
    no plot, a :class:`~sparrow.rl.JsonlLogger` into ``out/logs``."""
    out = Path(out)
    return [f"output_dir={out}", f"total_steps={steps}", "eval.every=0", "checkpoint_every=0", "plot=false",
            "metric_logger._component_=sparrow.rl.JsonlLogger", f"metric_logger.log_dir={out / 'logs'}"]


def speculative_section(drafter: dict[str, Any], toggle: str, lengths: Sequence[int],
                        max_active: int = 32) -> dict[str, Any]:
    """The recipe's ``speculative`` section: ``drafter`` (a :class:`~sparrow.speculative.DrafterConfig` spec) and
    the toggle builder ``toggle`` (one of :data:`TOGGLES`, or ``always`` for ``always_on``) with the arguments it
    takes: ``num_draft = max(lengths)`` for ``always_on`` and ``threshold`` (which also gets ``draft_lengths`` and
    ``max_active``), ``draft_lengths`` for ``cost_model``. ``ValueError`` for another toggle or no lengths."""
    toggle = "always_on" if toggle == "always" else toggle
    if toggle not in TOGGLES or not lengths:
        raise ValueError(f"toggle {toggle!r} (one of {TOGGLES}) with at least one draft length ({list(lengths)})")
    lengths = [int(k) for k in lengths]
    args = {"always_on": {"num_draft": max(lengths)},
            "threshold": {"num_draft": max(lengths), "draft_lengths": lengths, "max_active": max_active},
            "cost_model": {"draft_lengths": lengths}}[toggle]
    return {"drafter": drafter, "toggle": {"_component_": f"sparrow.speculative.{toggle}", **args}}


def technique_overrides(name: str, calibration: Path | str | None = None, *, toggle: str = "cost_model",
                        lengths: Sequence[int] = (2, 4, 8), max_active: int = 64) -> list[str]:
    """Overrides of configuration ``name``: ``all_off`` (dense attention, the dense sync codec, no speculation) or
    ``all_on`` (RTPurbo attention from the ``sparrow calibrate`` output ``calibration``, an int8 self-drafter with
    :func:`speculative_section` of ``toggle``, ``lengths`` and ``max_active``, the ``auto`` sync codec). The drafter
    has no window: a windowed drafter needs dense caches, and RTPurbo's local heads are windowed already.
    ``ValueError`` for another name, or ``all_on`` without a calibration."""
    if name == "all_off":
        return ["attention._component_=sparrow.attention.dense", "sync.codec=dense", "speculative=null"]
    if name != "all_on" or calibration is None:
        raise ValueError(f"configuration {name!r}: all_off, or all_on with a calibration")
    spec = speculative_section({"_component_": "sparrow.speculative.DrafterConfig", "weight": "int8"}, toggle,
                               lengths, max_active)
    return ["attention._component_=sparrow.attention.rtpurbo", f"attention.path={calibration}", "sync.codec=auto",
            "speculative=" + json.dumps(spec).replace('"', "")]


def launch_options(config: Path | str, steps: int, steps_help: str | None = None) -> list[tuple[str, dict]]:
    """Command-line options of a script that launches a recipe on a Hugging Face model directory, as rows
    ``(flag, add_argument kwargs)``: ``--model`` (every launch needs it: :func:`require_model`), ``--config``
    (default ``config``), ``--configs`` (``all_off,all_on``), ``--steps`` (default ``steps``), ``--calibration`` (an
    existing ``sparrow calibrate`` output), ``--calib-seq-len``, ``--calib-steps``, ``--set`` (overrides for every
    launch) and ``--merge`` (results of the script's earlier calls joined instead: no launch, no model)."""
    return [("--model", dict(type=Path, default=None, help="a Hugging Face model directory (not with --merge)")),
            ("--config", dict(type=Path, default=Path(config))), ("--configs", dict(default="all_off,all_on")),
            ("--steps", dict(type=int, default=steps, help=steps_help)),
            ("--calibration", dict(type=Path, default=None, help="an existing sparrow calibrate output")),
            ("--calib-seq-len", dict(type=int, default=4096)), ("--calib-steps", dict(type=int, default=200)),
            ("--set", dict(nargs="*", default=[], help="recipe overrides for every launch (key=value)")),
            ("--merge", dict(nargs="+", type=Path, default=None, metavar="JSON",
                             help="join results of this script's calls over other configurations into one"))]


def require_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A launching run of a :func:`launch_options` script needs ``--model``: the parser's usage error otherwise."""
    if args.model is None:
        parser.error("--model is required (except with --merge)")


def launch_recipe(config: Path | str, overrides: Sequence[str], *, out: Path | str, recipe: str = "sparrow_grpo",
                  nproc: int | None = None, env: dict[str, str] | None = None, log_path: Path | str | None = None,
                  timeout: float | None = None, cwd: Path | str | None = None, check: bool = True) -> Launch:
    """Run ``tune run [--nproc_per_node nproc] recipe --config config *overrides`` and wait for it.

    ``out``: the run's output folder (its metric log is read from ``out/logs/metrics.jsonl``, as
    :func:`log_overrides` sets it); ``env``: the process environment (default :func:`recipe_env`); ``log_path``:
    where stdout and stderr go (default ``<out>.log``); ``timeout``: seconds before the process is killed and
    :class:`subprocess.TimeoutExpired` raised. With ``check`` a non-zero exit raises :class:`LaunchError`, else
    the :class:`Launch` carries it.
    """
    out = Path(out)
    argv = ["run", *(["--nproc_per_node", str(nproc)] if nproc else []), recipe, "--config", str(config),
            *overrides]
    log_path = Path(log_path) if log_path is not None else out.with_name(out.name + ".log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    metrics, first = out / "logs" / "metrics.jsonl", None
    with open(log_path, "w") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "torchtune._cli.tune", *argv], stdout=log,
                                stderr=subprocess.STDOUT, env=env if env is not None else recipe_env(), cwd=cwd)
        while proc.poll() is None:
            if first is None and metrics.is_file() and '"time/step_s"' in metrics.read_text():
                first = time.perf_counter() - t0
            if timeout is not None and time.perf_counter() - t0 > timeout:
                proc.kill()
                proc.wait()
                raise subprocess.TimeoutExpired(argv, timeout)
            time.sleep(0.05)
        wall = time.perf_counter() - t0
    output = log_path.read_text()
    if check and proc.returncode != 0:
        raise LaunchError(f"tune {' '.join(argv[:2])}: exit {proc.returncode}\n{output[-4000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] \
        if metrics.is_file() else []
    if first is None and any("time/step_s" in r for r in records):
        first = wall  # the first step and the exit fell between two polls
    return Launch(argv, proc.returncode, wall, first, records, output)


def run_in_process(recipe_cls: type, config: dict[str, Any], after: Callable[[Any], dict] | None = None,
                   stop_at: float | None = None) -> dict[str, Any]:
    """``setup -> train -> cleanup`` of one recipe (``recipe_cls(cfg)``, e.g. ``sparrow_grpo.GRPORecipe``) on the
    config ``config`` (a plain dict, made an OmegaConf config), in this process, compiled code dropped first (each
    run compiles its own steps and never meets the recompile limit). ``stop_at`` (a ``time.perf_counter()``
    moment) goes to ``train``: no step starts that would end after it. ``after(recipe)``, when given, runs between
    training and cleanup; its dict joins the result. Returns ``{"records": every logged metrics dict, "setup_s",
    "run_s", **after(recipe)}``; the metric logger is closed and memory freed whatever happens."""
    import torch
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(config)
    free_memory()
    torch.compiler.reset()
    t0 = time.perf_counter()
    recipe = recipe_cls(cfg)
    try:
        recipe.setup(cfg)
        setup_s = time.perf_counter() - t0
        recipe.train(**({} if stop_at is None else {"stop_at": stop_at}))
        extra = after(recipe) if after is not None else {}
        recipe.cleanup()
        records = list(recipe.metric_logger.records)
    finally:
        if getattr(recipe, "metric_logger", None) is not None:
            recipe.metric_logger.close()
        del recipe
        free_memory()
    return {"records": records, "setup_s": setup_s, "run_s": time.perf_counter() - t0, **extra}


def fixed_rollout(recipe: Any, length: int) -> dict[str, Any]:
    """An equal-work rollout of a trained ``sparrow_grpo`` recipe (a ``GRPORecipe`` after ``train()``, e.g. as
    :func:`run_in_process`'s ``after``): the next step's prompts (from ``recipe.data_iter``) decoded
    ``recipe.group`` times each to exactly ``length`` new tokens (the recipe's sampling parameters without stop
    tokens), twice: the first call meets the no-stop sampling mode (compiled once), the second is timed. Returns
    ``{"fixed_rollout_s", "fixed_tokens", "fixed_prefill_s"}`` of the second call: the same work whatever lengths
    a configuration samples. ``StopIteration`` when the recipe's data is exhausted."""
    prompts = [b["prompt_ids"] for b in next(recipe.data_iter)]
    params = replace(recipe._sampling_params(), max_new_tokens=length, stop_token_ids=())
    for _ in range(2):
        t = time.perf_counter()
        gen = recipe.engine.generate(prompts, recipe.group, params)
        seconds = time.perf_counter() - t
    return {"fixed_rollout_s": seconds, "fixed_tokens": gen.stats.generated_tokens,
            "fixed_prefill_s": gen.stats.prefill_s}


def calibrate(model: Path | str, out: Path | str, *, seq_len: int, steps: int, env: dict[str, str] | None = None,
              log_path: Path | str | None = None) -> float:
    """``sparrow calibrate --checkpoint model --out out --seq-len seq_len --steps steps`` in its own process (its
    output to ``log_path``, default ``<out>.log``); returns its seconds. :class:`LaunchError` if it fails."""
    out = Path(out)
    cmd = [sys.executable, "-m", "sparrow.cli", "calibrate", "--checkpoint", str(model), "--out", str(out),
           "--seq-len", str(seq_len), "--steps", str(steps), "--no-progress"]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env if env is not None else recipe_env())
    log_path = Path(log_path) if log_path is not None else out.with_name(out.name + ".log")
    log_path.write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        raise LaunchError(f"sparrow calibrate: exit {r.returncode}\n{r.stderr[-4000:]}")
    return time.perf_counter() - t0


#: ``--task`` / ``--reward`` names of the benchmarks -> the recipe components
TASKS = {"kv_retrieval": "sparrow.rl.KVRetrieval", "variable_tracking": "sparrow.rl.VariableTracking",
         "kv_list": "sparrow.rl.KVListRetrieval"}
REWARDS = {"exact_match": "sparrow.rl.ExactMatch", "char_accuracy": "sparrow.rl.CharAccuracy"}


def engine_buckets(rows: int, growth: int, compile: bool) -> list[int]:
    """A benchmark engine's batch buckets: the powers of ``growth`` below ``rows`` from the smallest bucket worth
    compiling (:func:`~sparrow.rollout.config.smallest_bucket`), then ``rows``."""
    return batch_buckets(rows, growth, smallest=smallest_bucket(compile))


def grpo_base_config(model: dict[str, Any], checkpoint: Path | str, device: str, *, task: str = "kv_retrieval",
                     context: int = 8192, max_asked: int | None = None, reward: str = "exact_match", group: int = 8,
                     prompts_per_step: int = 8, max_new: int = 8, steps: int = 8, eval_prompts: int = 64,
                     lr: float = 1e-5, minibatches: int = 2, micro_batch: int = 32, block_steps: int = 16,
                     bucket_growth: int = 4, compile: bool = True, shared_prefix: bool = True,
                     activation_checkpointing: bool = False) -> dict[str, Any]:
    """A complete ``sparrow_grpo`` recipe config (a plain dict) with every technique off: dense attention, no
    speculation, the dense sync codec; the run :func:`technique_config` switches techniques on in.

    ``model``: the model builder's section (``{"_component_": ..., **kwargs}``), ``checkpoint`` its weights file;
    ``task`` / ``reward`` are keys of :data:`TASKS` / :data:`REWARDS` (``max_asked`` goes to the task); prompts of
    ``context`` tokens, ``prompts_per_step`` x ``group`` rows a step, ``max_new`` new tokens, ``steps`` steps, held-out
    accuracy on ``eval_prompts`` prompts at the start and end (0: none); AdamW at ``lr`` (fused on CUDA), bf16 mixed
    precision on CUDA, the bit-exact sync check at the last step; engine batch buckets: :func:`engine_buckets` of
    ``bucket_growth``;
    ``shared_prefix`` / ``activation_checkpointing``: the trainer's packed groups and per-layer recomputation.
    ``output_dir`` and the metric logger's ``log_dir`` are left ``None``. ``ValueError`` for an unknown task or
    reward."""
    if task not in TASKS or reward not in REWARDS:
        raise ValueError(f"task {task!r} (one of {list(TASKS)}), reward {reward!r} (one of {list(REWARDS)})")
    cuda = str(device).startswith("cuda")
    rows = group * prompts_per_step
    return {
        "name": "bench_e2e", "output_dir": None, "seed": 0, "device": str(device),
        "trainer_precision": "bf16-mixed" if cuda else "fp32", "dist_timeout_s": 600,
        "tokenizer": {"_component_": "sparrow.rl.CharTokenizer"},
        "task": {"_component_": TASKS[task], "context_len": context, **({"max_asked": max_asked} if max_asked else {})},
        "reward": {"_component_": REWARDS[reward]},
        "model": model,
        "checkpoint": str(checkpoint),
        "attention": {"_component_": "sparrow.attention.dense"},
        "engine": {"max_rows": rows, "max_prompts": max(prompts_per_step, min(eval_prompts, rows)),
                   "max_prompt_len": context + 1, "max_new_tokens": max_new, "block_steps": block_steps,
                   "compile": compile, "cuda_graphs": compile and cuda,
                   # speculation captures a draft and a verify graph per bucket and draft length
                   "batch_buckets": engine_buckets(rows, bucket_growth, compile)},
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": max_new},
        "group_size": group, "prompts_per_step": prompts_per_step, "ppo_epochs": 1,
        "minibatches": minibatches, "micro_batch_size": micro_batch, "logprob_chunk": 4096,
        "shared_prefix": shared_prefix, "enable_activation_checkpointing": activation_checkpointing,
        "max_grad_norm": 1.0,
        "optimizer": {"_component_": "torch.optim.AdamW", "lr": lr, "betas": [0.9, 0.999], "weight_decay": 0.0,
                      **({"fused": True} if cuda else {})},
        "loss": {"clip_low": 0.2, "clip_high": 0.28, "aggregation": "token_mean", "advantage_scale": "group",
                 "kl_beta": 0.0, "is_level": "token", "is_threshold": 2.0, "is_mode": "truncate"},
        "sync": {"codec": "dense", "bucket_bytes": 256 << 20, "anchor_every": 0, "verify": True,
                 "check_bitwise": steps},  # bit-exactness checked once, at the last step
        "total_steps": steps, "checkpoint_every": 0, "resume_from_checkpoint": False,
        "eval": {"every": steps if eval_prompts else 0, "prompts": max(1, eval_prompts)},
        "metric_logger": {"_component_": "sparrow.rl.JsonlLogger", "log_dir": None},
        "plot": False,
    }


def grpo_options() -> list[tuple]:
    """Command-line options of :func:`grpo_base_config`'s keywords but ``context``, as
    :func:`~sparrow.bench.base_parser` rows whose ``dest`` is the keyword (:func:`~sparrow.bench.keyword_args`
    passes them on). Those defaulting to None take their values from :data:`GRPO_DEFAULTS`
    (:func:`~sparrow.bench.fill_defaults`), except ``--max-new`` and ``--max-asked``, which the caller sets from its
    task (``--no-compile``: None unless given, the caller's choice)."""
    return [
        ("--steps", int, None, "GRPO steps per run (default 8; quick 2)"),
        ("--task", list(TASKS), "kv_retrieval", None), ("--group", int, 8, None),
        ("--prompts-per-step", int, None, "default 8; quick 2"),
        ("--max-new", int, None, "sampling max_new_tokens (default 8, quick 4; kv_list: its longest answer and <eos>)"),
        ("--max-asked", int, None, "kv_list: most keys asked at once (default 32; 256: responses up to 1K tokens)"),
        ("--minibatches", int, 2, "policy updates per step (>1: a separate pi_old pass)"),
        ("--micro-batch", int, 32, "trainer rows per forward / backward"),
        ("--reward", list(REWARDS), None, "also the held-out score (default exact_match; quick char_accuracy)"),
        ("--lr", float, None, "AdamW learning rate (default 1e-5; quick 1e-3)"),
        ("--eval-prompts", int, None, "held-out prompts (default 64; quick 8; 0: no eval)"),
        ("--block-steps", int, 16, "engine decode steps between host checks"),
        ("--bucket-growth", int, 4, "engine batch buckets are powers of this (4: about half the CUDA graphs of 2)"),
        ("--shared-prefix", dict(action=argparse.BooleanOptionalAction, default=True,
                                 help="trainer computes each prompt once per group (in every configuration)")),
        ("--activation-checkpointing", dict(action=argparse.BooleanOptionalAction, default=False,
                                            help="trainer recomputes each layer in the backward pass (long "
                                                 "contexts: one layer's activations held at once)")),
        ("--no-compile", dict(dest="compile", action="store_false", default=None,
                              help="eager decode steps (default on CUDA: compile + CUDA graphs; CPU / quick: eager)"))]


#: the ``(--quick, full)`` values of the :func:`grpo_options` that default to None (the caller's own excepted)
GRPO_DEFAULTS: dict[str, tuple[Any, Any]] = {"steps": (2, 8), "prompts_per_step": (2, 8), "eval_prompts": (8, 64),
                                             "reward": ("char_accuracy", "exact_match"), "lr": (1e-3, 1e-5)}


def technique_config(base: dict[str, Any], output_dir: Path | str, *, seed: int = 0, rtpurbo: Path | str | None = None,
                     indexer_refresh_every: int = 0, speculative: dict[str, Any] | None = None,
                     sparse_sync: bool = False, overprovision: int | None = None, max_staleness: int = 1,
                     bucket_growth: int = 4) -> dict[str, Any]:
    """A copy of ``base`` (:func:`grpo_base_config`) for one run: ``seed``, its output and metric logs in
    ``output_dir``, and the techniques given switched on. ``rtpurbo``: RTPurbo attention from that calibration
    (``indexer_refresh_every`` > 0: the indexer refreshed every that many steps, 20 fit steps on 8 sequences);
    ``speculative``: the recipe's section (:func:`speculative_section`); ``sparse_sync``: the ``auto`` codec;
    ``overprovision`` (not None): partial rollout with that many groups in flight beyond a step's, spanning at most
    ``max_staleness`` policy versions, the engine grown to hold their rows (buckets: powers of ``bucket_growth``)."""
    cfg = copy.deepcopy(base)
    cfg["seed"] = seed
    cfg["output_dir"] = cfg["metric_logger"]["log_dir"] = str(output_dir)
    if rtpurbo is not None:
        cfg["attention"] = {"_component_": "sparrow.attention.rtpurbo", "path": str(rtpurbo)}
        if indexer_refresh_every:
            cfg["indexer_refresh"] = {"every": indexer_refresh_every, "steps": 20, "sequences": 8}
    if speculative is not None:
        cfg["speculative"] = speculative
    if sparse_sync:
        cfg["sync"]["codec"] = "auto"
    if overprovision is not None:
        cfg["partial_rollout"] = {"enabled": True, "overprovision": overprovision, "max_staleness": max_staleness}
        per_step = cfg["prompts_per_step"] + overprovision
        rows = cfg["group_size"] * per_step
        cfg["engine"].update(max_rows=rows, max_prompts=max(cfg["engine"]["max_prompts"], per_step),
                             batch_buckets=engine_buckets(rows, bucket_growth, cfg["engine"]["compile"]))
    return cfg


#: the end-to-end comparison's configurations: name -> which techniques are on (``partial``: partial rollout, the
#: twin of the configuration with the same switches)
CONFIGS: dict[str, dict[str, bool]] = {
    "all_off": {"rtpurbo": False, "spec": False, "sparse_sync": False},
    "all_on": {"rtpurbo": True, "spec": True, "sparse_sync": True},
    "rtpurbo_only": {"rtpurbo": True, "spec": False, "sparse_sync": False},
    "spec_only": {"rtpurbo": False, "spec": True, "sparse_sync": False},
    "sparse_sync_only": {"rtpurbo": False, "spec": False, "sparse_sync": True},
    "all_off_partial": {"rtpurbo": False, "spec": False, "sparse_sync": False, "partial": True},
    "all_on_partial": {"rtpurbo": True, "spec": True, "sparse_sync": True, "partial": True},
}


def configuration_names(text: str, partial: bool = False) -> list[str]:
    """The configurations named in the comma list ``text`` (keys of :data:`CONFIGS`, blanks skipped) and, with
    ``partial``, after them each one's partial-rollout twin (``<name>_partial``) where there is one.
    ``ValueError`` naming the unknown ones."""
    names = [c.strip() for c in text.split(",") if c.strip()]
    if partial:
        names += [f"{n}_partial" for n in names if f"{n}_partial" in CONFIGS and f"{n}_partial" not in names]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown configs {unknown} (known: {list(CONFIGS)})")
    return names


def configuration(base: dict[str, Any], name: str, output_dir: Path | str, *, seed: int = 0,
                  rtpurbo: Path | str | None = None, draft_weight: str = "int8", draft_window: int = 0,
                  spec_toggle: str = "cost_model", draft_lengths: Sequence[int] = (2, 4), max_active: int = 32,
                  overprovision: int | None = None, max_staleness: int = 1, indexer_refresh_every: int = 0,
                  bucket_growth: int = 4) -> dict[str, Any]:
    """:func:`technique_config` of ``base`` (:func:`grpo_base_config`) for the configuration ``name`` of
    :data:`CONFIGS`, its run ``seed`` writing into ``output_dir``, with the techniques the configuration switches
    on: RTPurbo attention from the calibration ``rtpurbo`` (refreshed every ``indexer_refresh_every`` steps, 0:
    never); speculation with a ``draft_weight`` self-drafter (windowed to ``draft_window`` tokens when that is
    above 0 and RTPurbo is off: a windowed draft needs dense caches) under the :func:`speculative_section` of
    ``spec_toggle``, ``draft_lengths`` and ``max_active``; the sparse sync codec; and for a partial-rollout
    configuration ``overprovision`` groups in flight beyond a step's (None: as many as a step's prompts), spanning
    at most ``max_staleness`` policy versions. ``KeyError`` for a name not in :data:`CONFIGS`; ``ValueError`` from
    :func:`speculative_section`."""
    on, spec = CONFIGS[name], None
    if on["spec"]:
        drafter = {"_component_": "sparrow.speculative.DrafterConfig", "weight": draft_weight}
        if draft_window and not on["rtpurbo"]:  # a windowed draft needs dense caches
            drafter["window"] = draft_window
        spec = speculative_section(drafter, spec_toggle, draft_lengths, max_active)
    over = (base["prompts_per_step"] if overprovision is None else overprovision) if on.get("partial") else None
    return technique_config(base, output_dir, seed=seed, rtpurbo=rtpurbo if on["rtpurbo"] else None,
                            indexer_refresh_every=indexer_refresh_every, speculative=spec,
                            sparse_sync=on["sparse_sync"], overprovision=over, max_staleness=max_staleness,
                            bucket_growth=bucket_growth)

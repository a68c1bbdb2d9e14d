"""Supervised training from scratch on the synthetic tasks: the GRPO warm start and the benchmarks' task models.

    tune run sparrow_sft --config recipes/configs/tiny_kv_retrieval_sft.yaml [key=value ...]

A thin recipe over :mod:`sparrow.training`: the data is one ``task`` (a component) or a ``mix`` of the named
training families (:data:`sparrow.training.FAMILIES`), the model a ``model`` component initialised by
:func:`~sparrow.training.init_weights` (``init``), and the :class:`~sparrow.training.Trainer` runs the
``curriculum``, ``loss``, ``optimizer``, ``eval`` and ``growth`` sections (each a config dataclass of the library;
``growth`` trains a subset of the layers first, :mod:`sparrow.training.growth`). Writes
``output_dir/model.safetensors`` (the GRPO recipe's ``checkpoint``) and ``output_dir/report.json`` (the builder,
the run, the held-out accuracy table measured on the saved weights). ``seeds: [a, b, ...]`` trains one model per
seed at once, in separate processes, and keeps the best. Deterministic by seed on one thread count.

``checkpoint_every_s: S`` writes the whole training state (fp32 weights, optimizer, the trainer's counters,
curriculum and data stream) to ``output_dir/train_state`` every ``S`` seconds, atomically, keeping the latest;
``resume: true`` continues from it with the rest of ``minutes`` / ``steps`` (the same config, but for
``resume``, ``checkpoint_every_s`` and ``log_every_s``): a run killed loses at most ``S`` seconds, and a run of
``steps`` ends with the same weights, bit for bit, as one never stopped. With checkpoints on, SIGTERM (what
``timeout`` and most schedulers send first) loses nothing: the step in flight ends, the state is saved, and the
recipe exits with status 1 and a message naming the state (no model, no report: the run is not over).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from torchtune import config

from sparrow.rl.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from sparrow.rl.recipe_config import COMPONENT, check_config, has_component, parse
from sparrow.training import (
    EVAL_TASKS, FAMILIES, CurriculumConfig, EvalConfig, GrowthConfig, LossConfig, OptimizerConfig, TaskMixStream,
    TrainConfig, Trainer, accuracy_table, best_of_seeds, init_weights, load_trained_model, model_width, pick,
    save_trained_model, write_report,
)

_fields = lambda cls: {f.name for f in dataclasses.fields(cls)}  # noqa: E731
KEYS = {
    "name": None, "output_dir": None, "seed": None, "seeds": None, "device": None, "steps": None, "minutes": None,
    "log_every_s": None, "checkpoint_every_s": None, "resume": None, "save_dtype": None, "task": COMPONENT,
    "mix": None, "model": COMPONENT,
    "init": {"std", "residual_scaling", "zero_bias"},
    "data": {"seed", "tokens_per_step", "batch_size", "min_examples", "workers"},
    "curriculum": _fields(CurriculumConfig), "loss": _fields(LossConfig), "optimizer": _fields(OptimizerConfig),
    "eval": _fields(EvalConfig), "growth": _fields(GrowthConfig),
}
OPTIONAL = ("name", "seeds", "steps", "minutes", "log_every_s", "checkpoint_every_s", "resume", "task", "mix", "data",
            "curriculum", "loss", "eval", "growth")
STATE_DIR = "train_state"  # under output_dir: the latest training state (checkpoint_every_s, resume)
#: keys a resumed run may set otherwise than the run it continues
RESUME_FREE = ("resume", "checkpoint_every_s", "log_every_s")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class SFTRecipe:
    """setup -> train -> save_checkpoint -> evaluate -> cleanup, as in torchtune's recipes."""

    def __init__(self, cfg: DictConfig) -> None:
        check_config(cfg, KEYS, optional=OPTIONAL)
        if has_component(cfg, "task") == (cfg.get("mix") is not None):
            raise ValueError("the config needs a task or a mix (not both): set task=null or mix=null")
        if cfg.save_dtype not in DTYPES:
            raise ValueError(f"save_dtype must be one of {sorted(DTYPES)}, got {cfg.save_dtype!r}")
        every = cfg.get("checkpoint_every_s")
        if every is not None and (isinstance(every, bool) or not isinstance(every, (int, float)) or every < 0):
            raise ValueError(f"checkpoint_every_s must be a number of seconds >= 0 (0: none), got {every!r}")
        if cfg.get("resume") is not None and not isinstance(cfg.resume, bool):
            raise ValueError(f"resume must be true or false, got {cfg.resume!r}")
        self.cfg, self.output_dir, self.device = cfg, Path(cfg.output_dir), torch.device(cfg.device)
        self.t0 = time.perf_counter()

    def log(self, msg: str) -> None:
        print(f"[{time.perf_counter() - self.t0:7.1f}s] {msg}", flush=True)

    def setup(self, cfg: DictConfig) -> None:
        self.train_cfg = self._setup_config(cfg)
        self._setup_tasks(cfg)
        self.source = self._setup_data(cfg)
        self.model = self._setup_model(cfg)
        self.trainer = Trainer(self.model, self.train_cfg, self.source, eval_tasks=self.eval_tasks, log=self.log)
        if cfg.get("resume"):
            self._resume(cfg)

    def _setup_config(self, cfg: DictConfig) -> TrainConfig:
        """The run's config dataclasses (each validates its section)."""
        section = lambda key: OmegaConf.to_container(cfg[key], resolve=True) if cfg.get(key) else {}  # noqa: E731
        return TrainConfig(steps=cfg.get("steps"), minutes=cfg.get("minutes"), seed=cfg.seed, device=cfg.device,
                           log_every_s=cfg.get("log_every_s", 15.0),
                           curriculum=CurriculumConfig(**section("curriculum")),
                           loss=LossConfig(**section("loss")), optimizer=OptimizerConfig(**section("optimizer")),
                           eval=EvalConfig(**section("eval")), growth=GrowthConfig(**section("growth")))

    def _setup_tasks(self, cfg: DictConfig) -> None:
        """The training families and the evaluation tasks: the ``task`` at each context for both, or the ``mix``'s
        named families and :data:`~sparrow.training.EVAL_TASKS`."""
        if has_component(cfg, "task"):
            task = config.instantiate(cfg.task)
            self.families = self.eval_tasks = {"task": lambda n: dataclasses.replace(task, context_len=n)}
            self.mix = {"task": 1.0}
        else:
            self.mix = dict(cfg.mix)
            self.families, self.eval_tasks = pick(FAMILIES, self.mix, "mix"), EVAL_TASKS
        ev = self.train_cfg.eval
        pick(self.eval_tasks, ev.tasks, "eval.tasks")
        self.table = pick(self.eval_tasks, ev.table or ev.tasks, "eval.table")

    def _setup_data(self, cfg: DictConfig) -> TaskMixStream:
        data = dict(cfg.get("data") or {})
        seed = data.pop("seed", None)
        source = TaskMixStream(self.families, self.mix, seed=cfg.seed if seed is None else seed, **data)
        for n in (self.train_cfg.curriculum.min_context, self.train_cfg.curriculum.max_context):
            source.tasks(n)  # the tasks' knobs are valid at both ends of the curriculum
        return source

    def _setup_model(self, cfg: DictConfig) -> torch.nn.Module:
        """The model, built and initialised under ``seed``."""
        torch.manual_seed(cfg.seed)
        model = config.instantiate(cfg.model).to(self.device)
        init_weights(model, **cfg.init)
        return model

    def train(self) -> None:
        first, growth = self.trainer.active_layers, self.train_cfg.growth
        start = [f"layers {first} of {len(self.model.layers)}"] if first is not None else []
        if growth.narrow and self.trainer.run.grown_at is None:
            w = model_width(self.model)
            start.append(f"width {w.embed_dim}, {w.num_heads} query heads, MLP {w.intermediate_dim}, {w.vocab} ids")
        self.log(f"model: {sum(p.numel() for p in self.model.parameters()) / 1e6:.2f}M parameters, device "
                 f"{self.device}, mix {self.mix}" + (f"; {', '.join(start)} until the growth" if start else ""))
        every = float(self.cfg.get("checkpoint_every_s") or 0)
        # with checkpoints on, SIGTERM (a time limit's, a preemption's) ends the step, saves the state and stops
        previous = signal.signal(signal.SIGTERM, lambda *_: self.trainer.request_stop()) if every else None
        try:
            self.stats = self.trainer.train(checkpoint=self.save_state if every else None, checkpoint_every_s=every)
        finally:
            if every:
                signal.signal(signal.SIGTERM, previous)

    def _identity(self) -> dict:
        """The config a resumed run must share with the run it continues."""
        return {k: v for k, v in OmegaConf.to_container(self.cfg, resolve=True).items() if k not in RESUME_FREE}

    def save_state(self) -> None:
        """The whole training state to ``output_dir/train_state`` (atomically; older states removed after)."""
        t = time.perf_counter()
        root = self.output_dir / STATE_DIR
        path = save_checkpoint(root, self.trainer.step, model=self.model, optimizer=self.trainer.optimizer,
                               state={"trainer": self.trainer.state_dict(), "config": self._identity()})
        for old in root.glob("step_*"):
            if old != path:
                shutil.rmtree(old)
        self.log(f"training state at step {self.trainer.step} in {time.perf_counter() - t:.1f} s: {path}")

    def _resume(self, cfg: DictConfig) -> None:
        """Continue from ``output_dir/train_state``. ``FileNotFoundError`` when there is none, ``ValueError``
        naming the keys when it comes from another config; nothing is loaded then."""
        path = latest_checkpoint(self.output_dir / STATE_DIR)
        state = json.loads((path / "state.json").read_text())
        saved, now = state["config"], self._identity()
        differ = sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k))
        if differ:
            raise ValueError(f"resume: {path} was written by a run with other values of {differ}; only "
                             f"{list(RESUME_FREE)} may change")
        load_checkpoint(path, model=self.model, optimizer=self.trainer.optimizer)
        self.trainer.load_state_dict(state["trainer"])
        self.log(f"resumed from step {self.trainer.step} ({self.trainer.run.elapsed_s:.0f} s of training done): {path}")

    def save_checkpoint(self) -> None:
        cfg, top = self.cfg, self.train_cfg.curriculum.max_context
        self.report = {
            "model": OmegaConf.to_container(cfg.model, resolve=True), "tokenizer": "sparrow.rl.CharTokenizer",
            "train": self.stats, "recipe_config": OmegaConf.to_container(cfg, resolve=True),
            "tasks": {"train": {f: repr(fam(top)) for f, fam in self.families.items()},
                      "eval": {t: repr(fam(top)) for t, fam in self.table.items()},
                      "eval_seed": self.train_cfg.eval.seed},
            "environment": {"torch": torch.__version__, "device": torch.cuda.get_device_name(self.device)
                            if self.device.type == "cuda" else "cpu"},
        }
        save_trained_model(self.output_dir, self.model, self.report, DTYPES[cfg.save_dtype])
        self.log(f"wrote {self.output_dir}/model.safetensors")

    def evaluate(self) -> dict:
        """The accuracy table, measured on the saved weights as a user of the checkpoint sees them."""
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        loaded = load_trained_model(self.output_dir, self.device, dtype)
        saved = DTYPES[self.cfg.save_dtype]
        self.report["reload_matches_weights"] = all(
            torch.equal(a.detach().to(saved).cpu(), b.detach().to(saved).cpu())
            for a, b in zip(self.model.state_dict().values(), loaded.state_dict().values()))
        ev = self.train_cfg.eval
        self.report["accuracy"] = accuracy_table(loaded, self.table, self.train_cfg.contexts(), ev.final_examples,
                                                 seed=ev.seed, sampled=ev.sampled, sample_seed=self.cfg.seed,
                                                 log=self.log)
        self.report.update(eval_weights_dtype=str(dtype).replace("torch.", ""),
                           total_s=round(time.perf_counter() - self.t0, 1))
        write_report(self.output_dir, self.report)
        return self.report

    def cleanup(self) -> None:
        self.source.close()


def train_seeds(cfg: DictConfig) -> dict:
    """One process of this recipe per seed of ``seeds`` (each in ``output_dir/seed_<s>``), the best kept in
    ``output_dir``."""
    check_config(cfg, KEYS, optional=OPTIONAL)
    out = Path(cfg.output_dir).resolve()
    commands, dirs = {}, {}
    for seed in cfg.seeds:
        dirs[seed] = out / f"seed_{seed}"
        dirs[seed].mkdir(parents=True, exist_ok=True)
        one = OmegaConf.merge(cfg, {"seed": seed, "seeds": None, "output_dir": str(dirs[seed])})
        OmegaConf.save(one, dirs[seed] / "config.yaml")
        commands[seed] = [sys.executable, str(Path(__file__).resolve()), "--config", str(dirs[seed] / "config.yaml")]
    report = best_of_seeds(commands, dirs, out, device=cfg.device)
    print(f"kept seed {report['chosen_seed']} of {list(cfg.seeds)}: {out}", flush=True)
    return report


@parse
def recipe_main(cfg: DictConfig) -> str | None:
    if len(cfg.get("seeds") or []) > 1:
        train_seeds(cfg)
        return
    if cfg.get("seeds"):  # one seed listed: that seed
        cfg.seed = cfg.seeds[0]
    recipe = SFTRecipe(cfg)
    recipe.setup(cfg)
    recipe.train()
    if recipe.stats["stopped"]:
        recipe.cleanup()
        return (f"sparrow_sft: stopped by SIGTERM at step {recipe.trainer.step}, before the end of the run: its state "
                f"is in {recipe.output_dir / STATE_DIR}; the same command with resume=true continues it")
    recipe.save_checkpoint()
    recipe.evaluate()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())

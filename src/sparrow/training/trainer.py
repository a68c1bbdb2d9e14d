"""The teacher-forced trainer: supervised training of a model on batches of a :class:`BatchSource`.

One loop for every model Sparrow trains from scratch (the GRPO warm start, the task models of the benchmarks,
the speculative benchmark's model). A step: the step's context from the curriculum, a batch, the learning
rate (linear warm-up, then cosine decay to ``min_lr_ratio`` or constant), one forward (bf16 autocast on CUDA),
:func:`teacher_forced_loss`, gradient clipping, AdamW (weight decay on matrices and embeddings only). The run
ends after ``steps`` steps or ``minutes`` of training, whichever comes first; the schedule follows the larger
of the two fractions done. Every ``eval.every_s`` seconds the held-out greedy accuracy of the curriculum tasks
is measured (teacher forcing) and moves the curriculum. With ``growth`` the run starts on a subset of the
model's layers, or narrower, or both, and grows to the whole model (:mod:`sparrow.training.growth`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from sparrow._transfer import to_device
from sparrow.rl.logprobs import hidden_states
from sparrow.training.curriculum import Curriculum, CurriculumConfig
from sparrow.training.data import ANSWER, EOS, IGNORED, PROMPT, Batch, BatchSource
from sparrow.training.episodes import EpisodeBatches, MarkovEpisodes
from sparrow.training.evaluate import EVAL_SEED, autocast, greedy_accuracy
from sparrow.training.growth import (GrowthConfig, active_layers, check_growable, grow_, model_width, narrow_,
                                     shallow_layers, widen_)
from sparrow.training.tasks import TaskFamily

PROMPT_TOKENS = ("prompt", "sequence")
ANSWER_MEANS = ("example", "token")
SCHEDULES = ("cosine", "constant")


@dataclass(frozen=True)
class LossConfig:
    """``answer + prompt_weight * prompt``: two separate means, so a long prompt does not drown the answer.

    Attributes:
        prompt_weight: weight of the second term (0: the answer alone).
        prompt_tokens: the second term's tokens: ``"prompt"`` (the prompt's) or ``"sequence"`` (every token).
        answer_eos: whether the final ``<eos>`` belongs to the answer term.
        answer_mean: ``"example"`` (the mean of each example's mean: every example counts the same) or
            ``"token"`` (the mean over all answer tokens of the batch).
        logits_chunk: 0: the model's logits of the whole batch at once; ``N``: the logits of at most ``N``
            positions at a time, from the final hidden states, recomputed in the backward pass (a large
            vocabulary: 151,936 ids × 32K positions are 20 GB of fp32 logits). Same loss, other rounding.
        prompt_fraction: the share of the prompt's positions the second term reads, drawn afresh each step
            (:func:`draw_prompt_positions`: seeded by the run's seed and the step, so a resumed run draws the
            same): an unbiased estimate of the same mean from fewer positions. With ``logits_chunk`` only the
            drawn positions' logits are computed: with a large vocabulary the prompt's logits are most of a
            short-context step's work (at 64 tokens of the task mix, 7 of every 8 positions are prompt).

    Raises:
        ValueError: a negative weight or chunk, an unknown choice, ``prompt_fraction`` outside ``(0, 1]`` or
            below 1 with ``prompt_tokens="sequence"``.
    """

    prompt_weight: float = 0.05
    prompt_tokens: str = "prompt"
    answer_eos: bool = True
    answer_mean: str = "example"
    logits_chunk: int = 0
    prompt_fraction: float = 1.0

    def __post_init__(self) -> None:
        if not self.prompt_weight >= 0:
            raise ValueError(f"loss: prompt_weight must be >= 0, got {self.prompt_weight}")
        if self.logits_chunk < 0:
            raise ValueError(f"loss: logits_chunk must be >= 0 (0: whole logits), got {self.logits_chunk}")
        if self.prompt_tokens not in PROMPT_TOKENS or self.answer_mean not in ANSWER_MEANS:
            raise ValueError(f"loss: prompt_tokens must be one of {PROMPT_TOKENS} and answer_mean one of "
                             f"{ANSWER_MEANS}, got {self.prompt_tokens!r}, {self.answer_mean!r}")
        if not 0 < self.prompt_fraction <= 1 or (self.prompt_fraction < 1 and self.prompt_tokens != "prompt"):
            raise ValueError(f"loss: prompt_fraction must be in (0, 1], and 1 unless prompt_tokens is 'prompt', got "
                             f"{self.prompt_fraction} with prompt_tokens={self.prompt_tokens!r}")


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW and its learning-rate schedule (warm-up over ``warmup_steps``, then ``schedule``).

    Raises:
        ValueError: a non-positive ``lr`` or ``max_grad_norm``, ``min_lr_ratio`` outside ``[0, 1]``, a negative
            ``warmup_steps`` or ``weight_decay``, betas outside ``[0, 1)``, an unknown ``schedule``.
    """

    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    schedule: str = "cosine"
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    max_grad_norm: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        checks = {"lr": self.lr > 0, "max_grad_norm": self.max_grad_norm > 0,
                  "min_lr_ratio": 0 <= self.min_lr_ratio <= 1, "warmup_steps": self.warmup_steps >= 0,
                  "weight_decay": self.weight_decay >= 0,
                  "betas": len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas)}
        bad = {k: getattr(self, k) for k, ok in checks.items() if not ok}
        if bad:
            raise ValueError(f"optimizer: out of range {bad} (lr, max_grad_norm > 0; min_lr_ratio in [0, 1]; "
                             "warmup_steps, weight_decay >= 0; two betas in [0, 1))")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"optimizer: schedule must be one of {SCHEDULES}, got {self.schedule!r}")

    def lr_at(self, step: int, progress: float) -> float:
        """The learning rate of ``step`` (0-based) at ``progress`` (the fraction of the run done)."""
        warm = min(1.0, (step + 1) / max(1, self.warmup_steps))
        if self.schedule == "constant":
            return self.lr * warm
        cos = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return self.lr * warm * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cos)


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation.

    Attributes:
        tasks: the tasks whose accuracy moves the curriculum (names of the trainer's ``eval_tasks``).
        table: the tasks of the final accuracy table (default: ``tasks``).
        seed: the held-out examples' seed.
        every_s: seconds between progress evaluations (0: none).
        examples, final_examples: examples per task and context in a progress evaluation / the final table.
        lengths: contexts of the final table (default: the curriculum's levels).
        sampled: the final table also measures accuracy at temperature 1 (through the rollout engine).
    """

    tasks: tuple[str, ...] = ("kv_retrieval", "variable_tracking")
    table: tuple[str, ...] = ()
    seed: int = EVAL_SEED
    every_s: float = 20.0
    examples: int = 64
    final_examples: int = 128
    lengths: tuple[int, ...] = ()
    sampled: bool = False

    def __post_init__(self) -> None:
        for name in ("tasks", "table", "lengths"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if not self.tasks:
            raise ValueError("eval: tasks must name at least one task")
        if self.every_s < 0 or self.examples < 1 or self.final_examples < 1:
            raise ValueError(f"eval: need every_s >= 0 and examples, final_examples >= 1, got every_s={self.every_s}, "
                             f"examples={self.examples}, final_examples={self.final_examples}")
        if any(n < 1 for n in self.lengths):
            raise ValueError(f"eval: lengths must be >= 1, got {list(self.lengths)}")


@dataclass(frozen=True)
class TrainConfig:
    """A training run (see the module docstring).

    Attributes:
        steps, minutes: the run's length: at most ``steps`` steps and at most ``minutes`` of training (at least
            one of the two).
        seed: the curriculum's draws (the recipe also seeds the initialisation with it).
        device: where the model trains.
        log_every_s: seconds between progress lines.
        growth: trains on a subset of the layers, or a narrower model, first
            (:class:`~sparrow.training.growth.GrowthConfig`).

    Raises:
        ValueError: neither ``steps`` nor ``minutes``, or a non-positive one.
    """

    steps: int | None = None
    minutes: float | None = None
    seed: int = 0
    device: str = "cpu"
    log_every_s: float = 15.0
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    growth: GrowthConfig = field(default_factory=GrowthConfig)

    def __post_init__(self) -> None:
        if self.steps is None and self.minutes is None:
            raise ValueError("train: give steps, minutes or both")
        if (self.steps is not None and self.steps < 1) or (self.minutes is not None and not self.minutes > 0):
            raise ValueError(f"train: steps must be >= 1 and minutes > 0, got {self.steps}, {self.minutes}")

    def progress(self, step: int, elapsed_s: float) -> float:
        """The fraction of the run done after ``step`` steps and ``elapsed_s`` seconds."""
        by_steps = step / self.steps if self.steps else 0.0
        return max(by_steps, elapsed_s / (60.0 * self.minutes) if self.minutes else 0.0)

    def contexts(self) -> list[int]:
        """The contexts of the final accuracy table."""
        return sorted(self.eval.lengths) if self.eval.lengths else self.curriculum.levels()


class LossParts(NamedTuple):
    loss: torch.Tensor  # [] the loss to minimise
    answer_rows: torch.Tensor  # [B] detached: each example's mean answer loss
    prompt: torch.Tensor | None  # [] detached: the second term (None when prompt_weight is 0)


def teacher_forced_loss(logits: torch.Tensor, targets: torch.Tensor, roles: torch.Tensor, cfg: LossConfig) -> LossParts:
    """The loss of :class:`LossConfig` on ``logits`` ``[B, T, V]`` (float32) of ``targets`` ``[B, T]`` int64 with
    their ``roles`` ``[B, T]`` int8 (:mod:`sparrow.training.data`). Every example needs one answer token."""
    answer = roles == ANSWER
    if cfg.answer_eos:
        answer |= roles == EOS
    nll = F.cross_entropy(logits[answer], targets[answer], reduction="none")  # [answer tokens]
    per_row = logits.new_zeros(answer.shape[0]).index_add(0, answer.nonzero()[:, 0], nll) / answer.sum(1).clamp_min(1)
    # the token mean's gradient is the same as cross_entropy(reduction="mean")'s, bit for bit
    answer_loss = per_row.mean() if cfg.answer_mean == "example" else nll.mean()
    if not cfg.prompt_weight:
        return LossParts(answer_loss, per_row.detach(), None)
    context = roles == PROMPT if cfg.prompt_tokens == "prompt" else roles != IGNORED
    prompt = F.cross_entropy(logits[context], targets[context])
    return LossParts(answer_loss + cfg.prompt_weight * prompt, per_row.detach(), prompt.detach())


def draw_prompt_positions(roles: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    """``roles`` ``[B, T]`` with each prompt position kept with probability ``fraction`` and the others
    :data:`IGNORED` (the loss then skips them; answers and ``<eos>`` untouched), drawn on the CPU from ``seed``
    (the same seed, the same draw, on any device). ``fraction`` 1: ``roles`` itself."""
    if fraction >= 1:
        return roles
    draw = torch.rand(roles.shape, generator=torch.Generator().manual_seed(seed))
    drop = (roles.cpu() == PROMPT) & (draw >= fraction)
    return roles.masked_fill(drop.to(roles.device), IGNORED)


def chunked_teacher_forced_loss(model: torch.nn.Module, h: torch.Tensor, targets: torch.Tensor, roles: torch.Tensor,
                                cfg: LossConfig) -> LossParts:
    """:func:`teacher_forced_loss` from the final hidden states ``h`` ``[B, T, E]`` (before the final norm) of a
    torchtune decoder: the logits of only the positions a term reads, ``cfg.logits_chunk`` positions at a time
    under activation checkpointing, so no more than ``logits_chunk × vocab`` logits exist in the forward or the
    backward pass."""
    answer = roles == ANSWER
    if cfg.answer_eos:
        answer |= roles == EOS
    context = None
    if cfg.prompt_weight:
        context = roles == PROMPT if cfg.prompt_tokens == "prompt" else roles != IGNORED
    need = answer | context if context is not None else answer
    h_sel, t_sel = h[need], targets[need]
    parts = [checkpoint(_position_nll, model, h_sel[s:s + cfg.logits_chunk], t_sel[s:s + cfg.logits_chunk],
                        use_reentrant=False) for s in range(0, h_sel.shape[0], cfg.logits_chunk)]
    nll_all = h.new_zeros(answer.shape, dtype=torch.float32).masked_scatter(need, torch.cat(parts))
    nll = nll_all[answer]
    per_row = nll_all.new_zeros(answer.shape[0]).index_add(0, answer.nonzero()[:, 0], nll) / answer.sum(1).clamp_min(1)
    answer_loss = per_row.mean() if cfg.answer_mean == "example" else nll.mean()
    if context is None:
        return LossParts(answer_loss, per_row.detach(), None)
    prompt = nll_all[context].mean()
    return LossParts(answer_loss + cfg.prompt_weight * prompt, per_row.detach(), prompt.detach())


def _position_nll(model: torch.nn.Module, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model.output(model.norm(h)).float()  # [n, V]
    return F.cross_entropy(logits, targets, reduction="none")


@dataclass
class _Run:
    """A run's counters, kept across a resume (seconds of training, not of checkpoints)."""

    elapsed_s: float = 0.0
    tokens: int = 0
    examples: int = 0
    data_wait_s: float = 0.0
    eval_at_s: float = 0.0  # when the last progress evaluation ended
    progress: list = field(default_factory=list)
    curve: list = field(default_factory=list)
    resumed_at: list = field(default_factory=list)  # the steps a run continued from
    grown_at: dict | None = None  # when the run grew to the whole model (growth on): step, elapsed_s, max_context


class Trainer:
    """Trains ``model`` in place on ``source``'s batches (see the module docstring).

    Args:
        model: a decoder on ``config.device`` whose ``max_seq_len`` holds the source's longest sequence.
        config: the run.
        source: the batches.
        eval_tasks: name -> family, for the progress evaluations (the names ``config.eval.tasks`` picks);
            none: no progress evaluation (the curriculum then moves by its time caps alone).
        log: where progress lines go (``print`` by default).

    Raises:
        ValueError: the model is too short for the source's sequences at the curriculum's longest context,
            ``config.eval.tasks`` names a task ``eval_tasks`` does not hold, or ``config.growth`` asks for more
            starting layers than the model has, a starting width wider than the model or not a multiple of its
            key-value heads, or a model whose layers cannot grow (nothing changed then).
    """

    def __init__(self, model: torch.nn.Module, config: TrainConfig, source: BatchSource, *,
                 eval_tasks: Mapping[str, TaskFamily] | None = None, log: Callable[[str], None] = print) -> None:
        longest = source.longest_sequence(config.curriculum.max_context)
        if getattr(model, "max_seq_len", longest) < longest:
            raise ValueError(f"model max_seq_len {model.max_seq_len} is too short: the data makes sequences of up "
                             f"to {longest} tokens at context {config.curriculum.max_context}")
        self.eval_tasks = {}
        if eval_tasks:
            missing = [t for t in config.eval.tasks if t not in eval_tasks]
            if missing:
                raise ValueError(f"eval.tasks names {missing}, not among the evaluation tasks {sorted(eval_tasks)}")
            self.eval_tasks = {t: eval_tasks[t] for t in config.eval.tasks}
        self._shallow = None  # the layers trained before the growth (growth.start_layers)
        self._narrowed = None  # the full-size initial tensors while the model runs narrow (growth.start_* widths)
        if config.growth.enabled:
            check_growable(model)
            if config.growth.start_layers:
                self._shallow = shallow_layers(len(model.layers), config.growth.start_layers)
            ids, start_vocab = getattr(source, "vocab_size", None), config.growth.start_vocab
            if start_vocab and (ids is None or ids > start_vocab):
                raise ValueError(f"growth.start_vocab={start_vocab}: the data's ids reach "
                                 f"{'an unknown bound' if ids is None else ids} (its source's vocab_size)")
            if config.growth.narrow:
                self._narrowed = narrow_(model, config.growth.start_width(model))
        self.model, self.config, self.source, self.log = model, config, source, log
        self.device = torch.device(config.device)
        opt = config.optimizer
        # the layers that join at the growth in groups of their own (their learning rate warms up from it)
        later = {id(p) for i, layer in enumerate(model.layers) if i not in self._shallow
                 for p in layer.parameters()} if self._shallow is not None else set()
        groups = [{"params": [p for p in model.parameters() if (p.dim() >= 2) == matrix and (id(p) in later) == grown],
                   "weight_decay": opt.weight_decay if matrix else 0.0, "grown": grown}
                  for grown in (False, True) for matrix in (True, False)]
        self.optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=opt.lr, betas=opt.betas,
                                           **({"fused": True} if self.device.type == "cuda" else {}))
        self.curriculum = Curriculum(config.curriculum, seed=config.seed)
        self.step = 0
        self.run = _Run()
        self._stop_requested = False

    def request_stop(self) -> None:
        """Ask :meth:`train` to stop after the step it is in: it then saves the state through its ``checkpoint``
        (when it has one) and returns with ``stopped`` true, without the end-of-run growth. Only sets a flag, so a
        signal handler may call it (a call's time limit, a preemption)."""
        self._stop_requested = True

    def train_step(self, batch: Batch, lr: float) -> LossParts:
        """One optimizer step on ``batch`` at learning rate ``lr``."""
        roles = draw_prompt_positions(batch.roles, self.config.loss.prompt_fraction,
                                      self.config.seed * 1_000_003 + self.step)
        x, roles = (to_device(t, self.device) for t in (batch.tokens, roles))
        for group in self.optimizer.param_groups:
            group["lr"] = lr * self._grown_lr_scale() if group["grown"] else lr
        loss_cfg = self.config.loss
        with active_layers(self.model, self.active_layers):
            with autocast(self.device):
                if loss_cfg.logits_chunk:
                    parts = chunked_teacher_forced_loss(self.model, hidden_states(self.model, x[:, :-1]), x[:, 1:],
                                                        roles, loss_cfg)
                else:
                    logits = self.model(x[:, :-1])
            if not loss_cfg.logits_chunk:
                parts = teacher_forced_loss(logits.float(), x[:, 1:], roles, loss_cfg)
            self.optimizer.zero_grad(set_to_none=True)
            parts.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.optimizer.max_grad_norm)
        self.optimizer.step()
        self.step += 1
        return parts

    def evaluate(self, examples: int) -> dict[str, dict[int, float]]:
        """Greedy held-out accuracy of each curriculum task at the shortest and the current longest context."""
        contexts = sorted({self.config.curriculum.min_context, self.curriculum.top})
        tokens = max(8192, 2 * max(contexts))
        with active_layers(self.model, self.active_layers):
            return {name: {n: greedy_accuracy(self.model, family(n), examples, seed=self.config.eval.seed,
                                              batch_tokens=tokens) for n in contexts}
                    for name, family in self.eval_tasks.items()}

    @property
    def active_layers(self) -> list[int] | None:
        """The indices of the layers a step runs now: the starting subset until the run grows, else None
        (every layer)."""
        return self._shallow if self._shallow is not None and self.run.grown_at is None else None

    def _grown_lr_scale(self) -> float:
        """The grown layers' share of the step's learning rate: a linear warm-up over ``growth.warmup_steps`` steps
        from the growth (0 before it: those layers get no gradient then)."""
        if self.run.grown_at is None:
            return 0.0
        return min(1.0, (self.step - self.run.grown_at["step"] + 1) / max(1, self.config.growth.warmup_steps))

    def _grow(self, elapsed_s: float) -> None:
        """The whole width (:func:`widen_`) and every layer from now on; the layers that sat out start as the
        identity (:func:`grow_`)."""
        parts = []
        if self._narrowed is not None:
            narrow = widen_(self.model, self._narrowed, self.optimizer)
            full, self._narrowed = model_width(self.model), None
            parts.append(f"width {narrow.embed_dim} -> {full.embed_dim}, query heads {narrow.num_heads} -> "
                         f"{full.num_heads}, MLP {narrow.intermediate_dim} -> {full.intermediate_dim}"
                         + (f", ids {narrow.vocab} -> {full.vocab}" if narrow.vocab != full.vocab else ""))
        if self._shallow is not None:
            added = grow_(self.model, self._shallow)
            parts.append(f"{len(self._shallow)} -> {len(self.model.layers)} layers ({len(added)} start as the "
                         "identity)")
        self.run.grown_at = {"step": self.step, "elapsed_s": round(elapsed_s, 1), "max_context": self.curriculum.top}
        self.log(f"growth: {'; '.join(parts)} at step {self.step} (longest context {self.curriculum.top})")

    @property
    def _growing(self) -> bool:
        """Whether the run is still to grow."""
        return self.config.growth.enabled and self.run.grown_at is None

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run continues from, besides the model and the optimizer (JSON-able): the step, the run's
        counters, the curriculum and the data stream (a source without ``state_dict`` cannot be resumed).

        Raises:
            TypeError: the source has no ``state_dict``.
        """
        if not hasattr(self.source, "state_dict"):
            raise TypeError(f"{type(self.source).__name__} keeps no state: a run on it cannot be resumed")
        return {"step": self.step, "run": dataclasses.asdict(self.run), "curriculum": self.curriculum.state_dict(),
                "source": self.source.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s ``state``, then restore the model and the optimizer (in that order:
        a run that started narrow and grew before the state was saved is widened here, to the shapes the saved
        tensors have): a run of ``steps`` steps (no ``minutes``) then ends with the same weights, bit for bit, as
        one never stopped.

        Raises:
            TypeError: the source has no ``load_state_dict``.
            ValueError: the state does not fit this run's curriculum or mix (nothing is changed then).
        """
        if not hasattr(self.source, "load_state_dict"):
            raise TypeError(f"{type(self.source).__name__} keeps no state: a run on it cannot be resumed")
        run = _Run(**state["run"])
        probe = Curriculum(self.config.curriculum)
        probe.load_state_dict(state["curriculum"])  # checks the state before anything changes
        self.source.load_state_dict(state["source"])
        self.curriculum, self.run, self.step = probe, run, int(state["step"])
        run.resumed_at.append(self.step)
        if run.grown_at is not None and self._narrowed is not None:  # the saved tensors are full size
            widen_(self.model, self._narrowed, self.optimizer)
            self._narrowed = None

    def train(self, *, checkpoint: Callable[[], None] | None = None, checkpoint_every_s: float = 0.0) -> dict[str, Any]:
        """Run to the end (from where :meth:`load_state_dict` left it); returns what the run did (steps, tokens,
        examples, seconds, the curriculum's events, the progress evaluations, the mean losses of each progress
        line, the share of time spent waiting for data, the config). ``checkpoint`` is called every
        ``checkpoint_every_s`` seconds, between steps (its own time is not counted in the run's), and once more when
        the run stops on :meth:`request_stop` (``stopped`` true in what it returns). Leaves the model's
        ``requires_grad`` flags and train / eval mode as they were, its gradients cleared."""
        cfg, model, run, cur = self.config, self.model, self.run, self.curriculum
        flags, was_training = [p.requires_grad for p in model.parameters()], model.training
        model.requires_grad_(True).train()
        t0 = time.perf_counter() - run.elapsed_s  # a resumed run's clock continues
        tok_at_log, losses = run.tokens, {"prompt": []}
        t_log = t_ckpt = time.perf_counter()
        t_eval = t0 + run.eval_at_s
        stopped = False
        try:
            while (frac := cfg.progress(self.step, time.perf_counter() - t0)) < 1.0:
                if self._stop_requested:
                    stopped = True
                    break
                elapsed = time.perf_counter() - t0
                if cur.update(frac, elapsed_s=elapsed):
                    self.log(f"curriculum: longest context -> {cur.top} ({cfg.curriculum.mode} schedule)")
                if self._growing and cfg.growth.due(cur.top, frac):
                    self._grow(elapsed)
                tw = time.perf_counter()
                batch = self.source.next(cur.sample())
                run.data_wait_s += time.perf_counter() - tw
                lr = cfg.optimizer.lr_at(self.step, frac)
                parts = self.train_step(batch, lr)
                run.tokens += batch.tokens.numel()
                run.examples += len(batch.family)
                for name in dict.fromkeys(batch.family):
                    idx = [i for i, f in enumerate(batch.family) if f == name]
                    losses.setdefault(name, []).append(parts.answer_rows[idx].mean())
                if parts.prompt is not None:
                    losses["prompt"].append(parts.prompt)
                now = time.perf_counter()
                if now - t_log >= cfg.log_every_s:
                    self._log_progress(batch, lr, losses, (run.tokens - tok_at_log) / (now - t_log), now - t0)
                    losses = {"prompt": []}
                    t_log, tok_at_log = now, run.tokens
                done = cfg.progress(self.step, now - t0)
                left_s = (now - t0) * (1 - done) / max(done, 1e-9)
                if self.eval_tasks and cfg.eval.every_s and now - t_eval >= cfg.eval.every_s \
                        and left_s > 0.5 * cfg.eval.every_s:
                    self._progress_eval(t0)
                    t_eval = time.perf_counter()
                    run.eval_at_s = t_eval - t0
                if checkpoint is not None and checkpoint_every_s and \
                        time.perf_counter() - t_ckpt >= checkpoint_every_s:
                    t_c = time.perf_counter()
                    run.elapsed_s = t_c - t0
                    checkpoint()
                    t_ckpt = time.perf_counter()
                    t0 += t_ckpt - t_c  # the checkpoint's time is not the run's
            if stopped:  # asked to stop: the state a resumed run continues from, unless there is nowhere to put it
                self.log(f"stopped at step {self.step} on request" + ("; saving the training state" if checkpoint
                                                                      else " (no checkpoint to save the state to)"))
                if checkpoint is not None:
                    run.elapsed_s = time.perf_counter() - t0
                    checkpoint()
                    t0 = time.perf_counter() - run.elapsed_s
            elif self._growing:  # a run that ended before its growth still ends whole
                self._grow(time.perf_counter() - t0)
        finally:
            run.elapsed_s = time.perf_counter() - t0
            for p, f in zip(model.parameters(), flags):
                p.requires_grad_(f)
                p.grad = None
            model.train(was_training)
        train_s = run.elapsed_s
        self.log(f"trained {self.step} steps, {run.tokens / 1e6:.1f}M tokens, {run.examples} examples in "
                 f"{train_s:.0f} s")
        return {"steps": self.step, "tokens_seen": run.tokens, "examples_seen": run.examples,
                "train_s": round(train_s, 1), "final_max_context": cur.top, "curriculum_events": cur.events,
                "progress": run.progress, "loss_curve": run.curve, "resumed_at": run.resumed_at,
                "grown_at": run.grown_at, "stopped": stopped,
                "data_wait_frac": round(run.data_wait_s / max(train_s, 1e-9), 3), "config": dataclasses.asdict(cfg)}

    def _log_progress(self, batch: Batch, lr: float, losses: dict[str, list[torch.Tensor]], tok_s: float,
                      elapsed_s: float) -> None:
        """A progress line, and the mean losses since the last one into the run's loss curve."""
        run = self.run
        mean = {k: float(torch.stack(v).mean()) for k, v in losses.items() if v}
        run.curve.append({"step": self.step, **{k: round(v, 4) for k, v in mean.items()}})
        means = " ".join(f"{k} {v:.3f}" for k, v in mean.items())
        self.log(f"step {self.step:5d} ctx<={self.curriculum.top:5d} L={batch.context:5d} B={len(batch.family):4d} "
                 f"tokens {run.tokens / 1e6:7.1f}M  loss {means}  lr {lr:.1e}  {tok_s / 1e3:6.0f}k tok/s  data wait "
                 f"{100 * run.data_wait_s / max(elapsed_s, 1e-9):.0f}%")

    def _progress_eval(self, t0: float) -> None:
        """A progress evaluation into the run's record; in ``auto`` mode it may move the curriculum."""
        cfg, cur, run = self.config, self.curriculum, self.run
        now = time.perf_counter()
        top, acc = cur.top, self.evaluate(cfg.eval.examples)
        row = {"elapsed_s": round(now - t0, 1), "step": self.step, "tokens": run.tokens, "max_context": top}
        row.update({f"{t}@{n}": a for t, by in acc.items() for n, a in by.items()})
        run.progress.append(row)
        self.log("eval (greedy, held out): " + "  ".join(f"{k} {v:.2f}" for k, v in row.items() if "@" in k))
        t_eval = time.perf_counter()
        at_top = {t: by[top] for t, by in acc.items()}
        if cfg.curriculum.mode == "auto" and cur.update(cfg.progress(self.step, t_eval - t0), at_top,
                                                        elapsed_s=t_eval - t0):
            self.log(f"curriculum: longest context -> {cur.top} ({cur.events[-1]['reason']}; accuracy "
                     f"at {top} {min(at_top.values()):.2f})")


def train_on_episodes(model: torch.nn.Module, task: MarkovEpisodes, *, seq_len: int, batch: int, lr: float,
                      warmup_steps: int, minutes: float | None = None, steps: int | None = None, device: str = "cpu",
                      log: Callable[[str], None] = print, log_every_s: float = 5.0) -> dict[str, Any]:
    """Train ``model`` in place on :class:`EpisodeBatches` of ``task`` (``batch`` streams of ``seq_len`` tokens; the
    plain language-model loss, token mean) with AdamW (peak ``lr``, ``warmup_steps`` of warm-up, cosine to 10 %, no
    weight decay) for ``minutes`` and / or ``steps``: the peaked, structured distributions a speculative-decoding
    measurement needs. Returns ``{"steps", "seconds", "tokens", "loss_curve": [(step, loss), ...], "final_loss"}``:
    the loss is logged (to ``log`` and the curve) every ``log_every_s`` seconds, ``final_loss`` None when it never
    was. Raises ``ValueError`` from :class:`TrainConfig` (neither
    ``minutes`` nor ``steps``) and :class:`EpisodeBatches`."""
    cfg = TrainConfig(minutes=minutes, steps=steps, device=device, log_every_s=log_every_s,
                      curriculum=CurriculumConfig(min_context=seq_len, max_context=seq_len),
                      loss=LossConfig(prompt_weight=0.0, answer_mean="token"),
                      optimizer=OptimizerConfig(lr=lr, warmup_steps=warmup_steps, weight_decay=0.0))
    stats = Trainer(model, cfg, EpisodeBatches(task, seq_len, batch), log=log).train()
    curve = stats["loss_curve"]
    return {"steps": stats["steps"], "seconds": stats["train_s"], "tokens": stats["tokens_seen"],
            "loss_curve": [(r["step"], r["episodes"]) for r in curve],
            "final_loss": curve[-1]["episodes"] if curve else None}

"""GRPO for long-context tasks with Sparrow's rollout engine.

    tune run sparrow_grpo --config recipes/configs/tiny_kv_retrieval.yaml [key=value ...]
    tune run --nproc_per_node 2 sparrow_grpo --config ... # rank 0 trains, the other ranks roll out
    tune run --nproc_per_node 4 sparrow_grpo --config ... trainer_ranks=2  # FSDP2 over ranks 0-1, 2-3 roll out

One step: sample ``group_size`` completions of ``prompts_per_step`` prompts with the rollout copy of the
policy (bf16, the configured attention backend) -> rewards -> group-normalised advantages -> log-probs
of the trainer (fp32 master weights, dense attention) -> ``ppo_epochs`` x ``minibatches`` clipped policy
updates with truncated importance sampling against the rollout's behaviour log-probs -> the new weights go
to the rollout copy through the configured weight codec (``sparrow.sync``), bit-exactly, and nowhere else.
With ``shared_prefix: true`` the trainer computes each prompt once per group (one packed sequence per
group, :func:`sparrow.rl.shared_prefix_logprobs`): the same log-probs and gradients for a fraction of the
work when prompts are long and responses short; minibatches then hold whole groups. With
``enable_activation_checkpointing: true`` each layer is recomputed in the backward pass (one layer's activations
held at a time; the same bits).

Partial rollout (``partial_rollout.enabled``): a step trains on the first ``prompts_per_step`` groups to finish and
the others keep decoding into the next step, across the weight sync (:mod:`sparrow.rl.partial`).

Distributed: ranks ``0 .. trainer_ranks-1`` train (with more than one, the model is sharded with FSDP2
and each trainer takes an equal share of every minibatch), the other ranks roll out disjoint shares of
the prompts; rank 0 gathers the whole bf16 weights and sends the sparse sync to the rollout ranks.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import sys
import time
import types
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters as dynamo_counters
from omegaconf import DictConfig, OmegaConf
from torchtune import config
from tqdm import tqdm

import sparrow.sync as ssync
from sparrow.models import load_model_state, policy_parameters, use_attention
from sparrow.profiling import profile_path, start_step_profile, write_step_profile
from sparrow.rl import (
    GRPOConfig,
    ListSource,
    PartialRollout,
    PartialRolloutConfig,
    PromptFormat,
    PromptLengths,
    TaskSource,
    aggregation_weights,
    build_rollout_batch,
    decode_response,
    emittable_ids,
    exchange_rollouts,
    group_advantages,
    grpo_loss,
    latest_checkpoint,
    load_checkpoint,
    plot_history,
    prompt_loader,
    read_optimizer_state,
    read_jsonl,
    response_logprobs,
    restore_rng_state,
    save_checkpoint,
    shared_prefix_logprobs,
    StalenessStats,
    stop_ids,
    tail_agreement,
    tail_agreement_by,
)
from sparrow.rl.recipe_config import check_config, check_values, parse
from sparrow.rollout import EngineConfig, RolloutEngine, SamplingParams
from sparrow.speculative import QuantizedSelfDrafter
from sparrow.training import init_weights


class _Trainer(NamedTuple):
    """What :meth:`GRPORecipe._setup_trainer` builds on a trainer rank."""

    model: torch.nn.Module  # fp32 master weights on the device (FSDP2-sharded over several trainer ranks)
    logprobs: Callable[..., torch.Tensor]  # the model's response log-probs (one FSDP forward when sharded)
    optimizer: torch.optim.Optimizer


class _Rollout(NamedTuple):
    """What :meth:`GRPORecipe._setup_rollout` builds on a rollout rank."""

    model: torch.nn.Module  # the bf16 rollout copy with the configured attention
    drafter: QuantizedSelfDrafter | None  # with a ``speculative`` section
    engine: RolloutEngine  # prepared: compiled and captured for every batch size, its toggle built
    rtpurbo: bool  # the copy runs RTPurbo attention


class _Sync(NamedTuple):
    """What :meth:`GRPORecipe._setup_sync` builds: both ends of the weight sync."""

    sender: ssync.SyncSender | None  # rank 0's
    receiver: ssync.SyncReceiver | None  # every rollout rank's
    transport: Any  # None on a rank outside the sync (a trainer other than rank 0)


class GRPORecipe:
    """setup -> train -> save_checkpoint -> cleanup, as in torchtune's recipes."""

    def __init__(self, cfg: DictConfig) -> None:
        check_config(cfg)  # unknown or missing keys, then wrong values, fail here, before anything runs
        check_values(cfg)
        self.cfg = cfg
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.trainers = int(cfg.get("trainer_ranks") or 1)
        if self.trainers < 1 or (self.world > 1 and self.trainers >= self.world) or (
                self.world == 1 and self.trainers != 1):
            raise ValueError(f"trainer_ranks={self.trainers} with {self.world} ranks: at least one rank must train "
                             "and, when distributed, at least one must roll out")
        self.is_trainer = self.rank < self.trainers
        self.is_main = self.rank == 0  # logs, checkpoints, sends the weight sync
        self.is_rollout = self.world == 1 or self.rank >= self.trainers
        self.device = torch.device(cfg.device)
        self.output_dir = Path(cfg.output_dir)
        self.step = 0
        self.history: list[dict[str, float]] = []
        self.grpo = GRPOConfig(**cfg.loss)
        self.group = cfg.group_size
        self.prompts_per_step = cfg.prompts_per_step
        self.sampling = dict(cfg.sampling)
        self.prompt_format = PromptFormat(**(cfg.get("prompt") or {}))
        n_roll = max(1, self.world - self.trainers)
        if self.prompts_per_step % n_roll:
            raise ValueError(f"prompts_per_step ({self.prompts_per_step}) must divide evenly over the {n_roll} "
                             "rollout ranks")
        if (self.prompts_per_step * self.group // cfg.minibatches) % self.trainers:
            raise ValueError(f"a minibatch ({self.prompts_per_step * self.group // cfg.minibatches} samples) must "
                             f"divide evenly over the {self.trainers} trainer ranks")
        self.shared_prefix = bool(cfg.get("shared_prefix", False))
        self.checkpoint_layers = bool(cfg.get("enable_activation_checkpointing", False))
        self.profile_steps = set(cfg.get("profile_steps") or ())  # steps run under the profiler (1-based)
        share = self.prompts_per_step * self.group // cfg.minibatches // self.trainers
        if self.shared_prefix and (share % self.group or cfg.micro_batch_size % self.group):
            raise ValueError(f"shared_prefix packs whole groups: a trainer's share of a minibatch ({share} samples) "
                             f"and micro_batch_size ({cfg.micro_batch_size}) must be multiples of group_size "
                             f"({self.group})")
        self.partial_cfg = PartialRolloutConfig(**(cfg.get("partial_rollout") or {}))
        if self.partial_cfg.enabled:
            self.partial_cfg.check(self.prompts_per_step, n_roll)
        self.partial: PartialRollout | None = None  # this rollout rank's, with partial rollout on
        self._setup_metrics: dict[str, float] = {}  # setup/* phases, logged with the first step

    # ------------------------------------------------------------------------------------------- setup
    def setup(self, cfg: DictConfig) -> None:
        self.device, self.mesh, self.sync_group = self._setup_distributed(cfg)
        torch.manual_seed(cfg.seed)  # every rank draws the same batches and initial weights
        self.tokenizer, self.stop_ids, self.vocab_limit = self._setup_tokenizer(cfg)
        self.reward_fn = config.instantiate(cfg.reward)
        self.loader, self.eval_set = self._setup_data(cfg)
        model = self._setup_model(cfg)
        ckpt = latest_checkpoint(self.output_dir / "checkpoints") if cfg.resume_from_checkpoint else None
        if ckpt is not None:
            self.step, self.history = self._resume(ckpt, model)
        self.data_iter = iter(self.loader)  # from the resumed data position
        if self.is_rollout:  # before the trainer moves and shards the model: the rollout copy is a bf16 cast of it
            self.rollout_model, self.drafter, self.engine, self.rtpurbo = self._setup_rollout(cfg, model)
        if self.is_trainer:
            self.model, self._logprobs, self.optimizer = self._setup_trainer(cfg, model, ckpt)
        del model
        self.sender, self.receiver, self.transport = self._setup_sync(cfg)
        if self.is_rollout:  # the engine stamps tokens with the step's policy version
            self.engine.set_policy_version(self.step)
            self.partial = self._setup_partial_rollout(cfg, ckpt)
        if ckpt is not None:  # last: restore the random state the checkpointed run had at this step
            restore_rng_state(ckpt)
        if self.is_main:
            self.metric_logger = config.instantiate(cfg.metric_logger)
            self.metric_logger.log_config(cfg)

    def _setup_distributed(self, cfg: DictConfig) -> tuple[torch.device, Any, Any]:
        """The process group, when distributed; returns this rank's device, the trainers' FSDP mesh (None with one
        trainer) and the sync group (rank 0 and the rollout ranks; None in one process)."""
        if self.world == 1:
            return self.device, None, None
        device = self.device
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        dist.init_process_group(backend, timeout=timedelta(seconds=cfg.dist_timeout_s))
        # collectives every rank takes part in, in this order: the trainers' FSDP mesh, the sync group
        mesh = None
        if self.trainers > 1:
            from torch.distributed.device_mesh import DeviceMesh

            mesh = DeviceMesh(device.type, list(range(self.trainers)))
        return device, mesh, dist.new_group([0] + list(range(self.trainers, self.world)))

    def _setup_tokenizer(self, cfg: DictConfig) -> tuple[Any, tuple[int, ...], int]:
        """The tokenizer, the ids that stop a response and how many ids a response may use."""
        tokenizer = config.instantiate(cfg.tokenizer)
        # a checkpoint's embedding often has rows past the tokenizer (Qwen2.5: 271): never sampled, never trained
        return tokenizer, stop_ids(tokenizer), emittable_ids(tokenizer)

    def _setup_data(self, cfg: DictConfig) -> tuple[Any, list[tuple[list[int], str]]]:
        """The training prompts' loader (every rank draws the same batches; rollout ranks take disjoint slices) and the
        held-out set, tokenized the same way: ``(prompt ids, answer)`` pairs."""
        max_prompt = cfg.engine.max_prompt_len
        if cfg.get("dataset") is not None:
            rows = read_jsonl(cfg.dataset)
            source, eval_rows = ListSource(rows, seed=cfg.seed), rows[: cfg.eval.prompts]
        else:
            task = config.instantiate(cfg.task)
            source = TaskSource(task, seed=cfg.seed)
            eval_rows = [task.example(cfg.seed + 10_007, i) for i in range(cfg.eval.prompts)]
        loader = prompt_loader(source, self.tokenizer, batch_size=self.prompts_per_step, max_prompt_len=max_prompt,
                               prompt_format=self.prompt_format)
        eval_set = [(self.prompt_format.encode(self.tokenizer, e.prompt), e.answer) for e in eval_rows]
        # the held-out prompts measured with this run's tokenizer and format, before anything is built or compiled
        lengths = PromptLengths([len(p) for p, _ in eval_set], [len(e.prompt) for e in eval_rows])
        lengths.check(max_prompt_len=max_prompt, max_new_tokens=cfg.sampling.max_new_tokens,
                      max_seq_len=cfg.model.get("max_seq_len"),
                      where="the dataset's prompts" if cfg.get("dataset") is not None else "the task's prompts")
        self._add_setup_metrics({"setup/prompt_tokens_max": float(max(lengths.tokens)),
                                 "setup/prompt_tokens_mean": sum(lengths.tokens) / len(lengths.tokens)})
        return loader, eval_set

    def _setup_model(self, cfg: DictConfig) -> torch.nn.Module:
        """The policy's weights on the CPU in fp32: built, then initialised or loaded."""
        model = config.instantiate(cfg.model)
        rows = model.tok_embeddings.num_embeddings
        if self.vocab_limit > rows:
            raise ValueError(f"the tokenizer has {self.vocab_limit} ids but the model only {rows} embedding rows")
        if cfg.get("init_std") is not None:  # training from scratch: small random weights
            init_weights(model, cfg.init_std)
        if cfg.get("checkpoint") is not None:  # a Sparrow / torchtune state dict (safetensors)
            load_model_state(model, _read_weights(Path(cfg.checkpoint), "starting checkpoint"))
        return model

    def _resume(self, ckpt: Path, model) -> tuple[int, list[dict[str, float]]]:
        """The checkpoint's weights into ``model`` (before sharding; a sharded optimizer's state comes after it) and its
        data position into the loader; returns its step and history."""
        state = load_checkpoint(ckpt, model=model, optimizer=None, restore_rng=False)
        self.loader.load_state_dict(state["data"])
        return state["step"], state.get("history", [])

    def _setup_trainer(self, cfg: DictConfig, model, ckpt: Path | None) -> _Trainer:
        """The fp32 trainer (dense attention; FSDP2 over the trainer ranks), its log-prob pass and optimizer."""
        model = model.to(self.device)
        if self.trainers > 1:
            from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

            for layer in model.layers:
                fully_shard(layer, mesh=self.mesh)
            fully_shard(model, mesh=self.mesh)
            # log-probs call the model's parts directly (chunked lm_head): one FSDP forward around them, so
            # the root's parameters (embeddings, final norm, lm_head) are gathered for it
            model.response_logprobs = types.MethodType(self._logprob_fn(), model)
            register_fsdp_forward_method(model, "response_logprobs")
            logprobs = model.response_logprobs
        else:
            logprobs = functools.partial(self._logprob_fn(), model)
        optimizer = config.instantiate(cfg.optimizer, model.parameters())
        if ckpt is not None:
            _load_optimizer(ckpt, model, optimizer, sharded=self.trainers > 1)
        return _Trainer(model, logprobs, optimizer)

    def _setup_rollout(self, cfg: DictConfig, model) -> _Rollout:
        """The bf16 rollout copy (configured attention), the drafter, the engine compiled and captured for every
        batch size (:meth:`_prepare_engine`). Its phases (compilation per kind of step, graph capture, calibration)
        show as progress bars and are logged as ``setup/*`` with the first step's metrics."""
        t_setup = time.perf_counter()
        rollout_model = copy.deepcopy(model)
        use_attention(rollout_model, config.instantiate(cfg.attention))
        rollout_model.to(device=self.device, dtype=torch.bfloat16).eval().requires_grad_(False)
        # optional self-speculative decoding: a quantized drafter sharing the rollout copy's KV cache, and the
        # toggle that decides when and how far to draft (built on the engine: a cost model measures it)
        spec, drafter, engine_cfg = cfg.get("speculative"), None, dict(cfg.engine)
        lengths: list[int] = []
        if spec is not None:
            drafter = QuantizedSelfDrafter(rollout_model, config.instantiate(spec.drafter))
            # scratch for the longest draft the toggle can ask for: its ladder and / or its fixed length
            lengths = list(spec.toggle.get("draft_lengths") or []) + [spec.toggle.get("num_draft") or 4]
            engine_cfg["max_draft"] = max(lengths)
        # compiled code and calibrations persist under the run's output (engine.compile_cache; null: none), so the
        # next run of this configuration starts warm
        engine_cfg.setdefault("compile_cache", str(self.output_dir / "compile_cache"))
        engine_cfg.setdefault("progress", self.rank == (0 if self.world == 1 else self.trainers))
        engine = RolloutEngine(rollout_model, EngineConfig(**engine_cfg), drafter=drafter)
        warm = self._prepare_engine(cfg, engine, rollout_model, lengths)
        # RTPurbo selection statistics need host syncs: recorded only when the decode step is not compiled
        rtpurbo = _uses_rtpurbo(rollout_model, record=not cfg.engine.get("compile", True))
        self._add_setup_metrics(engine.setup_seconds)
        self._add_setup_metrics({f"setup/graphs_{k}": float(n) for k, n in engine.compiled_graphs.items()})
        self._add_setup_metrics({"setup/rollout_s": time.perf_counter() - t_setup, "setup/cache_warm": float(warm)})
        return _Rollout(rollout_model, drafter, engine, rtpurbo)

    def _prepare_engine(self, cfg: DictConfig, engine: RolloutEngine, rollout_model, draft_lengths: list[int]) -> bool:
        """With ``engine.compile``, every batch size compiled and captured now, not in a step; the toggle built on the
        engine (a cost model measures it: ``setup/calibrate_s``); the sparsity schedule's first tiers. Returns whether
        the compile cache was warm (an earlier run compiled this configuration)."""
        spec, compiled, params = cfg.get("speculative"), cfg.engine.get("compile", True), self._sampling_params()
        cache = engine.compile_cache
        warm = compiled and cache is not None and cache.warm
        if compiled:  # the draft lengths of the config first, so a calibration only measures
            engine.prepare(params, draft_lengths=draft_lengths)
        if spec is not None:
            t0, before = time.perf_counter(), _seconds(engine.setup_seconds)
            engine.toggle = config.instantiate(spec.toggle, engine=engine, params=params)
            # the cost model's measurement (or its load from the cache), without what it compiled or captured
            spent = time.perf_counter() - t0 - (_seconds(engine.setup_seconds) - before)
            self._add_setup_metrics({"setup/calibrate_s": max(0.0, spent)})
        self._apply_rtpurbo_schedule(rollout_model)
        if compiled:
            if spec is not None:
                engine.prepare(params)  # whatever else the toggle can ask for
            if cfg.eval.every:  # the greedy evaluation is a sampling mode of its own
                engine.prepare(self._eval_params())
        return warm

    # ------------------------------------------------------------------------------- setup phases
    def _add_setup_metrics(self, values: dict[str, float]) -> None:
        """Setup phase seconds (and counts), logged once, with the first step's metrics (``setup/*``)."""
        self._setup_metrics.update(values)

    def _take_setup_metrics(self) -> dict[str, float]:
        """The setup metrics not logged yet (then none: they go out with the first step)."""
        out, self._setup_metrics = self._setup_metrics, {}
        return out

    def _eval_params(self) -> SamplingParams:
        """Greedy decoding for the held-out evaluation."""
        return SamplingParams(temperature=0.0, max_new_tokens=self.sampling["max_new_tokens"],
                              stop_token_ids=self.stop_ids, vocab_limit=self.vocab_limit)

    @functools.cached_property
    def schedule(self):
        """The RTPurbo sparsity schedule (``rtpurbo_schedule``), or None; every rank keeps one (rank 0 measures the
        tail, the rollout ranks apply the top-p)."""
        from sparrow.attention.rtpurbo_schedule import SparsitySchedule

        sec = self.cfg.get("rtpurbo_schedule")
        return None if sec is None else SparsitySchedule(config.instantiate(sec))

    def _apply_rtpurbo_schedule(self, rollout_model) -> None:
        """The schedule's first top-p tiers into the rollout copy's RTPurbo buffers (in place: graphs stay valid)."""
        if self.schedule is not None:
            try:
                self.schedule.apply(rollout_model)
            except ValueError as e:
                raise ValueError(f"rtpurbo_schedule needs RTPurbo rollout attention: {e}") from None

    def _setup_sync(self, cfg: DictConfig) -> _Sync:
        """Both ends of the weight sync: the sender on rank 0 (from the trainer's bf16 weights), the receiver on every
        rollout rank (over the rollout copy: version 0 of the sync, the trainer's bf16 bits), the codec's warm-up, the
        transport."""
        weights, sender, receiver = None, None, None
        if self.is_trainer:
            weights = self._trainer_bf16()  # a collective over the trainers when sharded
            if self.is_main:
                sender = ssync.SyncSender(weights, codec=cfg.sync.codec, bucket_bytes=cfg.sync.bucket_bytes,
                                          anchor_every=cfg.sync.anchor_every)
        if self.is_rollout:
            receiver = ssync.SyncReceiver(policy_parameters(self.rollout_model), verify=cfg.sync.verify)
        if cfg.sync.codec != "dense" and self.device.type == "cuda" and (self.is_main or self.is_rollout):
            # the sparse codec's Triton kernels compile now, not inside the first sync that carries changes
            t0 = time.perf_counter()
            ssync.warmup(weights if self.is_main else policy_parameters(self.rollout_model), codec=cfg.sync.codec,
                         bucket_bytes=cfg.sync.bucket_bytes)
            self._wait_device()
            self._add_setup_metrics({"setup/sync_warmup_s": time.perf_counter() - t0})
        transport = None
        if self.world == 1:
            transport = ssync.InProcessTransport()
        elif self.is_main or self.is_rollout:
            transport = ssync.DistributedTransport(src=0, group=self.sync_group, device=self.device)
        return _Sync(sender, receiver, transport)

    def _setup_partial_rollout(self, cfg: DictConfig, ckpt: Path | None) -> PartialRollout | None:
        """With ``partial_rollout.enabled``, this rollout rank's share of the groups in flight
        (:class:`sparrow.rl.PartialRollout`, drawing its share of each batch); else None. On resume the checkpointed
        groups are queued first and restart (``docs/grpo.md``)."""
        if not self.partial_cfg.enabled:
            return None
        n_roll = max(1, self.world - self.trainers)
        share = self.prompts_per_step // n_roll
        lo = 0 if self.world == 1 else (self.rank - self.trainers) * share

        def score(row: dict[str, Any], s) -> float:
            return self.reward_fn(row["answer"], decode_response(self.tokenizer, s.tokens, self.stop_ids))

        partial = PartialRollout(self.engine, self.partial_cfg, prompts_per_step=share,
                                 overprovision=self.partial_cfg.overprovision // n_roll, group=self.group,
                                 draw=lambda: next(self.data_iter)[lo: lo + share], score=score)
        if ckpt is not None:
            self._resume_partial(ckpt, partial, n_roll)
        return partial

    def _resume_partial(self, ckpt: Path, partial: PartialRollout, n_roll: int) -> None:
        """This rollout rank's data position and held groups from the checkpoint ``ckpt``, into the loader and
        ``partial``; a synchronous run's checkpoint has none: its data position stands."""
        saved = json.loads((ckpt / "state.json").read_text()).get("partial")
        if saved is None:
            return
        ranks = saved["ranks"]
        if len(ranks) != n_roll:
            raise ValueError(f"the checkpoint {ckpt} holds the in-flight groups of {len(ranks)} rollout ranks; "
                             f"this run has {n_roll}")
        mine = ranks[0 if self.world == 1 else self.rank - self.trainers]
        self.loader.load_state_dict(mine["loader"])
        self.data_iter = iter(self.loader)
        partial.load_state_dict(mine)

    # ------------------------------------------------------------------------------------------- train
    def _rollout(self, batch: list[dict[str, Any]] | None):
        """Generate on this rank's share of the prompts; returns (prompts, samples, rewards). With partial rollout
        (``batch`` None): the groups this step trains, its ``partial/*`` counters in ``self.partial_metrics``."""
        if self.partial is not None:
            eval_next = self.cfg.eval.every and (self.step + 1) % self.cfg.eval.every == 0
            out = self.partial.step(self.step, self._sampling_params(), drain=bool(eval_next))  # eval: engine free
            self.partial_metrics = out.metrics
            return [r["prompt_ids"] for r in out.rows], out.generation, out.rewards
        share = len(batch) // max(1, self.world - self.trainers)
        lo = 0 if self.world == 1 else (self.rank - self.trainers) * share
        mine = batch[lo: lo + share] if self.world > 1 else batch
        prompts = [b["prompt_ids"] for b in mine]
        out = self.engine.generate(prompts, self.group, self._sampling_params())
        rewards = torch.tensor([
            self.reward_fn(mine[i // self.group]["answer"], decode_response(self.tokenizer, s.tokens, self.stop_ids))
            for i, s in enumerate(out.samples)
        ], dtype=torch.float32)
        return prompts, out, rewards

    def _sampling_params(self) -> SamplingParams:
        """The behaviour policy of this step: the engine samples from it and the trainer's log-probs use the same
        processing (vocabulary limit, temperature, top-k, top-p)."""
        return SamplingParams(**self.sampling, stop_token_ids=self.stop_ids, vocab_limit=self.vocab_limit,
                              seed=self.cfg.seed * 1_000_003 + self.step)

    def _rollout_metrics(self, gen) -> dict[str, float]:
        st = gen.stats
        m = {"time/prefill_s": st.prefill_s, "time/decode_s": st.decode_s}
        if self.drafter is not None:
            m.update({"spec/acceptance": st.acceptance_rate or 0.0, "spec/tokens_per_cycle": st.tokens_per_cycle or 0.0,
                      "spec/cycles": float(st.spec_cycles)})
        if self.rtpurbo and not self.cfg.engine.get("compile", True):
            from sparrow.attention.rtpurbo import collect_selection_stats

            d = collect_selection_stats(self.rollout_model, reset=True)
            m.update({f"attention/{k}": float(v) for k, v in d.items() if "density" in k})
        return m

    def _refresh_indexer(self, prompts, samples) -> dict[str, float]:
        """A few distillation steps of the RTPurbo indexer on the latest rollouts (the policy drifts)."""
        from sparrow.calibrate import refresh_indexer

        rc = self.cfg.indexer_refresh
        seqs = [torch.tensor(list(prompts[i // self.group]) + s.tokens.tolist())
                for i, s in enumerate(samples[: rc.sequences])]
        t0 = time.perf_counter()
        with torch.enable_grad():
            report = refresh_indexer(self.rollout_model, seqs, steps=rc.steps)
        out = {"time/indexer_refresh_s": time.perf_counter() - t0}
        summary = report.summary()
        out.update({"attention/indexer_recall": summary["recall"], "attention/indexer_density": summary["density"]})
        return out

    def _train_on(self, rb, version: int | None = None) -> dict[str, float]:
        """The step's updates on ``rb``; ``version``: π_old's policy version (the staleness metrics of partial
        rollout measure token ages from it)."""
        cfg = self.cfg
        if int(rb.tokens.max()) >= self.vocab_limit:  # host tensors: a sample from outside the engine's support
            raise ValueError(f"step {self.step}: token id {int(rb.tokens.max())} is past the tokenizer's "
                             f"{self.vocab_limit} ids")
        rb = rb.to(self.device)
        N = rb.tokens.shape[0]
        lp_kwargs = dict(max_response_len=rb.max_response_len, sampling=self._sampling_params(),
                         chunk_size=cfg.logprob_chunk)
        updates = cfg.ppo_epochs * cfg.minibatches
        t0, old = time.perf_counter(), None
        if updates > 1:  # π_old of the batch (with a single update it equals π_θ: reuse it detached)
            # in the training forward's precision: at the first update π_θ / π_old is then exactly 1 (an fp32
            # π_old against a bf16-autocast π_θ made it noise, and ran the pass in fp32 matmuls)
            with torch.no_grad(), self._autocast():
                old = torch.cat([self._logprobs(rb.tokens[s], rb.prompt_len[s], rb.response_len[s], **lp_kwargs)
                                 for s in self._micro(range(N))])
        self._wait_device()
        t_logprob = time.perf_counter() - t0
        pi_old = old if updates > 1 else torch.zeros_like(rb.behaviour_logprobs)  # every token's: the tail statistic
        sums: dict[str, torch.Tensor] = {}  # on the device: one host sync per step, not per micro-batch
        mb_size, T = N // cfg.minibatches, self.trainers
        for epoch in range(cfg.ppo_epochs):
            perm = self._permutation(N)
            if T > 1 and cfg.ppo_epochs > 1:  # every trainer walks the same permutation
                dist.broadcast(perm, src=0, group=self.mesh.get_group())
            for m in range(cfg.minibatches):
                self._update(rb, perm[m * mb_size:(m + 1) * mb_size], old, pi_old, lp_kwargs, sums)
        sums.update(self._tail_sums(rb, pi_old, gather=updates == 1))
        values = torch.stack([torch.as_tensor(v, dtype=torch.float32, device=self.device) for v in sums.values()])
        if T > 1:  # every trainer holds its rows' share of each metric
            dist.all_reduce(values, group=self.mesh.get_group())
        metrics = dict(zip(sums, values.tolist()))  # the step's one read-back of its training metrics
        self._wait_device()
        metrics["time/logprob_s"] = t_logprob
        metrics["time/train_s"] = time.perf_counter() - t0 - t_logprob
        if version is not None and self.partial_cfg.enabled:  # pi_old is whole on every trainer here
            metrics.update(self._staleness_metrics(rb, pi_old, version))
        return metrics

    def _update(self, rb, idx: torch.Tensor, old: torch.Tensor | None, pi_old: torch.Tensor, lp_kwargs: dict[str, Any],
                sums: dict[str, torch.Tensor]) -> None:
        """One optimizer step on the minibatch ``idx`` of ``rb`` (this trainer's share of it when several train). Its
        metrics are summed into ``sums`` (on the device); ``old``: π_old of the batch, None with a single update
        (π_old is then π_θ, written into ``pi_old``)."""
        cfg, T, r = self.cfg, self.trainers, self.rank
        N, mb_size, updates = rb.tokens.shape[0], len(idx), cfg.ppo_epochs * cfg.minibatches
        weights = aggregation_weights(rb.mask[idx], self.grpo)  # normalised over the whole minibatch
        if T > 1:  # this trainer's share of the minibatch (FSDP sums the shares' gradients)
            part = slice(r * mb_size // T, (r + 1) * mb_size // T)
            idx, weights = idx[part], weights[part]
        self.optimizer.zero_grad(set_to_none=True)
        for s in self._micro(range(len(idx))):
            ids = idx[s]
            sub = rb.select(ids)
            with self._autocast():
                lp = self._logprobs(sub.tokens, sub.prompt_len, sub.response_len, **lp_kwargs)
            o = old[ids] if updates > 1 else lp.detach()
            if updates == 1:
                pi_old[ids] = o
            loss, mets = grpo_loss(lp, o, sub.behaviour_logprobs, sub.advantages, sub.mask, weights[s], self.grpo)
            # FSDP averages the trainers' gradients; each loss holds its rows' share of the minibatch's weights, and
            # the minibatch's gradient is their sum
            (loss * T).backward()
            for k, v in mets.items():
                sums[k] = sums.get(k, 0.0) + v * (len(ids) / (N * cfg.ppo_epochs))
            sums["loss"] = sums.get("loss", 0.0) + loss.detach() / updates
        gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
        gn = gn.full_tensor() if hasattr(gn, "full_tensor") else gn  # the norm over every shard
        sums["grad_norm"] = gn.detach() / T  # the last update's (summed over the trainers below)
        self.optimizer.step()

    def _staleness_metrics(self, rb, pi_old: torch.Tensor, version: int) -> dict[str, float]:
        """Partial rollout: the response tokens by version age (π_old's version minus the one that sampled them):
        their share, IS clip fraction, mismatch KL (:class:`sparrow.rl.StalenessStats`) and the tail agreement
        (``partial/tail_agreement_age<k>``, :func:`sparrow.rl.tail_agreement_by`)."""
        age = torch.where(rb.mask, version - rb.versions, 0)
        out = StalenessStats.of(pi_old, rb.behaviour_logprobs, rb.mask, age, self.grpo,
                                self.partial_cfg.max_staleness).metrics()
        tails = tail_agreement_by(age, rb.behaviour_logprobs, pi_old, rb.mask)
        out.update({f"partial/tail_agreement_age{k}": v for k, v in tails.items()})
        return out

    def _tail_sums(self, rb, pi_old: torch.Tensor, gather: bool) -> dict[str, torch.Tensor]:
        """Lower tail of the per-token agreement of the behaviour log-probs with π_old (``sparrow.rl.mismatch``), on
        the device; per length tier of a sparsity schedule with several. Each trainer holds 1/T of it (the metrics
        are summed over the trainers)."""
        T, sched = self.trainers, self.schedule
        if gather and T > 1:  # each trainer scored its own rows (zeros elsewhere)
            dist.all_reduce(pi_old, group=self.mesh.get_group())
        q = sched.config.quantile if sched is not None else 0.05
        out = {_tail_key(q): tail_agreement(rb.behaviour_logprobs, pi_old, rb.mask, q) / T}
        if sched is not None and len(sched.config.lengths) > 1:
            tier = sched.tier_of(torch.arange(rb.max_response_len, device=rb.mask.device)).expand_as(rb.mask)
            for i in range(len(sched.config.lengths)):
                sel = rb.mask & (tier == i)
                out[f"{_tail_key(q)}/tier{i}"] = tail_agreement(rb.behaviour_logprobs, pi_old, sel, q) / T
        return out

    def _schedule_step(self, metrics: dict[str, float]) -> dict[str, float]:
        """Between steps: the sparsity schedule moves RTPurbo's top-p by the tail rank 0 measured (sent to every
        rank); the rollout ranks write it into their backends."""
        c = self.schedule.config
        keys = [_tail_key(c.quantile)] if len(c.lengths) == 1 else \
            [f"{_tail_key(c.quantile)}/tier{i}" for i in range(len(c.lengths))]
        t = torch.tensor([metrics.get(k, float("nan")) for k in keys], dtype=torch.float64, device=self.device)
        if self.world > 1:
            dist.broadcast(t, src=0)
        tails = t.tolist()
        tail = tails[0] if len(tails) == 1 else dict(enumerate(tails))
        if self.is_rollout:
            return self.schedule.step(tail, self.rollout_model)
        top = self.schedule.update(tail)
        return {"rtpurbo/top_p": top[0], **{f"rtpurbo/top_p/tier{i}": v for i, v in enumerate(top) if i}}

    def _logprob_fn(self):
        """The trainer's log-prob function: each prompt once per group (``shared_prefix``) or one row per sample,
        layers recomputed in the backward pass with ``enable_activation_checkpointing``."""
        if self.shared_prefix:
            return functools.partial(shared_prefix_logprobs, group=self.group, checkpoint_layers=self.checkpoint_layers)
        return functools.partial(response_logprobs, checkpoint_layers=self.checkpoint_layers)

    def _permutation(self, N: int) -> torch.Tensor:
        """The order of an epoch's samples: as they are with one epoch; shuffled with several, whole groups at
        a time when the trainer packs groups (``shared_prefix``)."""
        dev = self.device
        if self.cfg.ppo_epochs == 1:
            return torch.arange(N, device=dev)
        if not self.shared_prefix:
            return torch.randperm(N, device=dev)
        G = self.group
        return (torch.randperm(N // G, device=dev)[:, None] * G + torch.arange(G, device=dev)).flatten()

    def _wait_device(self) -> None:
        """Phase timers read the host clock: let queued GPU work finish first, so it counts in its phase."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _micro(self, rng):
        n = len(rng)
        size = self.cfg.micro_batch_size
        return [slice(s, min(s + size, n)) for s in range(0, n, size)]

    def _autocast(self):
        if self.device.type == "cuda" and self.cfg.trainer_precision == "bf16-mixed":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return torch.autocast(self.device.type, enabled=False)

    def _trainer_bf16(self) -> dict[str, torch.Tensor]:
        """The trainer's weights in bf16, whole: under FSDP2 an all-gather that every trainer rank joins."""
        out = {}
        for n, t in policy_parameters(self.model).items():
            t = t.detach()
            out[n] = (t.full_tensor() if hasattr(t, "full_tensor") else t).to(torch.bfloat16)
        return out

    def _sync(self) -> dict[str, float]:
        """Trainer -> rollout weights through the codec (the only path by which weights change)."""
        stats: dict[str, float] = {}
        new = None
        if self.is_trainer:
            t0 = time.perf_counter()
            new = self._trainer_bf16()
            gather_s = time.perf_counter() - t0
            if self.is_main:
                s = self.sender.send(new, self.transport)
                stats = {"sync/wire_bytes": s.wire_bytes, "sync/dense_bytes": s.dense_bytes,
                         "sync/density": s.density, "sync/ratio": s.ratio, "time/sync_s": s.total_s}
                if self.trainers > 1:
                    stats["time/sync_gather_s"] = gather_s
        if self.is_rollout:
            r = self.receiver.receive(self.transport)
            stats["time/sync_apply_s"] = r.total_s
        if self.cfg.sync.check_bitwise and self.step % self.cfg.sync.check_bitwise == 0:
            self._check_sync(new)  # raises on any difference
            stats["sync/bitwise_checked"] = 1.0
        return stats

    def _check_sync(self, sent: dict[str, torch.Tensor] | None) -> None:
        """The rollout copy must hold exactly the trainer's bf16 bits (every rank compared). ``sent``: the
        trainer's bf16 weights that this sync sent (None on ranks that only roll out)."""
        if self.world == 1:
            mine = policy_parameters(self.rollout_model)
            ok = all(torch.equal(t.view(torch.int16), mine[n].view(torch.int16)) for n, t in sent.items())
        else:
            named = sent if self.is_trainer else policy_parameters(self.rollout_model)
            fp = torch.tensor([ssync.state_fingerprint(named)], dtype=torch.int64, device=self.device)
            allfp = [torch.zeros_like(fp) for _ in range(self.world)]
            dist.all_gather(allfp, fp)
            ok = all(int(f) == int(allfp[0]) for f in allfp[1:])
        if not ok:
            raise RuntimeError(f"step {self.step}: rollout weights differ from the trainer's bf16 weights")

    def evaluate(self) -> float:
        """Greedy accuracy on the held-out set (rollout side; rank 1 reports in distributed runs)."""
        prompts = [p for p, _ in self.eval_set]
        out = self.engine.generate(prompts, 1, self._eval_params())
        hits = [self.reward_fn(a, decode_response(self.tokenizer, s.tokens, self.stop_ids))
                for s, (_, a) in zip(out.samples, self.eval_set)]
        return sum(hits) / len(hits)

    def train(self, stop_at: float | None = None) -> None:
        """GRPO steps until ``total_steps``. ``stop_at`` (a ``time.perf_counter()`` moment; one process only): no
        step starts that the last step's duration says would end after it, so a time-limited run ends on a whole
        step (the first step always runs). ``ValueError`` for ``stop_at`` in a run of several ranks (they would
        disagree on when to stop)."""
        cfg = self.cfg
        if stop_at is not None and self.world != 1:
            raise ValueError(f"train(stop_at=...) runs in one process only, not {self.world} ranks")
        bar = tqdm(total=cfg.total_steps, initial=self.step, disable=not self.is_main, dynamic_ncols=True,
                   desc="grpo")
        if self.step == 0 and cfg.eval.every:
            self._log_eval()
        last_s = None
        while self.step < cfg.total_steps:
            t_step = time.perf_counter()
            if stop_at is not None and last_s is not None and t_step + last_s > stop_at:
                tqdm.write(f"stopping before step {self.step + 1}: the last one took {last_s:.1f} s and the run "
                           f"must end within {max(0.0, stop_at - t_step):.1f} s")
                break
            prof = start_step_profile(self.device) if self.step + 1 in self.profile_steps else None
            partial = self.partial_cfg.enabled  # the rollout ranks draw their prompts themselves
            batch = None if partial else next(self.data_iter)
            metrics: dict[str, float] = {}
            t0 = time.perf_counter()
            local = self._rollout(batch) if self.is_rollout else None
            if local is not None:
                metrics.update(self._rollout_metrics(local[1]))
                if partial:
                    metrics.update(self.partial_metrics)
            if self.world == 1:
                prompts, gen, rewards = local
                samples = gen.samples
            else:
                prompts, samples, rewards = exchange_rollouts(
                    batch, local, self.group, self.world, self.rank, self.device, self.sampling["max_new_tokens"],
                    trainers=self.trainers, n_prompts=self.prompts_per_step,
                    max_prompt_len=self.cfg.engine.max_prompt_len if partial else None)
            metrics["time/rollout_s"] = time.perf_counter() - t0
            version = self.step  # of the weights that sampled this step's newest tokens, and of π_old
            self.step += 1
            if self.is_trainer:
                metrics.update(self._learn(prompts, samples, rewards, version, metrics["time/rollout_s"]))
            t0 = time.perf_counter()
            metrics.update(self._sync())
            self._wait_device()
            metrics["time/sync_total_s"] = time.perf_counter() - t0  # gather, send, apply (and check), on device
            metrics.update(self._follow_sync(metrics, local))
            self._wait_device()
            metrics["time/step_s"] = time.perf_counter() - t_step
            if prof is not None:  # the profiler's overhead is in this step's times: marked, left out of timings
                write_step_profile(prof, profile_path(self.output_dir, self.step, self.rank))
                metrics["profiled"] = 1.0
            # compilation inside the step shows as growth of these counts (the recipe prepares the engine)
            metrics["compile/graphs"] = float(dynamo_counters["stats"]["unique_graphs"])
            if self.is_rollout:
                metrics["engine/captured_graphs"] = float(self.engine.captured_graphs)
            if cfg.eval.every and self.step % cfg.eval.every == 0:
                metrics.update(self._log_eval(log=False))
            if self.is_main:
                self._log_step(metrics, bar)
            if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                self.save_checkpoint()
            _maybe_inject_fault(self.rank, self.step)
            last_s = time.perf_counter() - t_step
        bar.close()

    def _follow_sync(self, metrics: dict[str, float], local) -> dict[str, float]:
        """After the sync, between steps: the drafter re-quantized, the engine's policy version moved on, RTPurbo's
        top-p moved by the tail agreement in ``metrics`` and its indexer refreshed on this rank's rollouts ``local``
        (every ``indexer_refresh.every`` steps); returns their metrics."""
        out: dict[str, float] = {}
        if self.is_rollout and self.drafter is not None:  # the drafter follows the new weights
            t0 = time.perf_counter()
            self.drafter.refresh()
            out["time/drafter_refresh_s"] = time.perf_counter() - t0
        if self.is_rollout:  # tokens sampled from here on carry the new version (rows in flight keep theirs)
            self.engine.set_policy_version(self.step)
        if self.schedule is not None:  # RTPurbo's top-p follows the tail agreement, between steps
            out.update(self._schedule_step(metrics))
        rc = self.cfg.get("indexer_refresh")
        if self.is_rollout and self.rtpurbo and rc and rc.every and self.step % rc.every == 0:
            local_prompts, local_samples = (local[0], local[1].samples)
            out.update(self._refresh_indexer(local_prompts, local_samples))
        return out

    def _learn(self, prompts, samples, rewards: torch.Tensor, version: int, rollout_s: float) -> dict[str, float]:
        """The trainer's part of a step: group advantages, the rollout batch, its updates (:meth:`_train_on`); returns
        their metrics and the step's reward and response-length ones."""
        adv = group_advantages(rewards.view(-1, self.group), self.grpo.advantage_scale).flatten()
        rb = build_rollout_batch(prompts, samples, self.group, rewards, adv, pad_id=self.tokenizer.pad_id)
        metrics = self._train_on(rb, version)
        lengths = rb.response_len.float()
        n_tokens = int(rb.response_len.sum())
        metrics.update({
            "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std(unbiased=False)),
            "reward/success_rate": float((rewards >= 1.0).float().mean()),
            "response/len_mean": float(lengths.mean()), "response/len_max": float(lengths.max()),
            "rollout/tokens_per_s": n_tokens / max(rollout_s, 1e-9),
        })
        return metrics

    def _log_step(self, metrics: dict[str, float], bar: tqdm) -> None:
        """Rank 0: the step into the history and the metric log (the first step's record also carries the setup
        phases), the progress bar moved on."""
        self.history.append({"step": self.step, "reward": metrics["reward/mean"], "wall_s": metrics["time/step_s"],
                             **({"eval": metrics["eval/accuracy"]} if "eval/accuracy" in metrics else {})})
        metrics.update(self._take_setup_metrics())
        self.metric_logger.log_dict(metrics, step=self.step)
        bar.update(1)
        bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", tok_s=f"{metrics['rollout/tokens_per_s']:.0f}",
                        roll=f"{metrics['time/rollout_s']:.1f}s", train=f"{metrics['time/train_s']:.1f}s",
                        sync=f"{metrics['time/sync_s']:.2f}s")

    def _log_eval(self, log: bool = True) -> dict[str, float]:
        acc = self.evaluate() if self.is_rollout else 0.0
        if self.world > 1:  # the first rollout rank holds the answer; share it
            t = torch.tensor([acc], dtype=torch.float64, device=self.device)
            dist.broadcast(t, src=self.trainers)
            acc = float(t)
        m = {"eval/accuracy": acc}
        if self.is_main:
            if log:
                self.metric_logger.log_dict(m, step=self.step)
                self.history.append({"step": self.step, "eval": acc})
            tqdm.write(f"step {self.step}: greedy accuracy on {len(self.eval_set)} held-out prompts = {acc:.3f}")
        return m

    # ---------------------------------------------------------------------------------------- save / end
    def save_checkpoint(self) -> None:
        """Rank 0 writes the whole model and optimizer state (gathered from every trainer when sharded, in the
        same files as an unsharded run: a checkpoint resumes with any number of trainer ranks). With partial
        rollout also every rollout rank's data position and in-flight groups (gathered: every rank joins)."""
        partial = self._partial_state()
        if not self.is_trainer:
            return
        state = {"data": self.loader.state_dict(), "history": self.history,
                 "config": OmegaConf.to_container(self.cfg, resolve=True)}
        if partial is not None:
            state["partial"] = partial
            state["data"] = partial["ranks"][0]["loader"]  # the data position a synchronous resume continues from
        if self.trainers == 1:
            save_checkpoint(self.output_dir / "checkpoints", self.step, model=self.model, optimizer=self.optimizer,
                            state=state)
            return
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered onto rank 0's CPU
        weights = get_model_state_dict(self.model, options=opts)
        optim = get_optimizer_state_dict(self.model, self.optimizer, options=opts)
        if self.is_main:
            save_checkpoint(self.output_dir / "checkpoints", self.step, model_state=weights,
                            optimizer_state=_rekey_optimizer_state(optim, _param_position(self.model)), state=state)

    def _partial_state(self) -> dict[str, Any] | None:
        """Per rollout rank: its loader state and the data rows of its held groups (restarted on resume)."""
        if not self.partial_cfg.enabled:
            return None
        mine = {"loader": self.loader.state_dict(), **self.partial.state_dict()} if self.is_rollout else None
        if self.world == 1:
            return {"ranks": [mine]}
        every: list[Any] = [None] * self.world
        dist.all_gather_object(every, mine)
        return {"ranks": every[self.trainers:]}

    def cleanup(self) -> None:
        if self.is_main:
            self.metric_logger.close()
            if self.history and self.cfg.plot:
                plot_history(self.history, self.output_dir / "reward_curve.png", title=str(self.cfg.get("name", "")))
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _load_optimizer(ckpt: Path, model, optimizer, sharded: bool) -> None:
    """The checkpoint's optimizer state into ``optimizer`` (of ``model``, FSDP2-sharded when ``sharded``)."""
    saved = read_optimizer_state(ckpt)
    if not sharded:
        optimizer.load_state_dict(saved)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {i: n for n, i in _param_position(model).items()}
    set_optimizer_state_dict(model, optimizer, _rekey_optimizer_state(saved, names),
                             options=StateDictOptions(full_state_dict=True))


def _param_position(model) -> dict[str, int]:
    """Parameter name -> position in ``model.parameters()`` (the optimizer's numbering)."""
    return {n: i for i, (n, _) in enumerate(model.named_parameters())}


def _rekey_optimizer_state(sd: dict[str, Any], key: dict) -> dict[str, Any]:
    """An optimizer state with its parameters renamed through ``key``: between torch.distributed.checkpoint's
    layout (parameter names) and ``Optimizer.state_dict()``'s (positions), which checkpoints use."""
    return {"state": {key[p]: st for p, st in sd["state"].items()},
            "param_groups": [dict(g, params=[key[p] for p in g["params"]]) for g in sd["param_groups"]]}


def _tail_key(q: float) -> str:
    return f"mismatch/tail_agreement_p{100 * q:g}"  # q = 0.05: mismatch/tail_agreement_p5


def _seconds(phases: dict[str, float]) -> float:
    """The seconds of an engine's setup phases (``setup/*_s``; the cache lookup counts left out)."""
    return sum(v for k, v in phases.items() if k.endswith("_s"))


def _uses_rtpurbo(model, record: bool) -> bool:
    from sparrow.attention.rtpurbo import RTPurboAttention

    backends = [b for b in (layer.attn.backend for layer in model.layers) if isinstance(b, RTPurboAttention)]
    for b in backends:
        b.enable_stats(record)
    return bool(backends)


def _read_weights(path: Path, what: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    return load_file(str(path))


def _maybe_inject_fault(rank: int, step: int) -> None:
    """Failure drill for the distributed tests: SPARROW_FAULT=<rank>:<step> kills that rank there."""
    spec = os.environ.get("SPARROW_FAULT")
    if spec and spec == f"{rank}:{step}":
        os._exit(17)


@parse
def recipe_main(cfg: DictConfig) -> None:
    recipe = GRPORecipe(cfg)
    recipe.setup(cfg)
    recipe.train()
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())

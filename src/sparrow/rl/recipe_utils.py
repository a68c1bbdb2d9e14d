"""Helpers of the ``sparrow_grpo`` recipe: rollout exchange between ranks, sync views, fingerprints, the
speculative builders and the reward-curve plot (its configuration lives in :mod:`sparrow.rl.recipe_config`)."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist

from sparrow.rollout.engine import Sample


def sync_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights that travel trainer -> rollout: the model's parameters (attention-backend parameters,
    such as an indexer, are the rollout side's own)."""
    return {n: p for n, p in model.named_parameters() if ".backend." not in n}


def state_fingerprint(named: Mapping[str, torch.Tensor]) -> int:
    """A 64-bit fingerprint of the bit patterns of ``named`` (order-independent in the dict, name-bound)."""
    from sparrow.kernels.sync.api import hash_bits
    from sparrow.kernels.sync.common import bits_view

    acc = 0
    for name in sorted(named):
        t = named[name].detach().contiguous()
        lanes = hash_bits(bits_view(t)).tolist()  # host sync: a verification step, not the hot path
        tag = zlib.crc32(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())  # stable across processes
        for v in (tag, lanes[0], lanes[1]):
            acc = ((acc ^ v) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return acc - (1 << 64) if acc >= 1 << 63 else acc


def exchange_rollouts(batch, local, group: int, world: int, rank: int, device: torch.device, max_new: int,
                      trainers: int = 1):
    """Gather the samples and rewards of every rollout rank (ranks ``trainers .. world-1``) on every trainer
    rank (an all-gather of padded tensors).

    Returns (prompts, samples, rewards) on the trainer ranks and (None, None, None) elsewhere.
    """
    share = len(batch) // (world - trainers)
    rows = share * group
    tok = torch.full((rows, max_new), -1, dtype=torch.int64)
    lp = torch.zeros((rows, max_new), dtype=torch.float32)
    meta = torch.zeros((rows, 3), dtype=torch.float32)  # length, reward, finished-by-stop
    if local is not None:
        _, gen, rewards = local
        for i, s in enumerate(gen.samples):
            tok[i, : s.length] = s.tokens
            lp[i, : s.length] = s.logprobs
            meta[i] = torch.tensor([s.length, float(rewards[i]), 1.0 if s.finish_reason == "stop" else 0.0])
    parts = []
    for t in (tok, lp, meta):
        t = t.to(device)
        out = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(out, t)
        parts.append([o.cpu() for o in out[trainers:]])
    if rank >= trainers:
        return None, None, None
    samples, rewards = [], []
    for r in range(world - trainers):
        for i in range(rows):
            n = int(parts[2][r][i, 0])
            samples.append(Sample(r * share + i // group, i % group, parts[0][r][i, :n].clone(),
                                  parts[1][r][i, :n].clone(), "stop" if parts[2][r][i, 2] > 0 else "length"))
            rewards.append(float(parts[2][r][i, 1]))
    return [b["prompt_ids"] for b in batch], samples, torch.tensor(rewards, dtype=torch.float32)


def plot_history(history: list[dict[str, float]], png: Path, title: str = "") -> None:
    """Reward (and greedy eval accuracy, when measured) against steps."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - matplotlib is a dependency; keep training results regardless
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    tr = [h for h in history if "reward" in h]
    ev = [h for h in history if "eval" in h]
    if tr:
        ax.plot([h["step"] for h in tr], [h["reward"] for h in tr], lw=1, alpha=0.5, label="sampled reward (T=1)")
        k = max(1, len(tr) // 15)
        sm = [sum(h["reward"] for h in tr[max(0, i - k + 1): i + 1]) / len(tr[max(0, i - k + 1): i + 1])
              for i in range(len(tr))]
        ax.plot([h["step"] for h in tr], sm, lw=2, label=f"sampled reward, mean of {k}")
    if ev:
        ax.plot([h["step"] for h in ev], [h["eval"] for h in ev], "o-", label="greedy accuracy (held out)")
    ax.set(xlabel="step", ylabel="reward / accuracy", ylim=(0, 1.02), title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def build_speculation(spec_cfg, rollout_model):
    """The drafter and the engine's ``max_draft`` for the ``speculative`` config section (None: none)."""
    from torchtune import config as tt_config

    from sparrow.speculative import QuantizedSelfDrafter

    if spec_cfg is None:  # keys and values were checked with the rest of the config (recipe_config)
        return None, 0
    drafter = QuantizedSelfDrafter(rollout_model, tt_config.instantiate(spec_cfg.drafter))
    # the longest draft the toggle can ask for: its ladder and / or its fixed length (4 when it names neither)
    lengths = list(spec_cfg.get("draft_lengths") or []) + ([spec_cfg.num_draft] if spec_cfg.get("num_draft") else [])
    return drafter, max(lengths or [4])


def build_toggle(spec_cfg, engine, params):
    """The toggle of the ``speculative`` section; ``cost_model`` calibrates on ``engine`` (cached per model
    shape and device)."""
    from sparrow.speculative import AdaptiveDraft, AlwaysOn, CostModel, CostModelToggle, ThresholdToggle

    lengths = tuple(spec_cfg.get("draft_lengths") or ())
    adaptive = AdaptiveDraft(lengths=lengths) if len(lengths) > 1 else None
    if spec_cfg.toggle == "always":
        return AlwaysOn(spec_cfg.get("num_draft", 4))
    if spec_cfg.toggle == "threshold":
        return ThresholdToggle(spec_cfg.max_active, spec_cfg.get("num_draft", 4), adaptive=adaptive)
    costs = CostModel.calibrate(engine, params)
    return CostModelToggle(costs, margin=spec_cfg.get("margin", 0.05), hysteresis=spec_cfg.get("hysteresis", 0.03),
                           adaptive=adaptive or AdaptiveDraft(), probe_every=spec_cfg.get("probe_every", 8),
                           correct_costs=spec_cfg.get("correct_costs", True))

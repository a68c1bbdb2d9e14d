"""Supervised warm start on a synthetic task: the checkpoint the GRPO recipes begin from.

    tune run sparrow_sft --config recipes/configs/tiny_kv_retrieval_sft.yaml [key=value ...]

Teacher forcing on ``prompt + answer + <eos>``: the loss is the mean cross-entropy over the answer tokens
plus ``prompt_loss_weight`` times the mean over the whole sequence (prompt, answer and ``<eos>``; separate
means, so a long prompt does not drown the answer). ``seed`` sets the initialisation and the held-out set,
``data_seed`` the training examples. Writes ``model.safetensors`` (the model's weights) and
``report.json`` (greedy and sampled accuracy on held-out prompts) to ``output_dir``. Deterministic by seed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from safetensors.torch import save_file
from torchtune import config
from tqdm import tqdm

from sparrow.rl.recipe_config import check_config, parse
from sparrow.rollout import EngineConfig, RolloutEngine, SamplingParams

KEYS = {k: None for k in ("name", "output_dir", "seed", "data_seed", "device", "steps", "batch_size", "lr", "warmup_steps",
                          "weight_decay", "init_std", "prompt_loss_weight", "max_grad_norm", "eval_prompts",
                          "max_new_tokens")}
KEYS.update({"model": "component", "tokenizer": "component", "task": "component"})


class SFTRecipe:
    def __init__(self, cfg: DictConfig) -> None:
        check_config(cfg, KEYS, optional=("name",))
        self.cfg = cfg
        self.device = torch.device(cfg.device)

    def setup(self, cfg: DictConfig) -> None:
        torch.manual_seed(cfg.seed)
        self.tokenizer = config.instantiate(cfg.tokenizer)
        self.task = config.instantiate(cfg.task)
        self.model = config.instantiate(cfg.model).to(self.device)
        with torch.no_grad():  # small-std init: torchtune's defaults are meant for loading checkpoints
            for p in self.model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, cfg.init_std)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.98),
                                           weight_decay=cfg.weight_decay)
        warm = cfg.warmup_steps  # linear warm-up, then constant
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / max(1, warm)))

    def _batch(self, step: int):
        tok, B = self.tokenizer, self.cfg.batch_size
        seqs, plens = [], []
        for j in range(B):
            ex = self.task.example(self.cfg.data_seed, step * B + j)
            p = tok.encode(ex.prompt)
            seqs.append(p + tok.encode(ex.answer, add_bos=False, add_eos=True))
            plens.append(len(p))
        L = max(map(len, seqs))
        x = torch.full((B, L), tok.pad_id, dtype=torch.int64)
        answer = torch.zeros((B, L), dtype=torch.bool)
        whole = torch.zeros((B, L), dtype=torch.bool)
        for j, s in enumerate(seqs):
            x[j, : len(s)] = torch.tensor(s)
            whole[j, 1: len(s)] = True
            answer[j, plens[j]: len(s) - 1] = True
        return x.to(self.device), answer[:, 1:].to(self.device), whole[:, 1:].to(self.device)

    def train(self) -> None:
        cfg = self.cfg
        bar = tqdm(range(cfg.steps), desc="sft", dynamic_ncols=True)
        for step in bar:
            x, answer, whole = self._batch(step)  # masks over the predicted positions x[:, 1:]
            logits, target = self.model(x[:, :-1]), x[:, 1:]
            answer_loss = F.cross_entropy(logits[answer], target[answer])
            loss = answer_loss + cfg.prompt_loss_weight * F.cross_entropy(logits[whole], target[whole])
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
            self.optimizer.step()
            self.scheduler.step()
            if step % 20 == 0:
                bar.set_postfix(answer_loss=f"{answer_loss.item():.3f}", loss=f"{loss.item():.3f}")

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        cfg, tok = self.cfg, self.tokenizer
        self.model.eval()
        exs = [self.task.example(cfg.seed + 10_007, i) for i in range(cfg.eval_prompts)]  # the GRPO eval set
        prompts = [tok.encode(e.prompt) for e in exs]
        engine = RolloutEngine(self.model, EngineConfig(max_rows=max(8, len(prompts)), compile=False,
                                                        max_prompt_len=max(map(len, prompts)),
                                                        max_new_tokens=cfg.max_new_tokens))
        report = {}
        for name, temp in (("greedy_accuracy", 0.0), ("sampled_accuracy", 1.0)):
            out = engine.generate(prompts, 1, SamplingParams(temperature=temp, max_new_tokens=cfg.max_new_tokens,
                                                             stop_token_ids=(tok.eos_id,), seed=cfg.seed))
            hits = [tok.decode([t for t in s.tokens.tolist() if t != tok.eos_id]) == e.answer for s, e in zip(out, exs)]
            report[name] = sum(hits) / len(hits)
        return report

    def save_checkpoint(self, report: dict[str, float]) -> None:
        out = Path(self.cfg.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "model.safetensors.tmp"
        save_file({k: v.detach().contiguous().cpu() for k, v in self.model.state_dict().items()}, str(tmp))
        tmp.replace(out / "model.safetensors")
        (out / "report.json").write_text(json.dumps(report, indent=1))

    def cleanup(self) -> None:
        pass


@parse
def recipe_main(cfg: DictConfig) -> None:
    recipe = SFTRecipe(cfg)
    recipe.setup(cfg)
    t0 = time.perf_counter()
    recipe.train()
    report = {"steps": cfg.steps, "train_s": round(time.perf_counter() - t0, 1), **recipe.evaluate()}
    recipe.save_checkpoint(report)
    print(json.dumps(report))
    recipe.cleanup()


if __name__ == "__main__":
    sys.exit(recipe_main())

"""The real CLI (`tune run sparrow_sft`) on a tiny model: outputs, determinism, loss masks, config errors."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "recipes" / "configs" / "tiny_kv_retrieval_sft.yaml"
TUNE = str(Path(sys.executable).parent / "tune")
TINY = ["steps=3", "batch_size=4", "eval_prompts=4", "task.context_len=32", "model.num_layers=1",
        "model.embed_dim=32", "model.num_heads=2", "model.num_kv_heads=1", "model.intermediate_dim=64",
        "model.max_seq_len=40"]


def run(out: Path, *overrides: str):
    cmd = [TUNE, "run", "sparrow_sft", "--config", str(CONFIG), f"output_dir={out}", *TINY, *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=out.parent, capture_output=True, text=True, timeout=300, env=env)


def test_writes_weights_and_report_deterministically(tmp_path):
    a, b = run(tmp_path / "a"), run(tmp_path / "b")
    assert a.returncode == 0 and b.returncode == 0, (a.stderr + b.stderr)[-3000:]
    report = json.loads((tmp_path / "a/report.json").read_text())
    assert report["steps"] == 3 and 0 <= report["greedy_accuracy"] <= 1 and 0 <= report["sampled_accuracy"] <= 1
    wa, wb = load_file(str(tmp_path / "a/model.safetensors")), load_file(str(tmp_path / "b/model.safetensors"))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k].view(torch.int32), wb[k].view(torch.int32)) for k in wa)
    other = run(tmp_path / "c", "data_seed=2")  # other examples: other weights
    assert other.returncode == 0, other.stderr[-3000:]
    wc = load_file(str(tmp_path / "c/model.safetensors"))
    assert any(not torch.equal(wa[k], wc[k]) for k in wa)


def test_loss_masks_cover_answer_and_whole_sequence():
    sys.path.insert(0, str(REPO / "recipes"))
    from omegaconf import OmegaConf
    from sparrow_sft import SFTRecipe

    cfg = OmegaConf.load(CONFIG)
    cfg.batch_size = 3
    recipe = SFTRecipe(cfg)
    recipe.setup(cfg)
    x, answer, whole = recipe._batch(0)
    tok = recipe.tokenizer
    for j in range(3):
        ex = recipe.task.example(cfg.data_seed, j)
        plen = len(tok.encode(ex.prompt))
        # predicted positions t (target x[:, 1:][t] = x[t + 1]): the answer's digits only, not <eos>
        assert torch.equal(x[j, 1:][answer[j]], torch.tensor(tok.encode(ex.answer, add_bos=False)))
        assert answer[j].nonzero().flatten().tolist() == list(range(plen - 1, plen - 1 + len(ex.answer)))
        n = plen + len(ex.answer) + 1
        assert whole[j].sum() == n - 1 and x[j, 1:][whole[j]][-1] == tok.eos_id


def test_unknown_key_fails_before_training(tmp_path):
    r = run(tmp_path / "d", "learning_rate=1e-3")
    assert r.returncode != 0 and "unknown config keys: learning_rate" in r.stderr
    assert not (tmp_path / "d").exists()

"""Tiny Hugging Face model directories for tests, written by transformers' own classes.

- :func:`write_model` saves a random ``Qwen2ForCausalLM`` / ``LlamaForCausalLM`` (config from
  :func:`qwen2_config` / :func:`llama_config`) with ``save_pretrained(..., safe_serialization=True)``:
  ``config.json`` in transformers' own layout + ``model.safetensors``. Biases and norm weights are made
  random too (transformers initialises them to 0 / 1, which would hide a dropped or misplaced tensor).
- :func:`write_qwen_tokenizer` writes a byte-level BPE tokenizer laid out like the real Qwen2.5 one: a small
  BPE trained with ``tokenizers`` on synthetic arithmetic text (``vocab.json`` + ``merges.txt``), its vocabulary
  padded with never-merged entries so that ordinary ids run 0..151642, and a ``tokenizer.json`` whose added
  (special) tokens sit at 151643..151664; a model of :data:`QWEN_ROWS` embedding rows then has 271 rows that
  no token maps to, as Qwen2.5's checkpoints do.
- :func:`write_config` writes a bare ``config.json`` (for refusal tests and meta-device builds).

transformers and tokenizers are test-only dependencies: every writer skips the calling test without them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

QWEN_ORDINARY = 151_643  # ordinary (vocab.json) ids: 0 .. 151642
QWEN_ROWS = 151_936  # embedding rows of Qwen2.5-0.5B / 1.5B / 3B
# Qwen2.5's added tokens, in id order from QWEN_ORDINARY (as in its tokenizer.json)
QWEN_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)
# Qwen2's pre-tokenizer split (single digits, letters with one leading non-letter, punctuation runs, spaces)
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")
WORDS = ("what", "is", "the", "answer", "sum", "of", "and", "plus", "minus", "times", "so", "we", "get", "total",
         "apples", "left", "each", "box", "has", "how", "many", "final", "step", "then")

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96)


def _transformers():
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    return transformers


def qwen2_config(*, vocab_size: int = 503, tie_word_embeddings: bool = True, rope_theta: float = 1e6,
                 max_position_embeddings: int = 256, initializer_range: float = 0.2, **overrides: Any):
    """A tiny ``Qwen2Config`` (2 layers, hidden 64, 4 heads, 2 kv heads, MLP 96; eager attention)."""
    t = _transformers()
    kw = dict(TINY, vocab_size=vocab_size, tie_word_embeddings=tie_word_embeddings,
              max_position_embeddings=max_position_embeddings, initializer_range=initializer_range,
              rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, rms_norm_eps=1e-6)
    kw.update(overrides)
    cfg = t.Qwen2Config(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def llama_config(*, vocab_size: int = 509, tie_word_embeddings: bool = False, rope_theta: float = 5e5,
                 rope_scaling: dict | None = None, max_position_embeddings: int = 256,
                 initializer_range: float = 0.2, **overrides: Any):
    """A tiny ``LlamaConfig``; ``rope_scaling``: ``None`` or the four llama3 keys (``rope_type`` added)."""
    t = _transformers()
    rope = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling is not None:
        rope = {**rope, **rope_scaling, "rope_type": "llama3"}
    kw = dict(TINY, vocab_size=vocab_size, tie_word_embeddings=tie_word_embeddings,
              max_position_embeddings=max_position_embeddings, initializer_range=initializer_range,
              rope_parameters=rope, rms_norm_eps=1e-5)
    kw.update(overrides)
    cfg = t.LlamaConfig(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def write_model(path: Path, config, *, seed: int = 0):
    """Save a random model of ``config`` into ``path``; returns it (fp32, eval, eager attention)."""
    t = _transformers()
    cls = {"qwen2": t.Qwen2ForCausalLM, "llama": t.LlamaForCausalLM}[config.model_type]
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    std = config.initializer_range
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, std)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return model


def write_config(path: Path, config: dict) -> Path:
    """Write ``config`` as ``path/config.json``; returns ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def synthetic_text(n: int, seed: int = 0) -> list[str]:
    """``n`` lines of arithmetic-flavoured text: digits, lowercase words, ``\\boxed{...}``, ``#### ...``."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))
        lines.append(f"{words} {a} plus {b} is \\boxed{{{a + b}}}\n#### {a + b}")
    return lines


def write_qwen_tokenizer(path: Path, *, bpe_vocab: int = 600, seed: int = 0) -> Path:
    """Write ``vocab.json``, ``merges.txt`` and ``tokenizer.json`` in Qwen2.5's id layout; returns ``path``."""
    tk = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

    def pre_tokenizer():
        return pre_tokenizers.Sequence([pre_tokenizers.Split(tk.Regex(QWEN_SPLIT), behavior="isolated"),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])

    bpe = tk.Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizer()
    trainer = trainers.BpeTrainer(vocab_size=bpe_vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(synthetic_text(400, seed), trainer)
    path.mkdir(parents=True, exist_ok=True)
    bpe.model.save(str(path))  # vocab.json + merges.txt
    vocab = json.loads((path / "vocab.json").read_text(encoding="utf-8"))
    assert sorted(vocab.values()) == list(range(len(vocab))), "trained ids are not contiguous"
    # never-merged filler: no merge builds them and the pre-tokenizer splits them, so encode never yields them
    for i in range(len(vocab), QWEN_ORDINARY):
        vocab[f"<|filler_{i}|>"] = i
    (path / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")

    full = tk.Tokenizer(models.BPE.from_file(str(path / "vocab.json"), str(path / "merges.txt")))
    full.normalizer = normalizers.NFC()
    full.pre_tokenizer = pre_tokenizer()
    full.decoder = decoders.ByteLevel()
    full.add_special_tokens([tk.AddedToken(s, special=True, normalized=False) for s in QWEN_SPECIALS])
    full.save(str(path / "tokenizer.json"))
    added = {t["content"]: t["id"] for t in json.loads((path / "tokenizer.json").read_text())["added_tokens"]}
    assert added == {s: QWEN_ORDINARY + i for i, s in enumerate(QWEN_SPECIALS)}, added
    return path

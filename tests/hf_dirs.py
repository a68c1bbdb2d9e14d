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
- :func:`write_llama_tokenizer` writes a tiktoken ``original/tokenizer.model`` laid out like Llama-3's: a small
  byte-level BPE (Llama-3's pre-tokenizer split) padded to 128,000 ordinary ranks, so torchtune's special tokens
  sit at 128000.. as in the released files; :func:`llama_transformers_tokenizer` reads the same file into a
  ``transformers`` tokenizer with those special tokens at those ids.
- :func:`write_chat_template` writes ``tokenizer_config.json`` with a chat template: the released Qwen2.5-Instruct
  and Meta-Llama-3-Instruct templates are :data:`QWEN2_5_INSTRUCT_TEMPLATE` and :data:`LLAMA3_INSTRUCT_TEMPLATE`.
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

# Llama-3's pre-tokenizer split (digits in runs of at most three)
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_ORDINARY = 128_000  # ordinary (tiktoken) ranks: 0 .. 127999; torchtune's special tokens follow

# The chat templates of the released instruct checkpoints (tokenizer_config.json's "chat_template"), verbatim.
QWEN2_5_INSTRUCT_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>"
    "\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or (message.role == "
    "\"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)
LLAMA3_INSTRUCT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

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


def chat_text(n: int, seed: int = 0) -> list[str]:
    """``n`` chat-shaped texts: :func:`synthetic_text` lines in paragraphs (blank lines, runs of newlines), so a BPE
    trained on them merges ``\\n\\n`` and longer runs into single tokens, as released tokenizers do."""
    rng = random.Random(seed)
    lines = synthetic_text(4 * n, seed)
    return ["".join(line + "\n" * rng.choice((1, 2, 2, 3)) for line in lines[4 * i: 4 * i + 4]) for i in range(n)]


def write_qwen_tokenizer(path: Path, *, bpe_vocab: int = 600, seed: int = 0, corpus: list[str] | None = None) -> Path:
    """Write ``vocab.json``, ``merges.txt`` and ``tokenizer.json`` in Qwen2.5's id layout, the BPE trained on
    ``corpus`` (default :func:`synthetic_text`); returns ``path``."""
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
    bpe.train_from_iterator(corpus if corpus is not None else synthetic_text(400, seed), trainer)
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


def write_llama_tokenizer(path: Path, *, bpe_vocab: int = 600, seed: int = 0) -> Path:
    """Write ``original/tokenizer.model`` (tiktoken: base64 token bytes and rank per line) in Llama-3's layout: a
    byte-level BPE trained on :func:`chat_text` with Llama-3's split, padded with never-merged filler up to
    :data:`LLAMA3_ORDINARY` ranks; returns ``path``."""
    import base64

    tk = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    bpe = tk.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(tk.Regex(LLAMA3_SPLIT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=bpe_vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(chat_text(200, seed), trainer)
    unicode_to_byte = {c: b for b, c in _bytes_to_unicode().items()}
    ranks = {bytes(unicode_to_byte[c] for c in token): i for token, i in bpe.get_vocab().items()}
    assert sorted(ranks.values()) == list(range(len(ranks))), "trained ranks are not contiguous"
    for i in range(len(ranks), LLAMA3_ORDINARY):  # the split never puts "<|" and letters in one piece
        ranks[f"<|filler_{i}|>".encode()] = i
    (path / "original").mkdir(parents=True, exist_ok=True)
    (path / "original" / "tokenizer.model").write_text(
        "".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=lambda x: x[1])))
    return path


def llama_transformers_tokenizer(path: Path):
    """The ``transformers`` tokenizer of :func:`write_llama_tokenizer`'s file: its ranks (transformers' own tiktoken
    converter) and torchtune's Llama-3 special tokens at their ids (128000..)."""
    t = _transformers()
    from transformers.convert_slow_tokenizer import TikTokenConverter
    from torchtune.models.llama3._tokenizer import LLAMA3_SPECIAL_TOKENS

    by_id = {i: s for s, i in LLAMA3_SPECIAL_TOKENS.items()}
    specials = [by_id.get(i, f"<|unnamed_{i}|>") for i in range(LLAMA3_ORDINARY, max(by_id) + 1)]
    fast = TikTokenConverter(vocab_file=str(path / "original" / "tokenizer.model"), pattern=LLAMA3_SPLIT,
                             extra_special_tokens=specials).converted()
    tok = t.PreTrainedTokenizerFast(tokenizer_object=fast, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    assert all(tok.convert_tokens_to_ids(s) == i for s, i in LLAMA3_SPECIAL_TOKENS.items())
    return tok


def write_chat_template(path: Path, template: str, *, file: str = "tokenizer_config.json", **tokens: str) -> Path:
    """Give the directory ``path`` a chat template: in ``tokenizer_config.json`` (``chat_template`` beside the special
    tokens ``tokens``, e.g. ``bos_token``) or, with ``file="chat_template.jinja"``, in that file (the special tokens
    still in ``tokenizer_config.json``); returns ``path``."""
    config = dict(tokens)
    path.mkdir(parents=True, exist_ok=True)
    if file == "chat_template.jinja":
        (path / file).write_text(template, encoding="utf-8")
    else:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return path


def _bytes_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: byte -> the printable character that stands for it (GPT-2's table)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + \
        list(range(ord("\xae"), ord("\xff") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars

"""Prompt lengths measured with the run's own tokenizer, and the shipped Qwen config's prompts against its limits."""

from __future__ import annotations

from pathlib import Path

import pytest
from torchtune import config as tt_config

from sparrow.models import hf_tokenizer
from sparrow.rl import PromptFormat, PromptLengths
from sparrow.rl.recipe_config import load_config
from tests.hf_dirs import (QWEN2_5_INSTRUCT_TEMPLATE, chat_text, write_chat_template, write_config,
                           write_qwen_tokenizer)

REPO = Path(__file__).resolve().parents[2]
QWEN_CONFIG = REPO / "recipes" / "configs" / "qwen2_5_0_5b_long_context.yaml"
EXAMPLES = 16  # held-out prompts measured per check (every prompt of the task has the same length in characters)


@pytest.fixture(scope="module")
def instruct_dir(tmp_path_factory):
    """A Qwen2.5-layout tokenizer directory with the released Qwen2.5-Instruct template; torchtune's Qwen2.5
    tokenizer splits every digit into its own token, as the released one does."""
    path = write_qwen_tokenizer(tmp_path_factory.mktemp("instruct"), corpus=chat_text(300))
    write_config(path, {"model_type": "qwen2"})
    return write_chat_template(path, QWEN2_5_INSTRUCT_TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def _shipped_lengths(tokenizer, context_len: int | None = None) -> tuple[PromptLengths, object]:
    """The shipped config's held-out prompts (its task, its prompt format), measured with ``tokenizer``."""
    cfg = load_config(QWEN_CONFIG)
    if context_len is not None:
        cfg.task.context_len = context_len
    task = tt_config.instantiate(cfg.task)
    texts = [task.example(cfg.seed + 10_007, i).prompt for i in range(EXAMPLES)]
    return PromptLengths.measure(tokenizer, texts, PromptFormat(**cfg.prompt)), cfg


def _check(lengths: PromptLengths, cfg) -> None:
    lengths.check(max_prompt_len=cfg.engine.max_prompt_len, max_new_tokens=cfg.sampling.max_new_tokens,
                  max_seq_len=cfg.model.max_seq_len)


def test_the_shipped_qwen_config_fits_with_a_digit_splitting_tokenizer(instruct_dir):
    """The shipped config's prompts, in the directory's chat template and measured with a Qwen2.5 tokenizer (every
    digit one token), are 8K-9.5K tokens and fit engine.max_prompt_len and model.max_seq_len with the response;
    the config's earlier 24,000 characters (~21K such tokens) do not, and the error names the fix (negative
    control)."""
    tok = hf_tokenizer(instruct_dir)
    assert tok.encode("2025 1234", add_bos=False, add_eos=False).__len__() >= 9  # one token per digit
    lengths, cfg = _shipped_lengths(tok)
    # this BPE merges almost no letters: ~1 token per character (a released vocabulary merges more: fewer tokens)
    assert 8_000 <= min(lengths.tokens) and max(lengths.tokens) <= 9_500, (min(lengths.tokens), max(lengths.tokens))
    _check(lengths, cfg)
    too_long, cfg = _shipped_lengths(tok, context_len=24_000)
    assert max(too_long.tokens) > 19_000
    with pytest.raises(ValueError, match=r"measure up to \d+ tokens .* engine.max_prompt_len = 12288: shorten them "
                                         r"to about \d+ characters \(e.g. task.context_len\)"):
        _check(too_long, cfg)


def test_the_shipped_qwen_config_fits_with_any_byte_level_tokenizer(instruct_dir):
    """Worst case: a tokenizer with no merges at all (one token per byte of ASCII text) still fits: the character
    count bounds the tokens, plus the chat template's own."""

    class PerByte:
        special_tokens = hf_tokenizer(instruct_dir).special_tokens
        chat_template = hf_tokenizer(instruct_dir).chat_template

        def encode(self, text, add_bos=True, add_eos=True):
            return list(text.encode("utf-8"))

    lengths, cfg = _shipped_lengths(PerByte())
    assert max(lengths.tokens) > max(lengths.chars)  # the template's header and system turn on top
    _check(lengths, cfg)


@pytest.mark.parametrize("tokens, limits, message", [
    pytest.param([90, 100], dict(max_prompt_len=99, max_new_tokens=8), "more than engine.max_prompt_len = 99",
                 id="prompt-slots"),
    pytest.param([90, 100], dict(max_prompt_len=128, max_new_tokens=16, max_seq_len=112),
                 r"more than model.max_seq_len \(112\) minus the 16 new tokens = 96", id="model-context"),
])
def test_check_names_the_limit_and_the_fix(tokens, limits, message):
    lengths = PromptLengths(tokens, [200, 200])
    with pytest.raises(ValueError, match=message):
        lengths.check(**limits)
    fits = dict(limits, max_prompt_len=100)
    fits["max_seq_len"] = 116 if "max_seq_len" in limits else None
    lengths.check(**fits)  # exactly at both limits
    PromptLengths([], []).check(max_prompt_len=1, max_new_tokens=1)  # nothing measured, nothing refused

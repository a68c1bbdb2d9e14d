"""Prompt pipelines on ``torchdata.nodes``: synthetic task streams and JSONL datasets, tokenized and batched.

Every node keeps its position in ``get_state()``, so the :class:`~torchdata.nodes.Loader` returned by
:func:`prompt_loader` resumes exactly from a checkpoint (``loader.state_dict()`` / ``load_state_dict``).
"""

from __future__ import annotations

import inspect
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection, Protocol, Sequence

from torchdata.nodes import Batcher, BaseNode, Loader, Mapper

from sparrow.rl.tasks import Example


class Task(Protocol):
    def example(self, seed: int, index: int) -> Example: ...


class Tokenizer(Protocol):
    eos_id: int

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class TaskSource(BaseNode[Example]):
    """Endless stream ``task.example(seed, 0), task.example(seed, 1), ...``; state: the next index."""

    def __init__(self, task: Task, seed: int = 0) -> None:
        super().__init__()
        self.task, self.seed, self._i = task, int(seed), 0

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self._i = int(initial_state["index"]) if initial_state else 0

    def next(self) -> Example:
        ex = self.task.example(self.seed, self._i)
        self._i += 1
        return ex

    def get_state(self) -> dict[str, Any]:
        return {"index": self._i}


def read_jsonl(path: str | Path, *, prompt_key: str = "prompt", answer_key: str = "answer") -> list[Example]:
    """Read and validate a JSONL file of ``{"prompt": ..., "answer": ...}`` rows.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line that is not JSON, not an object, or lacks a non-empty prompt or an answer (the
            message gives the line number); an empty file.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"dataset file {p} does not exist")
    rows = []
    with p.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{p}:{n}: expected a JSON object, got {type(row).__name__}")
            prompt, answer = row.get(prompt_key), row.get(answer_key)
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"{p}:{n}: row has no {prompt_key!r} text")
            if answer is None or (isinstance(answer, str) and not answer.strip()):
                raise ValueError(f"{p}:{n}: row has no {answer_key!r}")
            rows.append(Example(prompt, str(answer), p.stem, len(rows)))
    if not rows:
        raise ValueError(f"{p} holds no rows")
    return rows


class ListSource(BaseNode[Example]):
    """Cycles through ``rows`` in a fresh seeded order every epoch; state: (epoch, position)."""

    def __init__(self, rows: list[Example], seed: int = 0, shuffle: bool = True) -> None:
        super().__init__()
        self.rows, self.seed, self.shuffle = rows, int(seed), shuffle
        self._epoch, self._pos, self._order = 0, 0, list(range(len(rows)))

    def _reorder(self) -> None:
        self._order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(f"{self.seed}:{self._epoch}").shuffle(self._order)

    def reset(self, initial_state: dict | None = None) -> None:
        super().reset(initial_state)
        self._epoch = int(initial_state["epoch"]) if initial_state else 0
        self._pos = int(initial_state["position"]) if initial_state else 0
        self._reorder()

    def next(self) -> Example:
        if self._pos >= len(self.rows):
            self._epoch, self._pos = self._epoch + 1, 0
            self._reorder()
        ex = self.rows[self._order[self._pos]]
        self._pos += 1
        return ex

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "position": self._pos}


@dataclass(frozen=True)
class PromptFormat:
    """How prompt text becomes the tokens the policy continues (the recipe's ``prompt`` section).

    Attributes:
        chat: ``False``: the text as it is (``encode(add_bos=True, add_eos=False)``: the tokenizer's BOS, if it
            has one, and no EOS). ``True``: the text as the user message of the model's chat format, with the
            assistant's turn opened, for instruct models: the chat template of the tokenizer's Hugging Face
            directory (:func:`sparrow.models.hf_tokenizer` attaches it; token for token what ``transformers``'
            ``apply_chat_template(..., add_generation_prompt=True)`` gives, the template's default system turn
            included); a tokenizer built otherwise uses torchtune's ``tokenize_messages``.
        system: a system message before it (``chat`` only), in place of the template's default one.
    """

    chat: bool = False
    system: str | None = None

    def __post_init__(self) -> None:
        if self.system is not None and not self.chat:
            raise ValueError("PromptFormat.system needs chat=True (a system message is part of the chat format)")

    def encode(self, tokenizer: Tokenizer, text: str) -> list[int]:
        """Token ids of the prompt ``text``.

        Raises:
            ValueError: ``chat`` with a tokenizer that has no chat format (a Hugging Face directory without a chat
                template, or a tokenizer without ``tokenize_messages``), or a prompt the tokenizer truncated.
        """
        if not self.chat:
            return tokenizer.encode(text, add_bos=True, add_eos=False)
        template = getattr(tokenizer, "chat_template", _NOT_FROM_A_DIRECTORY)
        if template is None:
            raise ValueError("prompt.chat is true but the tokenizer's directory has no chat template (neither "
                             "chat_template.jinja nor a chat_template in tokenizer_config.json): add the model's "
                             "template, or set prompt.chat to false for a base model")
        if template is not _NOT_FROM_A_DIRECTORY:
            messages = [{"role": "system", "content": self.system}] if self.system is not None else []
            ids = template.encode(tokenizer, messages + [{"role": "user", "content": text}])
        else:
            ids = self._tokenize_messages(tokenizer, text)
        limit = getattr(tokenizer, "max_seq_len", None)
        if limit and len(ids) >= limit:
            raise ValueError(f"the tokenizer's max_seq_len ({limit}) cuts the prompt: raise it or set it to null")
        return list(ids)

    def _tokenize_messages(self, tokenizer: Tokenizer, text: str) -> list[int]:
        """torchtune's chat format (``Message`` s through ``tokenize_messages``), for a tokenizer without a template."""
        fn = getattr(tokenizer, "tokenize_messages", None)
        if fn is None:
            raise ValueError(f"{type(tokenizer).__name__} has no chat format (tokenize_messages): set prompt.chat "
                             "to false")
        from torchtune.data import Message

        messages = [Message(role="system", content=self.system)] if self.system else []
        messages += [Message(role="user", content=text), Message(role="assistant", content="")]
        # no end tokens after the (empty, last) assistant message: the policy writes it
        end = {"add_eos": False} if "add_eos" in inspect.signature(fn).parameters else {"add_end_tokens": False}
        ids, _ = fn(messages, **end)
        return list(ids)


_NOT_FROM_A_DIRECTORY = object()  # a tokenizer that hf_tokenizer did not build carries no chat_template


@dataclass(frozen=True)
class PromptLengths:
    """Token counts of prompts measured with the run's own tokenizer and format, beside their lengths in characters.

    Attributes:
        tokens: tokens per prompt (:meth:`PromptFormat.encode`).
        chars: characters of each prompt's text.
    """

    tokens: Sequence[int]
    chars: Sequence[int]

    @classmethod
    def measure(cls, tokenizer: Tokenizer, texts: Sequence[str],
                prompt_format: PromptFormat = PromptFormat()) -> PromptLengths:
        """The lengths of ``texts`` as ``prompt_format`` encodes them with ``tokenizer``."""
        return cls([len(prompt_format.encode(tokenizer, t)) for t in texts], [len(t) for t in texts])

    def check(self, *, max_prompt_len: int, max_new_tokens: int, max_seq_len: int | None = None,
              where: str = "the task's prompts") -> None:
        """Refuse prompts that cannot run: the longest must fit ``max_prompt_len`` (the engine's prompt slots) and,
        with ``max_new_tokens`` of response, ``max_seq_len`` (the model's context; None: not checked).

        Raises:
            ValueError: naming the measured counts, the tokens per character and the longest text that would fit.
        """
        if not self.tokens:
            return
        longest = max(self.tokens)
        per_char = sum(self.tokens) / max(1, sum(self.chars))
        limits = [(max_prompt_len, "engine.max_prompt_len")]
        if max_seq_len is not None:
            limits.append((max_seq_len - max_new_tokens, f"model.max_seq_len ({max_seq_len}) minus the "
                                                         f"{max_new_tokens} new tokens"))
        for limit, name in limits:
            if longest > limit:
                chars = max(self.chars)
                fits = int(chars * limit / longest)
                raise ValueError(
                    f"{where} measure up to {longest} tokens with this tokenizer ({chars} characters, "
                    f"{per_char:.2f} tokens per character), more than {name} = {limit}: shorten them to about "
                    f"{fits} characters (e.g. task.context_len) or raise {name.split(' ')[0]}")


def decode_response(tokenizer: Tokenizer, tokens: Sequence[int], stop: Collection[int]) -> str:
    """The text of a response: its tokens without the stop token that ended it."""
    ids = [int(t) for t in tokens]
    if ids and ids[-1] in stop:
        ids = ids[:-1]
    return tokenizer.decode(ids)


def tokenize(ex: Example, tokenizer: Tokenizer, max_prompt_len: int,
             prompt_format: PromptFormat = PromptFormat()) -> dict[str, Any]:
    ids = prompt_format.encode(tokenizer, ex.prompt)
    if len(ids) > max_prompt_len:
        raise ValueError(f"{ex.task} example {ex.index}: prompt of {len(ids)} tokens is longer than "
                         f"max_prompt_len ({max_prompt_len})")
    return {"prompt_ids": ids, "answer": ex.answer, "task": ex.task, "index": ex.index}


def prompt_loader(source: BaseNode[Example], tokenizer: Tokenizer, *, batch_size: int,
                  max_prompt_len: int, prompt_format: PromptFormat = PromptFormat()) -> Loader:
    """Tokenize ``source`` (:class:`PromptFormat`) and batch it (lists of dicts with ``prompt_ids``, ``answer``,
    ``task``, ``index``)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    node = Mapper(source, lambda ex: tokenize(ex, tokenizer, max_prompt_len, prompt_format))
    return Loader(Batcher(node, batch_size=batch_size, drop_last=True))

"""Chat prompts from a Hugging Face directory's own chat template, token for token as ``transformers`` makes them.

A released instruct checkpoint carries its prompt format as a jinja template: ``chat_template.jinja`` or the
``chat_template`` of ``tokenizer_config.json``. :class:`ChatTemplate` reads it and renders messages the way
``transformers``' ``apply_chat_template(messages, add_generation_prompt=True)`` does (a sandboxed jinja
environment with ``trim_blocks`` and ``lstrip_blocks``, the ``tojson`` filter without HTML escaping,
``raise_exception`` and ``strftime_now``, and the tokenizer's special-token strings such as ``bos_token`` in
scope); :meth:`ChatTemplate.encode` then turns the rendered text into ids as ``transformers`` does: the text is cut
at the tokenizer's special tokens, each of which is one id, and every piece between them is encoded as ordinary
text. Rendering first and encoding the whole text matters: content that starts with newlines merges with the role
header's newline into one token, as in the released tokenizer. ::

    template = ChatTemplate.from_dir("/models/Qwen2.5-0.5B-Instruct")    # None for a directory without one
    ids = template.encode(tokenizer, [{"role": "user", "content": "2 + 2?"}])
    # <|im_start|>system\\nYou are Qwen, ...<|im_end|>\\n<|im_start|>user\\n2 + 2?<|im_end|>\\n<|im_start|>assistant\\n
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

#: the files a directory's template is read from, in the order ``transformers`` prefers them
TEMPLATE_FILE, CONFIG_FILE = "chat_template.jinja", "tokenizer_config.json"
#: the special-token strings of ``tokenizer_config.json`` a template may read (``{{ bos_token }}``)
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatTokenizer(Protocol):
    """What :meth:`ChatTemplate.encode` needs of a tokenizer: its special tokens (string -> id) and an ``encode`` of
    ordinary text (torchtune's Qwen2.5 and Llama-3 tokenizers)."""

    special_tokens: Mapping[str, int]

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template (jinja source) and the special-token strings it is rendered with.

    Attributes:
        source: the jinja text, as the directory holds it.
        special_tokens: ``bos_token``, ``eos_token``, ... -> their strings, given to the template as variables.
        origin: where the template came from (a file, for messages).
    """

    source: str
    special_tokens: Mapping[str, str] = field(default_factory=dict)
    origin: str = "<string>"

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source.strip():
            raise ValueError(f"chat template of {self.origin} is empty")
        _compile(self.source, self.origin)  # a syntax error shows now, naming the file

    @classmethod
    def from_dir(cls, path: str | Path) -> ChatTemplate | None:
        """The template of a Hugging Face directory, or None when it has none.

        ``chat_template.jinja`` wins over ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of
        ``{"name", "template"}`` of which ``default`` is taken), as in ``transformers``. The special-token strings
        come from ``tokenizer_config.json`` (plain strings or ``{"content": ...}`` entries).

        Raises:
            ValueError: ``tokenizer_config.json`` is not JSON, or its template is neither a string nor a list holding
                a ``default``, or the template does not parse.
        """
        d = Path(path)
        config: dict[str, Any] = {}
        if (d / CONFIG_FILE).is_file():
            try:
                config = json.loads((d / CONFIG_FILE).read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise ValueError(f"{d / CONFIG_FILE} is not valid JSON: {e}") from None
        specials = {k: _token_text(config[k]) for k in SPECIAL_TOKEN_KEYS if config.get(k) is not None}
        if (d / TEMPLATE_FILE).is_file():
            return cls((d / TEMPLATE_FILE).read_text(encoding="utf-8"), specials, str(d / TEMPLATE_FILE))
        source = config.get("chat_template")
        if source is None:
            return None
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            if "default" not in named:
                raise ValueError(f"{d / CONFIG_FILE}: chat_template lists {sorted(map(str, named))} but no 'default'")
            source = named["default"]
        if not isinstance(source, str):
            raise ValueError(f"{d / CONFIG_FILE}: chat_template must be a string, got {type(source).__name__}")
        return cls(source, specials, str(d / CONFIG_FILE))

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               **variables: Any) -> str:
        """The prompt text of ``messages`` (``{"role", "content"}`` dicts), the assistant's turn opened when
        ``add_generation_prompt``; ``variables`` reach the template beside the special tokens (and override them).

        Raises:
            ValueError: a message without a string ``role`` and ``content``, or the template refused the messages
                (its ``raise_exception``), naming the template's file.
        """
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"message {i} needs a string 'role' and 'content', got {dict(m)!r}")
        import jinja2

        scope = {"tools": None, "documents": None, **self.special_tokens, **variables}
        try:
            return _compile(self.source, self.origin).render(
                messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt, **scope)
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template of {self.origin}: {e}") from None

    def encode(self, tokenizer: ChatTokenizer, messages: Sequence[Mapping[str, Any]], *,
               add_generation_prompt: bool = True, **variables: Any) -> list[int]:
        """Token ids of :meth:`render`'s text: each special token of ``tokenizer`` in it is its id, the text between
        them ``tokenizer.encode(piece, add_bos=False, add_eos=False)`` (a template writes its own BOS).

        Raises:
            ValueError: as :meth:`render`; or the text holds a special token of ``tokenizer_config.json`` that
                ``tokenizer`` does not know as one (it would become ordinary text, unlike ``transformers``' ids).
        """
        text = self.render(messages, add_generation_prompt=add_generation_prompt, **variables)
        unknown = sorted({t for t in self.special_tokens.values() if t and t in text} - set(tokenizer.special_tokens))
        if unknown:
            raise ValueError(f"chat template of {self.origin} writes {unknown}, which {type(tokenizer).__name__} has "
                             "no special token for")
        return encode_with_special_tokens(tokenizer, text)


def encode_with_special_tokens(tokenizer: ChatTokenizer, text: str) -> list[int]:
    """``text`` as ids: every occurrence of one of ``tokenizer.special_tokens`` (longest first) is that token's id,
    every piece between them goes through ``tokenizer.encode`` without BOS or EOS."""
    specials = dict(tokenizer.special_tokens)
    if not specials:
        return list(tokenizer.encode(text, add_bos=False, add_eos=False))
    ids: list[int] = []
    for piece in _splitter(tuple(sorted(specials, key=len, reverse=True))).split(text):
        if piece in specials:
            ids.append(int(specials[piece]))
        elif piece:
            ids.extend(tokenizer.encode(piece, add_bos=False, add_eos=False))
    return ids


@functools.lru_cache(maxsize=16)
def _splitter(specials: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("(" + "|".join(re.escape(s) for s in specials) + ")")


def _token_text(entry: Any) -> str:
    """A special token of ``tokenizer_config.json``: a string, or an added-token entry ``{"content": ...}``."""
    return entry["content"] if isinstance(entry, dict) else str(entry)


def _raise_exception(message: str):
    import jinja2

    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters; templates expect plain JSON
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _generation_block():
    """``{% generation %}...{% endgeneration %}`` (templates mark the assistant's text for training masks): the body
    as it is."""
    import jinja2.ext
    import jinja2.nodes

    class GenerationBlock(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    return GenerationBlock


@functools.lru_cache(maxsize=16)
def _compile(source: str, origin: str):
    """The template compiled in a sandbox (templates of downloaded directories are untrusted code)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _generation_block()])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template of {origin} does not parse: {e} (line {e.lineno})") from None

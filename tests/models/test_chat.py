"""Chat prompts from a directory's chat template, against ``transformers``' ``apply_chat_template``."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sparrow.models import hf_tokenizer
from sparrow.models.chat import ChatTemplate, encode_with_special_tokens
from sparrow.rl import PromptFormat
from tests.hf_dirs import (
    LLAMA3_INSTRUCT_TEMPLATE,
    QWEN2_5_INSTRUCT_TEMPLATE,
    chat_text,
    llama_transformers_tokenizer,
    write_chat_template,
    write_config,
    write_llama_tokenizer,
    write_qwen_tokenizer,
)

pytest.importorskip("transformers")

SYSTEM = "Answer with the value only."
# prompt texts: plain, digits, leading / trailing / inner runs of newlines, leading spaces, a lone newline
TEXTS = ["what is 12 plus 345", "\n\nwhat is the answer\n\n\n 7", "\nkey=ab;c=12?q=", "  two spaces\n\n", "\n",
         "x" * 3 + "\n\n" + "1234567890"]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """A Qwen2.5-layout directory with the released Qwen2.5-Instruct template in ``tokenizer_config.json`` (as the
    released files have it: ``eos_token`` ``<|im_end|>``, ``pad_token`` ``<|endoftext|>``, no ``bos_token``), its
    BPE trained on text with blank lines so that ``\\n\\n`` is one token."""
    path = write_qwen_tokenizer(tmp_path_factory.mktemp("qwen_chat"), corpus=chat_text(300))
    write_config(path, {"model_type": "qwen2"})
    config = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
              "pad_token": "<|endoftext|>"}
    return write_chat_template(path, QWEN2_5_INSTRUCT_TEMPLATE, **config)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A Llama-3-layout directory (tiktoken ``original/tokenizer.model``) with the released Meta-Llama-3-Instruct
    template; returns it and the ``transformers`` tokenizer of the same file."""
    path = write_llama_tokenizer(tmp_path_factory.mktemp("llama_chat"))
    write_config(path, {"model_type": "llama"})
    write_chat_template(path, LLAMA3_INSTRUCT_TEMPLATE, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    return path, llama_transformers_tokenizer(path)


def _messages(text: str, system: str | None) -> list[dict[str, str]]:
    return ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def qwen_pair(qwen_dir):
    """(transformers' tokenizer, Sparrow's) of the Qwen directory."""
    return _qwen_reference(qwen_dir), hf_tokenizer(qwen_dir)


def _qwen_reference(qwen_dir):
    """transformers' tokenizer of the directory, template and all, as a user's ``AutoTokenizer`` reads it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_dir))


def _hf_ids(hf, text: str, system: str | None, template: str | None = None) -> list[int]:
    return list(hf.apply_chat_template(_messages(text, system), chat_template=template, add_generation_prompt=True,
                                       tokenize=True, return_dict=False))


@pytest.mark.parametrize("system", [None, SYSTEM], ids=["default-system", "system-override"])
def test_qwen_prompts_equal_apply_chat_template(qwen_dir, system):
    """Every prompt of the released Qwen2.5-Instruct template is, token for token, ``AutoTokenizer``'s
    ``apply_chat_template(..., add_generation_prompt=True)``: the template's default system turn without
    ``prompt.system``, the override with it, leading newlines merged with the header's. torchtune's
    ``tokenize_messages`` (the path before templates) misses (negative control): no default system turn, and the
    role header and content encoded apart."""
    hf, tok = _qwen_reference(qwen_dir), hf_tokenizer(qwen_dir)
    assert isinstance(tok.chat_template, ChatTemplate)
    fmt = PromptFormat(chat=True, system=system)
    missed = 0
    for text in TEXTS:
        ref = _hf_ids(hf, text, system)
        assert fmt.encode(tok, text) == ref, text
        assert tok.chat_template.render(_messages(text, system)) == hf.apply_chat_template(
            _messages(text, system), add_generation_prompt=True, tokenize=False)
        missed += fmt._tokenize_messages(tok, text) != ref
    if system is None:  # the released template writes its default system turn; torchtune's format has none
        assert missed == len(TEXTS)
        assert tok.decode(fmt.encode(tok, "hi")).startswith(
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n")
    else:  # only the texts with leading newlines tokenize apart
        assert missed == sum(t.startswith("\n") for t in TEXTS) > 0


@pytest.mark.parametrize("system", [None, SYSTEM], ids=["no-system", "system"])
def test_llama3_prompts_equal_apply_chat_template(llama_dir, system):
    """The released Meta-Llama-3-Instruct template (its BOS from ``bos_token``, contents trimmed) gives
    ``apply_chat_template``'s ids on the same tiktoken file, leading newlines and digit runs included; one BOS, the
    template's, and the assistant header opened."""
    path, hf = llama_dir
    tok = hf_tokenizer(path)
    fmt = PromptFormat(chat=True, system=system)
    for text in TEXTS:
        ids = fmt.encode(tok, text)
        assert ids == _hf_ids(hf, text, system, LLAMA3_INSTRUCT_TEMPLATE), text
        assert ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id
        assert ids[-3:] == _hf_ids(hf, "", None, LLAMA3_INSTRUCT_TEMPLATE)[-3:]  # ...assistant<|end_header_id|>\n\n
    assert fmt.encode(tok, "\n\n" + TEXTS[0] + "  ") == fmt.encode(tok, TEXTS[0])  # the template trims contents


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(list("ab7 \n=;?")), min_size=0, max_size=24))
def test_any_prompt_text_equals_apply_chat_template(qwen_pair, text):
    """Property: for any text over letters, digits, spaces, newlines and punctuation, the Qwen prompt equals
    ``apply_chat_template``'s ids."""
    hf, tok = qwen_pair
    assert PromptFormat(chat=True).encode(tok, text) == _hf_ids(hf, text, None)


def test_the_property_catches_header_and_content_encoded_apart(qwen_pair):
    """Negative control of the property: encoding the rendered prefix (up to the user's content) and the rest
    apart, as a per-message format does, fails for a text that starts with a newline."""
    hf, tok = qwen_pair
    text = "\n\nab"
    rendered = tok.chat_template.render(_messages(text, None))
    cut = rendered.index(text)
    apart = encode_with_special_tokens(tok, rendered[:cut]) + encode_with_special_tokens(tok, rendered[cut:])
    assert encode_with_special_tokens(tok, rendered) == _hf_ids(hf, text, None) != apart


# -- where the template comes from ------------------------------------------------------------------------

def test_template_sources(tmp_path):
    """``chat_template.jinja`` wins over ``tokenizer_config.json`` (as in transformers); a list of named templates
    gives its ``default``; special tokens given as added-token entries read as their content; no template: None."""
    d = tmp_path / "d"
    d.mkdir()
    assert ChatTemplate.from_dir(d) is None
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>", "special": True},
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "{{ bos_token }}D"}]}))
    assert ChatTemplate.from_dir(d).render([]) == "<s>D"
    (d / "chat_template.jinja").write_text("J{{ messages[0].content }}")
    t = ChatTemplate.from_dir(d)
    assert t.render([{"role": "user", "content": "x"}]) == "Jx" and t.origin.endswith("chat_template.jinja")
    write_chat_template(tmp_path / "e", "{{ eos_token }}", file="chat_template.jinja", eos_token="</s>")
    assert ChatTemplate.from_dir(tmp_path / "e").render([]) == "</s>"


def test_template_features_transformers_gives_templates():
    """``tojson`` without HTML escaping, ``raise_exception``, loop controls and ``{% generation %}`` blocks, the
    jinja settings (trim_blocks, lstrip_blocks), ``tools`` defined as none."""
    t = ChatTemplate("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m | tojson }}"
                     "{% endfor %}{% generation %}<g>{% endgeneration %}{{ tools is none }}")
    assert t.render([{"role": "user", "content": "<&é>"}, {"role": "user", "content": "b"}]) == \
        '{"role": "user", "content": "<&é>"}<g>True'
    assert ChatTemplate("{% if true %}\n  a\n{% endif %}\nb").render([]) == "  a\nb"
    with pytest.raises(ValueError, match="roles must alternate"):
        ChatTemplate("{{ raise_exception('roles must alternate') }}", origin="dir/tokenizer_config.json").render([])


def test_bad_templates_and_messages_raise(tmp_path):
    with pytest.raises(ValueError, match="does not parse"):
        ChatTemplate("{% if %}", origin="x")
    with pytest.raises(ValueError, match="empty"):
        ChatTemplate("  ")
    d = tmp_path / "d"
    d.mkdir()
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ChatTemplate.from_dir(d)
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "T"}]}))
    with pytest.raises(ValueError, match="no 'default'"):
        ChatTemplate.from_dir(d)
    with pytest.raises(ValueError, match="string 'role' and 'content'"):
        ChatTemplate("x").render([{"role": "user"}])


def test_chat_without_a_template_is_refused(qwen_dir, tmp_path):
    """A directory without a chat template (a base model): ``prompt.chat: true`` raises naming what is missing;
    ``chat: false`` encodes the text alone."""
    base = write_qwen_tokenizer(tmp_path / "base")
    tok = hf_tokenizer(base)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template .* set prompt.chat to false"):
        PromptFormat(chat=True).encode(tok, "hi")
    assert PromptFormat().encode(tok, "hi 7") == tok.encode("hi 7", add_bos=True, add_eos=False)


def test_special_tokens_the_tokenizer_lacks_are_refused(qwen_dir, tmp_path):
    """A template writing a special token (from tokenizer_config.json) that the tokenizer does not know as one
    would be encoded as text, unlike transformers: refused, naming it."""
    tok = hf_tokenizer(qwen_dir)
    t = ChatTemplate("{{ bos_token }}{{ messages[0].content }}", {"bos_token": "<|not_special|>"}, "cfg")
    with pytest.raises(ValueError, match=r"<\|not_special\|>"):
        t.encode(tok, [{"role": "user", "content": "x"}])

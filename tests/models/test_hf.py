"""Hugging Face directories: config reading, refusals, from_hf against transformers, hf_tokenizer."""

from __future__ import annotations

import base64
import copy
import dataclasses
import json
import re

import pytest
import torch

from sparrow.models import (
    HFModelConfig,
    from_hf,
    hf_tokenizer,
    hf_twin,
    llama3,
    load_hf_checkpoint,
    model_config,
    qwen2,
    read_hf_config,
)
from tests.hf_dirs import (
    QWEN_ORDINARY,
    QWEN_ROWS,
    QWEN_SPECIALS,
    llama_config,
    qwen2_config,
    synthetic_text,
    write_config,
    write_model,
    write_qwen_tokenizer,
)
from tests.helpers import bits_equal

TOL = 1e-4  # fp32 logits, max abs
LENGTHS = (1, 13, 77)  # prompt lengths, none a multiple of 8
SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)

# name -> config of the transformers model written into the directory
CASES = {
    "qwen2-tied": lambda: qwen2_config(tie_word_embeddings=True),
    "qwen2-untied": lambda: qwen2_config(tie_word_embeddings=False),
    "llama3-scaled": lambda: llama_config(rope_scaling=SCALING),
    "llama3-plain": lambda: llama_config(),
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """``hf_dir(name) -> (path, transformers model)``, each written once per module."""
    written = {}

    def get(name):
        if name not in written:
            path = tmp_path_factory.mktemp(name)
            written[name] = (path, write_model(path, CASES[name]()))
        return written[name]

    return get


@pytest.fixture(scope="module")
def qwen_full(tmp_path_factory):
    """A Qwen2 directory in the real Qwen2.5 layout: tokenizer (ids 0..151642 + specials) and 151,936 rows."""
    path = write_qwen_tokenizer(tmp_path_factory.mktemp("qwen_full"))
    return path, write_model(path, qwen2_config(vocab_size=QWEN_ROWS, rope_theta=1e4))


def _tokens(vocab: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(seed + length))


def _logit_diff(model, hf, tokens) -> float:
    with torch.no_grad():
        return float((model(tokens) - hf(tokens).logits).abs().max())


def _with_rope_base(model, factor: float):
    """A copy of ``model`` whose RoPE base is multiplied by ``factor`` (everything else kept)."""
    wrong = copy.deepcopy(model)
    for rope in {id(l.attn.pos_embeddings): l.attn.pos_embeddings for l in wrong.layers}.values():
        rope.base = rope.base * factor
        rope.rope_init()
    return wrong


# -- logits and greedy tokens against transformers ------------------------------------------------------

@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, hf_dir):
    """fp32 logits of ``from_hf`` equal transformers' (eager) within 1e-4 at every prompt length; the same model
    with the RoPE base doubled misses by far more (negative control; position 0 has no rotation, so only
    the longer prompts can show it)."""
    path, hf = hf_dir(case)
    model = from_hf(path).eval()
    assert model_config(model) == dataclasses.replace(read_hf_config(path), max_position_embeddings=model.max_seq_len)
    wrong = _with_rope_base(model, 2.0)
    for length in LENGTHS:
        tokens = _tokens(hf.config.vocab_size, length)
        assert _logit_diff(model, hf, tokens) <= TOL, length
        if length > 1:
            assert _logit_diff(wrong, hf, tokens) > 100 * TOL, length


@pytest.mark.parametrize("case", list(CASES))
def test_hf_twin_has_the_same_weights(case, hf_dir):
    """``hf_twin`` of a loaded model gives its logits (the twin of the model with the RoPE base doubled does not:
    the twin follows the model, not the directory it came from); tied weights stay tied."""
    path, hf = hf_dir(case)
    model = from_hf(path).eval()
    twin, twin_of_wrong = hf_twin(model, attn_implementation="eager"), hf_twin(_with_rope_base(model, 2.0))
    assert type(twin) is type(hf) and twin.config.tie_word_embeddings == hf.config.tie_word_embeddings
    for length in LENGTHS:
        tokens = _tokens(hf.config.vocab_size, length)
        assert _logit_diff(model, twin, tokens) <= TOL, length
        if length > 1:
            assert _logit_diff(model, twin_of_wrong, tokens) > 100 * TOL, length
    if hf.config.tie_word_embeddings:
        assert twin.lm_head.weight.data_ptr() == twin.model.embed_tokens.weight.data_ptr()


def test_llama3_rope_scaling_changes_the_logits(hf_dir):
    """The llama3 scaling is what makes the logits match: the same weights under plain RoPE (or under the
    default scaling constants instead of the config's) miss transformers by far more than the tolerance."""
    path, hf = hf_dir("llama3-scaled")
    model = from_hf(path).eval()
    shape = dict(vocab_size=hf.config.vocab_size, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64,
                 intermediate_dim=96, max_seq_len=256, rope_base=5e5, tie_word_embeddings=False)
    plain = llama3(**shape, scale_factor=None).eval()
    default_scaling = llama3(**shape).eval()  # factor 32, original context 8192: not the checkpoint's
    for other in (plain, default_scaling):
        other.load_state_dict(model.state_dict())
    tokens = _tokens(hf.config.vocab_size, 77)
    assert _logit_diff(model, hf, tokens) <= TOL
    assert _logit_diff(plain, hf, tokens) > 100 * TOL
    assert _logit_diff(default_scaling, hf, tokens) > 100 * TOL


def _engine_tokens(model, prompts, n):
    from sparrow.rollout import EngineConfig, RolloutEngine, SamplingParams

    engine = RolloutEngine(model, EngineConfig(max_rows=4, max_prompt_len=96, max_new_tokens=n, compile=False))
    out = engine.generate(prompts, 1, SamplingParams(temperature=0.0, max_new_tokens=n))
    return [s.tokens.tolist() for s in out.samples]


def _hf_greedy(hf, prompts, n):
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                           pad_token_id=None)
    out = []
    for p in prompts:  # one prompt at a time: no padding
        ids = torch.tensor([p])
        with torch.no_grad():
            seq = hf.generate(ids, generation_config=gen, attention_mask=torch.ones_like(ids))
        out.append(seq[0, len(p):].tolist())
    return out


@pytest.mark.parametrize("case", ["qwen2-tokenizer", "llama3-scaled"])
def test_greedy_tokens_match_transformers(case, hf_dir, qwen_full):
    """The engine's greedy tokens equal transformers' ``generate(do_sample=False)`` for prompts of three lengths
    (16 new tokens, no stop token); with the RoPE base doubled they do not (negative control)."""
    pytest.importorskip("transformers")
    n = 16
    if case == "qwen2-tokenizer":  # the real Qwen2.5 layout, prompts from the directory's own tokenizer
        path, hf = qwen_full
        tok = hf_tokenizer(path)
        texts = synthetic_text(3, seed=7)
        prompts = [tok.encode(t, add_bos=False, add_eos=False) for t in (texts[0][:5], texts[1], texts[2] + texts[0])]
    else:  # positions past the original context (32) the scaling is for
        path, hf = hf_dir(case)
        prompts = [_tokens(hf.config.vocab_size, s)[0].tolist() for s in (3, 29, 61)]
    assert len({len(p) for p in prompts}) == 3
    model = from_hf(path).eval()
    ref = _hf_greedy(hf, prompts, n)
    assert all(len(r) == n for r in ref)
    assert _engine_tokens(model, prompts, n) == ref
    assert _engine_tokens(_with_rope_base(model, 2.0), prompts, n) != ref


# -- refusals -------------------------------------------------------------------------------------------

QWEN_SHAPE = dict(vocab_size=503, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, intermediate_dim=96,
                  max_seq_len=256, norm_eps=1e-6, rope_base=1e6, tie_word_embeddings=True)
LLAMA_SHAPE = dict(vocab_size=509, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=64, intermediate_dim=96,
                   max_seq_len=256, norm_eps=1e-5, rope_base=5e5, tie_word_embeddings=False, scale_factor=8.0,
                   old_context_len=32)

LLAMA_PLAIN_SHAPE = dict(LLAMA_SHAPE, scale_factor=None)
RIGHT = {"qwen2-tied": (qwen2, QWEN_SHAPE), "llama3-scaled": (llama3, LLAMA_SHAPE),
         "llama3-plain": (llama3, LLAMA_PLAIN_SHAPE)}


def _misfit(case, build, overrides, named, same_shapes, id):
    kwargs = {**RIGHT[case][1], **overrides} if build is RIGHT[case][0] else overrides
    return pytest.param(case, build, kwargs, named, same_shapes, id=id)


# (checkpoint, builder, its arguments, texts the error must contain, same parameter shapes as the right model)
MISFITS = [
    _misfit("qwen2-tied", qwen2, dict(num_heads=2), ["num_heads: checkpoint 4 vs model 2",
            "head_dim: checkpoint 16 vs model 32"], False, "heads"),
    _misfit("qwen2-tied", qwen2, dict(num_layers=3), ["num_layers: checkpoint 2 vs model 3"], False, "layers"),
    _misfit("qwen2-tied", qwen2, dict(embed_dim=96), ["embed_dim: checkpoint 64 vs model 96"], False, "hidden"),
    _misfit("qwen2-tied", qwen2, dict(num_kv_heads=1), ["num_kv_heads: checkpoint 2 vs model 1"], False, "kv_heads"),
    _misfit("qwen2-tied", qwen2, dict(embed_dim=128), ["head_dim: checkpoint 16 vs model 32"], False, "head_dim"),
    _misfit("qwen2-tied", qwen2, dict(intermediate_dim=97), ["intermediate_dim: checkpoint 96 vs model 97"], False,
            "intermediate"),
    _misfit("qwen2-tied", qwen2, dict(vocab_size=501), ["vocab_size: checkpoint 503 vs model 501"], False, "vocab"),
    _misfit("qwen2-tied", qwen2, dict(rope_base=1e4), ["rope_theta: checkpoint 1000000.0 vs model 10000.0"], True,
            "rope_theta"),
    _misfit("qwen2-tied", qwen2, dict(norm_eps=1e-5), ["norm_eps: checkpoint 1e-06 vs model 1e-05"], True, "eps"),
    _misfit("qwen2-tied", qwen2, dict(tie_word_embeddings=False),
            ["tie_word_embeddings: checkpoint True vs model False"], False, "tied"),
    _misfit("llama3-scaled", llama3, dict(scale_factor=None), ["rope_scaling: checkpoint {'factor': 8.0"], True,
            "rope_scaling-none"),
    _misfit("llama3-scaled", llama3, dict(old_context_len=8192),
            ["rope_scaling: checkpoint {'factor': 8.0, 'low_freq_factor': 1.0, 'high_freq_factor': 4.0, "
             "'original_max_position_embeddings': 32} vs model {'factor': 8.0, 'low_freq_factor': 1.0, "
             "'high_freq_factor': 4.0, 'original_max_position_embeddings': 8192}"], True, "rope_scaling-context"),
    _misfit("llama3-plain", llama3, dict(scale_factor=32.0), ["rope_scaling: checkpoint None vs model {'factor': 32.0"],
            True, "rope_scaling-added"),
    _misfit("qwen2-tied", llama3, dict(LLAMA_PLAIN_SHAPE, vocab_size=503, norm_eps=1e-6, rope_base=1e6,
                                       tie_word_embeddings=True),
            ["family: checkpoint 'qwen2' vs model 'llama'", "attention_bias: checkpoint True vs model False"], False,
            "family"),
]


@pytest.mark.parametrize("case,build,kwargs,named,same_shapes", MISFITS)
def test_refuses_a_checkpoint_of_another_architecture(case, build, kwargs, named, same_shapes, hf_dir):
    """Each mismatching field is named as ``field: checkpoint X vs model Y`` and nothing is loaded (the model's
    bits are unchanged). Where the parameter shapes agree (theta, eps, rope scaling) only this check stands
    between the user and a silently wrong model."""
    path, _ = hf_dir(case)
    torch.manual_seed(1)
    model = build(**kwargs)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="does not fit the model") as err:
        load_hf_checkpoint(model, path)
    for text in named:
        assert text in str(err.value), (text, str(err.value))
    after = model.state_dict()
    assert all(bits_equal(before[k], after[k]) for k in before)
    right_build, right_kwargs = RIGHT[case]
    shapes = lambda m: {k: tuple(v.shape) for k, v in m.state_dict().items()}  # noqa: E731
    assert (shapes(model) == shapes(right_build(**right_kwargs))) == same_shapes


@pytest.mark.parametrize("case", ["qwen2-tied", "llama3-scaled"])
def test_the_right_model_loads(case, hf_dir):
    """Negative control for the refusals: the model of the right architecture loads, and the load does change
    its bits (so the unchanged-bits check above can fail)."""
    path, hf = hf_dir(case)
    build, shape = RIGHT[case]
    torch.manual_seed(1)
    model = build(**shape)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    load_hf_checkpoint(model, path)
    after = model.state_dict()
    assert not any(bits_equal(before[k], after[k]) for k in before)
    assert _logit_diff(model.eval(), hf, _tokens(shape["vocab_size"], 13)) <= TOL


def test_checkpoint_files_must_be_safetensors(hf_dir, tmp_path):
    path, _ = hf_dir("qwen2-tied")
    model = qwen2(**QWEN_SHAPE)
    with pytest.raises(ValueError, match=r"checkpoint_files: 'model.bin' is not a .safetensors file"):
        load_hf_checkpoint(model, path, checkpoint_files=["model.bin"])
    bare = write_config(tmp_path / "bare", json.loads((path / "config.json").read_text()))
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors files"):
        from_hf(bare)


# released-checkpoint layout (top-level rope_theta, rope_scaling), tiny sizes
QWEN_RELEASED = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu", "hidden_size": 64,
    "intermediate_size": 96, "max_position_embeddings": 256, "max_window_layers": 2, "num_attention_heads": 4,
    "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_scaling": None,
    "rope_theta": 1000000.0, "sliding_window": 256, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_sliding_window": False, "vocab_size": 503,
}
LLAMA_RELEASED = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "attention_bias": False, "head_dim": 16,
    "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 96, "max_position_embeddings": 256,
    "mlp_bias": False, "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5, "rope_scaling": {**SCALING, "rope_type": "llama3"}, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "vocab_size": 509,
}


def _drop(d, key):
    return {k: v for k, v in d.items() if k != key}


REFUSED = [
    pytest.param(QWEN_RELEASED | {"rope_scaling": {"type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 32768}},
                 "rope_scaling.rope_type='yarn'", id="qwen-yarn"),
    pytest.param(QWEN_RELEASED | {"rope_scaling": {"rope_type": "llama3", **SCALING}},
                 "rope_scaling.rope_type='llama3' is not supported for model_type 'qwen2'", id="qwen-llama3-rope"),
    pytest.param(LLAMA_RELEASED | {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                 "rope_scaling.rope_type='linear'", id="llama-linear-rope"),
    pytest.param(LLAMA_RELEASED | {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
                 "lacks required key(s) ['low_freq_factor'", id="llama3-rope-incomplete"),
    pytest.param(LLAMA_RELEASED | {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5,
                                                       "partial_rotary_factor": 0.5}},
                 "partial_rotary_factor=0.5", id="partial-rotary"),
    pytest.param(QWEN_RELEASED | {"use_sliding_window": True}, "use_sliding_window=True", id="sliding-window"),
    pytest.param(QWEN_RELEASED | {"layer_types": ["full_attention", "sliding_attention"]},
                 "layer_types=['sliding_attention']", id="sliding-layers"),
    pytest.param(QWEN_RELEASED | {"hidden_act": "gelu"}, "hidden_act='gelu'", id="gelu"),
    pytest.param(QWEN_RELEASED | {"model_type": "mistral"}, "model_type='mistral'", id="model_type"),
    pytest.param(LLAMA_RELEASED | {"mlp_bias": True}, "mlp_bias=True", id="mlp-bias"),
    pytest.param(LLAMA_RELEASED | {"attention_bias": True}, "attention_bias=True", id="llama-attention-bias"),
    pytest.param(LLAMA_RELEASED | {"head_dim": 32}, "head_dim=32", id="head_dim"),
    pytest.param(QWEN_RELEASED | {"num_key_value_heads": 3}, "num_key_value_heads=3", id="kv-heads-divide"),
    pytest.param(QWEN_RELEASED | {"quantization_config": {"quant_method": "gptq"}}, "quantization_config='gptq'",
                 id="quantized"),
    pytest.param(_drop(QWEN_RELEASED, "num_hidden_layers"), "config.json: required key 'num_hidden_layers' is missing",
                 id="missing-layers"),
    pytest.param(_drop(QWEN_RELEASED, "tie_word_embeddings"), "required key 'tie_word_embeddings' is missing",
                 id="missing-tied"),
    pytest.param(_drop(QWEN_RELEASED, "rope_theta"), "required key 'rope_theta' is missing", id="missing-theta"),
    pytest.param(LLAMA_RELEASED | {"rope_parameters": {"rope_theta": 1e4}}, "rope_theta=500000.0 and "
                 "rope_parameters.rope_theta=10000.0 disagree", id="two-thetas"),
]


@pytest.mark.parametrize("config,message", REFUSED)
def test_read_hf_config_refuses_what_sparrow_cannot_build(config, message, tmp_path):
    path = write_config(tmp_path, config)
    with pytest.raises(ValueError, match=re.escape(message)):
        read_hf_config(path)


def test_read_hf_config_layouts(tmp_path):
    """One architecture, three spellings: the released layout (top-level ``rope_theta``, ``rope_scaling`` with
    ``rope_type``), the older ``type`` key, and transformers 5's ``save_pretrained`` (``rope_parameters``)."""
    want = HFModelConfig(family="llama", vocab_size=509, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                         embed_dim=64, intermediate_dim=96, rope_theta=5e5, rope_scaling=SCALING, norm_eps=1e-5,
                         tie_word_embeddings=False, attention_bias=False, max_position_embeddings=256)
    assert read_hf_config(write_config(tmp_path / "released", LLAMA_RELEASED)) == want
    old = LLAMA_RELEASED | {"rope_scaling": {**SCALING, "type": "llama3"}}
    assert read_hf_config(write_config(tmp_path / "old", old) / "config.json") == want
    assert hash(want) == hash(read_hf_config(tmp_path / "old"))
    qwen = read_hf_config(write_config(tmp_path / "qwen", QWEN_RELEASED))
    assert (qwen.family, qwen.rope_scaling, qwen.attention_bias, qwen.tie_word_embeddings) == \
        ("qwen2", None, True, True)
    with pytest.raises(FileNotFoundError, match="config.json"):
        read_hf_config(tmp_path / "nowhere")
    pytest.importorskip("transformers")
    llama_config(rope_scaling=SCALING).save_pretrained(tmp_path / "tf5")
    saved = json.loads((tmp_path / "tf5" / "config.json").read_text())
    assert "rope_parameters" in saved and "rope_theta" not in saved  # the new layout really is the one read
    assert read_hf_config(tmp_path / "tf5") == want
    qwen2_config().save_pretrained(tmp_path / "tf5q")
    assert read_hf_config(tmp_path / "tf5q") == qwen


# published shapes: config.json of the released checkpoints (architecture keys), parameter counts from the hub
PUBLISHED = {
    "Qwen2.5-0.5B": (QWEN_RELEASED | dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                          num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                          max_position_embeddings=32768, tie_word_embeddings=True), 494_032_768),
    "Qwen2.5-1.5B": (QWEN_RELEASED | dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                          num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                          max_position_embeddings=131072, tie_word_embeddings=True), 1_543_714_304),
    "Qwen2.5-7B": (QWEN_RELEASED | dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                        num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                        max_position_embeddings=131072, tie_word_embeddings=False), 7_615_616_512),
    "Llama-3.2-1B": (LLAMA_RELEASED | dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                           num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                           vocab_size=128256, max_position_embeddings=131072,
                                           tie_word_embeddings=True,
                                           rope_scaling={"factor": 32.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0, "rope_type": "llama3",
                                                         "original_max_position_embeddings": 8192}),
                     1_235_814_400),
    "Llama-3.1-8B": (LLAMA_RELEASED | dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                           num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                           vocab_size=128256, max_position_embeddings=131072,
                                           tie_word_embeddings=False,
                                           rope_scaling={"factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0, "rope_type": "llama3",
                                                         "original_max_position_embeddings": 8192}),
                     8_030_261_248),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_shapes_give_published_parameter_counts(name, tmp_path):
    config, count = PUBLISHED[name]
    path = write_config(tmp_path, config)
    with torch.device("meta"):
        model = from_hf(path, load_weights=False)
    assert sum(p.numel() for p in model.parameters()) == count
    assert model.max_seq_len == config["max_position_embeddings"]
    got = model_config(model)
    assert got.rope_scaling == read_hf_config(path).rope_scaling
    assert got.tie_word_embeddings == config["tie_word_embeddings"]


# -- tokenizers -----------------------------------------------------------------------------------------

def test_hf_tokenizer_qwen_layout(qwen_full):
    """The Qwen fixture's tokenizer (torchtune's, from vocab.json + merges.txt + tokenizer.json): round trip,
    the same ids as the ``tokenizers`` library's reading of tokenizer.json, ordinary ids 0..151642, specials at
    151643..151664, and 271 embedding rows (151665..151935) with no token at all: torchtune's decode maps such
    an id to None and crashes joining the text (``TypeError``). Sparrow never samples them
    (``SamplingParams.vocab_limit``); this test pins the layout, it does not fix torchtune."""
    tokenizers = pytest.importorskip("tokenizers")
    path, hf = qwen_full
    tok = hf_tokenizer(path, max_seq_len=64)
    assert type(tok).__name__ == "Qwen2_5Tokenizer" and tok.max_seq_len == 64
    text = "what is 12 plus 345? so \\boxed{357}\n#### 357"
    ids = tok.encode(text, add_bos=False, add_eos=False)
    assert tok.decode(ids) == text
    assert ids == tokenizers.Tokenizer.from_file(str(path / "tokenizer.json")).encode(text).ids
    assert len(tok.encode("what is the answer", add_bos=False, add_eos=False)) == 4  # merged words, not bytes
    assert len(tok.encode("2025", add_bos=False, add_eos=False)) == 4  # Qwen's split: one digit per token
    assert sorted(tok.encoder.values()) == list(range(QWEN_ORDINARY))
    assert tok.special_tokens == {s: QWEN_ORDINARY + i for i, s in enumerate(QWEN_SPECIALS)}
    assert (tok.eos_id, tok.pad_id) == (151645, 151643)
    chat = tok.encode("<|im_start|>hi<|im_end|>", add_bos=False, add_eos=False)
    assert (chat[0], chat[-1]) == (151644, 151645) and max(chat[1:-1]) < QWEN_ORDINARY
    n_tokens = QWEN_ORDINARY + len(QWEN_SPECIALS)
    assert (n_tokens, hf.config.vocab_size, hf.config.vocab_size - n_tokens) == (151665, 151936, 271)
    assert tok.decode([151664]) == "<|file_sep|>"
    for missing in (151665, 151700, 151935):
        with pytest.raises(TypeError):
            tok.decode(ids[:3] + [missing])
    (path / "tokenizer.json").rename(path / "tokenizer.json.off")  # torchtune's canonical specials: the same
    try:
        assert hf_tokenizer(path).special_tokens == tok.special_tokens
    finally:
        (path / "tokenizer.json.off").rename(path / "tokenizer.json")


def test_hf_tokenizer_llama_and_missing_files(tmp_path):
    """A llama directory's tiktoken ``original/tokenizer.model`` gives torchtune's Llama-3 tokenizer; a directory
    without tokenizer files (or with another family's) raises FileNotFoundError naming what was looked for."""
    pytest.importorskip("tiktoken")
    llama = write_config(tmp_path / "llama", LLAMA_RELEASED)
    (llama / "original").mkdir()
    # a byte-level tiktoken file: every byte one token (base64 token, rank)
    (llama / "original" / "tokenizer.model").write_text(
        "".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    tok = hf_tokenizer(llama)
    ids = tok.encode("hi 7", add_bos=True, add_eos=False)
    assert type(tok).__name__ == "Llama3Tokenizer" and ids == [128000, 104, 105, 32, 55]
    assert tok.decode(ids) == "hi 7"
    looked_for = r"looked for vocab.json \+ merges.txt \(qwen2\) and tokenizer.model or original/tokenizer.model"
    with pytest.raises(FileNotFoundError, match=looked_for):
        hf_tokenizer(write_config(tmp_path / "empty", QWEN_RELEASED))
    qwen_with_tiktoken = write_config(tmp_path / "mixed", QWEN_RELEASED)
    (qwen_with_tiktoken / "tokenizer.model").write_text((llama / "original" / "tokenizer.model").read_text())
    with pytest.raises(FileNotFoundError, match="model_type 'qwen2'"):
        hf_tokenizer(qwen_with_tiktoken)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hf_tokenizer(tmp_path / "nowhere")


# -- the calibrate CLI on an HF directory ---------------------------------------------------------------

def test_calibrate_cli_builds_from_an_hf_directory(hf_dir, tmp_path, capsys):
    """``sparrow calibrate --checkpoint HF_DIR`` needs no ``--model``; a state-dict file without it is refused."""
    from safetensors.torch import save_file

    from sparrow.attention.rtpurbo import RTPurboConfig
    from sparrow.calibrate import load_rtpurbo, main

    path, _ = hf_dir("qwen2-tied")
    args = ["--seq-len", "128", "--num-seqs", "1", "--steps", "2", "--block", "16", "--ratio", "0.5",
            "--queries-per-seq", "16", "--no-progress", "--device", "cpu", "--dtype", "float32"]
    assert main(["--checkpoint", str(path), "--out", str(tmp_path / "a"), *args]) == 0
    assert "retrieval heads (2 of 4" in capsys.readouterr().out
    _, _, cfg = load_rtpurbo(tmp_path / "a", with_config=True)
    assert cfg.window == RTPurboConfig.for_context(256).window  # the config's max_position_embeddings
    with pytest.raises(ValueError, match="vocab_size: checkpoint 503 vs model 64"):
        main(["--model", "tiny_qwen2", "--checkpoint", str(path), "--out", str(tmp_path / "b"), *args])
    ckpt = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in qwen2(**QWEN_SHAPE).state_dict().items()}, str(ckpt))
    with pytest.raises(SystemExit, match="--model is required with a state-dict checkpoint"):
        main(["--checkpoint", str(ckpt), *args])

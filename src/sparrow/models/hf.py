"""Hugging Face model directories: read ``config.json``, build the exact Sparrow model, load, tokenize.

A Hugging Face directory (``config.json`` + ``*.safetensors``, plus the tokenizer files) describes its own
architecture. :func:`read_hf_config` turns ``config.json`` into an :class:`HFModelConfig` and refuses what
Sparrow cannot build exactly; :func:`model_config` reads the same fields off a built model, so
:func:`~sparrow.models.load_hf_checkpoint` can compare the two before it loads anything; :func:`from_hf`
is the builder of the directory itself, and :func:`hf_tokenizer` its tokenizer::

    model:
      _component_: sparrow.models.from_hf
      path: /models/Qwen2.5-0.5B-Instruct
    tokenizer:
      _component_: sparrow.models.hf_tokenizer
      path: /models/Qwen2.5-0.5B-Instruct
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from torch import nn
from torchtune.models.llama3_1._position_embeddings import Llama3ScaledRoPE
from torchtune.models.qwen2._positional_embeddings import Qwen2RotaryPositionalEmbeddings
from torchtune.modules import RotaryPositionalEmbeddings, TiedLinear, TransformerDecoder

from sparrow.attention.dense import DenseAttention
from sparrow.models.attention import AttentionFactory
from sparrow.models.builders import llama3, qwen2
from sparrow.models.chat import ChatTemplate
from sparrow.models.checkpoint import load_model_state

FAMILIES = ("qwen2", "llama")
# the llama3 rope-scaling keys, in HFModelConfig.rope_scaling and in config.json alike
ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class HFModelConfig:
    """The architecture of a Qwen2 / Llama-3 decoder, as ``config.json`` states it and a built model has it.

    Attributes:
        family: ``"qwen2"`` (Qwen2 / Qwen2.5: q/k/v biases, half-split RoPE) or ``"llama"`` (Llama-3.x).
        vocab_size: embedding rows (``vocab_size``); may exceed the tokenizer's ids (Qwen2.5: 151,936 rows).
        num_layers: decoder layers (``num_hidden_layers``).
        num_heads: query heads (``num_attention_heads``).
        num_kv_heads: key / value heads (``num_key_value_heads``); divides ``num_heads``.
        head_dim: per-head width (``head_dim``, else ``hidden_size / num_attention_heads``).
        embed_dim: residual width (``hidden_size``).
        intermediate_dim: MLP width (``intermediate_size``).
        rope_theta: RoPE base (``rope_theta``, top level or in ``rope_parameters``).
        rope_scaling: ``None`` (plain RoPE) or Llama-3.1-style scaling as a dict with ``factor``,
            ``low_freq_factor``, ``high_freq_factor`` (floats) and ``original_max_position_embeddings`` (int).
        norm_eps: RMSNorm epsilon (``rms_norm_eps``).
        tie_word_embeddings: the output projection is the token embedding (``tie_word_embeddings``).
        attention_bias: q / k / v projections have biases (always for Qwen2; never for the Llamas Sparrow
            builds).
        max_position_embeddings: the context the checkpoint was made for (``max_position_embeddings``); the
            default RoPE table length of :func:`from_hf`. Not compared against a model: the model's table
            length is a run-time choice (:func:`model_config` reports the model's ``max_seq_len``).
    """

    family: str
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    embed_dim: int
    intermediate_dim: int
    rope_theta: float
    rope_scaling: dict[str, float | int] | None = field(hash=False)
    norm_eps: float
    tie_word_embeddings: bool
    attention_bias: bool
    max_position_embeddings: int | None


def config_mismatches(checkpoint: HFModelConfig, model: HFModelConfig) -> list[str]:
    """Every architectural field that differs, as ``"name: checkpoint X vs model Y"`` (empty: they fit).

    ``max_position_embeddings`` is not compared (the model's RoPE table length is a run-time choice)."""
    out = []
    for f in dataclasses.fields(HFModelConfig):
        if f.name == "max_position_embeddings":
            continue
        a, b = getattr(checkpoint, f.name), getattr(model, f.name)
        if a != b:
            out.append(f"{f.name}: checkpoint {a!r} vs model {b!r}")
    return out


def _config_file(path: str | Path) -> Path:
    p = Path(path)
    f = p / "config.json" if p.is_dir() else p
    if not f.is_file():
        raise FileNotFoundError(f"{f} does not exist: expected a Hugging Face model directory with config.json")
    return f


def read_hf_config(path: str | Path) -> HFModelConfig:
    """Read ``config.json`` of a Hugging Face Qwen2 / Llama directory (``path``: the directory or the file).

    Both layouts are read: released checkpoints' (top-level ``rope_theta``; ``rope_scaling`` with
    ``rope_type`` or ``type``) and transformers 5's ``save_pretrained`` (a ``rope_parameters`` dict holding
    ``rope_theta``, ``rope_type`` and the scaling keys).

    Required keys: ``model_type``, ``vocab_size``, ``hidden_size``, ``intermediate_size``,
    ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``rms_norm_eps``,
    ``max_position_embeddings``, ``tie_word_embeddings`` and the RoPE base. ``hidden_act``, ``head_dim``,
    ``attention_bias``, ``mlp_bias`` and ``use_sliding_window`` default to transformers' defaults.

    Raises:
        FileNotFoundError: no ``config.json``.
        ValueError: naming the field and its value, for anything Sparrow cannot build exactly: a
            ``model_type`` other than ``qwen2`` / ``llama``; ``hidden_act`` other than ``silu``; RoPE scaling
            other than none (qwen2, llama) or ``llama3`` (llama), e.g. Qwen's ``yarn``; partial rotary
            embeddings; sliding-window attention; llama ``attention_bias`` / ``mlp_bias``; a ``head_dim``
            other than ``hidden_size / num_attention_heads``; heads not divisible by kv heads; a
            quantized checkpoint; a missing required key.
    """
    f = _config_file(path)
    cfg = json.loads(f.read_text())
    if not isinstance(cfg, dict):
        raise ValueError(f"{f}: expected a JSON object, got {type(cfg).__name__}")

    def need(key: str) -> Any:
        if key not in cfg or cfg[key] is None:
            raise ValueError(f"{f}: required key {key!r} is missing")
        return cfg[key]

    def refuse(key: str, value: Any, why: str) -> ValueError:
        return ValueError(f"{f}: {key}={value!r} is not supported: {why}")

    family = need("model_type")
    if family not in FAMILIES:
        raise refuse("model_type", family, "Sparrow builds 'qwen2' (Qwen2 / Qwen2.5) and 'llama' (Llama-3.x)")
    if "quantization_config" in cfg:
        method = (cfg["quantization_config"] or {}).get("quant_method", "?")
        raise refuse("quantization_config", method, "quantized checkpoints cannot be loaded: use a full-precision one")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise refuse("hidden_act", act, "the Qwen2 / Llama MLPs Sparrow builds use silu")
    if family == "qwen2":
        if cfg.get("use_sliding_window", False):
            raise refuse("use_sliding_window", cfg["use_sliding_window"], "Sparrow's attention is full causal")
    else:
        for key in ("attention_bias", "mlp_bias"):
            if cfg.get(key, False):
                raise refuse(key, cfg[key], "the Llama layers Sparrow builds have no biases")
    layer_types = cfg.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        kinds = sorted(set(layer_types) - {"full_attention"})
        raise refuse("layer_types", kinds, "Sparrow's attention is full causal attention in every layer")

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    kv_heads = int(need("num_key_value_heads"))
    if hidden % heads:
        raise refuse("hidden_size", hidden, f"not divisible by num_attention_heads={heads}")
    if heads % kv_heads:
        raise refuse("num_key_value_heads", kv_heads, f"does not divide num_attention_heads={heads}")
    head_dim = cfg.get("head_dim") or hidden // heads
    if head_dim != hidden // heads:
        raise refuse("head_dim", head_dim, f"the torchtune builders need head_dim = hidden_size / num_attention_heads "
                                           f"= {hidden // heads}")
    theta, scaling = _rope(cfg, f, family)
    return HFModelConfig(
        family=family, vocab_size=int(need("vocab_size")), num_layers=int(need("num_hidden_layers")),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=int(head_dim), embed_dim=hidden,
        intermediate_dim=int(need("intermediate_size")), rope_theta=theta, rope_scaling=scaling,
        norm_eps=float(need("rms_norm_eps")), tie_word_embeddings=bool(need("tie_word_embeddings")),
        attention_bias=family == "qwen2", max_position_embeddings=int(need("max_position_embeddings")),
    )


def _rope(cfg: dict, f: Path, family: str) -> tuple[float, dict[str, float | int] | None]:
    """(rope_theta, llama3 scaling or None) from either config layout."""
    params = cfg.get("rope_parameters")
    if params is not None and not ("rope_theta" in params or "rope_type" in params):
        raise ValueError(f"{f}: rope_parameters={params!r} is not supported: expected one dict with rope_theta and "
                         "rope_type (per-layer-type RoPE is not built by Sparrow)")
    scaling = dict(cfg.get("rope_scaling") or {})
    scaling.update(params or {})
    thetas = {float(t) for t in (cfg.get("rope_theta"), (params or {}).get("rope_theta")) if t is not None}
    if not thetas:
        raise ValueError(f"{f}: required key 'rope_theta' is missing (top level or in rope_parameters)")
    if len(thetas) > 1:
        raise ValueError(f"{f}: rope_theta={cfg['rope_theta']!r} and rope_parameters.rope_theta="
                         f"{params['rope_theta']!r} disagree")
    theta = thetas.pop()
    partial = scaling.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"{f}: partial_rotary_factor={partial!r} is not supported: Sparrow rotates the whole head")
    rope_type = scaling.get("rope_type", scaling.get("type")) or "default"
    if rope_type == "default":
        return theta, None
    supported = "rope scaling: none" + (" or rope_type 'llama3'" if family == "llama" else "")
    if rope_type != "llama3" or family != "llama":
        raise ValueError(f"{f}: rope_scaling.rope_type={rope_type!r} is not supported for model_type {family!r} "
                         f"(Sparrow builds {supported})")
    missing = [k for k in ROPE_SCALING_KEYS if scaling.get(k) is None]
    if missing:
        raise ValueError(f"{f}: rope_scaling (rope_type 'llama3') lacks required key(s) {missing}")
    return theta, {"factor": float(scaling["factor"]), "low_freq_factor": float(scaling["low_freq_factor"]),
                   "high_freq_factor": float(scaling["high_freq_factor"]),
                   "original_max_position_embeddings": int(scaling["original_max_position_embeddings"])}


def model_config(model: TransformerDecoder) -> HFModelConfig:
    """The :class:`HFModelConfig` of a built Sparrow / torchtune Qwen2 or Llama-3 ``TransformerDecoder``.

    Read off the modules: layer count, embedding, the attention modules' heads / head_dim and q bias, the MLP's
    ``w1.out_features``, the RoPE module (type gives the family: ``Qwen2RotaryPositionalEmbeddings`` → qwen2,
    ``RotaryPositionalEmbeddings`` / ``Llama3ScaledRoPE`` → llama; its base and scaling), the RMSNorm eps and
    whether the output is a ``TiedLinear``. ``max_position_embeddings`` is the model's ``max_seq_len``.

    Raises:
        ValueError: the layers differ from each other, or a layer has no (or an unknown) RoPE module.
    """
    per_layer = [_layer_fields(i, layer) for i, layer in enumerate(model.layers)]
    if not per_layer:
        raise ValueError("model has no layers")
    for i, fields in enumerate(per_layer[1:], 1):
        diff = [f"{k}: layer 0 {per_layer[0][k]!r} vs layer {i} {v!r}"
                for k, v in fields.items() if per_layer[0][k] != v]
        if diff:
            raise ValueError("the model's layers differ, so no Hugging Face config describes it: " + "; ".join(diff))
    emb = model.tok_embeddings
    return HFModelConfig(
        vocab_size=emb.num_embeddings, num_layers=len(model.layers), embed_dim=emb.embedding_dim,
        tie_word_embeddings=isinstance(model.output, TiedLinear), max_position_embeddings=model.max_seq_len,
        **per_layer[0],
    )


def _layer_fields(i: int, layer: nn.Module) -> dict[str, Any]:
    attn = layer.attn
    rope = getattr(attn, "pos_embeddings", None)
    if isinstance(rope, Qwen2RotaryPositionalEmbeddings):
        family, scaling = "qwen2", None
    elif isinstance(rope, Llama3ScaledRoPE):
        family = "llama"
        scaling = {"factor": float(rope.scale_factor), "low_freq_factor": float(rope.low_freq_factor),
                   "high_freq_factor": float(rope.high_freq_factor),
                   "original_max_position_embeddings": int(rope.old_context_len)}
    elif isinstance(rope, RotaryPositionalEmbeddings):
        family, scaling = "llama", None
    else:
        raise ValueError(f"layer {i}: RoPE module {type(rope).__name__} is not one Sparrow builds "
                         "(Qwen2RotaryPositionalEmbeddings, RotaryPositionalEmbeddings, Llama3ScaledRoPE)")
    return dict(family=family, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
                intermediate_dim=layer.mlp.w1.out_features, rope_theta=float(rope.base), rope_scaling=scaling,
                norm_eps=float(layer.sa_norm.eps), attention_bias=getattr(attn.q_proj, "bias", None) is not None)


def build_from_config(
    config: HFModelConfig, *, max_seq_len: int | None = None, attention: AttentionFactory = DenseAttention,
) -> TransformerDecoder:
    """The Sparrow model of ``config`` (random weights): :func:`~sparrow.models.qwen2` or
    :func:`~sparrow.models.llama3` with every field; ``max_seq_len`` defaults to ``max_position_embeddings``.

    Raises:
        ValueError: neither ``max_seq_len`` nor ``config.max_position_embeddings`` is set.
    """
    seq = max_seq_len or config.max_position_embeddings
    if not seq:
        raise ValueError("max_seq_len is required: the config has no max_position_embeddings")
    common = dict(vocab_size=config.vocab_size, num_layers=config.num_layers, num_heads=config.num_heads,
                  num_kv_heads=config.num_kv_heads, embed_dim=config.embed_dim,
                  intermediate_dim=config.intermediate_dim, max_seq_len=seq, norm_eps=config.norm_eps,
                  rope_base=config.rope_theta, tie_word_embeddings=config.tie_word_embeddings, attention=attention)
    if config.family == "qwen2":
        return qwen2(**common)
    s = config.rope_scaling
    if s is None:
        return llama3(**common, scale_factor=None)
    return llama3(**common, scale_factor=s["factor"], low_freq_factor=s["low_freq_factor"],
                  high_freq_factor=s["high_freq_factor"], old_context_len=s["original_max_position_embeddings"])


# torchtune ModelType per config.json model_type: QWEN2 converts with qwen2_hf_to_tune (no q/k permutation,
# lm_head dropped when tied); LLAMA3_2 falls to torchtune's generic hf_to_tune (q/k permuted to torchtune's
# interleaved RoPE layout), right for tied and untied Llamas alike
MODEL_TYPES = {"qwen2": "QWEN2", "llama": "LLAMA3_2"}


def load_hf_checkpoint(
    model: TransformerDecoder,
    checkpoint_dir: str | Path,
    *,
    checkpoint_files: Sequence[str] | None = None,
) -> None:
    """Load a Hugging Face checkpoint into ``model``, after checking that it is the model's architecture.

    After the files are found, ``config.json`` is read with :func:`~sparrow.models.read_hf_config` and
    compared field by field with :func:`~sparrow.models.model_config` of ``model`` (family, layers, heads, kv
    heads, head_dim, hidden and MLP widths, vocabulary, RoPE theta and scaling, RMSNorm eps, tied embeddings,
    q/k/v biases; not the context length) before any tensor is read; the weights then go through torchtune's
    ``FullModelHFCheckpointer`` (safetensors only, the ``ModelType`` taken from ``model_type``). On any error
    ``model`` is unchanged.

    Args:
        model: a Qwen2 / Llama-3 model from :mod:`sparrow.models` (torchtune parameter names).
        checkpoint_dir: directory holding ``config.json`` and ``*.safetensors`` (nothing is downloaded).
        checkpoint_files: ``.safetensors`` files inside ``checkpoint_dir`` (default: every ``*.safetensors``).

    Raises:
        FileNotFoundError: the directory, ``config.json`` or a listed file does not exist, or there are no
            safetensors files.
        ValueError: ``config.json`` describes something Sparrow cannot build (see :func:`read_hf_config`) or
            another architecture than ``model``'s (every mismatching field listed as
            ``name: checkpoint X vs model Y``); a listed file is not ``.safetensors``; the tensors do not
            fit the model (missing / unexpected keys, shapes).
    """
    from torchtune.training import FullModelHFCheckpointer

    d = Path(checkpoint_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"checkpoint directory {d} does not exist")
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{d} has no config.json: expected a Hugging Face model directory")
    files = list(checkpoint_files) if checkpoint_files else sorted(p.name for p in d.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {d}")
    for f in files:
        if not str(f).endswith(".safetensors"):
            raise ValueError(f"checkpoint_files: {f!r} is not a .safetensors file (Sparrow never unpickles weights)")
        if not (d / f).is_file():
            raise FileNotFoundError(f"checkpoint file {d / f} does not exist")
    config = read_hf_config(d)
    bad = config_mismatches(config, model_config(model))
    if bad:
        raise ValueError(f"checkpoint {d} does not fit the model: " + "; ".join(bad))
    with tempfile.TemporaryDirectory() as out:
        ckpt = FullModelHFCheckpointer(checkpoint_dir=str(d), checkpoint_files=files,
                                       model_type=MODEL_TYPES[config.family], output_dir=out)
        state = ckpt.load_checkpoint()["model"]
    if config.tie_word_embeddings:  # some tied checkpoints still store lm_head (a copy of the embedding)
        state.pop("output.weight", None)
    load_model_state(model, state)


def from_hf(
    path: str | Path,
    *,
    max_seq_len: int | None = None,
    attention: AttentionFactory = DenseAttention,
    load_weights: bool = True,
) -> TransformerDecoder:
    """Build the model a Hugging Face directory describes and (by default) load its weights.

    Args:
        path: directory with ``config.json`` (and ``*.safetensors`` when ``load_weights``).
        max_seq_len: RoPE table length, the longest context the model runs at (default: the config's
            ``max_position_embeddings``).
        attention: attention factory ``LayerShape -> AttentionBackend`` (default :class:`DenseAttention`).
        load_weights: load the safetensors through :func:`~sparrow.models.load_hf_checkpoint`; ``False``
            leaves the builder's random init (e.g. to count parameters under ``torch.device("meta")``).

    Returns:
        A ``TransformerDecoder`` with Sparrow attention, fp32 parameters (the checkpoint's values cast).

    Raises:
        FileNotFoundError / ValueError: from :func:`read_hf_config` and :func:`load_hf_checkpoint`.
    """
    model = build_from_config(read_hf_config(path), max_seq_len=max_seq_len, attention=attention)
    if load_weights:
        load_hf_checkpoint(model, path)
    return model


def hf_tokenizer(path: str | Path, *, max_seq_len: int | None = None, **kwargs: Any):
    """The torchtune tokenizer of a Hugging Face directory.

    - ``vocab.json`` + ``merges.txt`` (Qwen2 / Qwen2.5, ``model_type: qwen2`` or no config):
      :func:`torchtune.models.qwen2_5.qwen2_5_tokenizer`, with ``special_tokens_path=tokenizer.json`` when that
      file exists (else torchtune's Qwen2.5 special tokens, ids 151643..151664).
    - ``tokenizer.model`` or ``original/tokenizer.model`` (tiktoken, ``model_type: llama`` or no config):
      :func:`torchtune.models.llama3.llama3_tokenizer` with torchtune's Llama-3 special tokens (ids 128000..;
      a released ``tokenizer.json`` names some of them differently, which torchtune's tokenizer rejects).

    ``max_seq_len`` and ``kwargs`` (e.g. ``prompt_template``) go to the torchtune builder. The tokenizer returned
    carries the directory's chat template as ``chat_template``: a :class:`~sparrow.models.chat.ChatTemplate`, or
    None when the directory has none (a base model); :class:`sparrow.rl.PromptFormat` writes chat prompts with it.

    Raises:
        FileNotFoundError: ``path`` is not a directory, or none of those files fits its ``model_type``
            (the message lists what was looked for).
    """
    d = Path(path)
    if not d.is_dir():
        raise FileNotFoundError(f"tokenizer directory {d} does not exist")
    tok = _torchtune_tokenizer(d, max_seq_len, **kwargs)
    tok.chat_template = ChatTemplate.from_dir(d)
    return tok


def _torchtune_tokenizer(d: Path, max_seq_len: int | None, **kwargs: Any):
    family = None
    if (d / "config.json").is_file():
        family = json.loads((d / "config.json").read_text()).get("model_type")
    if family in ("qwen2", None) and (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
        from torchtune.models.qwen2_5 import qwen2_5_tokenizer

        specials = d / "tokenizer.json"
        return qwen2_5_tokenizer(path=str(d / "vocab.json"), merges_file=str(d / "merges.txt"),
                                 special_tokens_path=str(specials) if specials.is_file() else None,
                                 max_seq_len=max_seq_len, **kwargs)
    if family in ("llama", None):
        for model_file in (d / "tokenizer.model", d / "original" / "tokenizer.model"):
            if model_file.is_file():
                from torchtune.models.llama3 import llama3_tokenizer

                return llama3_tokenizer(path=str(model_file), max_seq_len=max_seq_len, **kwargs)
    raise FileNotFoundError(
        f"{d}: no tokenizer for model_type {family!r}: looked for vocab.json + merges.txt (qwen2) and "
        "tokenizer.model or original/tokenizer.model (llama)"
    )


def hf_twin(model: TransformerDecoder, *, dtype: Any = None, attn_implementation: str = "sdpa"):
    """The ``transformers`` model (``Qwen2ForCausalLM`` / ``LlamaForCausalLM``) with ``model``'s architecture and
    weights: the baseline a benchmark puts Sparrow against, or a way to check a Sparrow model against the reference
    implementation.

    Args:
        model: a Sparrow / torchtune Qwen2 or Llama-3 ``TransformerDecoder`` (what :func:`model_config` reads).
        dtype: the twin's parameter dtype (default: ``model``'s).
        attn_implementation: ``transformers``' attention (``"sdpa"``, ``"eager"``, ...).

    Returns:
        The twin in eval mode on ``model``'s device; its ``max_position_embeddings`` is ``model.max_seq_len``, tied
        output weights stay tied. Given the same token ids ``[B, S]``, its ``logits`` match ``model(ids)`` up to
        rounding.

    Raises:
        ImportError: ``transformers`` is not installed.
        ValueError: from :func:`model_config` (layers that differ, an unknown RoPE module), or a weight of
            ``model`` that the twin has no place for.
    """
    import transformers
    from torchtune.models.convert_weights import tune_to_hf
    from torchtune.models.qwen2._convert_weights import qwen2_tune_to_hf

    cfg = model_config(model)
    param = next(model.parameters())
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {**rope, "rope_type": "llama3", **cfg.rope_scaling}
    kw = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.embed_dim, intermediate_size=cfg.intermediate_dim,
              num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
              head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.norm_eps,
              tie_word_embeddings=cfg.tie_word_embeddings, rope_parameters=rope)
    shape = dict(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, dim=cfg.embed_dim, head_dim=cfg.head_dim)
    state = {k: v for k, v in model.state_dict().items()}
    if cfg.family == "qwen2":
        hf_cfg = transformers.Qwen2Config(**kw)
        state = qwen2_tune_to_hf(state, tie_word_embeddings=cfg.tie_word_embeddings, **shape)
    else:
        hf_cfg = transformers.LlamaConfig(**kw, attention_bias=cfg.attention_bias, mlp_bias=False)
        state = tune_to_hf(state, **shape)
    twin = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype or param.dtype,
                                                         attn_implementation=attn_implementation)
    missing, unexpected = twin.load_state_dict(state, strict=False)
    if unexpected or any("lm_head" not in k for k in missing):
        raise ValueError(f"weights without a place in the transformers model: {unexpected}; left unset: {missing}")
    if cfg.tie_word_embeddings:
        twin.tie_weights()
    elif missing:
        raise ValueError(f"untied model, yet the transformers model's {missing} were left unset")
    return twin.to(param.device).eval()

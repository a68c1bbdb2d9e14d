"""Load Hugging Face checkpoints (safetensors, from a local directory) into Sparrow models."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Sequence

import torch
from torchtune.modules import TransformerDecoder


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

    from sparrow.models.hf import config_mismatches, model_config, read_hf_config

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


def load_model_state(model: TransformerDecoder, state: dict[str, torch.Tensor]) -> None:
    """``load_state_dict`` that tolerates only missing attention-backend parameters (e.g. an indexer)."""
    own = model.state_dict()
    bad_shapes = [f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
                  for k, v in state.items() if k in own and own[k].shape != v.shape]
    if bad_shapes:
        raise ValueError("checkpoint does not fit the model: " + "; ".join(bad_shapes[:5]))
    missing = [k for k in own if k not in state and ".backend." not in k]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.load_state_dict(state, strict=False)

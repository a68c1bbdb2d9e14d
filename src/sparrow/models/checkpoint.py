"""Load Hugging Face checkpoints (safetensors, from a local directory) into Sparrow models."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Sequence

import torch
from torchtune.modules import TransformerDecoder


def load_hf_checkpoint(
    model: TransformerDecoder,
    checkpoint_dir: str | Path,
    *,
    model_type: str = "QWEN2",
    checkpoint_files: Sequence[str] | None = None,
) -> None:
    """Load an HF-format checkpoint into ``model`` through torchtune's ``FullModelHFCheckpointer``.

    Args:
        model: a model from :mod:`sparrow.models` (torchtune parameter names).
        checkpoint_dir: directory holding ``config.json`` and ``*.safetensors`` (nothing is downloaded).
        model_type: torchtune ``ModelType`` name: ``QWEN2`` (Qwen2 / Qwen2.5), ``LLAMA3``, ``LLAMA3_2``.
        checkpoint_files: weight files inside ``checkpoint_dir`` (default: every ``*.safetensors``).

    Raises:
        FileNotFoundError: the directory, ``config.json`` or a listed file does not exist, or there are no
            safetensors files.
        ValueError: the checkpoint's tensors do not match the model (missing / unexpected keys, shapes).
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
        if not (d / f).is_file():
            raise FileNotFoundError(f"checkpoint file {d / f} does not exist")
    with tempfile.TemporaryDirectory() as out:
        ckpt = FullModelHFCheckpointer(checkpoint_dir=str(d), checkpoint_files=files, model_type=model_type,
                                       output_dir=out)
        state = ckpt.load_checkpoint()["model"]
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

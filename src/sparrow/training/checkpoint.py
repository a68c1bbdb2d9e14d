"""A trained model on disk: one safetensors state dict and a JSON report beside it.

``DIR/model.safetensors`` holds the model's state dict with torchtune parameter names (what the GRPO recipe's
``checkpoint:`` key reads as it is); ``DIR/report.json`` says how to rebuild the model and what training did:

* ``format`` (:data:`FORMAT`), ``version``;
* ``model``: the builder as a recipe ``model:`` section (``{"_component_": "sparrow.models.qwen2", ...}``);
* ``weights_dtype``, ``params``, ``tokenizer``;
* ``train``: the training config (``config``) and what the run did (steps, tokens, curriculum events, ...);
* ``accuracy``: rows ``{task, context, n, accuracy, se[, sampled_accuracy]}`` measured on the saved weights.

Both files are written atomically (a temporary file renamed into place). :func:`load_recipe_model` reads the
other way round: the model, its ``checkpoint:`` and the task of a GRPO recipe config.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

FORMAT = "sparrow-task-model"
VERSION = 2
MODEL_FILE = "model.safetensors"
REPORT_FILE = "report.json"


def write_report(directory: str | Path, report: dict[str, Any]) -> Path:
    """Write ``report`` as ``directory/report.json`` (atomically); returns the path."""
    path = Path(directory) / REPORT_FILE
    tmp = path.with_name(REPORT_FILE + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(path)
    return path


def save_trained_model(directory: str | Path, model: torch.nn.Module, report: dict[str, Any],
                       dtype: torch.dtype = torch.float32) -> Path:
    """Write ``model``'s state dict in ``dtype`` as ``directory/model.safetensors`` and ``report`` (completed
    with ``format``, ``version``, ``weights_dtype`` and ``params``) as ``report.json``; returns the weights' path.

    Raises:
        ValueError: ``report`` has no ``model`` section with a ``_component_``.
    """
    if "_component_" not in (report.get("model") or {}):
        raise ValueError("save_trained_model: report['model'] must be the builder section, with a _component_")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in model.state_dict().items()}
    tmp = out / (MODEL_FILE + ".tmp")
    save_file(state, str(tmp), metadata={"format": FORMAT})
    tmp.replace(out / MODEL_FILE)
    report.update(format=FORMAT, version=VERSION, weights_dtype=str(dtype).replace("torch.", ""),
                  params=sum(p.numel() for p in model.parameters()))
    write_report(out, report)
    return out / MODEL_FILE


def read_report(directory: str | Path) -> dict[str, Any]:
    """The ``report.json`` of a trained model's directory.

    Raises:
        FileNotFoundError: no report (train with ``tune run sparrow_sft`` first). ValueError: not this format.
    """
    path = Path(directory) / REPORT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: train a model with `tune run sparrow_sft` first")
    doc = json.loads(path.read_text())
    if doc.get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} report (format {doc.get('format')!r})")
    return doc


def build_model(spec: dict[str, Any], **kwargs: Any) -> torch.nn.Module:
    """The model of a ``model:`` section: ``spec["_component_"]`` (a dotted path) called with the other keys and
    ``kwargs`` (e.g. ``attention=``)."""
    module, _, name = spec["_component_"].rpartition(".")
    builder = getattr(importlib.import_module(module), name)
    return builder(**{k: v for k, v in spec.items() if k != "_component_"}, **kwargs)


def load_trained_model(directory: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                       **builder_kwargs: Any) -> torch.nn.Module:
    """Rebuild a model saved by :func:`save_trained_model`: the builder from its report (``builder_kwargs``
    added, e.g. ``attention=``), the weights loaded strictly and cast to ``dtype`` (RoPE tables stay float32).
    Returns it in eval mode on ``device``."""
    model = build_model(read_report(directory)["model"], **builder_kwargs)
    model.load_state_dict(load_file(str(Path(directory) / MODEL_FILE)), strict=True)
    model.to(device=device)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model.eval()


def load_recipe_model(config: str | Path) -> tuple[torch.nn.Module, Any, Any]:
    """The model and the task of a GRPO recipe config file (e.g. ``recipes/configs/tiny_kv_retrieval.yaml``):
    ``(model, task, cfg)``, the model its ``model:`` section built (:func:`build_model`, as built: float32 on the
    CPU) with the Sparrow state dict of ``checkpoint:`` loaded, in eval mode without gradients; the task its
    ``task:`` component (any ``_component_`` spec) built; ``cfg`` the loaded config. Raises what
    :func:`~sparrow.rl.recipe_config.load_config` raises, ``ValueError`` for a state dict that does not fit the
    model (:func:`~sparrow.models.load_model_state`)."""
    from sparrow.models import load_model_state
    from sparrow.rl.recipe_config import load_config

    cfg = load_config(config)
    model = build_model(dict(cfg.model))
    load_model_state(model, load_file(cfg.checkpoint))
    model.eval().requires_grad_(False)
    return model, build_model(dict(cfg.task)), cfg

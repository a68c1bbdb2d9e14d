"""Training checkpoints in safetensors: model, optimizer, RNG and data-loader state, written atomically.

Layout of ``<dir>/step_<n>/``: ``model.safetensors`` (the trainer's weights), ``optimizer.safetensors``
(every optimizer tensor; its scalars and param groups in the file's JSON metadata), ``rng.safetensors``,
``state.json`` (step, data-loader state, anything else the recipe records). A checkpoint is written into a
temporary directory which is renamed into place, then ``<dir>/latest`` is replaced: a crash leaves either
the previous checkpoint or the new one, never half of one. Nothing is unpickled when loading.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, safe_open, save_file

_META = "sparrow_meta"
_FILES = ("model.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json")


def _check_files(path: Path) -> None:
    for f in _FILES:
        if not (path / f).is_file():
            raise FileNotFoundError(f"checkpoint file {path / f} does not exist")


def _flatten_optimizer(sd: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors, scalars = {}, {}
    for pid, st in sd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"state.{pid}.{k}"] = v.detach().contiguous().cpu()
            else:
                scalars[f"state.{pid}.{k}"] = v
    return tensors, {"scalars": scalars, "param_groups": sd["param_groups"]}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, v in list(tensors.items()) + list(meta["scalars"].items()):
        _, pid, k = key.split(".", 2)
        state.setdefault(int(pid), {})[k] = v
    return {"state": state, "param_groups": meta["param_groups"]}


def save_checkpoint(directory: str | Path, step: int, *, model: torch.nn.Module | None = None,
                    optimizer: torch.optim.Optimizer | None = None, state: dict[str, Any],
                    model_state: dict[str, torch.Tensor] | None = None,
                    optimizer_state: dict[str, Any] | None = None) -> Path:
    """Write checkpoint ``step`` under ``directory`` atomically and point ``latest`` at it.

    The weights come from ``model`` or, already gathered (e.g. the full state of a sharded model),
    from ``model_state``; the optimizer from ``optimizer`` or ``optimizer_state`` (the
    ``torch.optim.Optimizer.state_dict()`` layout: parameters numbered in the optimizer's order)."""
    if (model is None) == (model_state is None) or (optimizer is None) == (optimizer_state is None):
        raise ValueError("save_checkpoint needs exactly one of model / model_state and of optimizer / optimizer_state")
    model_state = model.state_dict() if model is not None else model_state
    optimizer_state = optimizer.state_dict() if optimizer is not None else optimizer_state
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file({k: v.detach().contiguous().cpu() for k, v in model_state.items()}, str(tmp / "model.safetensors"))
    opt_tensors, opt_meta = _flatten_optimizer(optimizer_state)
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"), metadata={_META: json.dumps(opt_meta)})
    rng = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            rng[f"torch_cuda_{i}"] = s
    save_file(rng, str(tmp / "rng.safetensors"))
    (tmp / "state.json").write_text(json.dumps({"step": step, **state}, indent=1))
    for f in tmp.iterdir():  # data on disk before the rename makes it visible
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = root / f".latest_{os.getpid()}"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, root / "latest")
    return final


def latest_checkpoint(directory: str | Path) -> Path:
    """The directory ``latest`` points at. Raises FileNotFoundError naming what is missing."""
    root = Path(directory)
    pointer = root / "latest"
    if not pointer.is_file():
        raise FileNotFoundError(f"no checkpoint to resume from: {pointer} does not exist")
    path = root / pointer.read_text().strip()
    _check_files(path)
    return path


def load_checkpoint(path: str | Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                    restore_rng: bool = True) -> dict[str, Any]:
    """Restore model, optimizer (unless None: a rank that does not train) and (unless ``restore_rng`` is
    false) RNG from checkpoint directory ``path``; returns its ``state.json``. Restore the RNG last of all (:func:`restore_rng_state`) when more random
    initialisation follows in the caller.

    Raises: FileNotFoundError for a missing file; ValueError when the weights do not fit ``model``.
    """
    path = Path(path)
    _check_files(path)
    weights = load_file(str(path / "model.safetensors"))
    own = model.state_dict()
    if set(weights) != set(own) or any(weights[k].shape != own[k].shape for k in own):
        raise ValueError(f"checkpoint {path} does not fit the model (different parameter names or shapes)")
    model.load_state_dict(weights)
    if optimizer is not None:
        optimizer.load_state_dict(read_optimizer_state(path))
    if restore_rng:
        restore_rng_state(path)
    return json.loads((path / "state.json").read_text())


def read_optimizer_state(path: str | Path) -> dict[str, Any]:
    """The optimizer state saved in checkpoint directory ``path``, in ``Optimizer.state_dict()`` layout."""
    f = Path(path) / "optimizer.safetensors"
    if not f.is_file():
        raise FileNotFoundError(f"checkpoint file {f} does not exist")
    with safe_open(str(f), "pt") as fh:
        meta = json.loads(fh.metadata()[_META])
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    return _unflatten_optimizer(tensors, meta)


def restore_rng_state(path: str | Path) -> None:
    """Set the torch CPU (and CUDA) generators to the states saved in checkpoint directory ``path``."""
    f = Path(path) / "rng.safetensors"
    if not f.is_file():
        raise FileNotFoundError(f"checkpoint file {f} does not exist")
    rng = load_file(str(f))
    torch.set_rng_state(rng["torch_cpu"])
    if torch.cuda.is_available():
        states = [rng[k] for k in sorted(k for k in rng if k.startswith("torch_cuda_"))]
        if states:
            torch.cuda.set_rng_state_all(states)

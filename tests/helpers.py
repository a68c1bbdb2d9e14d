"""Shared test helpers: tiny models, tolerances, bit-level comparison."""

from __future__ import annotations

import torch

from sparrow.models import tiny_llama3, tiny_qwen2

# Kernel tests run on CUDA when present, else on the CPU (Triton through its interpreter).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_tiny(family: str = "qwen2", *, std: float = 0.3, seed: int = 0, **kw) -> torch.nn.Module:
    """A tiny model with random (never zero) weights large enough to give peaked distributions."""
    torch.manual_seed(seed)
    build = {"qwen2": tiny_qwen2, "llama3": tiny_llama3}[family]
    m = build(**kw)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=std)
    return m.eval()


def to_device(x, device: torch.device | str = DEVICE):
    """Tensors, also inside tuples, lists and named tuples, moved to ``device`` (the Triton impls need the
    device their kernels run on: CUDA when present, else the CPU through the interpreter)."""
    if torch.is_tensor(x):
        return x.to(device)
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return type(x)(*(to_device(t, device) for t in x))
    if isinstance(x, (tuple, list)):
        return type(x)(to_device(t, device) for t in x)
    return x


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality of two tensors of the same dtype (NaN payloads and signed zeros included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


class StopTraining(Exception):
    """Raised by :func:`train_and_stop` where a time limit would have ended the run."""


def train_and_stop(trainer, model: torch.nn.Module, directory, step: int) -> None:
    """Run ``trainer`` (of ``model``), its whole state saved to ``directory`` after every step, and stop it after
    ``step`` steps, as a call's time limit would: the state a resumed run starts from."""
    import pytest

    from sparrow.rl import save_checkpoint

    def checkpoint():
        save_checkpoint(directory, trainer.step, model=model, optimizer=trainer.optimizer,
                        state={"trainer": trainer.state_dict()})
        if trainer.step == step:
            raise StopTraining

    with pytest.raises(StopTraining):
        trainer.train(checkpoint=checkpoint, checkpoint_every_s=1e-9)
    trainer.source.close()

"""Host -> device copies that do not stall the host: the one helper every package uses for them.

It imports nothing from Sparrow, so ``sparrow.sync``, ``sparrow.kernels.sync`` and ``sparrow.training`` can all
import it without an import circle.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``. A host tensor bound for a CUDA device is copied from pinned memory with
    ``non_blocking=True``: the copy is queued on the current stream and the host goes on at once (no host sync);
    the pinned staging copy is private, so ``t`` may be reused right away. Anything else is ``t.to(device)``
    (a no-op when ``t`` is there already)."""
    device = torch.device(device)
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


__all__ = ["to_device"]

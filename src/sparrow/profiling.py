"""One recipe step under the PyTorch profiler (a recipe's ``profile_steps``): where a step's time goes, op by op.

:func:`start_step_profile` starts :class:`torch.profiler.profile` on the host and, on CUDA, on the device;
:func:`write_step_profile` stops it and writes the ops' table (self device time first on CUDA, self host time
otherwise) as text. The profiler's own overhead inflates the profiled step: recipes mark its metrics
``profiled`` and benchmarks leave it out of their timed steps.

    prof = start_step_profile(torch.device("cuda"))
    ...                                             # one step
    write_step_profile(prof, profile_path("out", step=3))
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def profile_path(output_dir: Path | str, step: int, rank: int = 0) -> Path:
    """Where a recipe run writing into ``output_dir`` puts the op table of ``step`` on ``rank``."""
    return Path(output_dir) / "profile" / f"step{step}_rank{rank}.txt"


def start_step_profile(device: torch.device) -> profile:
    """A started profiler recording host ops and, for a CUDA ``device``, its kernels."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=activities)
    prof.start()
    return prof


def write_step_profile(prof: profile, path: Path | str, *, row_limit: int = 60) -> Path:
    """Stop ``prof`` and write its ops' table to ``path`` (folders made): the ``row_limit`` ops with the most self
    device time when it recorded a device, else the most self host time. Returns ``path``."""
    prof.stop()
    on_device = ProfilerActivity.CUDA in prof.activities
    table = prof.key_averages().table(sort_by="self_device_time_total" if on_device else "self_cpu_time_total",
                                      row_limit=row_limit)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(table + "\n")
    return path

"""Per-sync statistics returned by ``SyncSender.send`` and ``SyncReceiver.receive``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch


@dataclass
class SyncStats:
    """What one sync moved and how long it took (seconds, host wall clock around device-synchronised work).

    ``payload_bytes``: codec bodies; ``wire_bytes``: whole buckets (bodies + headers / manifests);
    ``dense_bytes``: what sending every element's bits would cost; ``changed``: elements whose bit
    pattern changed (out of ``numel``).
    """

    run_id: str = ""
    base_version: int = 0
    target_version: int = 0
    anchor: bool = False
    buckets: int = 0
    entries: int = 0
    numel: int = 0
    changed: int = 0
    dense_bytes: int = 0
    payload_bytes: int = 0
    wire_bytes: int = 0
    codec_entries: dict[str, int] = field(default_factory=dict)
    codec_bytes: dict[str, int] = field(default_factory=dict)
    encode_s: float = 0.0
    transfer_s: float = 0.0
    apply_s: float = 0.0
    total_s: float = 0.0
    resync_requested: bool = False
    error: str | None = None

    @property
    def ratio(self) -> float:
        """dense bytes / wire bytes."""
        return self.dense_bytes / max(1, self.wire_bytes)

    @property
    def density(self) -> float:
        return self.changed / max(1, self.numel)

    def count(self, codec: str, nbytes: int) -> None:
        self.codec_entries[codec] = self.codec_entries.get(codec, 0) + 1
        self.codec_bytes[codec] = self.codec_bytes.get(codec, 0) + nbytes

    def add_bucket(self, entries: Iterable[Any], wire_bytes: int) -> None:
        """Count one bucket of ``wire_bytes`` bytes and its entries (``EntryMeta`` of its manifest)."""
        for e in entries:
            self.entries += 1
            self.numel += e.length
            self.changed += e.nchanged
            self.dense_bytes += e.length * e.dtype.itemsize
            self.payload_bytes += e.nbytes
            self.count(e.codec, e.nbytes)
        self.buckets += 1
        self.wire_bytes += wire_bytes


class StageTimer:
    """Per-stage timing of one encode / apply (used by ``benchmarks/bench_sync_throughput.py``).

    ``mark(name)`` closes the stage that began at the previous mark (or :meth:`start`) and names it. On
    CUDA each mark records an event on the current stream, so a stage's ``gpu_ms`` is the device time
    between two marks (device idle time while the host works or waits is included, which is the point:
    it shows where the wall time goes); ``cpu_ms`` is the host time between the same marks. Stages with
    the same name accumulate. Attach one as ``SyncSender.timer`` / ``SyncReceiver.timer``.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        dev = torch.device(device) if device is not None else None
        self.cuda = dev is not None and dev.type == "cuda"
        self._marks: list[tuple[str, Any, float]] = []

    def _event(self):
        if not self.cuda:
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def start(self) -> None:
        self._marks = [("", self._event(), time.perf_counter())]

    def mark(self, name: str) -> None:
        if not self._marks:
            self.start()
        self._marks.append((name, self._event(), time.perf_counter()))

    def result(self) -> dict[str, dict[str, float]]:
        """``{stage: {"gpu_ms", "cpu_ms"}}`` (synchronises the device)."""
        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, dict[str, float]] = {}
        for (_, e0, t0), (name, e1, t1) in zip(self._marks, self._marks[1:]):
            d = out.setdefault(name, {"gpu_ms": 0.0, "cpu_ms": 0.0})
            d["cpu_ms"] += (t1 - t0) * 1e3
            d["gpu_ms"] += e0.elapsed_time(e1) if self.cuda else (t1 - t0) * 1e3
        return out

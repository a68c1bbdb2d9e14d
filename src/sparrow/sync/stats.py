"""Per-sync statistics returned by ``SyncSender.send`` and ``SyncReceiver.receive``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


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

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratio"] = self.ratio
        d["density"] = self.density
        return d

"""Sync time at model sizes and links not measured: measured per-parameter costs x size + payload / link.

A sync of ``P`` bf16 parameters at density ``rho`` over a link of ``B`` bit/s costs (no overlap of the three
phases assumed, so an upper bound: buckets could pipeline them)::

    sparse  = P * encode(rho) + P * payload(rho) * 8 / B + P * apply(rho)

where ``encode`` / ``apply`` are seconds per parameter and ``payload`` bytes per parameter, measured on one
device at a smaller size (the kernels stream memory, so their time scales with the parameters they read).
It is compared with sending every bf16 weight:

* dense broadcast: ``2 P * 8 / B`` plus one device copy of the weights on the receiver (``4 P / copy``);
* pipelined dense (checkpoint-engine style: the copy overlaps the transfer): ``max(2 P * 8 / B, 4 P / copy)``;
* the rate reported for Kimi's checkpoint-engine (1T parameters in about 20 s on its own cluster), scaled to
  ``P``: a reference point, not a measurement here.

:func:`memory_floor_ms` is the other bound, on one device: the memory traffic a sync must do at the copy bandwidth.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

#: Kimi's checkpoint-engine as reported: about 20 s to update 1T parameters (dense, pipelined, its cluster).
CHECKPOINT_ENGINE_S_PER_PARAM = 20.0 / 1e12


@dataclass(frozen=True)
class SyncRates:
    """Measured costs of one sync at one density, per parameter: encode and apply seconds, payload bytes
    (whole buckets: bodies, hash tables and manifests)."""

    density: float
    encode_s_per_param: float
    apply_s_per_param: float
    payload_bytes_per_param: float

    def __post_init__(self) -> None:
        if not 0.0 < self.density <= 1.0:
            raise ValueError(f"SyncRates: density must be in (0, 1], got {self.density}")
        for k in ("encode_s_per_param", "apply_s_per_param", "payload_bytes_per_param"):
            v = getattr(self, k)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"SyncRates: {k} must be a positive number, got {v}")


def rates_at(points: Sequence[SyncRates], density: float) -> SyncRates:
    """The rates at ``density``, interpolated between the measured ``points`` linearly in log-log (each of the
    three costs against the density). Raises ``ValueError`` outside the measured densities (no extrapolation)
    or for fewer than one point."""
    pts = sorted(points, key=lambda p: p.density)
    if not pts:
        raise ValueError("rates_at: no measured points")
    lo, hi = pts[0].density, pts[-1].density
    if not lo <= density <= hi:
        raise ValueError(f"rates_at: density {density} outside the measured {lo}..{hi}")
    for p in pts:
        if p.density == density:
            return p
    a, b = next((a, b) for a, b in zip(pts, pts[1:]) if a.density < density < b.density)
    t = (math.log(density) - math.log(a.density)) / (math.log(b.density) - math.log(a.density))

    def mix(x: float, y: float) -> float:
        return math.exp((1 - t) * math.log(x) + t * math.log(y))

    return SyncRates(density, mix(a.encode_s_per_param, b.encode_s_per_param),
                     mix(a.apply_s_per_param, b.apply_s_per_param),
                     mix(a.payload_bytes_per_param, b.payload_bytes_per_param))


@dataclass(frozen=True)
class Projection:
    """One projected sync (seconds; bytes)."""

    params: int
    density: float
    link_gbit: float
    payload_bytes: float
    dense_bytes: int
    encode_s: float
    transfer_s: float
    apply_s: float
    sparse_s: float
    dense_s: float
    pipelined_dense_s: float
    checkpoint_engine_s: float

    @property
    def speedup_vs_dense(self) -> float:
        return self.dense_s / self.sparse_s

    @property
    def speedup_vs_pipelined(self) -> float:
        return self.pipelined_dense_s / self.sparse_s


def project_sync(params: int, rates: SyncRates, link_gbit: float, *, copy_gbs: float,
                 bytes_per_param: int = 2) -> Projection:
    """The sync of ``params`` parameters at ``rates`` over a ``link_gbit`` Gbit/s link (see the module docstring);
    ``copy_gbs``: the receiver's device copy bandwidth (bytes read + written per second, GB/s). Raises
    ``ValueError`` for a non-positive size, link or copy bandwidth."""
    if params <= 0 or link_gbit <= 0 or copy_gbs <= 0 or bytes_per_param <= 0:
        raise ValueError(f"project_sync: params, link_gbit, copy_gbs and bytes_per_param must be > 0, got "
                         f"{params}, {link_gbit}, {copy_gbs}, {bytes_per_param}")
    bw = link_gbit * 1e9 / 8  # bytes per second
    payload = params * rates.payload_bytes_per_param
    dense = params * bytes_per_param
    encode = params * rates.encode_s_per_param
    apply = params * rates.apply_s_per_param
    transfer = payload / bw
    copy = 2 * dense / (copy_gbs * 1e9)
    return Projection(params, rates.density, link_gbit, payload, dense, encode, transfer, apply,
                      encode + transfer + apply, dense / bw + copy, max(dense / bw, copy),
                      params * CHECKPOINT_ENGINE_S_PER_PARAM)


def memory_floor_ms(params: int, changed: int, payload_bytes: int, copy_gbs: float) -> dict[str, float]:
    """The least time a sync of ``params`` bf16 parameters, ``changed`` of them changed, with a ``payload_bytes``
    payload takes on one device: the memory traffic it must do over the copy bandwidth ``copy_gbs`` (bytes read +
    written per second, GB/s). Encode reads the old and the new bits once (4 B / parameter) and writes the changed
    snapshot elements (2 B / change) and the payload; apply reads the payload and reads + writes the changed
    elements (4 B / change); a full verification also reads the receiver's weights (2 B / parameter). Returns
    milliseconds: ``encode_floor_ms``, ``apply_floor_ms``, ``floor_ms`` (the two) and ``floor_full_ms`` (the two
    and the full verification). ``ValueError`` for a non-positive bandwidth."""
    if copy_gbs <= 0:
        raise ValueError(f"memory_floor_ms: copy_gbs must be > 0, got {copy_gbs}")
    enc, app = 4 * params + 2 * changed + payload_bytes, payload_bytes + 4 * changed
    ms = lambda b: b / (copy_gbs * 1e9) * 1e3  # noqa: E731
    return {"encode_floor_ms": ms(enc), "apply_floor_ms": ms(app), "floor_ms": ms(enc + app),
            "floor_full_ms": ms(enc + app + 2 * params)}


__all__ = ["CHECKPOINT_ENGINE_S_PER_PARAM", "Projection", "SyncRates", "memory_floor_ms", "project_sync", "rates_at"]

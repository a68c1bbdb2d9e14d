"""One sync measured end to end: encode base -> new, apply every bucket on a receiver, check it bit for bit.

:func:`round_trip` is what the sync benchmarks time at each density or learning rate, and what a user measures on
their own weights::

    from sparrow.sync.roundtrip import round_trip

    r = round_trip(before, after, verifies=("incremental", "full"), iters=10)
    r["encode"]["median_ms"], r["apply"]["incremental"]["median_ms"], r["wire_bytes"], r["changed"]

Timings come from :func:`sparrow._device.measure` (CUDA events; ``time.perf_counter`` without CUDA). Between timed
calls the sender's snapshot and the receiver's weights are reset to ``base`` (untimed), so every call encodes or
applies the same change. ``verify="incremental"`` runs in its steady state: the receiver's running hashes of
``base`` are known before the timed apply.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from .._device import measure
from ..kernels.sync.common import bits_view
from .bucket import parse_bucket
from .receiver import SyncReceiver
from .sender import SyncSender
from .stats import StageTimer, SyncStats

#: the receiver's ``verify`` settings :func:`round_trip` takes
VERIFIES = (False, "incremental", "full")


def _stages(run, setup, timer: StageTimer, reps: int) -> dict[str, dict[str, float]]:
    """Mean per-stage ``{"gpu_ms", "cpu_ms"}`` of ``reps`` runs of ``run`` (``setup`` before each, untimed)."""
    acc: dict[str, dict[str, float]] = {}
    for _ in range(reps):
        setup()
        timer.start()
        run()
        for k, v in timer.result().items():
            d = acc.setdefault(k, {"gpu_ms": 0.0, "cpu_ms": 0.0})
            d["gpu_ms"] += v["gpu_ms"] / reps
            d["cpu_ms"] += v["cpu_ms"] / reps
    return {k: {kk: round(vv, 4) for kk, vv in v.items()} for k, v in acc.items()}


def round_trip(base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *, codec: str = "auto",
               bucket_bytes: int = 256 << 20, with_hash: bool = True, verifies: Sequence[bool | str] = ("incremental",),
               iters: int = 10, warmup: int = 2, stage_reps: int = 0) -> dict[str, Any]:
    """Time one sync of ``base -> new`` and check the receiver ends bit for bit at ``new``.

    Args:
        base, new: ``{name: tensor}`` with the same names, shapes and dtypes (bf16 / fp16 / fp32, contiguous, on
            one device); neither is modified.
        codec, bucket_bytes, with_hash: the :class:`~sparrow.sync.SyncSender`'s.
        verifies: receiver settings to time the apply under, each of :data:`VERIFIES` (``"incremental"`` and
            ``"full"`` need ``with_hash``).
        iters, warmup: timed and untimed calls per measurement.
        stage_reps: with ``> 0``, per-stage times (:class:`~sparrow.sync.stats.StageTimer`) averaged over that many
            more runs of each.

    Returns:
        ``{"params", "changed", "wire_bytes", "buckets", "encode", "apply"}``: element count, elements whose bit
        pattern changed, bytes of all buckets, bucket count, the encode's :func:`sparrow._device.quantiles` (ms) and
        ``{verify: quantiles}`` of the apply; with ``stage_reps`` also ``"encode_stages"`` (``{stage: {"gpu_ms",
        "cpu_ms"}}``) and ``"apply_stages"`` (``{verify: ...}``).

    Raises:
        ValueError: ``base`` and ``new`` differ in names or shapes, or a ``verifies`` entry is unknown or needs
            hashes the sender does not keep.
        TypeError: an unsupported dtype, or ``base`` and ``new`` differ in dtype.
        RuntimeError: the receiver's weights differ from ``new`` after the apply.
    """
    if set(base) != set(new) or any(base[k].shape != new[k].shape for k in base):
        raise ValueError("base and new must hold the same names and shapes")
    for k in base:
        if base[k].dtype != new[k].dtype:
            raise TypeError(f"{k}: dtype mismatch, base {base[k].dtype}, new {new[k].dtype}")
    for verify in verifies:
        if verify not in VERIFIES:
            raise ValueError(f"verify must be one of {VERIFIES}, got {verify!r}")
        if verify and not with_hash:
            raise ValueError(f"verify={verify!r} needs with_hash=True")
    dev = next(iter(base.values())).device
    sender = SyncSender(base, codec=codec, bucket_bytes=bucket_bytes, with_hash=with_hash)

    def reset_sender() -> None:
        for k, v in base.items():
            sender.snapshot[k].copy_(v)
        sender.rehash()  # the snapshot was written by hand: refresh its running hashes (untimed)

    encode = lambda: list(sender.encode(new))  # noqa: E731
    out: dict[str, Any] = {"encode": measure(encode, setup=reset_sender, warmup=warmup, iters=iters)}
    if stage_reps:
        sender.timer = StageTimer(dev)
        out["encode_stages"] = _stages(encode, reset_sender, sender.timer, stage_reps)
        sender.timer = None
    reset_sender()
    counts = SyncStats()
    encoded = list(sender.encode(new, stats=counts))  # the payload the receivers apply, with the sender's counts
    buckets = [b for b, _ in encoded]
    ranges = [(e.name, e.start, e.length) for b in buckets for e in parse_bucket(b).entries]
    rx_t = {k: v.clone() for k, v in base.items()}
    out["apply"], stages = {}, {}
    for verify in verifies:
        state: dict[str, Any] = {}

        def reset_rx() -> None:
            for k, v in base.items():
                rx_t[k].copy_(v)
            state["rx"] = SyncReceiver(rx_t, verify=verify, version=encoded[0][1].base_version)
            if verify == "incremental":  # steady state: running hashes of the base already known
                state["rx"].rehash(ranges)

        def apply() -> None:
            for b in buckets:
                state["rx"].apply_bucket(b)

        out["apply"][verify] = measure(apply, setup=reset_rx, warmup=warmup, iters=iters)
        if stage_reps:
            timer = StageTimer(dev)

            def setup_timed() -> None:
                reset_rx()
                state["rx"].timer = timer

            stages[verify] = _stages(apply, setup_timed, timer, stage_reps)
        reset_rx()
        apply()
        if not all(torch.equal(bits_view(rx_t[k]), bits_view(new[k])) for k in base):
            raise RuntimeError(f"receiver differs from sender after the apply (verify={verify!r})")
    if stage_reps:
        out["apply_stages"] = stages
    out.update(params=counts.numel, wire_bytes=counts.wire_bytes, changed=counts.changed, buckets=counts.buckets)
    return out


__all__ = ["VERIFIES", "round_trip"]

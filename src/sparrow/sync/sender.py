"""Trainer side of SparseRL-Sync: diff against the last-sent snapshot, pack into buckets, transfer."""

from __future__ import annotations

import time
import uuid
from typing import Iterator, Mapping

import torch

from ..kernels.sync.common import MAX_SLICE_ELEMS, bits_view, element_bits, fold_lanes
from ._util import hash_views
from .bucket import BucketInfo, EntryMeta, build_bucket
from .codecs import SliceJob, encode_slices
from .errors import ShapeMismatchError
from .stats import SyncStats
from .transport import Transport


class SyncSender:
    """Keeps the last-sent snapshot of named tensors and sends each new state as bit-exact sparse deltas.

    Args:
        named_tensors: ``{name: tensor}`` of the state the receivers hold now (version 0), e.g. bf16
            casts of the trainer's fp32 master weights. Copied into the snapshot (same device and dtype,
            bf16 / fp16 / fp32). The receivers must start from the same bits (the target hashes catch it
            when they do not, and they then ask for a dense resync).
        codec: ``"auto"`` (default: per slice the smallest of compact / COO / dense), ``"compact"``,
            ``"coo"`` or ``"dense"``.
        bucket_bytes: upper bound on one transfer (a bucket holds at least one slice; slices are at most
            ``bucket_bytes`` of dense data, so only a COO slice at high density can exceed it).
        run_id: identifies this sender's version sequence (default: random).
        anchor_every: every N-th sync is a dense anchor (0: only when asked for / ``initial_anchor``).
        with_hash: put the 64-bit hashes of each slice's base and target bits in the manifest (receivers
            verify). The sender hashes its snapshot once and then updates each slice's hash from the
            changed elements only (fused into the diff), so hashing costs O(changes) per sync.
        max_slice_elems: tensors larger than this are split into slices (bounds scratch memory).
        initial_anchor: make the first sync dense.
        impl: kernel implementation (None: Triton on CUDA, reference on CPU).

    Memory: the snapshot (one copy of the state in its dtype) plus per bucket of input the records and
    packed bodies of its changed elements.
    """

    CODECS = ("auto", "compact", "coo", "dense")

    def __init__(self, named_tensors: Mapping[str, torch.Tensor], *, codec: str = "auto",
                 bucket_bytes: int = 256 << 20, run_id: str | None = None, anchor_every: int = 0,
                 with_hash: bool = True, max_slice_elems: int = 1 << 25, initial_anchor: bool = False,
                 impl: str | None = None) -> None:
        if codec not in self.CODECS:
            raise ValueError(f"unknown codec {codec!r}; expected one of {', '.join(self.CODECS)}")
        if bucket_bytes < 1024:
            raise ValueError("bucket_bytes must be at least 1024")
        if anchor_every < 0:
            raise ValueError("anchor_every must be >= 0")
        self.codec = codec
        self.bucket_bytes = int(bucket_bytes)
        self.run_id = run_id if run_id is not None else uuid.uuid4().hex[:16]
        self.anchor_every = int(anchor_every)
        self.with_hash = with_hash
        self.impl = impl
        self.version = 0
        self._force_anchor = initial_anchor
        self.snapshot: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, t in named_tensors.items():
                element_bits(t.dtype)
                self.snapshot[name] = t.detach().clone(memory_format=torch.contiguous_format)
        self._slices: list[tuple[str, int, int]] = []
        for name, t in self.snapshot.items():
            cap = max(1, min(max_slice_elems, MAX_SLICE_ELEMS, self.bucket_bytes // t.element_size()))
            if cap >= 1024:
                cap -= cap % 8  # keep slices 16-byte aligned (vectorised kernels)
            n = t.numel()
            if n == 0:
                self._slices.append((name, 0, 0))
            for s in range(0, n, cap):
                self._slices.append((name, s, min(cap, n - s)))
        #: collect / pack work on groups of slices holding at most this many changes (bounds scratch)
        self.max_group_changes = max(1, self.bucket_bytes // 4)
        #: optional :class:`~sparrow.sync.stats.StageTimer` (per-stage timing of ``encode``)
        self.timer = None
        self._hash: list[int | None] = [None] * len(self._slices)
        if with_hash:
            self.rehash()

    def rehash(self) -> None:
        """Recompute the running hash of every snapshot slice from its bits (one pass over the snapshot).

        The sender keeps the 64-bit hash of each slice of its snapshot and updates it from the changed
        elements only; call this after modifying ``snapshot`` by hand (the next manifest's base hashes
        and target hashes are derived from these)."""
        if not self.with_hash or not self._slices:
            return
        with torch.no_grad():
            views = [bits_view(self.snapshot[name])[s:s + n] for name, s, n in self._slices]
            host = hash_views(views, [s for _, s, _ in self._slices], impl=self.impl).tolist()  # one host sync
        self._hash = [fold_lanes(a, b) for a, b in host]

    def request_resync(self) -> None:
        """Make the next sync a dense anchor."""
        self._force_anchor = True

    def _next_is_anchor(self, anchor: bool | None) -> bool:
        if anchor is not None:
            return anchor
        if self._force_anchor:
            return True
        return self.anchor_every > 0 and (self.version + 1) % self.anchor_every == 0

    def _new_bits(self, new_named: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        missing = set(self.snapshot) - set(new_named)
        extra = set(new_named) - set(self.snapshot)
        if missing or extra:
            raise ShapeMismatchError(f"tensor names differ from the snapshot: missing {sorted(missing)[:5]}, "
                                     f"unexpected {sorted(extra)[:5]}")
        out = {}
        for name, snap in self.snapshot.items():
            t = new_named[name].detach()
            if tuple(t.shape) != tuple(snap.shape):
                raise ShapeMismatchError(f"{name}: shape {tuple(t.shape)} != snapshot {tuple(snap.shape)}")
            if t.dtype != snap.dtype:
                if not t.dtype.is_floating_point:
                    raise ShapeMismatchError(f"{name}: dtype {t.dtype} cannot be cast to {snap.dtype}")
                t = t.to(snap.dtype)  # e.g. fp32 master -> bf16 (round to nearest even)
            if t.device != snap.device:
                t = t.to(snap.device)
            out[name] = bits_view(t.contiguous())
        return out

    def encode(self, new_named: Mapping[str, torch.Tensor], *, anchor: bool | None = None,
               stats: SyncStats | None = None) -> Iterator[tuple[torch.Tensor, BucketInfo]]:
        """Diff ``new_named`` against the snapshot and yield ``(bucket, info)`` for the next version.

        The snapshot is updated as slices are encoded; consume the iterator fully (``send`` does).
        Tensors of another float dtype are cast to the snapshot's dtype first. Raises
        :class:`ShapeMismatchError` for missing / extra names or shape mismatches.
        """
        stats = stats if stats is not None else SyncStats()
        is_anchor = self._next_is_anchor(anchor)
        base, target = self.version, self.version + 1
        stats.run_id, stats.base_version, stats.target_version, stats.anchor = self.run_id, base, target, is_anchor
        new_bits = self._new_bits(new_named)
        codec = "dense" if is_anchor else self.codec
        index = 0
        pending: list[tuple[EntryMeta, torch.Tensor]] = []
        pending_bytes = 0
        timer = self.timer
        if timer is not None:
            timer.start()
        # From here on the snapshot moves to `target`: reserve the version and make the next sync an
        # anchor unless this one completes (a failed sync must never be followed by a delta).
        self.version = target
        self._force_anchor = True
        t0 = time.perf_counter()
        jobs = []
        for name, s, n in self._slices:
            snap_bits = bits_view(self.snapshot[name])
            jobs.append(SliceJob(snap_bits[s:s + n], new_bits[name][s:s + n], s))
        base_hashes = list(self._hash) if (self.with_hash and not is_anchor) else None
        with torch.no_grad():
            enc = encode_slices(jobs, codec, with_hash=self.with_hash, update_old=True, copy_dense=False,
                                impl=self.impl, base_hashes=base_hashes, max_group_changes=self.max_group_changes,
                                timer=timer)
        stats.encode_s += time.perf_counter() - t0
        for i, ((name, s, n), e) in enumerate(zip(self._slices, enc)):
            snap = self.snapshot[name]
            meta = EntryMeta(name, snap.dtype, tuple(snap.shape), s, n, e.codec, 0, e.body.numel(),
                             e.nchanged, e.target_hash, self._hash[i] if self.with_hash else None)
            self._hash[i] = e.target_hash
            stats.entries += 1
            stats.numel += n
            stats.changed += e.nchanged
            stats.dense_bytes += n * snap.element_size()
            stats.payload_bytes += e.body.numel()
            stats.count(e.codec, e.body.numel())
            if pending and pending_bytes + e.body.numel() > self.bucket_bytes:
                yield self._finish(pending, base, target, index, False, is_anchor, stats)
                index += 1
                pending, pending_bytes = [], 0
            pending.append((meta, e.body))
            pending_bytes += e.body.numel()
        yield self._finish(pending, base, target, index, True, is_anchor, stats)
        self._force_anchor = False

    def _finish(self, entries, base, target, index, last, anchor, stats) -> tuple[torch.Tensor, BucketInfo]:
        t0 = time.perf_counter()
        info = BucketInfo(self.run_id, base, target, index, last, anchor)
        device = next(iter(self.snapshot.values())).device if self.snapshot else torch.device("cpu")
        bucket = build_bucket(info, entries, device=device)
        if self.timer is not None:
            self.timer.mark("bucket")
        stats.buckets += 1
        stats.wire_bytes += bucket.numel()
        stats.encode_s += time.perf_counter() - t0
        return bucket, info

    def send(self, new_named: Mapping[str, torch.Tensor], transport: Transport, *,
             anchor: bool | None = None) -> SyncStats:
        """Encode ``new_named`` (see :meth:`encode`) and send every bucket through ``transport``.

        Returns :class:`SyncStats` (bytes, changed elements, encode / transfer time). When a receiver
        asks for a dense resync the next sync is an anchor. If the transport raises, the next sync is an
        anchor too (the snapshot already moved on) and the error propagates.
        """
        stats = SyncStats()
        t_start = time.perf_counter()
        if transport.poll_resync():
            stats.resync_requested = True
            self._force_anchor = True
        try:
            for bucket, info in self.encode(new_named, anchor=anchor, stats=stats):
                t0 = time.perf_counter()
                transport.send_bucket(bucket, info)
                stats.transfer_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            if transport.end_sync_sender():
                stats.resync_requested = True
                self._force_anchor = True
            stats.transfer_s += time.perf_counter() - t0
        except BaseException:
            self._force_anchor = True
            raise
        stats.total_s = time.perf_counter() - t_start
        return stats

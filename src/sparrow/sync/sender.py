"""Trainer side of SparseRL-Sync: diff against the last-sent snapshot, pack into buckets, transfer."""

from __future__ import annotations

import time
import uuid
from typing import Iterator, Mapping, Sequence

import torch

from ..kernels.common.impl import Impl
from ..kernels.sync.common import (DEFAULT_SPAN_LOG2, MAX_SLICE_ELEMS, bits_view, check_span_log2, element_bits,
                                   fold_lanes, lanes_i32)
from ._util import align, cut_runs, hash_views, public_impl
from .base import WeightCodec, user_codec_name
from .bucket import BucketInfo, EntryMeta, build_bucket, finish_bucket, plan_bucket, table_view
from .codecs import BUILTIN_CODECS, SliceJob, builtin_codec_name, plan_encode, write_jobs
from .errors import ShapeMismatchError
from .stats import SyncStats
from .transport import Transport
from .user_codecs import encode_user_slice, encoded_slice


class SyncSender:
    """Keeps the last-sent snapshot of named tensors and sends each new state as bit-exact sparse deltas.

    Args:
        named_tensors: ``{name: tensor}`` of the state the receivers hold now (version 0), e.g. bf16
            casts of the trainer's fp32 master weights. Copied into the snapshot (same device and dtype,
            bf16 / fp16 / fp32). The receivers must start from the same bits (the target hashes catch it
            when they do not, and they then ask for a dense resync).
        codec: a built-in codec, by name or instance: ``"auto"`` (default: per slice the smallest of
            compact / COO / dense), ``"compact"``, ``"coo"``, ``"dense"`` (fused, bucketed kernels); or a
            user :class:`~sparrow.sync.WeightCodec`, whose ``encode`` runs per tensor slice (1-D views of
            the snapshot and of the new state) inside the same buckets; receivers need it in their
            ``codecs``. Anchors are always built-in dense, so a receiver can resync without the codec.
        bucket_bytes: upper bound on the bodies of one transfer (a bucket holds at least one slice; slices are
            at most ``bucket_bytes`` of dense data, so only a COO slice at high density can exceed it).
        run_id: identifies this sender's version sequence (default: random).
        anchor_every: every N-th sync is a dense anchor (0: only when asked for / ``initial_anchor``).
        with_hash: send the 64-bit hashes of each slice's bits before and after the sync (receivers
            verify). The sender hashes its snapshot once and then updates each slice's hash from the
            changed elements only, fused into the encode kernel, so hashing costs O(changes) per sync.
        max_slice_elems: tensors larger than this are split into slices (bounds scratch memory).
        initial_anchor: make the first sync dense.
        impl: kernel implementation: ``"auto"`` (Triton on CUDA tensors, the reference elsewhere),
            ``"reference"`` or ``"triton"``; ``None`` is a deprecated spelling of ``"auto"``.
        span_log2: block span of compact bodies (``2**span_log2`` elements, 10..20).

    Raises:
        ValueError: unknown codec name, a user codec with a reserved or empty name, ``bucket_bytes`` below
            1024, negative ``anchor_every``, bad ``impl`` or ``span_log2``.
        TypeError: ``codec`` is neither a name nor a :class:`~sparrow.sync.WeightCodec`; a tensor of an
            unsupported dtype.

    Host syncs: a sync with a built-in codec reads the device once, after the diff scan (every slice's change
    count and body size: what cuts the buckets and sizes their buffers); bodies, hashes and bucket checksums
    are then written on the device (an anchor, too, reads only that). Memory: the snapshot (one copy of the state in its
    dtype), the scan's change mask (1/16 of a bf16 state), 4 bytes of scratch per change of one write
    (at most ``bucket_bytes / 4`` changes), and each bucket.
    """

    #: Names of the built-in codecs (``codec=`` also takes a user :class:`~sparrow.sync.WeightCodec`).
    CODECS = BUILTIN_CODECS

    def __init__(self, named_tensors: Mapping[str, torch.Tensor], *, codec: str | WeightCodec = "auto",
                 bucket_bytes: int = 256 << 20, run_id: str | None = None, anchor_every: int = 0,
                 with_hash: bool = True, max_slice_elems: int = 1 << 25, initial_anchor: bool = False,
                 impl: Impl = "auto", span_log2: int = DEFAULT_SPAN_LOG2) -> None:
        self.codec: str | WeightCodec = self._resolve_codec(codec)
        if bucket_bytes < 1024:
            raise ValueError(f"bucket_bytes must be at least 1024, got {bucket_bytes}")
        if anchor_every < 0:
            raise ValueError(f"anchor_every must be >= 0, got {anchor_every}")
        self.impl = public_impl(impl)
        self.span_log2 = check_span_log2(span_log2)
        self.bucket_bytes = int(bucket_bytes)
        self.run_id = run_id if run_id is not None else uuid.uuid4().hex[:16]
        self.anchor_every = int(anchor_every)
        self.with_hash = with_hash
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
        #: the encode writer works on runs of slices holding at most this many changes (bounds scratch)
        self.max_group_changes = max(1, self.bucket_bytes // 4)
        #: optional :class:`~sparrow.sync.stats.StageTimer` (per-stage timing of ``encode``)
        self.timer = None
        dev = self._device()
        #: running hash lanes of every slice of the snapshot (int32 [slices, 2], on the state's device)
        self._lanes = torch.zeros(len(self._slices), 2, dtype=torch.int32, device=dev)
        if with_hash:
            self.rehash()

    @classmethod
    def _resolve_codec(cls, codec: object) -> str | WeightCodec:
        """A built-in codec's name, or the user codec itself (its name checked)."""
        name = builtin_codec_name(codec)
        if name is not None:
            return name
        if isinstance(codec, str):
            raise ValueError(f"unknown codec {codec!r}; expected one of {', '.join(cls.CODECS)} or a WeightCodec")
        user_codec_name(codec)
        return codec  # type: ignore[return-value]

    def _device(self) -> torch.device:
        return next(iter(self.snapshot.values())).device if self.snapshot else torch.device("cpu")

    def rehash(self) -> None:
        """Recompute the running hash of every snapshot slice from its bits (one pass over the snapshot, on the
        device; no host sync).

        The sender keeps the 64-bit hash of each slice of its snapshot and updates it from the changed
        elements only; call this after modifying ``snapshot`` by hand (the next bucket's base hashes and
        target hashes are derived from these)."""
        if not self.with_hash or not self._slices:
            return
        with torch.no_grad():
            views = [bits_view(self.snapshot[name])[s:s + n] for name, s, n in self._slices]
            self._lanes = lanes_i32(hash_views(views, [s for _, s, _ in self._slices], impl=self.impl))

    def slice_hashes(self) -> list[int | None]:
        """The running 64-bit hash of every slice of the snapshot (``None`` without ``with_hash``); one host
        sync. The receivers check each slice's bits against these."""
        if not self.with_hash:
            return [None] * len(self._slices)
        return [fold_lanes(a, b) for a, b in self._lanes.tolist()]

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

        The snapshot is updated as buckets are built; consume the iterator fully (``send`` does).
        Tensors of another float dtype are cast to the snapshot's dtype first. Raises
        :class:`ShapeMismatchError` for missing / extra names or shape mismatches; an error raised by a user
        codec's ``encode`` or found in its payloads (``TypeError`` / ``ValueError`` naming the slice) comes
        before anything is written: the snapshot and the version stay as they were.
        """
        stats = stats if stats is not None else SyncStats()
        is_anchor = self._next_is_anchor(anchor)
        base, target = self.version, self.version + 1
        stats.run_id, stats.base_version, stats.target_version, stats.anchor = self.run_id, base, target, is_anchor
        new_bits = self._new_bits(new_named)
        codec = "dense" if is_anchor else self.codec
        if self.timer is not None:
            self.timer.start()
        if is_anchor:
            yield from self._encode_anchor(new_bits, base, target, stats)
        elif isinstance(codec, str):
            yield from self._encode_builtin(codec, new_bits, base, target, stats)
        else:
            yield from self._encode_user(codec, new_bits, base, target, stats)
        self._force_anchor = False

    def _reserve(self, target: int) -> None:
        # From here on the snapshot moves to `target`: reserve the version and make the next sync an
        # anchor unless this one completes (a failed sync must never be followed by a delta).
        self.version = target
        self._force_anchor = True

    def _jobs(self, new_bits: dict[str, torch.Tensor]) -> list[SliceJob]:
        jobs = []
        for name, s, n in self._slices:
            snap_bits = bits_view(self.snapshot[name])
            jobs.append(SliceJob(snap_bits[s:s + n], new_bits[name][s:s + n], s))
        return jobs

    def _mark(self, stage: str) -> None:
        if self.timer is not None:
            self.timer.mark(stage)

    def _cuts(self, nbytes: Sequence[int]) -> list[tuple[int, int]]:
        """Consecutive runs of slices whose bodies fit ``bucket_bytes`` (a run holds at least one slice; a state
        without slices is one empty bucket)."""
        return cut_runs([align(n) for n in nbytes], self.bucket_bytes) or [(0, 0)]

    def _meta(self, k: int, codec: str, nbytes: int, nchanged: int, payload: dict | None = None) -> EntryMeta:
        name, s, n = self._slices[k]
        snap = self.snapshot[name]
        span = self.span_log2 if codec == "compact" else None
        return EntryMeta(name, snap.dtype, tuple(snap.shape), s, n, codec, 0, nbytes, nchanged, payload=payload,
                         span_log2=span)

    def _encode_builtin(self, codec: str, new_bits: dict[str, torch.Tensor], base: int, target: int,
                        stats: SyncStats, anchor: bool = False) -> Iterator[tuple[torch.Tensor, BucketInfo]]:
        """The fused path: one scan of every slice, the sync's one host read (sizes), then per bucket one
        writer launch per element size straight into the bucket (snapshot and hashes updated on the way).
        An anchor is this path with every slice dense and the full hash of the new bits as target."""
        t0 = time.perf_counter()
        jobs = self._jobs(new_bits)
        self._reserve(target)
        dev = self._device()
        with torch.no_grad():
            full = None
            if anchor and self.with_hash and jobs:
                full = lanes_i32(hash_views([j.new for j in jobs], [j.start for j in jobs], impl=self.impl))
            # the host sync of this sync: every slice's change count and body size
            plan = plan_encode(jobs, codec, span_log2=self.span_log2, impl=self.impl,
                               before_read=lambda: self._mark("scan"))
            self._mark("sync_sizes")
        nbytes = [plan.nbytes(k) for k in range(len(jobs))]
        cuts = self._cuts(nbytes)
        stats.encode_s += time.perf_counter() - t0
        for index, (a, b) in enumerate(cuts):
            t0 = time.perf_counter()
            info = BucketInfo(self.run_id, base, target, index, index == len(cuts) - 1, anchor)
            metas = [self._meta(k, plan.kinds[k], nbytes[k], plan.counts[k]) for k in range(a, b)]
            layout = plan_bucket(info, metas, hashes=self.with_hash)
            bucket = torch.zeros(layout.total, dtype=torch.uint8, device=dev)
            tab = None
            if self.with_hash and b > a:
                tab = table_view(bucket, layout)
                tab[:, :2] = self._lanes[a:b]
                tab[:, 2:] = self._lanes[a:b] if full is None else full[a:b]
            with torch.no_grad():
                write_jobs(plan, range(a, b), bucket, {k: layout.body_start + metas[k - a].offset for k in range(a, b)},
                           update_old=True, hash_out=tab[:, 2:] if tab is not None and full is None else None,
                           hash_rows={k: k - a for k in range(a, b)}, max_changes=self.max_group_changes)
            self._mark("write")
            if tab is not None:
                self._lanes[a:b] = tab[:, 2:]
            finish_bucket(bucket, layout)
            self._mark("bucket")
            stats.add_bucket(metas, bucket.numel())
            stats.encode_s += time.perf_counter() - t0
            yield bucket, info

    def _encode_anchor(self, new_bits: dict[str, torch.Tensor], base: int, target: int,
                       stats: SyncStats) -> Iterator[tuple[torch.Tensor, BucketInfo]]:
        """A dense anchor: every slice's new bits, the full hash of the new bits as target (a receiver rebases
        on it), the snapshot updated."""
        yield from self._encode_builtin("dense", new_bits, base, target, stats, anchor=True)

    def _encode_user(self, codec: WeightCodec, new_bits: dict[str, torch.Tensor], base: int, target: int,
                     stats: SyncStats) -> Iterator[tuple[torch.Tensor, BucketInfo]]:
        """A user codec: ``encode`` per slice (nothing is written until every slice is encoded), the full
        hash of every new slice (on the device), then the snapshot takes the new bits."""
        t0 = time.perf_counter()
        name = codec.name
        jobs = self._jobs(new_bits)
        with torch.no_grad():
            payloads = []
            for (tname, s, n), j in zip(self._slices, jobs):
                dtype = self.snapshot[tname].dtype
                payloads.append(encode_user_slice(codec, name, j.old.view(dtype), j.new.view(dtype),
                                                  f"{tname}[{s}:{s + n}]"))
            self._mark("user_encode")
            lanes = None
            if self.with_hash and jobs:
                lanes = lanes_i32(hash_views([j.new for j in jobs], [j.start for j in jobs], impl=self.impl))
            self._reserve(target)
            for j in jobs:
                j.old.copy_(j.new)
        self._mark("user_hash_update")
        enc = [encoded_slice(name, p) for p in payloads]
        cuts = self._cuts([e.body.numel() for e in enc])
        stats.encode_s += time.perf_counter() - t0
        for index, (a, b) in enumerate(cuts):
            t0 = time.perf_counter()
            info = BucketInfo(self.run_id, base, target, index, index == len(cuts) - 1, False)
            metas = [self._meta(k, enc[k].codec, enc[k].body.numel(), enc[k].nchanged, enc[k].payload)
                     for k in range(a, b)]
            table = torch.cat([self._lanes[a:b], lanes[a:b]], 1) if lanes is not None and b > a else None
            bucket = build_bucket(info, [(m, enc[k].body) for m, k in zip(metas, range(a, b))], self._device(),
                                  table=table)
            if lanes is not None and b > a:
                self._lanes[a:b] = lanes[a:b]
            self._mark("bucket")
            stats.add_bucket(metas, bucket.numel())
            stats.encode_s += time.perf_counter() - t0
            yield bucket, info

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

"""Trainer side of SparseRL-Sync: diff against the last-sent snapshot, pack into buckets, transfer."""

from __future__ import annotations

import time
import uuid
from typing import Iterator, Mapping

import torch

from ..kernels.common.impl import Impl
from ..kernels.sync.common import MAX_SLICE_ELEMS, bits_view, element_bits, fold_lanes
from ._util import hash_views, public_impl
from .base import WeightCodec, user_codec_name
from .bucket import BucketInfo, EntryMeta, build_bucket
from .codecs import BUILTIN_CODECS, EncodedSlice, SliceJob, builtin_codec_name, encode_slices
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
        bucket_bytes: upper bound on one transfer (a bucket holds at least one slice; slices are at most
            ``bucket_bytes`` of dense data, so only a COO slice at high density can exceed it).
        run_id: identifies this sender's version sequence (default: random).
        anchor_every: every N-th sync is a dense anchor (0: only when asked for / ``initial_anchor``).
        with_hash: put the 64-bit hashes of each slice's base and target bits in the manifest (receivers
            verify). The sender hashes its snapshot once and then updates each slice's hash from the
            changed elements only (fused into the diff), so hashing costs O(changes) per sync.
        max_slice_elems: tensors larger than this are split into slices (bounds scratch memory).
        initial_anchor: make the first sync dense.
        impl: kernel implementation: ``"auto"`` (Triton on CUDA tensors, the reference elsewhere),
            ``"reference"`` or ``"triton"``; ``None`` is a deprecated spelling of ``"auto"``.

    Raises:
        ValueError: unknown codec name, a user codec with a reserved or empty name, ``bucket_bytes`` below
            1024, negative ``anchor_every``, bad ``impl``.
        TypeError: ``codec`` is neither a name nor a :class:`~sparrow.sync.WeightCodec`; a tensor of an
            unsupported dtype.

    Memory: the snapshot (one copy of the state in its dtype) plus per bucket of input the records and
    packed bodies of its changed elements (user codecs: their payloads).
    """

    #: Names of the built-in codecs (``codec=`` also takes a user :class:`~sparrow.sync.WeightCodec`).
    CODECS = BUILTIN_CODECS

    def __init__(self, named_tensors: Mapping[str, torch.Tensor], *, codec: str | WeightCodec = "auto",
                 bucket_bytes: int = 256 << 20, run_id: str | None = None, anchor_every: int = 0,
                 with_hash: bool = True, max_slice_elems: int = 1 << 25, initial_anchor: bool = False,
                 impl: Impl = "auto") -> None:
        self.codec: str | WeightCodec = self._resolve_codec(codec)
        if bucket_bytes < 1024:
            raise ValueError(f"bucket_bytes must be at least 1024, got {bucket_bytes}")
        if anchor_every < 0:
            raise ValueError(f"anchor_every must be >= 0, got {anchor_every}")
        self.impl = public_impl(impl)
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
        #: collect / pack work on groups of slices holding at most this many changes (bounds scratch)
        self.max_group_changes = max(1, self.bucket_bytes // 4)
        #: optional :class:`~sparrow.sync.stats.StageTimer` (per-stage timing of ``encode``)
        self.timer = None
        self._hash: list[int | None] = [None] * len(self._slices)
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
        t0 = time.perf_counter()
        if isinstance(codec, str):
            enc = self._encode_builtin(codec, new_bits, target, is_anchor)
        else:
            enc = self._encode_user(codec, new_bits, target)
        stats.encode_s += time.perf_counter() - t0
        yield from self._buckets(enc, base, target, is_anchor, stats)
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

    def _encode_builtin(self, codec: str, new_bits: dict[str, torch.Tensor], target: int,
                        is_anchor: bool) -> list[EncodedSlice]:
        """The fused path: every slice in one :func:`encode_slices` call (which updates the snapshot)."""
        self._reserve(target)
        base_hashes = list(self._hash) if (self.with_hash and not is_anchor) else None
        with torch.no_grad():
            return encode_slices(self._jobs(new_bits), codec, with_hash=self.with_hash, update_old=True,
                                 copy_dense=False, impl=self.impl, base_hashes=base_hashes,
                                 max_group_changes=self.max_group_changes, timer=self.timer)

    def _encode_user(self, codec: WeightCodec, new_bits: dict[str, torch.Tensor],
                     target: int) -> list[EncodedSlice]:
        """A user codec: ``encode`` per slice (nothing is written until every slice is encoded), the full
        hash of every new slice (one host sync), then the snapshot takes the new bits."""
        name = codec.name
        jobs = self._jobs(new_bits)
        with torch.no_grad():
            payloads = []
            for (tname, s, n), j in zip(self._slices, jobs):
                dtype = self.snapshot[tname].dtype
                payloads.append(encode_user_slice(codec, name, j.old.view(dtype), j.new.view(dtype),
                                                  f"{tname}[{s}:{s + n}]"))
            if self.timer is not None:
                self.timer.mark("user_encode")
            hashes: list[int | None] = [None] * len(jobs)
            if self.with_hash and jobs:
                host = hash_views([j.new for j in jobs], [j.start for j in jobs], impl=self.impl).tolist()
                hashes = [fold_lanes(a, b) for a, b in host]  # one host sync for every slice
            self._reserve(target)
            for j in jobs:
                j.old.copy_(j.new)
        if self.timer is not None:
            self.timer.mark("user_hash_update")
        return [encoded_slice(name, p, h) for p, h in zip(payloads, hashes)]

    def _buckets(self, enc: list[EncodedSlice], base: int, target: int, is_anchor: bool,
                 stats: SyncStats) -> Iterator[tuple[torch.Tensor, BucketInfo]]:
        """Manifest entries of the encoded slices, cut into buckets of at most ``bucket_bytes`` of bodies."""
        index = 0
        pending: list[tuple[EntryMeta, torch.Tensor]] = []
        pending_bytes = 0
        for i, ((name, s, n), e) in enumerate(zip(self._slices, enc)):
            snap = self.snapshot[name]
            meta = EntryMeta(name, snap.dtype, tuple(snap.shape), s, n, e.codec, 0, e.body.numel(),
                             e.nchanged, e.target_hash, self._hash[i] if self.with_hash else None, e.payload)
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

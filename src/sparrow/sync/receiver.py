"""Rollout side of SparseRL-Sync: check, apply (in place, per bucket all-or-nothing) and verify."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping

import torch

from ..kernels.sync import api as K
from ..kernels.sync.common import SyncFormatError, add_lanes, bits_view, element_bits, fold_lanes
from ._util import hash_views
from .bucket import BucketInfo, parse_bucket
from .codecs import apply_decoded, decode_slice, undo_decoded
from .errors import (
    CorruptPayloadError,
    HashMismatchError,
    OutOfOrderError,
    ReplayError,
    ResyncRequiredError,
    ShapeMismatchError,
    SyncError,
    VersionMismatchError,
)
from .stats import SyncStats
from .transport import Transport


@dataclass
class _Pending:
    base: int
    target: int
    next_index: int
    anchor: bool


class SyncReceiver:
    """Applies buckets from a :class:`~sparrow.sync.SyncSender` to named tensors in place.

    Args:
        named_tensors: ``{name: tensor}`` updated in place (e.g. ``dict(model.named_parameters())`` of the
            rollout model; contiguous, bf16 / fp16 / fp32, dtypes and shapes as on the sender).
        run_id: accept only this sender run (None: adopt the run id of the first bucket applied).
        version: the version the tensors hold now (0 = the sender's initial state).
        verify: check the 64-bit hashes of the manifest (raise :class:`HashMismatchError` and leave the
            tensors unchanged on a mismatch). ``True`` / ``"full"``: hash each range's current bits
            before writing and compare with the sender's base hash (O(elements) read, any divergence of
            the receiver's bits is caught), then check ``base + change == target`` with the hash
            change fused into the apply (O(changes)). ``"incremental"``: the receiver keeps a running
            hash of every range it has seen (hashed once in full, then updated from the changed
            elements) and compares it with the base hash: O(changes) per sync, but writes to the
            tensors made behind the receiver's back are only caught when they touch changed elements
            or at the next full check (``audit_every``, anchors, :meth:`rehash`). ``False``: none.
        audit_every: with ``verify="incremental"``, every N-th target version is verified in full.
        keep_records: keep decoded records between validation and apply when a bucket has at most this
            many changed elements (8 bytes each); larger buckets are decoded twice instead.
        impl: kernel implementation (None: Triton on CUDA, reference on CPU).

    Guarantees: every check (manifest, versions, checksums, shapes, index bounds and order) runs before
    the first write of a bucket; a bucket is applied all-or-nothing. After any error the receiver asks the
    sender for a dense resync (``resync_requested``); if a multi-bucket sync failed after some of its
    buckets were applied, the tensors are a mix of two versions and deltas are refused
    (``needs_resync``) until a dense anchor arrives. Extra memory: one bucket, its decoded records (or one
    slice's when large), and copies of the dense / COO-overwritten elements for undo.
    """

    def __init__(self, named_tensors: Mapping[str, torch.Tensor], *, run_id: str | None = None, version: int = 0,
                 verify: bool | str = True, keep_records: int = 1 << 24, impl: str | None = None,
                 audit_every: int = 0) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._bits: dict[str, torch.Tensor] = {}
        for name, t in named_tensors.items():
            element_bits(t.dtype)
            if not t.is_contiguous():
                raise ShapeMismatchError(f"{name}: receiver tensors must be contiguous (updated in place)")
            self.tensors[name] = t
            self._bits[name] = bits_view(t.detach())
        self.run_id = run_id
        self.version = int(version)
        if verify not in (True, False, "full", "incremental"):
            raise ValueError(f"verify must be True, False, 'full' or 'incremental', got {verify!r}")
        self.verify = verify
        self.audit_every = int(audit_every)
        #: running hashes of ranges: ``{name: {(start, length): hash}}`` (incremental verification)
        self._hashes: dict[str, dict[tuple[int, int], int]] = {}
        #: optional :class:`~sparrow.sync.stats.StageTimer` (per-stage timing of ``apply_bucket``)
        self.timer = None
        self.keep_records = keep_records
        self.impl = impl
        self.needs_resync = False
        self.resync_requested = False
        self._pending: _Pending | None = None

    # -- version checks ------------------------------------------------------------------------------

    def _check_sequence(self, info: BucketInfo) -> None:
        if self.run_id is not None and info.run_id != self.run_id:
            raise VersionMismatchError(f"bucket from run {info.run_id!r}, receiver follows run {self.run_id!r}")
        p = self._pending
        tag = f"sync {info.base_version}->{info.target_version} bucket {info.index}"
        if p is None:
            if info.index != 0:
                raise OutOfOrderError(f"{tag}: expected bucket 0 of a new sync (reordered or lost buckets)")
            if info.target_version <= self.version and (self.run_id is None or info.run_id == self.run_id):
                raise ReplayError(f"{tag}: receiver already holds version {self.version} (replayed payload)")
            if not info.anchor:
                if self.needs_resync:
                    raise ResyncRequiredError(f"{tag}: receiver needs a dense anchor after an earlier failure")
                if info.base_version != self.version:
                    raise VersionMismatchError(f"{tag}: base version {info.base_version} != receiver version "
                                               f"{self.version}")
            return
        want = (p.base, p.target, p.anchor, p.next_index)
        got = (info.base_version, info.target_version, info.anchor, info.index)
        if got != want:
            raise OutOfOrderError(f"{tag}: expected bucket {p.next_index} of sync {p.base}->{p.target} "
                                  "(reordered, replayed or lost buckets)")

    # -- one bucket ----------------------------------------------------------------------------------

    def apply_bucket(self, bucket: torch.Tensor | bytes | bytearray, *, last: bool | None = None,
                     stats: SyncStats | None = None) -> BucketInfo:
        """Check and apply one bucket in place; returns its :class:`BucketInfo`.

        Raises :class:`TruncatedPayloadError` / :class:`CorruptPayloadError` (bad bytes, checksums,
        manifest, indices), :class:`ShapeMismatchError`, :class:`VersionMismatchError` /
        :class:`ReplayError` / :class:`ResyncRequiredError` (versions), :class:`OutOfOrderError` or
        :class:`HashMismatchError`; the tensors are unchanged by the failing bucket in every case.
        """
        try:
            return self._apply_bucket(bucket, last, stats)
        except SyncError:
            self.resync_requested = True
            if self._pending is not None and self._pending.next_index > 0:
                self.needs_resync = True  # earlier buckets of this sync were applied
                self._pending = None
            raise

    def _apply_bucket(self, bucket, last, stats) -> BucketInfo:
        t0 = time.perf_counter()
        if isinstance(bucket, torch.Tensor) and bucket.dtype == torch.uint8:
            dev = next(iter(self._bits.values())).device if self._bits else bucket.device
            if bucket.device != dev:
                bucket = bucket.to(dev)
        pb = parse_bucket(bucket)
        info = pb.info
        if last is not None and last != info.last:
            raise CorruptPayloadError(f"bucket {info.index}: transport says last={last}, manifest says {info.last}")
        self._check_sequence(info)
        # shapes / ranges against the local tensors
        for e in pb.entries:
            t = self.tensors.get(e.name)
            if t is None:
                raise ShapeMismatchError(f"bucket entry {e.name!r}: no such tensor on the receiver")
            if t.dtype != e.dtype or tuple(t.shape) != tuple(e.shape):
                raise ShapeMismatchError(f"{e.name}: payload is {e.dtype}{list(e.shape)}, receiver has "
                                         f"{t.dtype}{list(t.shape)}")
        ranges = sorted((e.name, e.start, e.start + e.length) for e in pb.entries)
        for (n0, _, end0), (n1, s1, _) in zip(ranges, ranges[1:]):
            if n0 == n1 and s1 < end0:
                raise CorruptPayloadError(f"bucket {info.index}: overlapping entries for {n0!r}")
        body = pb.body
        if body.device != (dev := self._device()):
            body = body.to(dev)
        timer = self.timer
        if timer is not None:
            timer.mark("parse")
        words = body.view(torch.int32) if body.numel() else torch.zeros(0, dtype=torch.int32, device=dev)
        ents = pb.entries
        views = [self._bits[e.name][e.start:e.start + e.length] for e in ents]
        compact: dict[int, list[int]] = {}
        for k, e in enumerate(ents):
            if e.codec == "compact":
                compact.setdefault(e.dtype.itemsize, []).append(k)
        keep = sum(e.nchanged for e in ents) <= self.keep_records
        mode = self._mode(info)
        checked = [k for k, e in enumerate(ents) if mode is not None and e.target_hash is not None]
        starts = [e.start for e in ents]

        def decode_group(idx: list[int]):
            eb = 8 * ents[idx[0]].dtype.itemsize
            spec = [(ents[k].offset // 4, ents[k].nbytes // 4, ents[k].length, ents[k].nchanged) for k in idx]
            return K.group_unpack_compact(words, spec, eb, impl=self.impl)

        # phase 1: decode + validate everything and hash what must be hashed in full (current bits of the
        # ranges in "full" mode or when no running hash is known; new bits of dense entries); one host
        # sync for all device-side checks and hashes
        flags = [pb.body_bad.to(dev)]
        decoded: dict[int, tuple] = {}
        other: dict[int, object] = {}
        try:
            for eb, idx in compact.items():
                pos, val, _, bad = decode_group(idx)
                if bad is not None:
                    flags.append(bad)
                if keep:
                    decoded[eb] = (pos, val)
            for k, e in enumerate(ents):
                if e.codec != "compact":
                    d = decode_slice(e.codec, body[e.offset:e.offset + e.nbytes], e.length, e.dtype, e.nchanged,
                                     defer_check=True, impl=self.impl)
                    if d.bad is not None:
                        flags.append(d.bad.to(dev))
                    other[k] = d
        except SyncFormatError as exc:
            raise CorruptPayloadError(f"bucket {info.index}: {exc}") from None
        base_of: dict[int, int] = {}
        hash_jobs: list[tuple[str, int, torch.Tensor]] = []  # ("cur" | "new", entry, bits)
        for k in checked:
            e = ents[k]
            if e.codec != "dense" or (not info.anchor and e.base_hash is not None):
                known = self._hashes.get(e.name, {}).get((e.start, e.length)) if mode == "incremental" else None
                if known is None:
                    hash_jobs.append(("cur", k, views[k]))
                else:
                    base_of[k] = known
            if e.codec == "dense":
                hash_jobs.append(("new", k, other[k].new_bits))
        lanes = [hash_views([b for _, _, b in hash_jobs], [starts[k] for _, k, _ in hash_jobs],
                            impl=self.impl).reshape(-1)] if hash_jobs else []
        host = torch.cat([torch.stack(flags).reshape(-1).to(torch.int64)] + lanes).tolist()
        if timer is not None:
            timer.mark("decode_validate")
        if any(host[:len(flags)]):
            if host[0]:
                raise CorruptPayloadError(f"bucket {info.index}: body checksum mismatch")
            raise CorruptPayloadError(f"bucket {info.index}: an entry failed validation (indices out of range, "
                                      "unordered, or malformed compact body)")
        at = len(flags)
        new_of: dict[int, int] = {}
        for kind, k, _ in hash_jobs:
            h = fold_lanes(host[at], host[at + 1])
            at += 2
            (base_of if kind == "cur" else new_of)[k] = h
        for k in checked:
            e = ents[k]
            if not info.anchor and e.base_hash is not None and base_of[k] != e.base_hash:
                self._drop_hash(e.name, e.start, e.length, keep_exact=mode == "incremental")
                raise HashMismatchError(
                    f"{e.name}[{e.start}:{e.start + e.length}]: the receiver's bits hash to {base_of[k]:016x}, the "
                    f"sender's base to {e.base_hash:016x}: the receiver's base differs from the sender's. Nothing "
                    "was written; a dense resync is needed")
            if e.codec == "dense" and new_of[k] != e.target_hash:
                raise HashMismatchError(
                    f"{e.name}[{e.start}:{e.start + e.length}]: dense body hashes to {new_of[k]:016x}, target "
                    f"{e.target_hash:016x}. Nothing was written; a dense resync is needed")
        # phase 2: apply the sparse entries with the hash change fused in, check base + change == target
        # (one host sync), undo on a mismatch; phase 3: write the dense entries (verified before writing)
        applied: list[int] = []
        undo: dict[int, object] = {}
        want = {k for k in checked if ents[k].codec != "dense"}
        dacc = K.hash_zeros(len(ents), dev) if want else None
        with torch.no_grad():
            try:
                for k, d in other.items():
                    if d.codec == "dense":
                        continue
                    undo[k] = apply_decoded(views[k], d, keep_undo=True, impl=self.impl,
                                            hash_start=starts[k] if k in want else None,
                                            hash_out=dacc[k:k + 1] if k in want else None)
                    applied.append(k)
                for eb, idx in compact.items():
                    pos, val = decoded[eb] if eb in decoded else decode_group(idx)[:2]
                    hacc = K.hash_zeros(len(idx), dev) if any(k in want for k in idx) else None
                    K.group_apply_records([views[k] for k in idx], pos, val, [ents[k].nchanged for k in idx],
                                          impl=self.impl, hash_starts=[starts[k] for k in idx], hash_out=hacc)
                    if hacc is not None:
                        dacc[idx] = hacc
                    applied.append(-eb)
                if timer is not None:
                    timer.mark("apply")
                if want:
                    dl = dacc.tolist()
                    for k in sorted(want):
                        e = ents[k]
                        got = add_lanes(base_of[k], *dl[k])
                        if got != e.target_hash:
                            raise HashMismatchError(
                                f"{e.name}[{e.start}:{e.start + e.length}]: target hash mismatch after apply "
                                f"({got:016x} != {e.target_hash:016x}); the receiver's base differs from the "
                                "sender's. The bucket was undone; a dense resync is needed")
                        new_of[k] = got
                    if timer is not None:
                        timer.mark("verify")
            except BaseException:
                for k in reversed(applied):
                    if k >= 0:
                        undo_decoded(views[k], other[k], undo[k], impl=self.impl)
                    else:
                        idx = compact[-k]
                        pos, val = decoded[-k] if -k in decoded else decode_group(idx)[:2]
                        K.group_apply_records([views[i] for i in idx], pos, val, [ents[i].nchanged for i in idx],
                                              negate=True, impl=self.impl)
                for e in ents:  # running hashes of these ranges are no longer trusted
                    self._drop_hash(e.name, e.start, e.length, keep_exact=False)
                raise
            for k, d in other.items():
                if d.codec == "dense":
                    apply_decoded(views[k], d, keep_undo=False, impl=self.impl)
        # running hashes: the verified target hash of every written range (unknown ranges are dropped)
        for k, e in enumerate(ents):
            self._drop_hash(e.name, e.start, e.length, keep_exact=False)
            if k in new_of:
                self._hashes.setdefault(e.name, {})[(e.start, e.length)] = new_of[k]
        # success: advance the state
        if info.last:
            self.version = info.target_version
            self._pending = None
            if info.anchor:
                self.needs_resync = False
                self.resync_requested = False
            if self.run_id is None:
                self.run_id = info.run_id
        else:
            self._pending = _Pending(info.base_version, info.target_version, info.index + 1, info.anchor)
        if stats is not None:
            stats.run_id, stats.base_version, stats.target_version = info.run_id, info.base_version, info.target_version
            stats.anchor = info.anchor
            stats.buckets += 1
            stats.wire_bytes += int(bucket.numel()) if isinstance(bucket, torch.Tensor) else len(bucket)
            for e in pb.entries:
                stats.entries += 1
                stats.numel += e.length
                stats.changed += e.nchanged
                stats.dense_bytes += e.length * e.dtype.itemsize
                stats.payload_bytes += e.nbytes
                stats.count(e.codec, e.nbytes)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            stats.apply_s += time.perf_counter() - t0
        if timer is not None:
            timer.mark("finish")
        return info

    # -- hashes --------------------------------------------------------------------------------------

    def _mode(self, info: BucketInfo) -> str | None:
        if self.verify is False:
            return None
        if self.verify == "incremental":
            if self.audit_every > 0 and info.target_version % self.audit_every == 0:
                return "full"
            return "incremental"
        return "full"

    def _drop_hash(self, name: str, start: int, length: int, *, keep_exact: bool) -> None:
        """Forget running hashes of ranges of ``name`` overlapping ``[start, start + length)``."""
        d = self._hashes.get(name)
        if not d:
            return
        for (s0, n0) in list(d):
            if s0 < start + length and start < s0 + n0 and not (keep_exact and (s0, n0) == (start, length)):
                del d[(s0, n0)]

    def rehash(self, ranges=None) -> None:
        """Reset the running hashes used by ``verify="incremental"``.

        Without arguments every running hash is forgotten (the next sync hashes the ranges it touches in
        full): call this after writing to the tensors outside the receiver. ``ranges`` (``(name, start,
        length)`` triples, e.g. the entries of a manifest) are hashed now from the current bits instead,
        one pass over those ranges."""
        self._hashes.clear()
        if not ranges:
            return
        ranges = [(str(n), int(s), int(ln)) for n, s, ln in ranges]
        lanes = hash_views([self._bits[n][s:s + ln] for n, s, ln in ranges], [s for _, s, _ in ranges],
                           impl=self.impl).tolist()  # one host sync
        for (n, s, ln), (a, b) in zip(ranges, lanes):
            self._hashes.setdefault(n, {})[(s, ln)] = fold_lanes(a, b)

    def _device(self) -> torch.device:
        return next(iter(self._bits.values())).device if self._bits else torch.device("cpu")

    # -- one sync ------------------------------------------------------------------------------------

    def receive(self, transport: Transport, *, raise_on_error: bool = True) -> SyncStats:
        """Receive and apply every bucket of the next sync from ``transport``.

        On an error the remaining buckets of the sync are still received (collective transports need
        every rank to take part) but not applied; the resync request is reported to the sender through
        the transport, then the first error is raised (or returned in ``SyncStats.error`` when
        ``raise_on_error`` is false).
        """
        stats = SyncStats()
        t_start = time.perf_counter()
        error: SyncError | None = None
        while True:
            t0 = time.perf_counter()
            bucket, last = transport.recv_bucket()
            stats.transfer_s += time.perf_counter() - t0
            if error is None:
                try:
                    self.apply_bucket(bucket, last=last, stats=stats)
                except SyncError as exc:
                    error = exc
            if last:
                break
        if error is not None:
            self._pending = None
        stats.resync_requested = self.resync_requested
        t0 = time.perf_counter()
        transport.end_sync_receiver(self.resync_requested)
        stats.transfer_s += time.perf_counter() - t0
        stats.total_s = time.perf_counter() - t_start
        if error is not None:
            stats.error = f"{type(error).__name__}: {error}"
            if raise_on_error:
                raise error
        return stats

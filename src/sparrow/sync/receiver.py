"""Rollout side of SparseRL-Sync: check, apply (in place, per bucket all-or-nothing) and verify.

Per bucket the receiver reads the device twice: the bucket's two ends when it arrives (header, hash table,
manifest, trailer) and one verdict after the apply kernels. Between the two, the bucket's checks of versions,
entries, shapes, codecs and running hashes run on the host, and its entries go through the apply core
(:func:`sparrow.sync.apply.apply_entries`, also behind :func:`~sparrow.sync.apply_`): the body checksum, the
base hashes that must be computed, the checks of dense bodies, COO indices and compact block headers go into a
gate that every writing kernel reads first, so a bucket failing any of them writes nothing; a compact block
that fails its own validation writes nothing and the others are undone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from ..kernels.common.impl import Impl
from ..kernels.sync.common import bits_view, element_bits, fold_lanes
from ._util import hash_views, public_impl
from .apply import apply_entries
from .base import WeightCodec, user_codec_name
from .bucket import BucketContents, BucketInfo, EntryMeta, parse_bucket
from .codecs import BUILTIN_CODECS, builtin_codec_name
from .errors import (
    CorruptPayloadError,
    HashMismatchError,
    OutOfOrderError,
    ReplayError,
    ResyncRequiredError,
    ShapeMismatchError,
    SyncError,
    UnknownCodecError,
    VersionMismatchError,
)
from .stats import SyncStats
from .transport import Transport
from .user_codecs import payload_of


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
        codecs: the user :class:`~sparrow.sync.WeightCodec` instances the sender may use, looked up by their
            ``name`` (the built-in codecs are always known; instances of them are accepted and ignored). A
            bucket naming a codec not given here is refused with :class:`UnknownCodecError`, nothing written.
        run_id: accept only this sender run (None: adopt the run id of the first bucket applied).
        version: the version the tensors hold now (0 = the sender's initial state).
        verify: check the 64-bit hashes the sender sent (raise :class:`HashMismatchError` and leave the
            tensors unchanged on a mismatch). ``True`` / ``"full"``: hash each range's current bits
            before writing and compare with the sender's base hash (O(elements) read, any divergence of
            the receiver's bits is caught), then check ``base + change == target`` with the hash
            change fused into the apply (O(changes); user codec ranges: the full hash of the result).
            ``"incremental"``: the receiver keeps a running
            hash of every range it has seen (hashed once in full, then updated from the changed
            elements) and compares it with the base hash: O(changes) per sync, but writes to the
            tensors made behind the receiver's back are only caught when they touch changed elements
            or at the next full check (``audit_every``, anchors, :meth:`rehash`). ``False``: none.
        audit_every: with ``verify="incremental"``, every N-th target version is verified in full.
        keep_records: at most this many changed elements per decode launch (8 bytes of scratch each); a
            bucket with more is decoded in several launches (an entry is never split).
        impl: kernel implementation: ``"auto"`` (Triton on CUDA tensors, the reference elsewhere),
            ``"reference"`` or ``"triton"``; ``None`` is a deprecated spelling of ``"auto"``.

    Raises:
        ValueError: bad ``verify`` or ``impl``; two user codecs of one name, or one with a reserved name.
        TypeError: an item of ``codecs`` that is not a :class:`~sparrow.sync.WeightCodec`.
        ShapeMismatchError: a tensor that is not contiguous.

    Guarantees: a bucket is applied all-or-nothing, user codec entries included. Checks of the manifest,
    versions, shapes and codecs run on the host before anything is launched; the body checksum, base hashes,
    dense bodies, COO indices and compact block headers are checked on the device before any kernel writes
    (a failure: nothing written); each compact block is validated completely (positions in range and
    increasing, bit counts) before it writes, and a block that fails makes the receiver undo the others.
    After any error the receiver asks the sender for a dense resync (``resync_requested``); if a multi-bucket
    sync failed after some of its buckets were applied, the tensors are a mix of two versions and deltas are
    refused (``needs_resync``) until a dense anchor arrives. Extra memory: one bucket, 8 bytes per change of
    one decode launch, and the overwritten bits of COO entries for undo (user codec entries: one slice copy
    while its ``apply_`` runs, then 8 bytes per element it changed).
    """

    def __init__(self, named_tensors: Mapping[str, torch.Tensor], *, codecs: Sequence[WeightCodec] = (),
                 run_id: str | None = None, version: int = 0, verify: bool | str = True,
                 keep_records: int = 1 << 24, impl: Impl = "auto", audit_every: int = 0) -> None:
        if verify not in (True, False, "full", "incremental"):
            raise ValueError(f"verify must be True, False, 'full' or 'incremental', got {verify!r}")
        self.impl = public_impl(impl)
        #: user codecs by name (the built-in ones are handled by the fused kernels)
        self.codecs: dict[str, WeightCodec] = self._user_codecs(codecs)
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
        self.verify = verify
        self.audit_every = int(audit_every)
        #: running hashes of ranges: ``{name: {(start, length): hash}}`` (incremental verification)
        self._hashes: dict[str, dict[tuple[int, int], int]] = {}
        #: optional :class:`~sparrow.sync.stats.StageTimer` (per-stage timing of ``apply_bucket``)
        self.timer = None
        self.keep_records = keep_records
        self.needs_resync = False
        self.resync_requested = False
        self._pending: _Pending | None = None

    @staticmethod
    def _user_codecs(codecs: Sequence[WeightCodec]) -> dict[str, WeightCodec]:
        if isinstance(codecs, (WeightCodec, str, Mapping)):
            raise TypeError(f"codecs must be a sequence of WeightCodec instances, got {type(codecs).__name__}")
        out: dict[str, WeightCodec] = {}
        for c in codecs:
            if isinstance(c, WeightCodec) and builtin_codec_name(c) is not None:
                continue  # built-in: always known
            name = user_codec_name(c)
            if name in out and out[name] is not c:
                raise ValueError(f"two codecs named {name!r} in codecs: {out[name]!r} and {c!r}")
            out[name] = c
        return out

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
        manifest, indices, a user codec's ``apply_`` failing), :class:`ShapeMismatchError`,
        :class:`UnknownCodecError`, :class:`VersionMismatchError` / :class:`ReplayError` /
        :class:`ResyncRequiredError` (versions), :class:`OutOfOrderError` or :class:`HashMismatchError`; the
        tensors are unchanged by the failing bucket in every case.
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
        """Parse (host read 1) and check on the host, then the apply core (device checks into the gate, sparse
        entries gated and undone on any failure, the verdict: host read 2, dense entries last), then commit."""
        t0 = time.perf_counter()
        contents = self._parse(bucket, last)
        self._validate_entries(contents)
        info, ents = contents.info, contents.entries
        body = contents.body if contents.body.device == (dev := self._device()) else contents.body.to(dev)
        mode = self._mode(info)
        checked = {k for k, e in enumerate(ents) if mode is not None and e.target_hash is not None}
        base_of, check_base = self._known_bases(info, ents, checked, mode)
        user = {k: (self.codecs[e.codec], payload_of(e, body[e.offset:e.offset + e.nbytes], info))
                for k, e in enumerate(ents) if e.is_user}
        self._mark("parse")
        try:
            new_of = apply_entries(ents, [self._bits[e.name][e.start:e.start + e.length] for e in ents], body,
                                   what=f"bucket {info.index}", checked=checked, base_of=base_of,
                                   check_base=check_base, body_bad=contents.body_bad.to(dev), user=user,
                                   keep_records=self.keep_records, impl=self.impl, mark=self._mark)
        except BaseException:
            for e in ents:  # running hashes of these ranges are no longer trusted
                self._drop_hash(e.name, e.start, e.length, keep_exact=False)
            raise
        self._commit(info, ents, new_of)
        if stats is not None:
            self._record(stats, info, ents, bucket, t0)
        self._mark("finish")
        return info

    def _mark(self, stage: str) -> None:
        if self.timer is not None:
            self.timer.mark(stage)

    def _parse(self, bucket, last: bool | None) -> BucketContents:
        """Bytes, checksums and manifest of the bucket (one host read), then its place in the sequence."""
        if isinstance(bucket, torch.Tensor) and bucket.dtype == torch.uint8:
            dev = self._device() if self._bits else bucket.device
            if bucket.device != dev:
                bucket = bucket.to(dev)
        contents = parse_bucket(bucket)
        if last is not None and last != contents.info.last:
            raise CorruptPayloadError(f"bucket {contents.info.index}: transport says last={last}, manifest says "
                                      f"{contents.info.last}")
        self._check_sequence(contents.info)
        return contents

    def _validate_entries(self, contents: BucketContents) -> None:
        """Entries against the local tensors (name, dtype, shape), against each other (no overlapping
        ranges) and against the codecs this receiver knows."""
        for e in contents.entries:
            t = self.tensors.get(e.name)
            if t is None:
                raise ShapeMismatchError(f"bucket entry {e.name!r}: no such tensor on the receiver")
            if t.dtype != e.dtype or tuple(t.shape) != tuple(e.shape):
                raise ShapeMismatchError(f"{e.name}: payload is {e.dtype}{list(e.shape)}, receiver has "
                                         f"{t.dtype}{list(t.shape)}")
            self._follow(e.name)
        ranges = sorted((e.name, e.start, e.start + e.length) for e in contents.entries)
        for (n0, _, end0), (n1, s1, _) in zip(ranges, ranges[1:]):
            if n0 == n1 and s1 < end0:
                raise CorruptPayloadError(f"bucket {contents.info.index}: overlapping entries for {n0!r}")
        for e in contents.entries:
            if e.is_user and e.codec not in self.codecs:
                known = ", ".join([*BUILTIN_CODECS[1:], *sorted(self.codecs)])
                raise UnknownCodecError(
                    f"bucket {contents.info.index}: entry {e.name}[{e.start}:{e.start + e.length}] uses codec "
                    f"{e.codec!r}, which this receiver does not know (it knows {known}): pass it as "
                    "SyncReceiver(..., codecs=[...]). Nothing was written; a dense resync is needed")

    def _follow(self, name: str) -> None:
        """Write where the tensor's storage is now: a parameter given storage of its own after the receiver was
        built (``param.data = ...``; :func:`sparrow.models.fuse_projections_` makes parameters views of one
        fused weight) gets its bit view rebuilt, and its running hashes dropped (hashed in full next time).
        Without this the receiver would keep writing the old storage, which nothing reads any more."""
        t, view = self.tensors[name], self._bits[name]
        if t.data_ptr() == view.data_ptr() and t.device == view.device:
            return
        if not t.is_contiguous():
            raise ShapeMismatchError(f"{name}: the tensor's storage moved to a non-contiguous one; receiver "
                                     "tensors must be contiguous (updated in place)")
        self._bits[name] = bits_view(t.detach())
        self._hashes.pop(name, None)

    def _known_bases(self, info: BucketInfo, ents: Sequence[EntryMeta], checked: set[int],
                     mode: str | None) -> tuple[dict[int, int], list[int]]:
        """Which entries' ranges must hold the sender's base bits: the checked ones, except in an anchor (a dense
        entry is checked too). With ``verify="incremental"`` the running hash of a range the receiver has seen is
        compared with the sender's base hash here, on the host, before anything is launched; the other ranges are
        hashed on the device by the apply. Returns ``({entry: known base hash}, [entries to hash on the device])``.
        """
        base_of: dict[int, int] = {}
        check_base: list[int] = []
        for k, e in enumerate(ents):
            if k not in checked or info.anchor or e.base_hash is None:
                continue
            known = self._hashes.get(e.name, {}).get((e.start, e.length)) if mode == "incremental" else None
            if known is None:
                check_base.append(k)
                continue
            base_of[k] = known
            if known != e.base_hash:
                self._drop_hash(e.name, e.start, e.length, keep_exact=True)
                raise HashMismatchError(
                    f"{e.name}[{e.start}:{e.start + e.length}]: the receiver's bits hash to {known:016x}, the "
                    f"sender's base to {e.base_hash:016x}: the receiver's base differs from the sender's. Nothing was "
                    "written; a dense resync is needed")
        return base_of, check_base

    def _commit(self, info: BucketInfo, ents: Sequence[EntryMeta], new_of: Mapping[int, int]) -> None:
        """Running hashes (the verified target hash of every written range; unknown ranges are dropped)
        and the receiver's place in the version sequence."""
        for k, e in enumerate(ents):
            self._drop_hash(e.name, e.start, e.length, keep_exact=False)
            if k in new_of:
                self._hashes.setdefault(e.name, {})[(e.start, e.length)] = new_of[k]
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

    def _record(self, stats: SyncStats, info: BucketInfo, ents: Sequence[EntryMeta], bucket, t0: float) -> None:
        stats.run_id, stats.base_version, stats.target_version = info.run_id, info.base_version, info.target_version
        stats.anchor = info.anchor
        stats.add_bucket(ents, bucket.numel() if isinstance(bucket, torch.Tensor) else len(bucket))
        dev = self._device()
        if dev.type == "cuda" and any(e.codec == "dense" for e in ents):
            torch.cuda.synchronize(dev)  # the dense copies were queued after the verdict
        stats.apply_s += time.perf_counter() - t0

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

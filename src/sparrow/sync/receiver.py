"""Rollout side of SparseRL-Sync: check, apply (in place, per bucket all-or-nothing) and verify."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from ..kernels.common.impl import Impl
from ..kernels.sync import api as K
from ..kernels.sync.common import SyncFormatError, add_lanes, bits_view, element_bits, fold_lanes
from ._util import hash_views, public_impl
from .base import Payload, WeightCodec, user_codec_name
from .bucket import BucketInfo, EntryMeta, ParsedBucket, parse_bucket
from .codecs import BUILTIN_CODECS, Decoded, apply_decoded, builtin_codec_name, decode_slice, undo_decoded
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
from .user_codecs import apply_user_slice, payload_of, undo_user_slice


@dataclass
class _Pending:
    base: int
    target: int
    next_index: int
    anchor: bool


@dataclass
class _Bucket:
    """One bucket on its way through :meth:`SyncReceiver._apply_bucket` (``k``: index of a manifest entry)."""

    info: BucketInfo
    ents: list[EntryMeta]
    body: torch.Tensor  # uint8, on the receiver's device
    body_bad: torch.Tensor  # 0-d bool: body checksum mismatch
    views: list[torch.Tensor]  # bit views of the entries' ranges of the receiver's tensors
    mode: str | None  # verification of this bucket: "full", "incremental" or None
    checked: list[int]  # entries whose target hash is verified
    compact: dict[int, list[int]]  # element size -> compact entries (decoded and applied as one group)
    keep: bool  # keep decoded compact records between validation and apply (else decode twice)
    flags: list[torch.Tensor] = field(default_factory=list)  # device-side validation flags (body first)
    decoded: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # size -> (pos, val)
    other: dict[int, Decoded] = field(default_factory=dict)  # dense and COO entries
    user: dict[int, Payload] = field(default_factory=dict)  # user codec entries
    base_of: dict[int, int] = field(default_factory=dict)  # hash of the range's bits before writing
    new_of: dict[int, int] = field(default_factory=dict)  # verified hash of the range's bits after writing
    want: set[int] = field(default_factory=set)  # sparse built-in entries verified by base + change
    dacc: torch.Tensor | None = None  # int32 [entries, 2]: hash change of the sparse built-in entries
    user_lanes: dict[int, torch.Tensor] = field(default_factory=dict)  # full hash of checked user ranges
    applied: list[tuple[str, int]] = field(default_factory=list)  # ("entry" | "group" | "user", key), in order
    undo: dict[int, object] = field(default_factory=dict)

    @property
    def starts(self) -> list[int]:
        return [e.start for e in self.ents]

    def label(self, k: int) -> str:
        e = self.ents[k]
        return f"{e.name}[{e.start}:{e.start + e.length}]"


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
        verify: check the 64-bit hashes of the manifest (raise :class:`HashMismatchError` and leave the
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
        keep_records: keep decoded records between validation and apply when a bucket has at most this
            many changed elements (8 bytes each); larger buckets are decoded twice instead.
        impl: kernel implementation: ``"auto"`` (Triton on CUDA tensors, the reference elsewhere),
            ``"reference"`` or ``"triton"``; ``None`` is a deprecated spelling of ``"auto"``.

    Raises:
        ValueError: bad ``verify`` or ``impl``; two user codecs of one name, or one with a reserved name.
        TypeError: an item of ``codecs`` that is not a :class:`~sparrow.sync.WeightCodec`.
        ShapeMismatchError: a tensor that is not contiguous.

    Guarantees: every check (manifest, versions, checksums, shapes, index bounds and order, codecs) runs
    before the first write of a bucket; a bucket is applied all-or-nothing, user codec entries included.
    After any error the receiver asks the
    sender for a dense resync (``resync_requested``); if a multi-bucket sync failed after some of its
    buckets were applied, the tensors are a mix of two versions and deltas are refused
    (``needs_resync``) until a dense anchor arrives. Extra memory: one bucket, its decoded records (or one
    slice's when large), and copies of the dense / COO-overwritten elements for undo (user codec entries:
    one slice copy while its ``apply_`` runs, then 8 bytes per element it changed).
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
        """Parse, validate, decode, check before writing, apply (undo on any failure), write dense, commit."""
        t0 = time.perf_counter()
        pb = self._parse(bucket, last)
        self._validate_entries(pb)
        b = self._start(pb)
        self._mark("parse")
        self._decode(b)
        self._check_before_write(b)  # host sync: every validation flag and the hashes needed before writing
        self._mark("decode_validate")
        with torch.no_grad():
            try:
                self._apply_sparse(b)
                self._mark("apply")
                self._verify_after_apply(b)  # host sync: hash changes / user range hashes
            except BaseException:
                self._undo(b)
                raise
            self._write_dense(b)
        self._commit(b)
        if stats is not None:
            self._record(stats, b, bucket, t0)
        self._mark("finish")
        return b.info

    def _mark(self, stage: str) -> None:
        if self.timer is not None:
            self.timer.mark(stage)

    def _parse(self, bucket, last: bool | None) -> ParsedBucket:
        """Bytes, checksums and manifest of the bucket (one host read), then its place in the sequence."""
        if isinstance(bucket, torch.Tensor) and bucket.dtype == torch.uint8:
            dev = self._device() if self._bits else bucket.device
            if bucket.device != dev:
                bucket = bucket.to(dev)
        pb = parse_bucket(bucket)
        if last is not None and last != pb.info.last:
            raise CorruptPayloadError(f"bucket {pb.info.index}: transport says last={last}, manifest says "
                                      f"{pb.info.last}")
        self._check_sequence(pb.info)
        return pb

    def _validate_entries(self, pb: ParsedBucket) -> None:
        """Entries against the local tensors (name, dtype, shape), against each other (no overlapping
        ranges) and against the codecs this receiver knows."""
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
                raise CorruptPayloadError(f"bucket {pb.info.index}: overlapping entries for {n0!r}")
        for e in pb.entries:
            if e.is_user and e.codec not in self.codecs:
                known = ", ".join([*BUILTIN_CODECS[1:], *sorted(self.codecs)])
                raise UnknownCodecError(
                    f"bucket {pb.info.index}: entry {e.name}[{e.start}:{e.start + e.length}] uses codec "
                    f"{e.codec!r}, which this receiver does not know (it knows {known}): pass it as "
                    "SyncReceiver(..., codecs=[...]). Nothing was written; a dense resync is needed")

    def _start(self, pb: ParsedBucket) -> _Bucket:
        """The per-bucket state: body on the receiver's device, views of the target ranges, the groups."""
        body = pb.body
        if body.device != (dev := self._device()):
            body = body.to(dev)
        ents = pb.entries
        compact: dict[int, list[int]] = {}
        for k, e in enumerate(ents):
            if e.codec == "compact":
                compact.setdefault(e.dtype.itemsize, []).append(k)
        mode = self._mode(pb.info)
        return _Bucket(
            info=pb.info, ents=ents, body=body, body_bad=pb.body_bad,
            views=[self._bits[e.name][e.start:e.start + e.length] for e in ents], mode=mode,
            checked=[k for k, e in enumerate(ents) if mode is not None and e.target_hash is not None],
            compact=compact, keep=sum(e.nchanged for e in ents if not e.is_user) <= self.keep_records)

    def _decode_group(self, b: _Bucket, idx: list[int]):
        """Decode the compact entries ``idx`` (one element size) in one launch: ``(pos, val, rec_off, bad)``."""
        body = b.body
        words = body.view(torch.int32) if body.numel() else torch.zeros(0, dtype=torch.int32, device=body.device)
        eb = 8 * b.ents[idx[0]].dtype.itemsize
        spec = [(b.ents[k].offset // 4, b.ents[k].nbytes // 4, b.ents[k].length, b.ents[k].nchanged) for k in idx]
        return K.group_unpack_compact(words, spec, eb, impl=self.impl)

    def _decode(self, b: _Bucket) -> None:
        """Decode every built-in entry with its validation deferred into ``b.flags`` (no host sync); the
        payloads of user entries."""
        dev = b.body.device
        b.flags = [b.body_bad.to(dev)]
        try:
            for eb, idx in b.compact.items():
                pos, val, _, bad = self._decode_group(b, idx)
                if bad is not None:
                    b.flags.append(bad)
                if b.keep:
                    b.decoded[eb] = (pos, val)
            for k, e in enumerate(b.ents):
                if e.codec in ("dense", "coo"):
                    d = decode_slice(e.codec, b.body[e.offset:e.offset + e.nbytes], e.length, e.dtype, e.nchanged,
                                     defer_check=True, impl=self.impl)
                    if d.bad is not None:
                        b.flags.append(d.bad.to(dev))
                    b.other[k] = d
        except SyncFormatError as exc:
            raise CorruptPayloadError(f"bucket {b.info.index}: {exc}") from None
        for k, e in enumerate(b.ents):
            if e.is_user:
                b.user[k] = payload_of(e, b.body[e.offset:e.offset + e.nbytes], b.info)

    def _check_before_write(self, b: _Bucket) -> None:
        """One host sync for the validation flags and the hashes needed before writing (current bits of the
        ranges in "full" mode or when no running hash is known; new bits of dense entries); raises on a bad
        body, an invalid entry, a base that is not the sender's, or a dense body that is not the target."""
        info, ents = b.info, b.ents
        hash_jobs: list[tuple[str, int, torch.Tensor]] = []  # ("cur" | "new", entry, bits)
        for k in b.checked:
            e = ents[k]
            if e.codec != "dense" or (not info.anchor and e.base_hash is not None):
                known = self._hashes.get(e.name, {}).get((e.start, e.length)) if b.mode == "incremental" else None
                if known is None:
                    hash_jobs.append(("cur", k, b.views[k]))
                else:
                    b.base_of[k] = known
            if e.codec == "dense":
                hash_jobs.append(("new", k, b.other[k].new_bits))
        lanes = [hash_views([v for _, _, v in hash_jobs], [ents[k].start for _, k, _ in hash_jobs],
                            impl=self.impl).reshape(-1)] if hash_jobs else []
        host = torch.cat([torch.stack(b.flags).reshape(-1).to(torch.int64)] + lanes).tolist()  # host sync
        nflags = len(b.flags)
        if any(host[:nflags]):
            if host[0]:
                raise CorruptPayloadError(f"bucket {info.index}: body checksum mismatch")
            raise CorruptPayloadError(f"bucket {info.index}: an entry failed validation (indices out of range, "
                                      "unordered, or malformed compact body)")
        at = nflags
        for kind, k, _ in hash_jobs:
            (b.base_of if kind == "cur" else b.new_of)[k] = fold_lanes(host[at], host[at + 1])
            at += 2
        for k in b.checked:
            self._check_base_and_dense(b, k)

    def _check_base_and_dense(self, b: _Bucket, k: int) -> None:
        e = b.ents[k]
        if not b.info.anchor and e.base_hash is not None and b.base_of[k] != e.base_hash:
            self._drop_hash(e.name, e.start, e.length, keep_exact=b.mode == "incremental")
            raise HashMismatchError(
                f"{b.label(k)}: the receiver's bits hash to {b.base_of[k]:016x}, the "
                f"sender's base to {e.base_hash:016x}: the receiver's base differs from the sender's. Nothing "
                "was written; a dense resync is needed")
        if e.codec == "dense" and b.new_of[k] != e.target_hash:
            raise HashMismatchError(
                f"{b.label(k)}: dense body hashes to {b.new_of[k]:016x}, target "
                f"{e.target_hash:016x}. Nothing was written; a dense resync is needed")

    def _apply_sparse(self, b: _Bucket) -> None:
        """Write the COO entries, the compact groups (hash change fused in) and the user codec entries, in
        that order, recording in ``b.applied`` what :meth:`_undo` must restore."""
        b.want = {k for k in b.checked if b.ents[k].codec in ("coo", "compact")}
        dev = b.body.device
        b.dacc = K.hash_zeros(len(b.ents), dev) if b.want else None
        starts = b.starts
        for k, d in b.other.items():
            if d.codec == "dense":
                continue
            hashed = k in b.want
            b.undo[k] = apply_decoded(b.views[k], d, keep_undo=True, impl=self.impl,
                                      hash_start=starts[k] if hashed else None,
                                      hash_out=b.dacc[k:k + 1] if hashed else None)
            b.applied.append(("entry", k))
        for eb, idx in b.compact.items():
            pos, val = b.decoded[eb] if eb in b.decoded else self._decode_group(b, idx)[:2]
            hacc = K.hash_zeros(len(idx), dev) if any(k in b.want for k in idx) else None
            K.group_apply_records([b.views[k] for k in idx], pos, val, [b.ents[k].nchanged for k in idx],
                                  impl=self.impl, hash_starts=[starts[k] for k in idx], hash_out=hacc)
            if hacc is not None:
                b.dacc[idx] = hacc
            b.applied.append(("group", eb))
        checked = set(b.checked)
        for k, p in b.user.items():
            e = b.ents[k]
            b.undo[k] = apply_user_slice(self.codecs[e.codec], b.views[k], e.dtype, p, b.label(k), impl=self.impl)
            b.applied.append(("user", k))
            if k in checked:
                b.user_lanes[k] = K.hash_bits(b.views[k], e.start, impl=self.impl)

    def _verify_after_apply(self, b: _Bucket) -> None:
        """One host sync: ``base + change == target`` for the sparse built-in entries, ``hash == target`` for
        the user codec entries; raises :class:`HashMismatchError` (the caller undoes the bucket)."""
        if not b.want and not b.user_lanes:
            return
        rows = ([b.dacc.to(torch.int64)] if b.want else []) + [ln.reshape(1, 2) for ln in b.user_lanes.values()]
        host = torch.cat(rows).tolist()  # host sync
        for k in sorted(b.want):
            e = b.ents[k]
            got = add_lanes(b.base_of[k], *host[k])
            if got != e.target_hash:
                raise HashMismatchError(
                    f"{b.label(k)}: target hash mismatch after apply "
                    f"({got:016x} != {e.target_hash:016x}); the receiver's base differs from the "
                    "sender's. The bucket was undone; a dense resync is needed")
            b.new_of[k] = got
        at = len(b.ents) if b.want else 0
        for r, k in enumerate(b.user_lanes):
            e = b.ents[k]
            got = fold_lanes(*host[at + r])
            if got != e.target_hash:
                raise HashMismatchError(
                    f"{b.label(k)}: after codec {e.codec!r} applied its payload the range hashes to {got:016x}, "
                    f"the sender's target is {e.target_hash:016x}: the codec's apply_ does not reproduce what its "
                    "encode saw, or the receiver's base differs from the sender's. The bucket was undone; a "
                    "dense resync is needed")
            b.new_of[k] = got
        self._mark("verify")

    def _undo(self, b: _Bucket) -> None:
        """Restore, newest first, every range :meth:`_apply_sparse` wrote (bit-exact); forget their hashes."""
        for kind, key in reversed(b.applied):
            if kind == "user":
                undo_user_slice(b.views[key], b.undo[key], impl=self.impl)  # type: ignore[arg-type]
            elif kind == "entry":
                undo_decoded(b.views[key], b.other[key], b.undo[key], impl=self.impl)
            else:
                idx = b.compact[key]
                pos, val = b.decoded[key] if key in b.decoded else self._decode_group(b, idx)[:2]
                K.group_apply_records([b.views[i] for i in idx], pos, val, [b.ents[i].nchanged for i in idx],
                                      negate=True, impl=self.impl)
        for e in b.ents:  # running hashes of these ranges are no longer trusted
            self._drop_hash(e.name, e.start, e.length, keep_exact=False)

    def _write_dense(self, b: _Bucket) -> None:
        """Dense entries last: verified before writing, so they never need an undo copy."""
        for k, d in b.other.items():
            if d.codec == "dense":
                apply_decoded(b.views[k], d, keep_undo=False, impl=self.impl)

    def _commit(self, b: _Bucket) -> None:
        """Running hashes (the verified target hash of every written range; unknown ranges are dropped)
        and the receiver's place in the version sequence."""
        for k, e in enumerate(b.ents):
            self._drop_hash(e.name, e.start, e.length, keep_exact=False)
            if k in b.new_of:
                self._hashes.setdefault(e.name, {})[(e.start, e.length)] = b.new_of[k]
        info = b.info
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

    def _record(self, stats: SyncStats, b: _Bucket, bucket, t0: float) -> None:
        info = b.info
        stats.run_id, stats.base_version, stats.target_version = info.run_id, info.base_version, info.target_version
        stats.anchor = info.anchor
        stats.buckets += 1
        stats.wire_bytes += int(bucket.numel()) if isinstance(bucket, torch.Tensor) else len(bucket)
        for e in b.ents:
            stats.entries += 1
            stats.numel += e.length
            stats.changed += e.nchanged
            stats.dense_bytes += e.length * e.dtype.itemsize
            stats.payload_bytes += e.nbytes
            stats.count(e.codec, e.nbytes)
        dev = b.body.device
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
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

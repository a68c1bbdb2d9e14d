"""Rollout side of SparseRL-Sync: check, apply (in place, per bucket all-or-nothing) and verify.

Per bucket the receiver reads the device twice: the bucket's two ends when it arrives (header, hash table,
manifest, trailer) and one verdict after the apply kernels (the pre-write gate, the count of blocks that
failed validation and the hash changes). Everything between runs on the device: the body checksum, the base
hashes that must be computed, the checks of dense bodies, COO indices and compact block headers go into a
gate that every writing kernel reads first, so a bucket failing any of them writes nothing; a compact block
that fails its own validation writes nothing and the others are undone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from .._transfer import to_device
from ..kernels.common.impl import Impl
from ..kernels.sync import api as K
from ..kernels.sync.common import (BITS_DTYPE, SyncFormatError, add_lanes, bits_view, element_bits, fold_lanes,
                                   split_lanes)
from ._util import cut_runs, hash_views, public_impl
from .base import Payload, WeightCodec, user_codec_name
from .bucket import BucketInfo, EntryMeta, ParsedBucket, parse_bucket
from .codecs import BUILTIN_CODECS, builtin_codec_name, coo_records
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

# gate flags (int32 on the device): any set -> no kernel of the bucket writes
_G_BODY, _G_FORMAT, _G_BASE, _G_DENSE = 0, 1, 2, 3
_NGATE = 4


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
    body: torch.Tensor  # uint8 entry bodies, on the receiver's device
    body_bad: torch.Tensor  # 0-d bool: body checksum mismatch
    views: list[torch.Tensor]  # bit views of the entries' ranges of the receiver's tensors
    mode: str | None  # verification of this bucket: "full", "incremental" or None
    checked: set[int]  # entries whose target hash is verified
    gate: torch.Tensor  # int32 [_NGATE] pre-write flags
    err: torch.Tensor  # int32 [1]: compact blocks that failed validation
    dacc: torch.Tensor  # int32 [entries, 2]: hash change of the sparse built-in entries
    compact: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # (element size, span) -> entries
    coo: list[int] = field(default_factory=list)
    dense: list[int] = field(default_factory=list)
    user: dict[int, Payload] = field(default_factory=dict)  # user codec entries
    coo_recs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    hash_now: list[int] = field(default_factory=list)  # entries whose current bits are hashed on the device
    base_lanes: torch.Tensor | None = None  # their lanes
    dense_lanes: tuple[list[int], torch.Tensor] | None = None  # dense entries checked: lanes of their bodies
    base_of: dict[int, int] = field(default_factory=dict)  # hash of the range's bits before writing
    new_of: dict[int, int] = field(default_factory=dict)  # verified hash of the range's bits after writing
    want: set[int] = field(default_factory=set)  # sparse built-in entries verified by base + change
    user_lanes: dict[int, torch.Tensor] = field(default_factory=dict)  # full hash of checked user ranges
    applied: list[tuple[str, object]] = field(default_factory=list)  # ("coo" | "compact" | "user", key), in order
    undo: dict[int, object] = field(default_factory=dict)

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
        """Parse (host read 1), check on the host, check on the device into the gate, apply the sparse entries
        (gated; undone on any failure), read the verdict (host read 2), write the dense entries, commit."""
        t0 = time.perf_counter()
        pb = self._parse(bucket, last)
        self._validate_entries(pb)
        b = self._start(pb)
        self._check_known_bases(b)
        self._mark("parse")
        with torch.no_grad():
            self._gate(b)
            self._mark("check")
            try:
                self._apply_sparse(b)
                self._mark("apply")
                self._verdict(b)  # host sync: gate, validation count, hash changes
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
            self._follow(e.name)
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

    def _start(self, pb: ParsedBucket) -> _Bucket:
        """The per-bucket state: body on the receiver's device, views of the target ranges, the groups, the
        device flags (one allocation: gate, validation count, hash changes)."""
        body = pb.body
        if body.device != (dev := self._device()):
            body = body.to(dev)
        ents = pb.entries
        mode = self._mode(pb.info)
        flags = torch.zeros(_NGATE + 1 + 2 * len(ents), dtype=torch.int32, device=dev)
        b = _Bucket(info=pb.info, ents=ents, body=body, body_bad=pb.body_bad.to(dev),
                    views=[self._bits[e.name][e.start:e.start + e.length] for e in ents], mode=mode,
                    checked={k for k, e in enumerate(ents) if mode is not None and e.target_hash is not None},
                    gate=flags[:_NGATE], err=flags[_NGATE:_NGATE + 1], dacc=flags[_NGATE + 1:].view(len(ents), 2))
        for k, e in enumerate(ents):
            if e.codec == "compact":
                b.compact.setdefault((e.dtype.itemsize, e.span_log2), []).append(k)
            elif e.codec == "coo":
                b.coo.append(k)
            elif e.codec == "dense":
                b.dense.append(k)
            else:
                b.user[k] = payload_of(e, body[e.offset:e.offset + e.nbytes], pb.info)
        b.want = {k for k in b.checked if ents[k].codec in ("coo", "compact")}
        return b

    def _needs_base(self, b: _Bucket, k: int) -> bool:
        """Entry ``k``'s base hash is checked: not in an anchor, hashes sent, verification on (a dense entry is
        checked too: the receiver's bits must still be the sender's base)."""
        e = b.ents[k]
        return k in b.checked and not b.info.anchor and e.base_hash is not None

    def _check_known_bases(self, b: _Bucket) -> None:
        """Incremental verification, before anything is launched: the running hash of a range the receiver
        has seen is compared with the sender's base hash on the host. Other ranges are hashed on the device
        (:meth:`_gate`)."""
        for k in range(len(b.ents)):
            if not self._needs_base(b, k):
                continue
            e = b.ents[k]
            known = self._hashes.get(e.name, {}).get((e.start, e.length)) if b.mode == "incremental" else None
            if known is None:
                b.hash_now.append(k)
                continue
            b.base_of[k] = known
            if known != e.base_hash:
                self._drop_hash(e.name, e.start, e.length, keep_exact=True)
                raise HashMismatchError(
                    f"{b.label(k)}: the receiver's bits hash to {known:016x}, the sender's base to "
                    f"{e.base_hash:016x}: the receiver's base differs from the sender's. Nothing was written; a "
                    "dense resync is needed")

    def _lanes_of(self, hashes: Sequence[int]) -> torch.Tensor:
        """int64 [N, 2] device lanes of 64-bit host hashes (non-blocking upload)."""
        return to_device(torch.tensor([v for h in hashes for v in split_lanes(h)], dtype=torch.int64).view(-1, 2),
                         self._device())

    def _gate(self, b: _Bucket) -> None:
        """The pre-write checks that need the device, each into a gate flag (no host sync): the body checksum,
        base hashes of the ranges not known on the host (``verify="full"``: all), dense bodies against their
        target hashes, COO indices and compact block headers."""
        b.gate[_G_BODY:_G_BODY + 1].copy_(b.body_bad.view(1))
        if b.hash_now:
            lanes = hash_views([b.views[k] for k in b.hash_now], [b.ents[k].start for k in b.hash_now],
                               impl=self.impl)
            b.base_lanes = lanes
            want = self._lanes_of([b.ents[k].base_hash for k in b.hash_now])
            b.gate[_G_BASE:_G_BASE + 1].copy_((lanes != want).any().view(1))
        dense = [k for k in b.dense if k in b.checked]
        if dense:
            lanes = hash_views([self._dense_bits(b, k) for k in dense], [b.ents[k].start for k in dense],
                               impl=self.impl)
            b.dense_lanes = (dense, lanes)
            want = self._lanes_of([b.ents[k].target_hash for k in dense])
            b.gate[_G_DENSE:_G_DENSE + 1].copy_((lanes != want).any().view(1))
        for k in b.coo:
            e = b.ents[k]
            pos, vals = coo_records(b.body[e.offset:e.offset + e.nbytes], e.nchanged, e.dtype)
            b.coo_recs[k] = (pos, vals, torch.empty_like(pos))
            fmt = b.gate[_G_FORMAT:_G_FORMAT + 1]
            torch.maximum(fmt, K.positions_bad(pos, e.length).view(1).to(torch.int32), out=fmt)
        for (esize, span), idx in b.compact.items():
            try:
                K.check_compact_headers(self._words(b), self._entries(b, idx), ebits=8 * esize, span_log2=span,
                                        gate=b.gate, gate_slot=_G_FORMAT, impl=self.impl)
            except SyncFormatError as exc:
                raise CorruptPayloadError(f"bucket {b.info.index}: {exc}") from None

    def _words(self, b: _Bucket) -> torch.Tensor:
        return b.body.view(torch.int32) if b.body.numel() else torch.zeros(0, dtype=torch.int32, device=b.body.device)

    def _entries(self, b: _Bucket, idx: Sequence[int]) -> list[tuple[int, int, int, int]]:
        return [(b.ents[k].offset // 4, b.ents[k].nbytes // 4, b.ents[k].length, b.ents[k].nchanged) for k in idx]

    def _dense_bits(self, b: _Bucket, k: int) -> torch.Tensor:
        e = b.ents[k]
        return b.body[e.offset:e.offset + e.nbytes].view(BITS_DTYPE[e.dtype])

    def _runs(self, b: _Bucket, idx: list[int]) -> list[list[int]]:
        """The compact entries of a group in runs of at most ``keep_records`` changes (decode scratch)."""
        return [idx[i:j] for i, j in cut_runs([b.ents[k].nchanged for k in idx], self.keep_records)]

    def _apply_compact(self, b: _Bucket, key, run: list[int], negate: bool) -> None:
        esize, span = key
        hashed = not negate and any(k in b.want for k in run)
        contiguous = run == list(range(run[0], run[0] + len(run)))
        hacc = None
        if hashed:  # the kernel adds the hash changes into the rows of b.dacc (a view when the run is contiguous)
            hacc = b.dacc[run[0]:run[0] + len(run)] if contiguous else K.hash_zeros(len(run), b.body.device)
        K.apply_compact([b.views[k] for k in run], self._words(b), self._entries(b, run), span_log2=span,
                        gate=b.gate, err=b.err if not negate else torch.zeros_like(b.err), check_headers=False,
                        negate=negate, hash_starts=[b.ents[k].start for k in run], hash_out=hacc, impl=self.impl)
        if hacc is not None and not contiguous:
            b.dacc[torch.tensor(run)] = hacc

    def _apply_sparse(self, b: _Bucket) -> None:
        """Write the COO entries and the compact groups (gated on the device: nothing is written when a pre-write
        check failed; hash changes fused in), then the user codec entries, recording in ``b.applied`` what
        :meth:`_undo` must restore."""
        for k in b.coo:
            pos, vals, undo = b.coo_recs[k]
            hashed = k in b.want
            K.group_apply_records([b.views[k]], pos, vals, [b.ents[k].nchanged], values="new", impl=self.impl,
                                  hash_starts=[b.ents[k].start], hash_out=b.dacc[k:k + 1] if hashed else None,
                                  gate=b.gate, undo_out=undo)
            b.applied.append(("coo", k))
        for key, idx in b.compact.items():
            for run in self._runs(b, idx):
                self._apply_compact(b, key, run, negate=False)
                b.applied.append(("compact", (key, tuple(run))))
        if b.user:
            if any(b.gate.tolist()):  # host sync: a user codec's apply_ runs on the host, only past the gate
                return
            for k, p in b.user.items():
                e = b.ents[k]
                b.undo[k] = apply_user_slice(self.codecs[e.codec], b.views[k], e.dtype, p, b.label(k),
                                             impl=self.impl)
                b.applied.append(("user", k))
                if k in b.checked:
                    b.user_lanes[k] = K.hash_bits(b.views[k], e.start, impl=self.impl)

    def _verdict(self, b: _Bucket) -> None:
        """One host sync for every device-side result; raises what failed (the caller undoes what was written:
        nothing when a gate flag is set)."""
        rows = [b.gate, b.err, b.dacc.reshape(-1)]
        if b.base_lanes is not None:
            rows.append(b.base_lanes.reshape(-1).to(torch.int32))
        if b.dense_lanes is not None:
            rows.append(b.dense_lanes[1].reshape(-1).to(torch.int32))
        rows += [ln.reshape(-1).to(torch.int32) for ln in b.user_lanes.values()]
        host = torch.cat(rows).tolist()  # the verdict sync
        gate, nerr = host[:_NGATE], host[_NGATE]
        at = _NGATE + 1
        dacc = [(host[at + 2 * k], host[at + 2 * k + 1]) for k in range(len(b.ents))]
        at += 2 * len(b.ents)
        tag = f"bucket {b.info.index}"
        if gate[_G_BODY]:
            raise CorruptPayloadError(f"{tag}: body checksum mismatch. Nothing was written")
        if gate[_G_FORMAT]:
            raise CorruptPayloadError(f"{tag}: an entry failed validation (indices out of range or unordered, or "
                                      "compact block headers that do not describe the body). Nothing was written")
        if b.base_lanes is not None:
            for r, k in enumerate(b.hash_now):
                b.base_of[k] = fold_lanes(host[at + 2 * r], host[at + 2 * r + 1])
            at += 2 * len(b.hash_now)
        if gate[_G_BASE]:
            k = next(k for k in b.hash_now if b.base_of[k] != b.ents[k].base_hash)
            e = b.ents[k]
            self._drop_hash(e.name, e.start, e.length, keep_exact=False)
            raise HashMismatchError(
                f"{b.label(k)}: the receiver's bits hash to {b.base_of[k]:016x}, the sender's base to "
                f"{e.base_hash:016x}: the receiver's base differs from the sender's. Nothing was written; a dense "
                "resync is needed")
        if b.dense_lanes is not None:
            dense = b.dense_lanes[0]
            got = {k: fold_lanes(host[at + 2 * r], host[at + 2 * r + 1]) for r, k in enumerate(dense)}
            at += 2 * len(dense)
            for k in dense:
                if got[k] != b.ents[k].target_hash:
                    raise HashMismatchError(f"{b.label(k)}: dense body hashes to {got[k]:016x}, target "
                                            f"{b.ents[k].target_hash:016x}. Nothing was written; a dense resync "
                                            "is needed")
                b.new_of[k] = got[k]
        if nerr:
            raise CorruptPayloadError(f"{tag}: {nerr} compact block(s) failed validation (positions out of range or "
                                      "not increasing, bit counts or padding). The bucket was undone; a dense "
                                      "resync is needed")
        for k in sorted(b.want):
            e = b.ents[k]
            got = add_lanes(b.base_of.get(k, e.base_hash), *dacc[k])
            if got != e.target_hash:
                raise HashMismatchError(
                    f"{b.label(k)}: target hash mismatch after apply ({got:016x} != {e.target_hash:016x}); the "
                    "receiver's base differs from the sender's. The bucket was undone; a dense resync is needed")
            b.new_of[k] = got
        for r, k in enumerate(b.user_lanes):
            e = b.ents[k]
            got = fold_lanes(host[at + 2 * r], host[at + 2 * r + 1])
            if got != e.target_hash:
                raise HashMismatchError(
                    f"{b.label(k)}: after codec {e.codec!r} applied its payload the range hashes to {got:016x}, "
                    f"the sender's target is {e.target_hash:016x}: the codec's apply_ does not reproduce what its "
                    "encode saw, or the receiver's base differs from the sender's. The bucket was undone; a "
                    "dense resync is needed")
            b.new_of[k] = got
        self._mark("verify")

    def _undo(self, b: _Bucket) -> None:
        """Restore, newest first, every range :meth:`_apply_sparse` wrote (bit-exact; gated like the writes, so
        nothing moves when nothing was written); forget their hashes."""
        for kind, key in reversed(b.applied):
            if kind == "user":
                undo_user_slice(b.views[key], b.undo[key], impl=self.impl)  # type: ignore[arg-type]
            elif kind == "coo":
                pos, _, undo = b.coo_recs[key]
                K.group_apply_records([b.views[key]], pos, undo, [b.ents[key].nchanged], values="new",
                                      impl=self.impl, gate=b.gate)
            else:
                gkey, run = key
                self._apply_compact(b, gkey, list(run), negate=True)
        for e in b.ents:  # running hashes of these ranges are no longer trusted
            self._drop_hash(e.name, e.start, e.length, keep_exact=False)

    def _write_dense(self, b: _Bucket) -> None:
        """Dense entries last: verified before writing, so they never need an undo copy."""
        for k in b.dense:
            b.views[k].copy_(self._dense_bits(b, k))

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
        stats.add_bucket(b.ents, bucket.numel() if isinstance(bucket, torch.Tensor) else len(bucket))
        dev = b.body.device
        if dev.type == "cuda" and b.dense:
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

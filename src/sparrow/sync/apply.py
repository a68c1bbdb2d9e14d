"""The one apply core of SparseRL-Sync: encoded slices written into their tensors in place, all or nothing.

:class:`~sparrow.sync.SyncReceiver` applies every entry of a bucket with :func:`apply_entries`; :func:`apply_payload`
(behind the public :func:`~sparrow.sync.apply_` and the built-in codecs' ``apply_``) is the same call with one
entry. Checks of the entries, versions and shapes are the callers', on the host, before this runs. Then everything
runs on the device until one verdict read: the body checksum, the base hashes that must be computed, the checks of
dense bodies, COO indices and compact block headers go into a gate that every writing kernel reads first, so an
apply failing any of them writes nothing; a compact block that fails its own validation writes nothing and the
other writes are undone; so are they when a result does not hash to its target.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Collection, Mapping, Sequence

import torch

from .._transfer import to_device
from ..kernels.common.impl import Impl
from ..kernels.sync import api as K
from ..kernels.sync.common import (BITS_DTYPE, SyncFormatError, add_lanes, bits_view, element_bits, fold_lanes,
                                   split_lanes)
from ._util import cut_runs, hash_views
from .base import CODEC_NAMES, Payload, WeightCodec, check_body_length, span_of
from .bucket import EntryMeta
from .errors import CorruptPayloadError, HashMismatchError, ShapeMismatchError
from .user_codecs import apply_user_slice, undo_user_slice

# gate flags (int32 on the device): any set -> no kernel of the apply writes
_G_BODY, _G_FORMAT, _G_BASE, _G_DENSE = 0, 1, 2, 3
_NGATE = 4
#: changes per compact decode launch unless the caller bounds them (8 bytes of scratch each)
KEEP_RECORDS = 1 << 24


def coo_records(body: torch.Tensor, nchanged: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (int32) and new bit patterns (zero-extended int32) of a COO body (length already checked)."""
    ebits = element_bits(dtype)
    pos = body[:4 * nchanged].view(torch.int32)
    vals = body[4 * nchanged:].view(BITS_DTYPE[dtype]).to(torch.int32) & ((1 << ebits) - 1)
    return pos, vals


@dataclass
class _ApplyState:
    """One all-or-nothing apply on its way through :func:`apply_entries` (``k``: index of an entry)."""

    what: str  # what is applied, as errors name it: "bucket 3", "the payload"
    ents: Sequence[EntryMeta]
    body: torch.Tensor  # uint8 entry bodies, on the views' device
    views: Sequence[torch.Tensor]  # bit views of the entries' ranges of the target tensors
    checked: Collection[int]  # entries whose target hash is verified
    check_base: Sequence[int]  # entries whose bits are hashed on the device and compared with their base hash
    gate: torch.Tensor  # int32 [_NGATE] pre-write flags
    err: torch.Tensor  # int32 [1]: compact blocks that failed validation
    dacc: torch.Tensor  # int32 [entries, 2]: hash change of the sparse built-in entries
    user: Mapping[int, tuple[WeightCodec, Payload]]  # user codec entries: the codec and its payload
    base_of: dict[int, int]  # hash of the range's bits before writing (known on the host, or read in the verdict)
    compact: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # (element size, span) -> entries
    coo: list[int] = field(default_factory=list)
    dense: list[int] = field(default_factory=list)
    coo_recs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    hash_now: list[int] = field(default_factory=list)  # entries whose current bits are hashed on the device
    base_lanes: torch.Tensor | None = None  # their lanes
    dense_lanes: tuple[list[int], torch.Tensor] | None = None  # dense entries checked: lanes of their bodies
    new_of: dict[int, int] = field(default_factory=dict)  # verified hash of the range's bits after writing
    want: set[int] = field(default_factory=set)  # sparse built-in entries verified by base + change
    user_lanes: dict[int, torch.Tensor] = field(default_factory=dict)  # full hash of checked user ranges
    applied: list[tuple[str, object]] = field(default_factory=list)  # ("coo" | "compact" | "user", key), in order
    undo: dict[int, object] = field(default_factory=dict)

    def label(self, k: int) -> str:
        e = self.ents[k]
        return f"{e.name}[{e.start}:{e.start + e.length}]" if e.name else self.what

    def undone(self) -> str:
        return f"{self.what[0].upper()}{self.what[1:]} was undone; a dense resync is needed"


def apply_entries(ents: Sequence[EntryMeta], views: Sequence[torch.Tensor], body: torch.Tensor, *, what: str,
                  checked: Collection[int] = (), base_of: Mapping[int, int] | None = None,
                  check_base: Sequence[int] = (), body_bad: torch.Tensor | None = None,
                  user: Mapping[int, tuple[WeightCodec, Payload]] | None = None, keep_records: int = KEEP_RECORDS,
                  impl: Impl = "auto", mark: Callable[[str], None] | None = None) -> dict[int, int]:
    """Write the encoded entries ``ents`` into the bit views ``views`` (``views[k]``: the ``ents[k].length``
    elements of entry ``k``'s range) in place, all or nothing; returns ``{k: hash}``, the verified hash of every
    checked entry's range after the write.

    Args:
        ents: entries whose fields the caller checked (codec, dtype, range, body ``offset`` / ``nbytes`` into
            ``body``, ``nchanged``, ``span_log2``; ``target_hash`` / ``base_hash`` where known).
        views: contiguous int16 / int32 bit views, one per entry, on one device.
        body: the entries' bodies (1-D uint8, on the views' device; compact bodies 4-byte aligned).
        what: names the apply in error messages (``"bucket 3"``, ``"the payload"``).
        checked: entries whose ``target_hash`` is verified: a dense body before it is written, a COO or compact
            entry as its base hash plus the hash change fused into the apply, a user codec's range by its full
            hash after its ``apply_``.
        base_of: hashes of checked entries' ranges before the write that the caller knows on the host.
        check_base: entries whose current bits are hashed on the device and compared with their ``base_hash``
            before anything is written. A checked COO / compact entry in neither gets its base hashed too.
        body_bad: 0-d bool device flag (the caller's body checksum failed): nothing is written when set.
        user: user codec entries: ``{k: (codec, payload)}`` (applied through ``codec.apply_``).
        keep_records: changes per compact decode launch (an entry is never split).
        impl: kernel implementation.
        mark: called with ``"check"``, ``"apply"`` and ``"verify"`` as the stages end (a timer's ``mark``).

    Raises:
        CorruptPayloadError: a body checksum, COO indices, compact block headers or blocks, or a user codec's
            ``apply_`` failed.
        HashMismatchError: a base hash or a target hash does not match.
        ValueError: an entry of a codec that is not built in and not in ``user``.

    Whatever is raised, the views hold the bits they held before. Host syncs: one (the verdict), and one more
    before the first user codec entry (its ``apply_`` runs on the host).
    """
    dev = body.device
    flags = torch.zeros(_NGATE + 1 + 2 * len(ents), dtype=torch.int32, device=dev)
    st = _ApplyState(what=what, ents=ents, body=body, views=views, checked=checked, check_base=check_base,
                     gate=flags[:_NGATE], err=flags[_NGATE:_NGATE + 1], dacc=flags[_NGATE + 1:].view(len(ents), 2),
                     user=user or {}, base_of=dict(base_of or {}))
    for k, e in enumerate(ents):
        if e.codec == "compact":
            st.compact.setdefault((e.dtype.itemsize, e.span_log2), []).append(k)
        elif e.codec == "coo":
            st.coo.append(k)
        elif e.codec == "dense":
            st.dense.append(k)
        elif k not in st.user:
            raise ValueError(f"apply_entries: entry {k} of codec {e.codec!r} needs its codec and payload in user")
    st.want = {k for k in checked if ents[k].codec in ("coo", "compact")}
    unknown = [k for k in sorted(st.want) if k not in st.base_of and k not in check_base]
    st.hash_now = [*check_base, *unknown]  # the rows compared with a base hash come first
    with torch.no_grad():
        if body_bad is not None:
            st.gate[_G_BODY:_G_BODY + 1].copy_(body_bad.view(1))
        _gate(st, impl)
        if mark is not None:
            mark("check")
        try:
            _write_sparse(st, keep_records, impl)
            if mark is not None:
                mark("apply")
            _verdict(st)  # host sync: gate, validation count, hash changes
            if mark is not None:
                mark("verify")
        except BaseException:
            _undo(st, impl)
            raise
        for k in st.dense:  # dense entries last: verified before writing, so they never need an undo copy
            st.views[k].copy_(_dense_bits(st, k))
    return st.new_of


def apply_payload(base: torch.Tensor, payload: Payload, *, verify: bool = True, impl: Impl = "auto") -> None:
    """Apply a built-in ``payload`` to ``base`` in place: :func:`apply_entries` of its one entry (see
    :func:`~sparrow.sync.apply_`, which validates ``impl`` and calls this)."""
    if not isinstance(payload, Payload):
        raise TypeError(f"expected a Payload, got {type(payload).__name__}")
    if payload.codec not in CODEC_NAMES:
        raise CorruptPayloadError(f"payload codec {payload.codec!r} is not built in ({', '.join(CODEC_NAMES)}): "
                                  "apply it with the apply_ of the WeightCodec that made it")
    if base.dtype != payload.dtype or tuple(base.shape) != tuple(payload.shape):
        raise ShapeMismatchError(f"payload is for {payload.dtype}{list(payload.shape)}, target is "
                                 f"{base.dtype}{list(base.shape)}")
    if not base.is_contiguous():
        raise ShapeMismatchError("target tensor must be contiguous to be updated in place")
    n, m = base.numel(), payload.nchanged
    check_body_length(payload.codec, payload.dtype, n, m, payload.nbytes)
    span = span_of(payload) if payload.codec == "compact" else None
    body = payload.data.to(base.device) if payload.data.device != base.device else payload.data
    entry = EntryMeta("", payload.dtype, tuple(payload.shape), 0, n, payload.codec, 0, payload.nbytes, m,
                      target_hash=payload.target_hash, span_log2=span)
    checked = (0,) if verify and payload.target_hash is not None else ()
    apply_entries([entry], [bits_view(base.detach())], body, what="the payload", checked=checked, impl=impl)


# ---------------------------------------------------------------------------------------------------
# the steps of apply_entries
# ---------------------------------------------------------------------------------------------------

def _lanes_of(hashes: Sequence[int], dev: torch.device) -> torch.Tensor:
    """int64 [N, 2] device lanes of 64-bit host hashes (non-blocking upload)."""
    return to_device(torch.tensor([v for h in hashes for v in split_lanes(h)], dtype=torch.int64).view(-1, 2), dev)


def _words(st: _ApplyState) -> torch.Tensor:
    return st.body.view(torch.int32) if st.body.numel() else torch.zeros(0, dtype=torch.int32, device=st.body.device)


def _entries(st: _ApplyState, idx: Sequence[int]) -> list[tuple[int, int, int, int]]:
    return [(st.ents[k].offset // 4, st.ents[k].nbytes // 4, st.ents[k].length, st.ents[k].nchanged) for k in idx]


def _dense_bits(st: _ApplyState, k: int) -> torch.Tensor:
    e = st.ents[k]
    return st.body[e.offset:e.offset + e.nbytes].view(BITS_DTYPE[e.dtype])


def _gate(st: _ApplyState, impl: Impl) -> None:
    """The pre-write checks that need the device, each into a gate flag (no host sync): base hashes of the
    ranges not known on the host, dense bodies against their target hashes, COO indices and compact block
    headers."""
    dev = st.body.device
    if st.hash_now:
        lanes = hash_views([st.views[k] for k in st.hash_now], [st.ents[k].start for k in st.hash_now], impl=impl)
        st.base_lanes = lanes
        if st.check_base:
            want = _lanes_of([st.ents[k].base_hash for k in st.check_base], dev)
            st.gate[_G_BASE:_G_BASE + 1].copy_((lanes[:len(st.check_base)] != want).any().view(1))
    dense = [k for k in st.dense if k in st.checked]
    if dense:
        lanes = hash_views([_dense_bits(st, k) for k in dense], [st.ents[k].start for k in dense], impl=impl)
        st.dense_lanes = (dense, lanes)
        want = _lanes_of([st.ents[k].target_hash for k in dense], dev)
        st.gate[_G_DENSE:_G_DENSE + 1].copy_((lanes != want).any().view(1))
    for k in st.coo:
        e = st.ents[k]
        pos, vals = coo_records(st.body[e.offset:e.offset + e.nbytes], e.nchanged, e.dtype)
        st.coo_recs[k] = (pos, vals, torch.empty_like(pos))
        fmt = st.gate[_G_FORMAT:_G_FORMAT + 1]
        torch.maximum(fmt, K.positions_bad(pos, e.length).view(1).to(torch.int32), out=fmt)
    for (esize, span), idx in st.compact.items():
        try:
            K.check_compact_headers(_words(st), _entries(st, idx), ebits=8 * esize, span_log2=span, gate=st.gate,
                                    gate_slot=_G_FORMAT, impl=impl)
        except SyncFormatError as exc:
            raise CorruptPayloadError(f"{st.what}: {exc}") from None


def _compact_runs(st: _ApplyState, idx: list[int], keep_records: int) -> list[list[int]]:
    """The compact entries of a group in runs of at most ``keep_records`` changes (decode scratch)."""
    return [idx[i:j] for i, j in cut_runs([st.ents[k].nchanged for k in idx], keep_records)]


def _apply_compact(st: _ApplyState, key: tuple[int, int], run: list[int], negate: bool, impl: Impl) -> None:
    _, span = key
    hashed = not negate and any(k in st.want for k in run)
    contiguous = run == list(range(run[0], run[0] + len(run)))
    hacc = None
    if hashed:  # the kernel adds the hash changes into the rows of st.dacc (a view when the run is contiguous)
        hacc = st.dacc[run[0]:run[0] + len(run)] if contiguous else K.hash_zeros(len(run), st.body.device)
    K.apply_compact([st.views[k] for k in run], _words(st), _entries(st, run), span_log2=span, gate=st.gate,
                    err=st.err if not negate else torch.zeros_like(st.err), check_headers=False, negate=negate,
                    hash_starts=[st.ents[k].start for k in run], hash_out=hacc, impl=impl)
    if hacc is not None and not contiguous:
        st.dacc[torch.tensor(run)] = hacc


def _write_sparse(st: _ApplyState, keep_records: int, impl: Impl) -> None:
    """Write the COO entries and the compact groups (gated on the device: nothing is written when a pre-write
    check failed; hash changes fused in), then the user codec entries, recording in ``st.applied`` what
    :func:`_undo` must restore."""
    for k in st.coo:
        pos, vals, undo = st.coo_recs[k]
        hashed = k in st.want
        K.group_apply_records([st.views[k]], pos, vals, [st.ents[k].nchanged], values="new", impl=impl,
                              hash_starts=[st.ents[k].start], hash_out=st.dacc[k:k + 1] if hashed else None,
                              gate=st.gate, undo_out=undo)
        st.applied.append(("coo", k))
    for key, idx in st.compact.items():
        for run in _compact_runs(st, idx, keep_records):
            _apply_compact(st, key, run, False, impl)
            st.applied.append(("compact", (key, tuple(run))))
    if st.user:
        if any(st.gate.tolist()):  # host sync: a user codec's apply_ runs on the host, only past the gate
            return
        for k, (codec, p) in st.user.items():
            e = st.ents[k]
            st.undo[k] = apply_user_slice(codec, st.views[k], e.dtype, p, st.label(k), impl=impl)
            st.applied.append(("user", k))
            if k in st.checked:
                st.user_lanes[k] = K.hash_bits(st.views[k], e.start, impl=impl)


def _verdict(st: _ApplyState) -> None:
    """One host sync for every device-side result; raises what failed (the caller undoes what was written:
    nothing when a gate flag is set)."""
    rows = [st.gate, st.err, st.dacc.reshape(-1)]
    if st.base_lanes is not None:
        rows.append(st.base_lanes.reshape(-1).to(torch.int32))
    if st.dense_lanes is not None:
        rows.append(st.dense_lanes[1].reshape(-1).to(torch.int32))
    rows += [ln.reshape(-1).to(torch.int32) for ln in st.user_lanes.values()]
    host = torch.cat(rows).tolist()  # the verdict sync
    gate, nerr = host[:_NGATE], host[_NGATE]
    at = _NGATE + 1
    dacc = [(host[at + 2 * k], host[at + 2 * k + 1]) for k in range(len(st.ents))]
    at += 2 * len(st.ents)
    if gate[_G_BODY]:
        raise CorruptPayloadError(f"{st.what}: body checksum mismatch. Nothing was written")
    if gate[_G_FORMAT]:
        raise CorruptPayloadError(f"{st.what}: a body failed validation (COO indices out of range or not strictly "
                                  "increasing, or compact block headers that do not describe the body). Nothing was "
                                  "written")
    if st.base_lanes is not None:
        for r, k in enumerate(st.hash_now):
            st.base_of[k] = fold_lanes(host[at + 2 * r], host[at + 2 * r + 1])
        at += 2 * len(st.hash_now)
    if gate[_G_BASE]:
        k = next(k for k in st.check_base if st.base_of[k] != st.ents[k].base_hash)
        raise HashMismatchError(
            f"{st.label(k)}: the receiver's bits hash to {st.base_of[k]:016x}, the sender's base to "
            f"{st.ents[k].base_hash:016x}: the receiver's base differs from the sender's. Nothing was written; a "
            "dense resync is needed")
    if st.dense_lanes is not None:
        dense = st.dense_lanes[0]
        got = {k: fold_lanes(host[at + 2 * r], host[at + 2 * r + 1]) for r, k in enumerate(dense)}
        at += 2 * len(dense)
        for k in dense:
            if got[k] != st.ents[k].target_hash:
                raise HashMismatchError(f"{st.label(k)}: dense body hashes to {got[k]:016x}, target "
                                        f"{st.ents[k].target_hash:016x}. Nothing was written; a dense resync "
                                        "is needed")
            st.new_of[k] = got[k]
    if nerr:
        raise CorruptPayloadError(f"{st.what}: {nerr} compact block(s) failed validation (positions out of range or "
                                  f"not increasing, bit counts or padding). {st.undone()}")
    for k in sorted(st.want):
        e = st.ents[k]
        got = add_lanes(st.base_of.get(k, e.base_hash), *dacc[k])
        if got != e.target_hash:
            raise HashMismatchError(
                f"{st.label(k)}: target hash mismatch after apply ({got:016x} != {e.target_hash:016x}); the "
                f"target's base differs from the sender's. {st.undone()}")
        st.new_of[k] = got
    for r, k in enumerate(st.user_lanes):
        e = st.ents[k]
        got = fold_lanes(host[at + 2 * r], host[at + 2 * r + 1])
        if got != e.target_hash:
            raise HashMismatchError(
                f"{st.label(k)}: after codec {e.codec!r} applied its payload the range hashes to {got:016x}, "
                f"the sender's target is {e.target_hash:016x}: the codec's apply_ does not reproduce what its "
                f"encode saw, or the receiver's base differs from the sender's. {st.undone()}")
        st.new_of[k] = got


def _undo(st: _ApplyState, impl: Impl) -> None:
    """Restore, newest first, every range :func:`_write_sparse` wrote (bit-exact; gated like the writes, so
    nothing moves when nothing was written)."""
    for kind, key in reversed(st.applied):
        if kind == "user":
            undo_user_slice(st.views[key], st.undo[key], impl=impl)  # type: ignore[arg-type,index]
        elif kind == "coo":
            pos, _, undo = st.coo_recs[key]  # type: ignore[index]
            K.group_apply_records([st.views[key]], pos, undo, [st.ents[key].nchanged], values="new",  # type: ignore
                                  impl=impl, gate=st.gate)
        else:
            gkey, run = key  # type: ignore[misc]
            _apply_compact(st, gkey, list(run), True, impl)


__all__ = ["KEEP_RECORDS", "apply_entries", "apply_payload", "coo_records"]

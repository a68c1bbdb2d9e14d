"""The codecs (dense, COO, compact, auto), the slice-level encode / decode pipeline they share with
:class:`~sparrow.sync.SyncSender` / :class:`~sparrow.sync.SyncReceiver`, and the public
:func:`encode` / :func:`apply_`.

Everything works on bit patterns (int16 views of bf16 / fp16, int32 views of fp32): the changed set
is ``old_bits != new_bits``, values are raw bit patterns or bit-pattern differences, never floats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ..kernels.common.impl import Impl
from ..kernels.sync import api as K
from ..kernels.sync.common import (BITS_DTYPE, SyncFormatError, add_lanes, bits_view, combine_hash, element_bits,
                                   fold_lanes)
from ._util import as_u8, public_impl
from .base import CODEC_NAMES, Payload, WeightCodec, check_body_length
from .errors import CorruptPayloadError, HashMismatchError, ShapeMismatchError

#: ``auto``: above this fraction of changed elements the slice goes dense without trying compact.
AUTO_DENSE_FRACTION = 0.75
#: Names of the built-in codecs, which take the fused, bucketed fast path of ``SyncSender``.
BUILTIN_CODECS = ("auto", "compact", "coo", "dense")


# ---------------------------------------------------------------------------------------------------
# slice-level pipeline
# ---------------------------------------------------------------------------------------------------

@dataclass
class SliceJob:
    """One slice to encode: flat bit views ``old`` / ``new`` (same dtype / length / device) and the
    position of the slice's first element in its tensor (hash positions are tensor positions)."""

    old: torch.Tensor
    new: torch.Tensor
    start: int = 0


@dataclass
class EncodedSlice:
    """One encoded slice as it goes into a bucket entry."""

    codec: str  # built-in payload codec, or the user WeightCodec's name
    nchanged: int
    body: torch.Tensor  # uint8
    target_hash: int | None  # hash of the slice's new bits at its tensor positions
    sizes: dict[str, int] = field(default_factory=dict)  # body bytes of the codecs considered
    payload: dict | None = None  # user codecs: the payload's own fields (see EntryMeta.payload)


def dense_nbytes(bits: torch.Tensor) -> int:
    return bits.numel() * bits.element_size()


def coo_nbytes(nchanged: int, ebits: int) -> int:
    return nchanged * (4 + ebits // 8)


def _coo_body(pos: torch.Tensor, newvals: torch.Tensor, bits_dtype: torch.dtype) -> torch.Tensor:
    vals = newvals.to(torch.int16) if bits_dtype == torch.int16 else newvals
    return torch.cat([as_u8(pos), as_u8(vals.contiguous())])


def _mark(timer, name: str) -> None:
    if timer is not None:
        timer.mark(name)


def encode_slices(jobs: Sequence[SliceJob], codec: str, *, with_hash: bool = True, update_old: bool = False,
                  copy_dense: bool = True, impl: Impl = "auto", base_hashes: Sequence[int | None] | None = None,
                  max_group_changes: int | None = None, timer=None) -> list[EncodedSlice]:
    """Encode a batch of slices with the built-in codec ``codec`` ("dense" | "coo" | "compact" | "auto").

    Pipeline (Triton: one launch per stage per bit width, whatever the number of slices):

    1. **scan** all slices (change counts, 1-bit masks; the full hash of the new bits only when it is
       needed, see below); host sync 1 reads the counts;
    2. per group of consecutive slices holding at most ``max_group_changes`` changes (bounds the
       scratch: ~40 bytes per change): **collect** the records (+ snapshot update, + hash change),
       **pack** the compact bodies;
    3. host sync 2 reads every packed size and hash change at once.

    Target hashes: with ``base_hashes[k]`` (the hash of ``jobs[k].old``, e.g. the sender's running hash of
    its snapshot) the target hash is ``base + (hash change over the changed elements)``, fused into the
    collect pass (O(changes)); slices without a base hash, and slices sent dense, get the full hash of
    their new bits (O(elements)). ``update_old`` leaves every ``old`` equal to its ``new`` (only changed
    elements are written). ``copy_dense=False`` lets dense bodies alias ``new``. ``timer`` (a
    :class:`~sparrow.sync.stats.StageTimer`) gets a mark after each stage.

    Raises:
        ValueError: ``codec`` is not a built-in codec name, or ``base_hashes`` has the wrong length.
    """
    if codec not in (*CODEC_NAMES, "auto"):
        raise ValueError(f"unknown codec {codec!r}; expected one of dense, coo, compact, auto")
    if not jobs:
        return []
    if base_hashes is not None and len(base_hashes) != len(jobs):
        raise ValueError(f"base_hashes must have one entry per job: {len(base_hashes)} for {len(jobs)} jobs")
    enc = _Encoding(jobs, codec, with_hash, base_hashes, timer)
    _scan(enc, impl)
    _read_counts(enc)  # host sync 1
    _plan(enc)
    _hash_dense_slices(enc)
    cap = max_group_changes if max_group_changes is not None else 1 << 62
    for eb, idx in enc.parts.items():
        _collect_and_pack(enc, eb, idx, cap, update_old)
    _read_sizes_and_hashes(enc)  # host sync 2
    result = [_finish_slice(enc, k, copy_dense, update_old) for k in range(len(jobs))]
    _mark(timer, "finish")
    return result


@dataclass
class _Encoding:
    """What the steps of one :func:`encode_slices` call hand on to each other (per job index ``k``)."""

    jobs: Sequence[SliceJob]
    codec: str
    with_hash: bool
    base_hashes: Sequence[int | None] | None
    timer: object
    parts: dict[int, list[int]] = field(default_factory=dict)  # element size -> job indices
    scan_hash: dict[int, bool] = field(default_factory=dict)  # element size -> the scan hashes new bits
    scans: dict[int, K.GroupScan] = field(default_factory=dict)
    counts: list[int] = field(default_factory=list)
    hashes: list[int | None] = field(default_factory=list)  # target hashes, as they become known
    plan: list[str] = field(default_factory=list)  # codec per job before auto's final choice
    full_lanes: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)  # dense: full hash lanes
    records: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    packed: list[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    deltas: list[tuple[list[int], torch.Tensor]] = field(default_factory=list)  # hash-change accumulators
    words_of: dict[int, torch.Tensor] = field(default_factory=dict)  # compact bodies (int32 words)


def _scan(enc: _Encoding, impl: Impl) -> None:
    """Step 1: group the jobs by bit width and launch the diff scans (no host sync)."""
    jobs = enc.jobs
    for k, j in enumerate(jobs):
        enc.parts.setdefault(j.old.element_size(), []).append(k)
    incremental = [enc.with_hash and enc.base_hashes is not None and enc.base_hashes[k] is not None
                   for k in range(len(jobs))]
    # full hash in the scan only for slices that cannot be updated incrementally (e.g. a first sync / anchor)
    enc.scan_hash = {eb: enc.with_hash and not all(incremental[k] for k in idx) for eb, idx in enc.parts.items()}
    enc.scans = {eb: K.group_diff_scan([jobs[k].old for k in idx], [jobs[k].new for k in idx],
                                       hash_starts=[jobs[k].start for k in idx] if enc.scan_hash[eb] else None,
                                       impl=impl)
                 for eb, idx in enc.parts.items()}
    _mark(enc.timer, "scan")


def _read_counts(enc: _Encoding) -> None:
    """Host sync 1: the change count of every slice (and the full hash lanes where the scan made them)."""
    stat = [enc.scans[eb].counts.to(torch.int64) for eb in enc.parts]
    stat += [enc.scans[eb].hashes.reshape(-1) for eb in enc.parts if enc.scan_hash[eb]]
    host = torch.cat(stat).tolist()  # host sync 1: change counts (and full hash lanes where computed)
    enc.counts = [0] * len(enc.jobs)
    enc.hashes = [None] * len(enc.jobs)
    at = 0
    for idx in enc.parts.values():
        for k in idx:
            enc.counts[k] = int(host[at])
            at += 1
    for eb, idx in enc.parts.items():
        if enc.scan_hash[eb]:
            for k in idx:
                enc.hashes[k] = fold_lanes(host[at], host[at + 1])
                at += 2
    _mark(enc.timer, "sync_counts")


def _plan(enc: _Encoding) -> None:
    """Step 2a: each slice's codec; ``auto`` sends a slice dense above ``AUTO_DENSE_FRACTION`` changed."""
    enc.plan = []
    for j, m in zip(enc.jobs, enc.counts):
        want = enc.codec
        if enc.codec == "auto":
            want = "dense" if m > AUTO_DENSE_FRACTION * j.old.numel() else "compact"
        enc.plan.append(want)


def _hash_dense_slices(enc: _Encoding) -> None:
    """Step 2b: dense slices whose target hash is still unknown get the full hash of their new bits (they
    cost O(n) anyway); lanes stay on the device until host sync 2."""
    jobs = enc.jobs
    full_idx = [k for k in range(len(jobs)) if enc.with_hash and enc.hashes[k] is None and enc.plan[k] == "dense"]
    for eb in enc.parts:
        idx = [k for k in full_idx if jobs[k].old.element_size() == eb]
        if idx:
            enc.full_lanes.append((idx, K.group_hash_bits([jobs[k].new for k in idx], [jobs[k].start for k in idx],
                                                          impl=enc.scans[eb].impl)))


def _runs(idx: list[int], plan: list[str], cnts: list[int], cap: int) -> list[tuple[int, int]]:
    """Runs ``[a, b)`` of consecutive non-dense slices of ``idx``, cut so that a run holds at most ``cap``
    changes (a run holds at least one slice)."""
    runs, a = [], 0
    while a < len(idx):
        if plan[idx[a]] == "dense":
            a += 1
            continue
        b, tot = a, 0
        while b < len(idx) and plan[idx[b]] != "dense" and (b == a or tot + cnts[b] <= cap):
            tot += cnts[b]
            b += 1
        runs.append((a, b))
        a = b
    return runs


def _collect_and_pack(enc: _Encoding, eb: int, idx: list[int], cap: int, update_old: bool) -> None:
    """Step 2c, for the slices ``idx`` of element size ``eb``: per run, collect the records (+ snapshot
    update, + hash change), then pack the compact ones."""
    jobs = enc.jobs
    olds = [jobs[k].old for k in idx]
    news = [jobs[k].new for k in idx]
    cnts = [enc.counts[k] for k in idx]
    starts = [jobs[k].start for k in idx]
    # hash changes only where the scan did not hash the new bits in full (all slices incremental)
    dacc = K.hash_zeros(len(idx), olds[0].device) if enc.with_hash and not enc.scan_hash[eb] else None
    values = "new" if enc.codec == "coo" else "delta"
    for a, b in _runs(idx, enc.plan, cnts, cap):
        pos, val, rec_off = K.group_diff_collect(olds, news, enc.scans[eb], cnts, values=values,
                                                 update_old=update_old, hash_starts=starts, hash_out=dacc,
                                                 sub=(a, b))
        for k, off in zip(idx[a:b], rec_off):
            enc.records[k] = (pos[off:off + enc.counts[k]], val[off:off + enc.counts[k]])
        _mark(enc.timer, "collect")
        _pack_run(enc, eb, idx[a:b], pos, val)
        _mark(enc.timer, "pack")
    if dacc is not None:
        enc.deltas.append((idx, dacc))


def _pack_run(enc: _Encoding, eb: int, sub_idx: list[int], pos: torch.Tensor, val: torch.Tensor) -> None:
    """Compact bodies of the compact slices of one collected run (one launch; sizes read at host sync 2)."""
    cidx = [k for k in sub_idx if enc.plan[k] == "compact"]
    if not cidx:
        return
    if len(cidx) == len(sub_idx):
        cpos, cval = pos, val
    else:
        cpos = torch.cat([enc.records[k][0] for k in cidx])
        cval = torch.cat([enc.records[k][1] for k in cidx])
    out, wbase, nwords = K.group_pack_compact(cpos, cval, [enc.counts[k] for k in cidx], 8 * eb,
                                              impl=enc.scans[eb].impl)
    enc.packed.append((cidx, out, wbase, nwords))


def _read_sizes_and_hashes(enc: _Encoding) -> None:
    """Host sync 2: packed sizes, hash changes and full hashes of dense slices, all at once."""
    tail = [torch.stack([b, n], 1).reshape(-1) for _, _, b, n in enc.packed]
    tail += [d.to(torch.int64).reshape(-1) for _, d in enc.deltas]
    tail += [ln.reshape(-1) for _, ln in enc.full_lanes]
    host = torch.cat(tail).tolist() if tail else []  # host sync 2
    _mark(enc.timer, "sync_sizes")
    at = 0
    for cidx, out, _, _ in enc.packed:
        for k in cidx:
            enc.words_of[k] = out[host[at]: host[at] + host[at + 1]]
            at += 2
    for idx, _ in enc.deltas:
        for k in idx:
            if enc.plan[k] != "dense":  # dense slices: full hash (full_lanes)
                enc.hashes[k] = add_lanes(int(enc.base_hashes[k]), host[at], host[at + 1])  # type: ignore[index]
            at += 2
    for idx, _ in enc.full_lanes:
        for k in idx:
            enc.hashes[k] = fold_lanes(host[at], host[at + 1])
            at += 2


def _finish_slice(enc: _Encoding, k: int, copy_dense: bool, update_old: bool) -> EncodedSlice:
    """Step 3: slice ``k``'s codec (``auto``: the smallest body, ties to compact) and body."""
    j, m = enc.jobs[k], enc.counts[k]
    ebits = 8 * j.old.element_size()
    sizes = {"dense": dense_nbytes(j.new), "coo": coo_nbytes(m, ebits)}
    kind = enc.plan[k]
    if kind == "compact":
        sizes["compact"] = 4 * enc.words_of[k].numel()
        if enc.codec == "auto":
            kind = min(("compact", "coo", "dense"), key=lambda c: sizes[c])  # ties: compact first
    if kind == "compact":
        body = as_u8(enc.words_of[k])
    elif kind == "coo":
        pos, val = enc.records[k]
        if enc.codec != "coo":  # auto chose COO after packing: new values at the changed positions
            val = j.new[pos.to(torch.int64)].to(torch.int32) & ((1 << ebits) - 1)
        body = _coo_body(pos, val, j.new.dtype)
    else:
        body = as_u8(j.new).clone() if copy_dense else as_u8(j.new)
        if update_old:
            j.old.copy_(j.new)
    return EncodedSlice(kind, int(m), body, enc.hashes[k], sizes)


@dataclass
class Decoded:
    """A validated (or validation-deferred) slice body: either all new bits, or records."""

    codec: str
    new_bits: torch.Tensor | None = None
    pos: torch.Tensor | None = None
    val: torch.Tensor | None = None
    bad: torch.Tensor | None = None  # deferred validation flag (0-d bool) or None


def decode_slice(codec: str, body: torch.Tensor, n: int, dtype: torch.dtype, nchanged: int, *,
                 defer_check: bool = False, impl: Impl = "auto") -> Decoded:
    """Decode one slice body. Raises :class:`CorruptPayloadError` for any invalid body (length, indices
    out of range or unordered, bad compact fields). With ``defer_check`` device-side checks are returned
    in ``Decoded.bad`` instead (no host sync); the records must not be used until it is checked."""
    ebits = element_bits(dtype)
    bdt = BITS_DTYPE[dtype]
    try:
        check_body_length(codec, dtype, n, nchanged, body.numel())
        if codec == "dense":
            return Decoded("dense", new_bits=body.view(bdt))
        if codec == "coo":
            pos = body[: 4 * nchanged].view(torch.int32)
            vals = body[4 * nchanged:].view(bdt).to(torch.int32) & ((1 << ebits) - 1)
            bad = K.positions_bad(pos, n)
            if not defer_check and bool(bad):
                raise SyncFormatError(f"COO indices out of range [0, {n}) or not strictly increasing")
            return Decoded("coo", pos=pos, val=vals, bad=bad if defer_check else None)
        if codec == "compact":
            words = body.view(torch.int32)
            if defer_check:
                pos, val, bad = K.unpack_compact_deferred(words, n, ebits, nchanged, impl=impl)
                return Decoded("compact", pos=pos, val=val, bad=bad)
            pos, val = K.unpack_compact(words, n, ebits, nchanged, impl=impl)
            return Decoded("compact", pos=pos, val=val)
    except CorruptPayloadError:
        raise
    except SyncFormatError as exc:
        raise CorruptPayloadError(f"corrupt {codec} body: {exc}") from None
    raise CorruptPayloadError(f"unknown codec {codec!r}")


def apply_decoded(bits: torch.Tensor, dec: Decoded, *, keep_undo: bool = True, impl: Impl = "auto",
                  hash_start: int | None = None, hash_out: torch.Tensor | None = None):
    """Write a validated decode into the flat bit view ``bits``; returns what :func:`undo_decoded` needs.
    ``hash_out`` (int32 ``[1, 2]``, sparse codecs only) receives the hash change of the written elements
    at positions ``hash_start + i``."""
    if dec.codec == "dense":
        if hash_out is not None:
            raise ValueError("apply_decoded: hash_out is not supported for dense bodies (hash the body)")
        undo = bits.clone() if keep_undo else None
        bits.copy_(dec.new_bits)
        return undo
    if dec.codec == "coo":
        undo = None
        if keep_undo:
            undo = bits[dec.pos.to(torch.int64)].to(torch.int32) & ((1 << (8 * bits.element_size())) - 1)
        K.apply_records(bits, dec.pos, dec.val, values="new", impl=impl, hash_start=hash_start, hash_out=hash_out)
        return undo
    K.apply_records(bits, dec.pos, dec.val, values="delta", impl=impl, hash_start=hash_start, hash_out=hash_out)
    return None


def undo_decoded(bits: torch.Tensor, dec: Decoded, undo, *, impl: Impl = "auto") -> None:
    """Restore the bits :func:`apply_decoded` overwrote (bit-exact)."""
    if dec.codec == "dense":
        bits.copy_(undo)
    elif dec.codec == "coo":
        K.apply_records(bits, dec.pos, undo, values="new", impl=impl)
    else:
        K.apply_records(bits, dec.pos, dec.val, values="delta", negate=True, impl=impl)


# ---------------------------------------------------------------------------------------------------
# public codecs
# ---------------------------------------------------------------------------------------------------

def _check_pair(base: torch.Tensor, new: torch.Tensor) -> None:
    element_bits(base.dtype)
    if base.dtype != new.dtype:
        raise TypeError(f"dtype mismatch: base {base.dtype}, new {new.dtype}")
    if base.shape != new.shape:
        raise ValueError(f"shape mismatch: base {tuple(base.shape)}, new {tuple(new.shape)}")
    if base.device != new.device:
        raise ValueError(f"device mismatch: base {base.device}, new {new.device}")


def _encode(codec: str, base: torch.Tensor, new: torch.Tensor, with_hash: bool, impl: Impl) -> Payload:
    _check_pair(base, new)
    b = bits_view(base.detach().contiguous())
    x = bits_view(new.detach().contiguous())
    (s,) = encode_slices([SliceJob(b, x, 0)], codec, with_hash=with_hash, impl=impl)
    return Payload(codec=s.codec, dtype=base.dtype, shape=tuple(base.shape), nchanged=s.nchanged, data=s.body,
                   target_hash=s.target_hash, extra={"sizes": s.sizes})


def apply_payload(base: torch.Tensor, payload: Payload, *, verify: bool = True, impl: Impl = "auto") -> None:
    """Apply a built-in ``payload`` to ``base`` in place (see :func:`apply_`)."""
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
    body = payload.data.to(base.device) if payload.data.device != base.device else payload.data
    bits = bits_view(base.detach())
    with torch.no_grad():
        dec = decode_slice(payload.codec, body, bits.numel(), base.dtype, payload.nchanged, impl=impl)
        check = verify and payload.target_hash is not None
        undo = apply_decoded(bits, dec, keep_undo=check, impl=impl)
        if check:
            got = combine_hash(K.hash_bits(bits, 0, impl=impl))
            if got != payload.target_hash:
                undo_decoded(bits, dec, undo, impl=impl)
                raise HashMismatchError(f"target hash mismatch after apply ({got:016x} != "
                                        f"{payload.target_hash:016x}): the base was not the sender's base; "
                                        "the tensor was restored, ask for a dense resync")


class _BuiltinCodec(WeightCodec):
    """A built-in codec as a :class:`WeightCodec`. ``with_hash``: store the target hash in each payload;
    ``verify``: check it on apply; ``impl``: kernel implementation (``None``: deprecated ``"auto"``).
    Given to :class:`~sparrow.sync.SyncSender`, only its name counts (the sender has its own
    ``with_hash`` / ``impl``)."""

    name = "auto"

    def __init__(self, *, with_hash: bool = True, verify: bool = True, impl: Impl = "auto") -> None:
        self.with_hash = with_hash
        self.verify = verify
        self.impl = public_impl(impl)

    def encode(self, base: torch.Tensor, new: torch.Tensor) -> Payload:
        return _encode(self.name, base, new, self.with_hash, self.impl)

    def apply_(self, base: torch.Tensor, payload: Payload) -> None:
        apply_payload(base, payload, verify=self.verify, impl=self.impl)


class DenseCodec(_BuiltinCodec):
    """All new bit patterns (``numel * element_size`` bytes)."""

    name = "dense"


class CooCodec(_BuiltinCodec):
    """int32 positions + new bit patterns of the changed elements (``m * (4 + element_size)`` bytes)."""

    name = "coo"


class CompactCodec(_BuiltinCodec):
    """Elias-Fano positions (per block of 1024 changes) + zig-zag bit-pattern deltas packed at a per-block
    width with escapes (format and measured sizes: ``docs/sync.md``)."""

    name = "compact"


class AutoCodec(_BuiltinCodec):
    """Smallest of compact / COO / dense per tensor slice; dense when most elements changed."""

    name = "auto"


_REGISTRY: dict[str, type[_BuiltinCodec]] = {c.name: c for c in (DenseCodec, CooCodec, CompactCodec, AutoCodec)}


def builtin_codec_name(codec: object) -> str | None:
    """``codec``'s name if it is a built-in codec (a name in :data:`BUILTIN_CODECS`, or an instance of one of
    the built-in classes under its own name), else ``None`` (a user codec, or not a codec at all)."""
    if isinstance(codec, str):
        return codec if codec in _REGISTRY else None
    if isinstance(codec, _BuiltinCodec) and codec.name in _REGISTRY:
        return codec.name
    return None


def get_codec(codec: str | WeightCodec, **kwargs) -> WeightCodec:
    """A codec instance from a name (``"dense"``, ``"coo"``, ``"compact"``, ``"auto"``) or an instance."""
    if isinstance(codec, WeightCodec):
        return codec
    try:
        return _REGISTRY[codec](**kwargs)
    except KeyError:
        raise ValueError(f"unknown codec {codec!r}; expected one of {sorted(_REGISTRY)}") from None


def encode(base: torch.Tensor, new: torch.Tensor, codec: str | WeightCodec = "auto", *,
           with_hash: bool = True, impl: Impl = "auto") -> Payload:
    """Encode the change from ``base`` to ``new`` (same shape, dtype in {bf16, fp16, fp32}, device).

    Neither tensor is modified. ``codec``: ``"auto"`` (default: smallest of compact / COO / dense),
    ``"compact"``, ``"coo"``, ``"dense"`` or a :class:`WeightCodec` instance. ``with_hash`` stores the
    hash of ``new``'s bits so :func:`apply_` can verify the result; ``impl``: kernel implementation
    (``None``: deprecated spelling of ``"auto"``). Raises ``TypeError`` (dtype) or ``ValueError`` (shape /
    device mismatch, unknown codec, bad ``impl``).
    """
    impl = public_impl(impl)
    if isinstance(codec, WeightCodec):
        return codec.encode(base, new)
    if codec not in _REGISTRY:
        raise ValueError(f"unknown codec {codec!r}; expected one of {sorted(_REGISTRY)}")
    return _encode(codec, base, new, with_hash, impl)


def apply_(base: torch.Tensor, payload: Payload, *, verify: bool = True, impl: Impl = "auto") -> None:
    """Apply a built-in codec's ``payload`` to ``base`` in place, bit-exactly (a user codec's payload goes
    through that codec's own ``apply_``).

    ``base``: contiguous tensor of the payload's dtype and shape holding the encoder's base bits. ``impl``:
    kernel implementation (``None``: deprecated spelling of ``"auto"``).
    Raises :class:`ShapeMismatchError`, :class:`CorruptPayloadError` (invalid body / indices, or not a
    built-in payload; checked before any write) or :class:`HashMismatchError` (``verify`` and the result's
    hash differs from the payload's target hash; the write is undone first); ``ValueError`` (bad ``impl``).
    ``base`` is unchanged when an error is raised.
    """
    apply_payload(base, payload, verify=verify, impl=public_impl(impl))


def position_entropy_bits(n: int, m: int) -> float:
    """log2 C(n, m): bits needed to name which ``m`` of ``n`` positions changed (the positions' bound)."""
    if m <= 0 or m >= n:
        return 0.0
    return (math.lgamma(n + 1) - math.lgamma(m + 1) - math.lgamma(n - m + 1)) / math.log(2)


def empirical_entropy_bits(values: torch.Tensor) -> float:
    """Total order-0 entropy (bits) of a tensor of integer symbols (e.g. the bit-pattern deltas)."""
    if values.numel() == 0:
        return 0.0
    _, counts = torch.unique(values.cpu(), return_counts=True)
    p = counts.double() / values.numel()
    return float(-(counts.double() * torch.log2(p)).sum())


__all__ = ["AUTO_DENSE_FRACTION", "BUILTIN_CODECS", "AutoCodec", "CompactCodec", "CooCodec", "DenseCodec", "apply_",
           "builtin_codec_name", "encode", "empirical_entropy_bits", "get_codec", "position_entropy_bits"]

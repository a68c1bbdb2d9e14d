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

from ..kernels.sync import api as K
from ..kernels.sync.common import (BITS_DTYPE, SyncFormatError, add_lanes, bits_view, combine_hash, element_bits,
                                   fold_lanes)
from ._util import as_u8
from .base import CODEC_NAMES, Payload, WeightCodec, check_body_length
from .errors import CorruptPayloadError, HashMismatchError, ShapeMismatchError

#: ``auto``: above this fraction of changed elements the slice goes dense without trying compact.
AUTO_DENSE_FRACTION = 0.75


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
    codec: str
    nchanged: int
    body: torch.Tensor  # uint8
    target_hash: int | None
    sizes: dict[str, int] = field(default_factory=dict)  # body bytes of the codecs considered


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
                  copy_dense: bool = True, impl: str | None = None, base_hashes: Sequence[int | None] | None = None,
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
    """
    if codec not in (*CODEC_NAMES, "auto"):
        raise ValueError(f"unknown codec {codec!r}; expected one of dense, coo, compact, auto")
    if not jobs:
        return []
    if base_hashes is not None and len(base_hashes) != len(jobs):
        raise ValueError("base_hashes must have one entry per job")
    dev = jobs[0].old.device
    parts: dict[int, list[int]] = {}
    for k, j in enumerate(jobs):
        parts.setdefault(j.old.element_size(), []).append(k)
    incremental = [with_hash and base_hashes is not None and base_hashes[k] is not None for k in range(len(jobs))]
    # full hash in the scan only for slices that cannot be updated incrementally (e.g. a first sync / anchor)
    scan_hash = {eb: with_hash and not all(incremental[k] for k in idx) for eb, idx in parts.items()}
    scans = {eb: K.group_diff_scan([jobs[k].old for k in idx], [jobs[k].new for k in idx],
                                   hash_starts=[jobs[k].start for k in idx] if scan_hash[eb] else None, impl=impl)
             for eb, idx in parts.items()}
    _mark(timer, "scan")
    stat = [scans[eb].counts.to(torch.int64) for eb in parts]
    stat += [scans[eb].hashes.reshape(-1) for eb in parts if scan_hash[eb]]
    host = torch.cat(stat).tolist()  # host sync 1: change counts (and full hash lanes where computed)
    counts = [0] * len(jobs)
    hashes: list[int | None] = [None] * len(jobs)
    at = 0
    for eb, idx in parts.items():
        for k in idx:
            counts[k] = int(host[at])
            at += 1
    for eb, idx in parts.items():
        if scan_hash[eb]:
            for k in idx:
                hashes[k] = fold_lanes(host[at], host[at + 1])
                at += 2
    _mark(timer, "sync_counts")
    plan = []
    for j, m in zip(jobs, counts):
        want = codec
        if codec == "auto":
            want = "dense" if m > AUTO_DENSE_FRACTION * j.old.numel() else "compact"
        plan.append(want)
    # dense slices whose target hash is still unknown: full hash of the new bits (they cost O(n) anyway)
    full_idx = [k for k in range(len(jobs)) if with_hash and hashes[k] is None and plan[k] == "dense"]
    full_lanes = []
    for eb in parts:
        idx = [k for k in full_idx if jobs[k].old.element_size() == eb]
        if idx:
            full_lanes.append((idx, K.group_hash_bits([jobs[k].new for k in idx], [jobs[k].start for k in idx],
                                                      impl=scans[eb].impl)))
    cap = max_group_changes if max_group_changes is not None else 1 << 62
    records: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    packed: list[tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]] = []
    deltas: list[tuple[list[int], torch.Tensor]] = []
    values = "new" if codec == "coo" else "delta"
    for eb, idx in parts.items():
        olds = [jobs[k].old for k in idx]
        news = [jobs[k].new for k in idx]
        cnts = [counts[k] for k in idx]
        starts = [jobs[k].start for k in idx]
        # hash changes only where the scan did not hash the new bits in full (all slices incremental)
        dacc = K.hash_zeros(len(idx), dev) if with_hash and not scan_hash[eb] else None
        # runs of consecutive non-dense slices, cut so that a run holds at most `cap` changes
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
        for a, b in runs:
            pos, val, rec_off = K.group_diff_collect(olds, news, scans[eb], cnts, values=values,
                                                     update_old=update_old, hash_starts=starts, hash_out=dacc,
                                                     sub=(a, b))
            sub_idx = idx[a:b]
            for k, off in zip(sub_idx, rec_off):
                records[k] = (pos[off:off + counts[k]], val[off:off + counts[k]])
            _mark(timer, "collect")
            cidx = [k for k in sub_idx if plan[k] == "compact"]
            if cidx:
                if len(cidx) == len(sub_idx):
                    cpos, cval = pos, val
                else:
                    cpos = torch.cat([records[k][0] for k in cidx])
                    cval = torch.cat([records[k][1] for k in cidx])
                out, wbase, nwords = K.group_pack_compact(cpos, cval, [counts[k] for k in cidx], 8 * eb,
                                                          impl=scans[eb].impl)
                packed.append((cidx, out, wbase, nwords))
            _mark(timer, "pack")
        if dacc is not None:
            deltas.append((idx, dacc))
    # host sync 2: packed sizes, hash changes and full hashes of dense slices, all at once
    tail = [torch.stack([b, n], 1).reshape(-1) for _, _, b, n in packed]
    tail += [d.to(torch.int64).reshape(-1) for _, d in deltas]
    tail += [ln.reshape(-1) for _, ln in full_lanes]
    host2 = torch.cat(tail).tolist() if tail else []
    _mark(timer, "sync_sizes")
    at = 0
    words_of: dict[int, torch.Tensor] = {}
    for cidx, out, _, _ in packed:
        for k in cidx:
            words_of[k] = out[host2[at]: host2[at] + host2[at + 1]]
            at += 2
    for idx, _ in deltas:
        for k in idx:
            if plan[k] != "dense":  # dense slices: full hash (full_lanes)
                hashes[k] = add_lanes(int(base_hashes[k]), host2[at], host2[at + 1])  # type: ignore[index]
            at += 2
    for idx, _ in full_lanes:
        for k in idx:
            hashes[k] = fold_lanes(host2[at], host2[at + 1])
            at += 2
    result: list[EncodedSlice] = []
    for k, (j, m) in enumerate(zip(jobs, counts)):
        ebits = 8 * j.old.element_size()
        sizes = {"dense": dense_nbytes(j.new), "coo": coo_nbytes(m, ebits)}
        kind = plan[k]
        if kind == "compact":
            sizes["compact"] = 4 * words_of[k].numel()
            if codec == "auto":
                kind = min(("compact", "coo", "dense"), key=lambda c: sizes[c])  # ties: compact first
        if kind == "compact":
            body = as_u8(words_of[k])
        elif kind == "coo":
            pos, val = records[k]
            if codec != "coo":  # auto chose COO after packing: new values at the changed positions
                val = j.new[pos.to(torch.int64)].to(torch.int32) & ((1 << ebits) - 1)
            body = _coo_body(pos, val, j.new.dtype)
        else:
            body = as_u8(j.new).clone() if copy_dense else as_u8(j.new)
            if update_old:
                j.old.copy_(j.new)
        result.append(EncodedSlice(kind, int(m), body, hashes[k], sizes))
    _mark(timer, "finish")
    return result


@dataclass
class Decoded:
    """A validated (or validation-deferred) slice body: either all new bits, or records."""

    codec: str
    new_bits: torch.Tensor | None = None
    pos: torch.Tensor | None = None
    val: torch.Tensor | None = None
    bad: torch.Tensor | None = None  # deferred validation flag (0-d bool) or None


def decode_slice(codec: str, body: torch.Tensor, n: int, dtype: torch.dtype, nchanged: int, *,
                 defer_check: bool = False, impl: str | None = None) -> Decoded:
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


def apply_decoded(bits: torch.Tensor, dec: Decoded, *, keep_undo: bool = True, impl: str | None = None,
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


def undo_decoded(bits: torch.Tensor, dec: Decoded, undo, *, impl: str | None = None) -> None:
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


def _encode(codec: str, base: torch.Tensor, new: torch.Tensor, with_hash: bool, impl: str | None) -> Payload:
    _check_pair(base, new)
    b = bits_view(base.detach().contiguous())
    x = bits_view(new.detach().contiguous())
    (s,) = encode_slices([SliceJob(b, x, 0)], codec, with_hash=with_hash, impl=impl)
    return Payload(codec=s.codec, dtype=base.dtype, shape=tuple(base.shape), nchanged=s.nchanged, data=s.body,
                   target_hash=s.target_hash, extra={"sizes": s.sizes})


def apply_payload(base: torch.Tensor, payload: Payload, *, verify: bool = True, impl: str | None = None) -> None:
    """Apply ``payload`` to ``base`` in place (see :func:`apply_`)."""
    if not isinstance(payload, Payload):
        raise TypeError(f"expected a Payload, got {type(payload).__name__}")
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
    name = "auto"

    def __init__(self, *, with_hash: bool = True, verify: bool = True, impl: str | None = None) -> None:
        self.with_hash = with_hash
        self.verify = verify
        self.impl = impl

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
    width with escapes; ~10.5 bits per changed element at 1% density (see ``docs/sync.md``)."""

    name = "compact"


class AutoCodec(_BuiltinCodec):
    """Smallest of compact / COO / dense per tensor slice; dense when most elements changed."""

    name = "auto"


_REGISTRY: dict[str, type[_BuiltinCodec]] = {c.name: c for c in (DenseCodec, CooCodec, CompactCodec, AutoCodec)}


def get_codec(codec: str | WeightCodec, **kwargs) -> WeightCodec:
    """A codec instance from a name (``"dense"``, ``"coo"``, ``"compact"``, ``"auto"``) or an instance."""
    if isinstance(codec, WeightCodec):
        return codec
    try:
        return _REGISTRY[codec](**kwargs)
    except KeyError:
        raise ValueError(f"unknown codec {codec!r}; expected one of {sorted(_REGISTRY)}") from None


def encode(base: torch.Tensor, new: torch.Tensor, codec: str | WeightCodec = "auto", *,
           with_hash: bool = True, impl: str | None = None) -> Payload:
    """Encode the change from ``base`` to ``new`` (same shape, dtype in {bf16, fp16, fp32}, device).

    Neither tensor is modified. ``codec``: ``"auto"`` (default: smallest of compact / COO / dense),
    ``"compact"``, ``"coo"``, ``"dense"`` or a :class:`WeightCodec` instance. ``with_hash`` stores the
    hash of ``new``'s bits so :func:`apply_` can verify the result. Raises ``TypeError`` (dtype) or
    ``ValueError`` (shape / device mismatch, unknown codec).
    """
    if isinstance(codec, WeightCodec):
        return codec.encode(base, new)
    if codec not in _REGISTRY:
        raise ValueError(f"unknown codec {codec!r}; expected one of {sorted(_REGISTRY)}")
    return _encode(codec, base, new, with_hash, impl)


def apply_(base: torch.Tensor, payload: Payload, *, verify: bool = True, impl: str | None = None) -> None:
    """Apply ``payload`` to ``base`` in place, bit-exactly.

    ``base``: contiguous tensor of the payload's dtype and shape holding the encoder's base bits.
    Raises :class:`ShapeMismatchError`, :class:`CorruptPayloadError` (invalid body / indices; checked
    before any write) or :class:`HashMismatchError` (``verify`` and the result's hash differs from the
    payload's target hash; the write is undone first). ``base`` is unchanged when an error is raised.
    """
    apply_payload(base, payload, verify=verify, impl=impl)


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


__all__ = ["AUTO_DENSE_FRACTION", "AutoCodec", "CompactCodec", "CooCodec", "DenseCodec", "apply_", "encode",
           "empirical_entropy_bits", "get_codec", "position_entropy_bits"]

"""User codecs inside SyncSender / SyncReceiver buckets.

A user codec is any :class:`~sparrow.sync.WeightCodec` that is not one of the built-in ones. It travels in
the same buckets as the built-in codecs, one entry per tensor slice: the sender calls its ``encode`` on
the slice of its snapshot and the slice of the new state, the receiver calls its ``apply_`` on the same
slice of its tensor. Everything around it is the bucket's: versions, checksums, base and target hashes
of the slice, bounds checks of the manifest, and the all-or-nothing apply (the receiver keeps a sparse
undo record of what ``apply_`` changed, so a later failure in the bucket restores the slice bit for bit).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from ..kernels.common.impl import Impl
from ..kernels.sync import api as K
from .base import Payload, WeightCodec
from .bucket import BucketInfo, EntryMeta
from .errors import CorruptPayloadError, SyncError

#: A sparse undo record of one slice: positions (int32) and the bit patterns they held before.
Undo = tuple[torch.Tensor, torch.Tensor]


@dataclass
class EncodedSlice:
    """One slice a user codec encoded, as it goes into a bucket entry."""

    codec: str  # the user WeightCodec's name
    nchanged: int
    body: torch.Tensor  # uint8
    payload: dict[str, Any]  # the payload's own fields (see EntryMeta.payload)


# ---------------------------------------------------------------------------------------------------
# sender
# ---------------------------------------------------------------------------------------------------

def encode_user_slice(codec: WeightCodec, name: str, base: torch.Tensor, new: torch.Tensor,
                      label: str) -> Payload:
    """``codec.encode(base, new)`` of one flat slice, with the payload checked (see :func:`check_payload`)."""
    return check_payload(name, codec.encode(base, new), base, label)


def check_payload(name: str, p: object, base: torch.Tensor, label: str) -> Payload:
    """``p`` if it is a payload the bucket can carry for the flat slice ``base`` (called ``label``).

    Raises:
        TypeError: ``p`` is not a :class:`Payload`.
        ValueError: dtype or shape not the slice's, ``data`` not a 1-D uint8 tensor, ``nchanged`` outside
            ``[0, n]``, ``codec`` not a non-empty string, ``target_hash`` not a 64-bit int or None, ``extra``
            not a JSON-serialisable dict.
    """
    where = f"codec {name!r} on {label}"
    if not isinstance(p, Payload):
        raise TypeError(f"{where}: encode returned a {type(p).__name__}, not a Payload")
    n = base.numel()
    if p.dtype != base.dtype or tuple(p.shape) != (n,):
        raise ValueError(f"{where}: encode returned a payload for {p.dtype}{list(p.shape)}; the slice is "
                         f"{base.dtype}[{n}]")
    d = p.data
    if not isinstance(d, torch.Tensor) or d.dtype != torch.uint8 or d.dim() != 1:
        raise ValueError(f"{where}: payload data must be a 1-D uint8 tensor, got "
                         f"{type(d).__name__ if not isinstance(d, torch.Tensor) else f'{d.dtype}{list(d.shape)}'}")
    m = p.nchanged
    if not isinstance(m, int) or isinstance(m, bool) or not 0 <= m <= n:
        raise ValueError(f"{where}: nchanged {m!r} is not an int in [0, {n}]")
    if not isinstance(p.codec, str) or not p.codec:
        raise ValueError(f"{where}: payload codec {p.codec!r} is not a non-empty string")
    th = p.target_hash
    if th is not None and (not isinstance(th, int) or isinstance(th, bool) or not 0 <= th < 1 << 64):
        raise ValueError(f"{where}: payload target_hash {th!r} is not a 64-bit unsigned int or None")
    try:
        ok = isinstance(p.extra, dict) and json.loads(json.dumps(p.extra)) == p.extra
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{where}: payload extra {p.extra!r} is not a dict that survives JSON unchanged")
    return p


def encoded_slice(name: str, p: Payload) -> EncodedSlice:
    """The bucket entry of a checked user payload of codec ``name``."""
    fields = {"codec": p.codec, "target_hash": None if p.target_hash is None else f"{p.target_hash:016x}",
              "extra": p.extra}
    return EncodedSlice(name, p.nchanged, p.data.contiguous(), fields)


# ---------------------------------------------------------------------------------------------------
# receiver
# ---------------------------------------------------------------------------------------------------

def payload_of(e: EntryMeta, body: torch.Tensor, info: BucketInfo) -> Payload:
    """The payload of user entry ``e`` as its codec's ``encode`` returned it (``body``: the entry's bytes)."""
    f: dict[str, Any] = e.payload or {}
    th = f.get("target_hash")
    return Payload(codec=f["codec"], dtype=e.dtype, shape=(e.length,), nchanged=e.nchanged, data=body,
                   target_hash=None if th is None else int(th, 16), run_id=info.run_id,
                   base_version=info.base_version, target_version=info.target_version, extra=dict(f["extra"]))


def apply_user_slice(codec: WeightCodec, bits: torch.Tensor, dtype: torch.dtype, payload: Payload, label: str,
                     *, impl: Impl = "auto") -> Undo:
    """``codec.apply_`` on the flat slice whose bit view is ``bits``; returns what :func:`undo_user_slice`
    needs to restore it. Extra memory: one copy of the slice while it runs, then 8 bytes per changed element.

    Raises whatever ``apply_`` raises, after restoring the slice bit for bit: its :class:`SyncError` as is,
    any other ``Exception`` as :class:`CorruptPayloadError` (so that a receiver keeps draining a collective
    transport and asks for a resync, as for a bad built-in entry).
    """
    before = bits.clone()
    try:
        codec.apply_(bits.view(dtype), payload)
    except BaseException as exc:
        bits.copy_(before)
        if isinstance(exc, Exception) and not isinstance(exc, SyncError):
            raise CorruptPayloadError(f"{label}: codec {codec.name!r} could not apply its payload "
                                      f"({type(exc).__name__}: {exc})") from exc
        raise
    # the elements apply_ changed and the bits they held (host sync: the change count)
    return K.diff_records(bits, before, values="new", impl=impl)


def undo_user_slice(bits: torch.Tensor, undo: Undo, *, impl: Impl = "auto") -> None:
    """Restore the bits :func:`apply_user_slice` changed (bit-exact)."""
    pos, old = undo
    K.apply_records(bits, pos, old, values="new", impl=impl)

"""Core types of SparseRL-Sync: :class:`WeightCodec` and :class:`Payload`.

A payload describes the change from ``base`` to ``new`` (same shape and dtype, bf16 / fp16 / fp32) on
bit patterns: applying it to a tensor holding ``base`` bit for bit yields ``new`` bit for bit, including
NaN payloads, +0.0 / -0.0, infinities and subnormals.
"""

from __future__ import annotations

import abc
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

from ..kernels.sync.common import check_span_log2
from ._util import align, as_u8, dtype_from_name, dtype_name, hash_bytes
from .errors import CorruptPayloadError, TruncatedPayloadError

PAYLOAD_MAGIC = b"SPWPAY\x00\x01"
PAYLOAD_FORMAT = 2  # 2: compact bodies of format 2 (blocks of 2**span_log2 elements, gamma-coded values)
_PREFIX = struct.Struct("<8sIIQQQ")  # magic, header_len, format, body_len, header_hash, body_hash
#: Payload codecs of the built-in codecs (what a built-in payload's ``codec`` field holds).
CODEC_NAMES = ("dense", "coo", "compact")
#: Names a user codec may not take: the built-in codecs' (``"auto"`` picks one of the three per slice).
RESERVED_NAMES = ("auto", *CODEC_NAMES)


@dataclass
class Payload:
    """One encoded tensor (or tensor slice) change.

    Attributes:
        codec: ``"dense"`` (all new bit patterns), ``"coo"`` (int32 positions + new bit patterns),
            ``"compact"`` (Elias-Fano positions + zig-zag bit-pattern deltas; see ``docs/sync.md``), or any
            other non-empty name a user :class:`WeightCodec` gives its payloads (its body is its own business).
        dtype: element dtype of the tensor (``torch.bfloat16``, ``torch.float16`` or ``torch.float32``).
        shape: tensor shape.
        nchanged: number of elements whose bit pattern differs between base and new.
        data: the codec body, a 1-D ``uint8`` tensor on the encoding device.
        target_hash: 64-bit hash of the new bit patterns (``None``: not checked on apply).
        run_id, base_version, target_version: versioning fields; :func:`apply_` ignores them, the
            :class:`~sparrow.sync.SyncReceiver` checks them (in the bucket manifest).
        extra: JSON-serialisable codec details (the built-in codecs record the body sizes they considered;
            a compact payload its block span, ``span_log2``).
    """

    codec: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    nchanged: int
    data: torch.Tensor
    target_hash: int | None = None
    run_id: str = ""
    base_version: int = 0
    target_version: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the codec body (what the transfer of this tensor costs, without headers)."""
        return int(self.data.numel())

    @property
    def dense_nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def header(self) -> dict[str, Any]:
        return {"format": PAYLOAD_FORMAT, "codec": self.codec, "dtype": dtype_name(self.dtype),
                "shape": list(self.shape), "nchanged": int(self.nchanged),
                "target_hash": None if self.target_hash is None else f"{self.target_hash:016x}",
                "run_id": self.run_id, "base_version": int(self.base_version),
                "target_version": int(self.target_version), "extra": self.extra}

    def to_bytes(self) -> bytes:
        """Serialise: 40-byte prefix (magic, lengths, format, header hash, body hash), JSON header, body.

        No pickle; :meth:`from_bytes` checks every length and both hashes."""
        head = json.dumps(self.header(), sort_keys=True, separators=(",", ":")).encode()
        body_dev = as_u8(self.data.detach())
        body_hash = hash_bytes(body_dev)  # on the payload's device
        body = body_dev.cpu()
        prefix = _PREFIX.pack(PAYLOAD_MAGIC, len(head), PAYLOAD_FORMAT, body.numel(), hash_bytes(head), body_hash)
        return prefix + head + body.numpy().tobytes()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview | torch.Tensor,
                   device: torch.device | str | None = None) -> "Payload":
        """Parse :meth:`to_bytes` output. Raises :class:`TruncatedPayloadError` (too short / trailing bytes)
        or :class:`CorruptPayloadError` (magic, format, hashes, header fields, body length)."""
        if isinstance(data, torch.Tensor):
            raw = as_u8(data.detach()).cpu().numpy().tobytes()
        else:
            raw = bytes(data)
        if len(raw) < _PREFIX.size:
            raise TruncatedPayloadError(f"payload truncated: {len(raw)} bytes, the prefix alone is {_PREFIX.size}")
        magic, hlen, fmt, blen, hhash, bhash = _PREFIX.unpack_from(raw)
        if magic != PAYLOAD_MAGIC:
            raise CorruptPayloadError(f"not a sparrow payload (magic {magic!r})")
        if fmt != PAYLOAD_FORMAT:
            raise CorruptPayloadError(f"unsupported payload format {fmt}: this build reads format {PAYLOAD_FORMAT} "
                                      "only (re-encode the payload with this version)")
        want = _PREFIX.size + hlen + blen
        if len(raw) != want:
            cls_ = TruncatedPayloadError
            raise cls_(f"payload length {len(raw)} != {want} announced by its header "
                       f"({'truncated' if len(raw) < want else 'trailing bytes'})")
        head = raw[_PREFIX.size:_PREFIX.size + hlen]
        body = raw[_PREFIX.size + hlen:]
        if hash_bytes(head) != hhash:
            raise CorruptPayloadError("payload header checksum mismatch")
        body_t = torch.frombuffer(bytearray(body), dtype=torch.uint8) if blen else torch.zeros(0, dtype=torch.uint8)
        if hash_bytes(body_t) != bhash:
            raise CorruptPayloadError("payload body checksum mismatch")
        try:
            h = json.loads(head.decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptPayloadError(f"payload header is not valid JSON: {exc}") from None
        p = cls._from_header(h, body_t)
        if device is not None:
            p.data = p.data.to(device)
        return p

    @classmethod
    def _from_header(cls, h: Any, body: torch.Tensor) -> "Payload":
        if not isinstance(h, dict):
            raise CorruptPayloadError("payload header must be a JSON object")
        codec = h.get("codec")
        if not isinstance(codec, str) or not codec:
            raise CorruptPayloadError(f"bad codec {codec!r} in payload header")
        dtype = dtype_from_name(h.get("dtype"))
        shape = h.get("shape")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise CorruptPayloadError(f"bad shape {shape!r} in payload header")
        nchanged = h.get("nchanged")
        numel = math.prod(shape)
        if not isinstance(nchanged, int) or not 0 <= nchanged <= numel:
            raise CorruptPayloadError(f"bad nchanged {nchanged!r} for {numel} elements")
        th = h.get("target_hash")
        try:
            target_hash = None if th is None else int(th, 16)
        except (TypeError, ValueError):
            raise CorruptPayloadError(f"bad target_hash {th!r}") from None
        ints = {k: h.get(k) for k in ("base_version", "target_version")}
        if not all(isinstance(v, int) for v in ints.values()) or not isinstance(h.get("run_id"), str):
            raise CorruptPayloadError("bad run_id / version fields in payload header")
        p = cls(codec=codec, dtype=dtype, shape=tuple(shape), nchanged=nchanged, data=body,
                target_hash=target_hash, run_id=h["run_id"], base_version=ints["base_version"],
                target_version=ints["target_version"], extra=h.get("extra") or {})
        if p.codec in CODEC_NAMES:  # a user codec's body is checked by its own apply_
            check_body_length(p.codec, p.dtype, p.numel, p.nchanged, p.nbytes)
            if p.codec == "compact":
                span_of(p)
        return p


def span_of(payload: "Payload") -> int:
    """The block span (``extra["span_log2"]``) of a built-in compact payload; :class:`CorruptPayloadError`
    when it is missing or out of range."""
    span = payload.extra.get("span_log2") if isinstance(payload.extra, dict) else None
    try:
        return check_span_log2(span)
    except ValueError:
        raise CorruptPayloadError(f"compact payload without a valid span_log2 (got {span!r})") from None


def check_body_length(codec: str, dtype: torch.dtype, numel: int, nchanged: int, nbytes: int) -> None:
    """Raise :class:`CorruptPayloadError` unless ``nbytes`` is a possible body length for the codec."""
    esize = dtype.itemsize
    if codec == "dense":
        ok, want = nbytes == numel * esize, f"{numel * esize}"
    elif codec == "coo":
        ok, want = nbytes == nchanged * (4 + esize), f"{nchanged * (4 + esize)}"
    elif codec == "compact":
        ok, want = nbytes % 4 == 0 and (nchanged > 0 or nbytes == 0), "a multiple of 4 (0 if nothing changed)"
    else:
        raise CorruptPayloadError(f"unknown codec {codec!r}")
    if not ok:
        raise CorruptPayloadError(f"{codec} body of {nbytes} bytes for {nchanged}/{numel} changed "
                                  f"{dtype_name(dtype)} elements; expected {want}")


class WeightCodec(abc.ABC):
    """Encodes the change from `base` to `new` (same shape/dtype, any of bf16/fp16/fp32) as a Payload;
    applies it in place, bit-exactly.

    ``encode(base, new)``: ``base`` and ``new`` are tensors of identical shape, dtype (bf16 / fp16 /
    fp32) and device; neither is modified. Raises ``TypeError`` (dtype) / ``ValueError`` (shape, device).

    ``apply_(base, payload)``: writes the payload into ``base`` (contiguous, same dtype and shape) in place.
    Raises :class:`~sparrow.sync.ShapeMismatchError` (target does not match),
    :class:`~sparrow.sync.CorruptPayloadError` (invalid body, indices out of range) or
    :class:`~sparrow.sync.HashMismatchError` (result does not hash to ``payload.target_hash``; the write
    is undone first). ``base`` is unchanged whenever an error is raised.

    Used by :class:`~sparrow.sync.SyncSender` (``codec=``) and :class:`~sparrow.sync.SyncReceiver`
    (``codecs=``), a user codec sees flat 1-D slices ``tensor.view(-1)[start:start + n]`` and must return
    payloads of that dtype and shape ``(n,)`` with a 1-D ``uint8`` ``data`` tensor and a JSON-serialisable
    ``extra``; ``apply_`` gets the same slice of the receiver's tensor. It must be deterministic. The bucket
    around it brings the rest: versions, checksums, the target hash of every slice, all-or-nothing apply.

    Attributes:
        name: recorded in the bucket manifest; the receiver looks the codec up by it. A user codec's name is
            any non-empty string except :data:`RESERVED_NAMES`.
    """

    name: str

    @abc.abstractmethod
    def encode(self, base: torch.Tensor, new: torch.Tensor) -> Payload: ...

    @abc.abstractmethod
    def apply_(self, base: torch.Tensor, payload: Payload) -> None: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def user_codec_name(codec: object) -> str:
    """The name of a user :class:`WeightCodec` (not a built-in one), validated.

    Raises:
        TypeError: ``codec`` is not a :class:`WeightCodec`.
        ValueError: its ``name`` is not a non-empty string, or is one of :data:`RESERVED_NAMES`.
    """
    if not isinstance(codec, WeightCodec):
        raise TypeError(f"expected a WeightCodec instance, got {type(codec).__name__}: {codec!r}")
    name = getattr(codec, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{type(codec).__name__}.name must be a non-empty string, got {name!r}")
    if name in RESERVED_NAMES:
        raise ValueError(f"{type(codec).__name__}.name {name!r} is reserved for the built-in codecs "
                         f"({', '.join(RESERVED_NAMES)}): give the codec another name")
    return name


__all__ = ["CODEC_NAMES", "Payload", "RESERVED_NAMES", "WeightCodec", "align", "check_body_length", "span_of",
           "user_codec_name"]

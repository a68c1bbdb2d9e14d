"""Bucket wire format: one transfer unit of a sync (manifest + concatenated slice bodies).

Layout (little-endian)::

    [0, 64)         header: magic b"SPWSYNC\\x01", format u32, manifest_len u32, body_len u64,
                    total_len u64, manifest_hash u64, 2 x u64 reserved, header_hash u64 (of bytes 0..56)
    [64, 64+M)      manifest: UTF-8 JSON, zero-padded to a multiple of 16 bytes
    [.., +body_len) body: entry bodies at 16-byte aligned offsets
    last 16 bytes   trailer: body hash (2 x u32 lanes), b"SPWE", u32 0

The manifest holds the run id, base / target version, bucket index, ``last`` and ``anchor`` flags, and
per entry: tensor name, dtype, shape, element range (start, length), codec, body offset / length,
changed-element count and the 64-bit hashes of the range's bits before (``base_hash``) and after
(``hash``) the sync (format 2; format 1 had only the target hash). An entry made by a user
:class:`~sparrow.sync.WeightCodec` names that codec in ``codec`` and carries one more field, ``payload``:
``{"codec", "target_hash", "extra"}`` of the payload its ``encode`` returned (built-in entries have no
``payload`` field, so their buckets are what they were). The body hash is computed on the bucket's device
(no host copy of the body).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ._util import align, dtype_from_name, dtype_name, hash_bytes, hash_bytes_lanes
from .base import CODEC_NAMES, check_body_length
from .errors import CorruptPayloadError, TruncatedPayloadError

BUCKET_MAGIC = b"SPWSYNC\x01"
BUCKET_FORMAT = 2  # 2: entries carry base_hash (incremental verification)
TRAILER_MAGIC = b"SPWE"
_HDR = struct.Struct("<8sIIQQQQQQ")
HEADER_BYTES = _HDR.size  # 64
TRAILER_BYTES = 16
_PREFETCH = 1 << 16  # manifest bytes read together with the header
assert HEADER_BYTES == 64


@dataclass(frozen=True)
class BucketInfo:
    """Versioning fields of one bucket."""

    run_id: str
    base_version: int
    target_version: int
    index: int
    last: bool
    anchor: bool


@dataclass
class EntryMeta:
    """One slice ``tensor.view(-1)[start:start+length]`` of tensor ``name`` in a bucket."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    length: int
    codec: str
    offset: int
    nbytes: int
    nchanged: int
    target_hash: int | None
    base_hash: int | None = None  # sender's hash of the range's bits before this sync
    #: user codecs only: ``{"codec": str, "target_hash": "<16 hex>" | None, "extra": dict}`` of the payload
    payload: dict[str, Any] | None = None

    @property
    def is_user(self) -> bool:
        """Made by a user codec (applied through its ``apply_``), not by a built-in one."""
        return self.codec not in CODEC_NAMES

    def to_json(self) -> dict[str, Any]:
        d = {"name": self.name, "dtype": dtype_name(self.dtype), "shape": list(self.shape), "start": self.start,
             "length": self.length, "codec": self.codec, "offset": self.offset, "nbytes": self.nbytes,
             "nchanged": self.nchanged,
             "hash": None if self.target_hash is None else f"{self.target_hash:016x}",
             "base_hash": None if self.base_hash is None else f"{self.base_hash:016x}"}
        if self.payload is not None:
            d["payload"] = self.payload
        return d


def _to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host -> device copy that does not wait for the device queue (pinned, non-blocking) on CUDA."""
    device = torch.device(device)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def build_bucket(info: BucketInfo, entries: Sequence[tuple[EntryMeta, torch.Tensor]],
                 device: torch.device | str | None = None) -> torch.Tensor:
    """Assemble a bucket (1-D uint8 tensor on ``device``, default: the bodies' device). ``EntryMeta.offset``
    and ``nbytes`` are (re)assigned here."""
    if device is None:
        device = entries[0][1].device if entries else torch.device("cpu")
    metas, parts, off = [], [], 0
    for meta, body in entries:
        meta.offset, meta.nbytes = off, int(body.numel())
        metas.append(meta.to_json())
        pad = align(body.numel()) - body.numel()
        parts.append(body.to(device))
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=device))
        off += body.numel() + pad
    manifest = {"format": BUCKET_FORMAT, "run_id": info.run_id, "base_version": info.base_version,
                "target_version": info.target_version, "index": info.index, "last": info.last,
                "anchor": info.anchor, "entries": metas}
    mbytes = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    mpad = mbytes + b"\0" * (align(len(mbytes)) - len(mbytes))
    body = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8, device=device)
    total = HEADER_BYTES + len(mpad) + body.numel() + TRAILER_BYTES
    head = struct.pack("<8sIIQQQQQ", BUCKET_MAGIC, BUCKET_FORMAT, len(mbytes), body.numel(), total,
                       hash_bytes(mbytes), 0, 0)
    head += struct.pack("<Q", hash_bytes(head))
    lanes = hash_bytes_lanes(body)
    lanes32 = (lanes - ((lanes >> 31) << 32)).to(torch.int32)
    end = torch.frombuffer(bytearray(TRAILER_MAGIC + b"\0" * 4), dtype=torch.uint8)
    trailer = torch.cat([lanes32.view(torch.uint8), _to_device(end, device)])
    prefix = _to_device(torch.frombuffer(bytearray(head + mpad), dtype=torch.uint8), device)
    return torch.cat([prefix, body, trailer])


@dataclass
class ParsedBucket:
    info: BucketInfo
    entries: list[EntryMeta]
    body: torch.Tensor  # uint8 view into the bucket
    body_bad: torch.Tensor  # 0-d bool on the bucket's device: body hash mismatch (checked by the caller)


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.cpu().numpy().tobytes()


def parse_bucket(bucket: torch.Tensor | bytes | bytearray | memoryview) -> ParsedBucket:
    """Parse and check a bucket's header, manifest and trailer (host reads: header + manifest + trailer).

    The body hash comparison is returned as a device flag (``body_bad``) so the caller can fold it
    into its single validation sync. Raises :class:`TruncatedPayloadError` / :class:`CorruptPayloadError`.
    """
    if not isinstance(bucket, torch.Tensor):
        raw = bytearray(bucket)
        bucket = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
    if bucket.dtype != torch.uint8 or bucket.dim() != 1:
        raise CorruptPayloadError(f"a bucket is a 1-D uint8 tensor, got {bucket.dtype}{tuple(bucket.shape)}")
    size = bucket.numel()
    if size < HEADER_BYTES + TRAILER_BYTES:
        raise TruncatedPayloadError(f"bucket truncated: {size} bytes < {HEADER_BYTES + TRAILER_BYTES}")
    # one device -> host read for the header, (usually) the whole manifest and the trailer
    k = min(size, HEADER_BYTES + _PREFETCH)
    raw = _bytes_of(torch.cat([bucket[:k], bucket[size - TRAILER_BYTES:]]))
    head, pre, trailer = raw[:HEADER_BYTES], raw[:k], raw[k:]
    magic, fmt, mlen, blen, total, mhash, _, _, hhash = _HDR.unpack(head)
    if magic != BUCKET_MAGIC:
        raise CorruptPayloadError(f"not a sparrow sync bucket (magic {magic!r})")
    if hash_bytes(head[:56]) != hhash:
        raise CorruptPayloadError("bucket header checksum mismatch")
    if fmt != BUCKET_FORMAT:
        raise CorruptPayloadError(f"unsupported bucket format {fmt} (this build reads {BUCKET_FORMAT})")
    if total != HEADER_BYTES + align(mlen) + blen + TRAILER_BYTES:
        raise CorruptPayloadError("bucket header lengths are inconsistent")
    if size != total:
        if size < total:
            raise TruncatedPayloadError(f"bucket truncated: {size} bytes of {total}")
        raise TruncatedPayloadError(f"bucket has {size - total} trailing bytes beyond its {total} bytes")
    mend = HEADER_BYTES + align(mlen)
    mall = pre[HEADER_BYTES:mend] if mend <= k else _bytes_of(bucket[HEADER_BYTES:mend])
    mbytes, mpad = mall[:mlen], mall[mlen:]
    if hash_bytes(mbytes) != mhash:
        raise CorruptPayloadError("bucket manifest checksum mismatch")
    if mpad.strip(b"\0"):
        raise CorruptPayloadError("bucket manifest padding is not zero")
    if trailer[8:] != TRAILER_MAGIC + b"\0" * 4:
        raise CorruptPayloadError("bucket trailer missing (bad end marker)")
    try:
        man = json.loads(mbytes.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptPayloadError(f"bucket manifest is not valid JSON: {exc}") from None
    info, entries = _check_manifest(man, blen)
    bstart = HEADER_BYTES + align(mlen)
    body = bucket[bstart:bstart + blen]
    want = _to_device(torch.tensor(list(struct.unpack("<II", trailer[:8])), dtype=torch.int64), bucket.device)
    body_bad = (hash_bytes_lanes(body) != want).any()
    return ParsedBucket(info, entries, body, body_bad)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise CorruptPayloadError(f"bad bucket manifest: {msg}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_manifest(man: Any, blen: int) -> tuple[BucketInfo, list[EntryMeta]]:
    _need(isinstance(man, dict), "not an object")
    _need(man.get("format") == BUCKET_FORMAT, f"format {man.get('format')!r}")
    _need(isinstance(man.get("run_id"), str), "run_id")
    for k in ("base_version", "target_version", "index"):
        _need(_is_int(man.get(k)) and man[k] >= 0, k)
    for k in ("last", "anchor"):
        _need(isinstance(man.get(k), bool), k)
    info = BucketInfo(man["run_id"], man["base_version"], man["target_version"], man["index"], man["last"],
                      man["anchor"])
    _need(info.target_version > info.base_version, "target_version must exceed base_version")
    ents = man.get("entries")
    _need(isinstance(ents, list), "entries")
    out, end = [], 0
    for k, e in enumerate(ents):
        out.append(_check_entry(k, e, end, blen))
        end = out[-1].offset + out[-1].nbytes
    return info, out


def _hex64(k: int, key: str, h: Any) -> int | None:
    try:
        v = None if h is None else int(h, 16)
    except (TypeError, ValueError):
        raise CorruptPayloadError(f"bad bucket manifest: entry {k} {key} {h!r}") from None
    _need(v is None or 0 <= v < 1 << 64, f"entry {k} {key} out of range")
    return v


def _check_entry(k: int, e: Any, end: int, blen: int) -> EntryMeta:
    """Entry ``k`` of a manifest, checked field by field (``end``: where the previous body ended)."""
    _need(isinstance(e, dict), f"entry {k}")
    _need(isinstance(e.get("name"), str), f"entry {k} name")
    dtype = dtype_from_name(e.get("dtype"))
    shape = e.get("shape")
    _need(isinstance(shape, list) and all(_is_int(s) and s >= 0 for s in shape), f"entry {k} shape")
    for f in ("start", "length", "offset", "nbytes", "nchanged"):
        _need(_is_int(e.get(f)) and e[f] >= 0, f"entry {k} {f}")
    _need(e["start"] + e["length"] <= math.prod(shape), f"entry {k} range beyond its tensor")
    _need(e["nchanged"] <= e["length"], f"entry {k} nchanged > length")
    codec = e.get("codec")
    _need(isinstance(codec, str) and bool(codec) and codec != "auto", f"entry {k} codec {codec!r}")
    _need(e["offset"] % 16 == 0 and e["offset"] >= end and e["offset"] + e["nbytes"] <= blen,
          f"entry {k} body range [{e['offset']}, +{e['nbytes']}) (body {blen} bytes)")
    th, bh = _hex64(k, "hash", e.get("hash")), _hex64(k, "base_hash", e.get("base_hash"))
    if codec in CODEC_NAMES:
        _need("payload" not in e, f"entry {k}: a built-in {codec} entry has no payload field")
        check_body_length(codec, dtype, e["length"], e["nchanged"], e["nbytes"])
        payload = None
    else:  # a user codec: its body is checked by its own apply_
        payload = _check_user_payload(k, e.get("payload"))
    return EntryMeta(e["name"], dtype, tuple(shape), e["start"], e["length"], codec, e["offset"], e["nbytes"],
                     e["nchanged"], th, bh, payload)


def _check_user_payload(k: int, p: Any) -> dict[str, Any]:
    _need(isinstance(p, dict) and set(p) == {"codec", "target_hash", "extra"},
          f"entry {k} payload {p!r} (a user codec entry needs codec, target_hash, extra)")
    _need(isinstance(p["codec"], str) and bool(p["codec"]), f"entry {k} payload codec {p['codec']!r}")
    _hex64(k, "payload target_hash", p["target_hash"])
    _need(isinstance(p["extra"], dict), f"entry {k} payload extra")
    return p

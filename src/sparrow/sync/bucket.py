"""Bucket wire format: one transfer unit of a sync (hash table, slice bodies, manifest).

Layout (little-endian; format 3)::

    [0, 64)            header: magic b"SPWSYNC\\x01", format u32, manifest_len u32, body_len u64, total_len u64,
                       manifest_hash u64, table_len u64, reserved u64, header_hash u64 (of bytes 0..56)
    [64, 64+T)         hash table (T = 16 * entries when the manifest says "hashes", else 0): per entry the
                       32-bit lanes (a, b) of the range's hash before the sync, then after it
    [64+T, 64+B)       entry bodies at 16-byte aligned offsets (B = body_len, table included)
    [64+B, .. +M)      manifest: UTF-8 JSON, zero-padded to a multiple of 16 bytes
    last 16 bytes      trailer: hash of bytes [64, 64+B) (2 x u32 lanes), b"SPWE", u32 0

Names: a *bucket* is always these bytes (a 1-D uint8 tensor: what a transport moves, what ``SyncSender.encode``
yields and ``SyncReceiver.apply_bucket`` takes); :class:`BucketInfo` is its version fields, :class:`EntryMeta` one
entry of its manifest, :class:`BucketLayout` where its parts go (the sender, before writing it) and
:class:`BucketContents` what :func:`parse_bucket` read from it (the receiver).

The manifest holds the run id, base / target version, bucket index, ``last`` and ``anchor`` flags, whether a
hash table is present, and per entry: tensor name, dtype, shape, element range (start, length), codec, body
offset (from the first body byte) / length, changed-element count, ``span_log2`` for compact bodies and, for
an entry of a user :class:`~sparrow.sync.WeightCodec`, ``payload``: ``{"codec", "target_hash", "extra"}`` of
the payload its ``encode`` returned.

Why this order: the sender writes a bucket in place. After its one host read it knows every body's size, so
the bodies sit at fixed offsets behind the header and the table and are written straight into the buffer by
the encode kernel (the hash table's target lanes are accumulated there by the same kernel); the manifest,
built on the host meanwhile, goes behind the bodies, and the body hash is computed on the device. The
receiver reads the header, the table and the tail (manifest, trailer) in one device-to-host copy.

Format 2 (manifest first, hashes in the manifest, compact bodies of format 1) is not read: a receiver of this
version rejects it with a clear error (the sender and receiver must run the same version).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .._transfer import to_device
from ..kernels.sync.common import MAX_SPAN_LOG2, MIN_SPAN_LOG2, fold_lanes, lanes_i32, split_lanes
from ._util import align, dtype_from_name, dtype_name, hash_bytes, hash_bytes_lanes
from .base import CODEC_NAMES, check_body_length
from .errors import CorruptPayloadError, TruncatedPayloadError

BUCKET_MAGIC = b"SPWSYNC\x01"
BUCKET_FORMAT = 3  # 3: hash table + bodies before the manifest; compact bodies of format 2
TRAILER_MAGIC = b"SPWE"
_HDR = struct.Struct("<8sIIQQQQQQ")
HEADER_BYTES = _HDR.size  # 64
TRAILER_BYTES = 16
TABLE_ENTRY_BYTES = 16
_PREFETCH = 1 << 16  # bytes read from each end of a bucket in the one device -> host read
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
    target_hash: int | None = None  # hash of the range's bits after this sync (from the hash table)
    base_hash: int | None = None  # sender's hash of the range's bits before this sync (from the hash table)
    #: user codecs only: ``{"codec": str, "target_hash": "<16 hex>" | None, "extra": dict}`` of the payload
    payload: dict[str, Any] | None = None
    #: compact bodies: their block span (``2**span_log2`` elements)
    span_log2: int | None = None

    @property
    def is_user(self) -> bool:
        """Made by a user codec (applied through its ``apply_``), not by a built-in one."""
        return self.codec not in CODEC_NAMES

    def to_json(self) -> dict[str, Any]:
        d = {"name": self.name, "dtype": dtype_name(self.dtype), "shape": list(self.shape), "start": self.start,
             "length": self.length, "codec": self.codec, "offset": self.offset, "nbytes": self.nbytes,
             "nchanged": self.nchanged}
        if self.span_log2 is not None:
            d["span_log2"] = self.span_log2
        if self.payload is not None:
            d["payload"] = self.payload
        return d


@dataclass
class BucketLayout:
    """Where everything of a bucket goes (:func:`plan_bucket`, before the sender writes it); ``metas[k].offset`` is
    assigned."""

    info: BucketInfo
    metas: list[EntryMeta]
    hashes: bool
    manifest: bytes  # unpadded
    table_len: int
    bodies_len: int

    @property
    def body_start(self) -> int:
        """Byte of the bucket where body offsets start (behind the header and the hash table)."""
        return HEADER_BYTES + self.table_len

    @property
    def body_len(self) -> int:
        return self.table_len + self.bodies_len

    @property
    def total(self) -> int:
        return HEADER_BYTES + self.body_len + align(len(self.manifest)) + TRAILER_BYTES


def plan_bucket(info: BucketInfo, metas: Sequence[EntryMeta], *, hashes: bool) -> BucketLayout:
    """Lay out a bucket for entries whose ``nbytes`` are known: body offsets (16-byte aligned) and the manifest."""
    off = 0
    for m in metas:
        m.offset = off
        off += align(m.nbytes)
    manifest = {"format": BUCKET_FORMAT, "run_id": info.run_id, "base_version": info.base_version,
                "target_version": info.target_version, "index": info.index, "last": info.last,
                "anchor": info.anchor, "hashes": bool(hashes), "entries": [m.to_json() for m in metas]}
    mbytes = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
    return BucketLayout(info, list(metas), bool(hashes), mbytes, TABLE_ENTRY_BYTES * len(metas) if hashes else 0, off)


def table_view(bucket: torch.Tensor, layout_or_len: BucketLayout | int) -> torch.Tensor:
    """The hash table of a bucket as int32 ``[entries, 4]`` (base lanes, target lanes), a view of its bytes."""
    tlen = layout_or_len.table_len if isinstance(layout_or_len, BucketLayout) else int(layout_or_len)
    return bucket[HEADER_BYTES:HEADER_BYTES + tlen].view(torch.int32).view(-1, 4)


def finish_bucket(bucket: torch.Tensor, layout: BucketLayout) -> torch.Tensor:
    """Write the header, the manifest and the trailer of a bucket whose table and bodies are in place; returns
    the bucket (``bucket`` itself). The body hash is computed on the device; header and manifest are one
    non-blocking host -> device copy. No host sync."""
    if bucket.dtype != torch.uint8 or bucket.dim() != 1 or bucket.numel() != layout.total:
        raise ValueError(f"finish_bucket: need a 1-D uint8 buffer of {layout.total} bytes")
    head = struct.pack("<8sIIQQQQQ", BUCKET_MAGIC, BUCKET_FORMAT, len(layout.manifest), layout.body_len,
                       layout.total, hash_bytes(layout.manifest), layout.table_len, 0)
    head += struct.pack("<Q", hash_bytes(head))
    mpad = layout.manifest + b"\0" * (align(len(layout.manifest)) - len(layout.manifest))
    tail_at = HEADER_BYTES + layout.body_len
    dev = bucket.device
    bucket[:HEADER_BYTES] = to_device(torch.frombuffer(bytearray(head), dtype=torch.uint8), dev)
    rest = mpad + TRAILER_MAGIC + b"\0" * 4  # manifest, then the trailer's last 8 bytes
    tail = to_device(torch.frombuffer(bytearray(rest), dtype=torch.uint8), dev)
    bucket[tail_at:tail_at + len(mpad)] = tail[:len(mpad)]
    bucket[-8:] = tail[len(mpad):]
    lanes = hash_bytes_lanes(bucket[HEADER_BYTES:tail_at])
    bucket[-TRAILER_BYTES:-8].view(torch.int32).copy_(lanes_i32(lanes))
    return bucket


def build_bucket(info: BucketInfo, entries: Sequence[tuple[EntryMeta, torch.Tensor]],
                 device: torch.device | str | None = None, *, table: torch.Tensor | None = None) -> torch.Tensor:
    """Assemble a bucket (1-D uint8 tensor on ``device``, default: the bodies' device) from entry bodies.

    ``table`` (int32 or int64 ``[entries, 4]`` lanes: base, then target) makes it carry hashes; without it the
    hashes come from ``EntryMeta.base_hash`` / ``target_hash`` when every entry has both, else none are sent."""
    if device is None:
        device = entries[0][1].device if entries else torch.device("cpu")
    metas = [m for m, _ in entries]
    if table is None and metas and all(m.base_hash is not None and m.target_hash is not None for m in metas):
        table = torch.tensor([[*split_lanes(m.base_hash), *split_lanes(m.target_hash)] for m in metas],
                             dtype=torch.int64)
    for m, body in entries:
        m.nbytes = int(body.numel())
    layout = plan_bucket(info, metas, hashes=table is not None)
    bucket = torch.zeros(layout.total, dtype=torch.uint8, device=device)
    if table is not None:
        table_view(bucket, layout).copy_(lanes_i32(table.to(device)))
    for m, body in entries:
        at = layout.body_start + m.offset
        bucket[at:at + m.nbytes] = body.reshape(-1).to(device)
    return finish_bucket(bucket, layout)


@dataclass
class BucketContents:
    """What :func:`parse_bucket` read from a bucket and checked."""

    info: BucketInfo
    entries: list[EntryMeta]
    body: torch.Tensor  # uint8 view of the entry bodies (offsets count from its first byte)
    body_bad: torch.Tensor  # 0-d bool on the bucket's device: body hash mismatch (checked by the caller)
    hashes: bool


def _bytes_of(t: torch.Tensor) -> bytes:
    return t.cpu().numpy().tobytes()


def parse_bucket(bucket: torch.Tensor | bytes | bytearray | memoryview) -> BucketContents:
    """Parse and check a bucket's header, hash table, manifest and trailer: one device -> host read of both ends
    of the bucket (a second only for a manifest or table larger than 64 KiB).

    The body hash comparison is returned as a device flag (``body_bad``) so the caller can fold it into its
    pre-write checks. Raises :class:`TruncatedPayloadError` / :class:`CorruptPayloadError` (including for
    buckets of another format)."""
    if not isinstance(bucket, torch.Tensor):
        raw = bytearray(bucket)
        bucket = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
    if bucket.dtype != torch.uint8 or bucket.dim() != 1:
        raise CorruptPayloadError(f"a bucket is a 1-D uint8 tensor, got {bucket.dtype}{tuple(bucket.shape)}")
    size = bucket.numel()
    if size < HEADER_BYTES + TRAILER_BYTES:
        raise TruncatedPayloadError(f"bucket truncated: {size} bytes < {HEADER_BYTES + TRAILER_BYTES}")
    if size <= 2 * _PREFETCH:  # the one device -> host read: the whole bucket, or its two ends
        k = t0 = size
        raw = _bytes_of(bucket)
    else:
        k, t0 = HEADER_BYTES + _PREFETCH, size - _PREFETCH
        raw = _bytes_of(torch.cat([bucket[:k], bucket[t0:]]))
    head, front, back = raw[:HEADER_BYTES], raw[:k], raw[k:]

    def read(a: int, b: int) -> bytes:
        """Bytes [a, b) of the bucket, from what was read when it covers them."""
        if b <= k:
            return front[a:b]
        if a >= t0:
            return back[a - t0:b - t0]
        return _bytes_of(bucket[a:b])

    magic, fmt, mlen, blen, total, mhash, tlen, _, hhash = _HDR.unpack(head)
    if magic != BUCKET_MAGIC:
        raise CorruptPayloadError(f"not a sparrow sync bucket (magic {magic!r})")
    if hash_bytes(head[:56]) != hhash:
        raise CorruptPayloadError("bucket header checksum mismatch")
    if fmt != BUCKET_FORMAT:
        raise CorruptPayloadError(f"unsupported bucket format {fmt}: this build reads format {BUCKET_FORMAT} only "
                                  "(sender and receivers must run the same Sparrow version)")
    if total != HEADER_BYTES + blen + align(mlen) + TRAILER_BYTES or tlen > blen or tlen % TABLE_ENTRY_BYTES:
        raise CorruptPayloadError("bucket header lengths are inconsistent")
    if size != total:
        if size < total:
            raise TruncatedPayloadError(f"bucket truncated: {size} bytes of {total}")
        raise TruncatedPayloadError(f"bucket has {size - total} trailing bytes beyond its {total} bytes")
    mstart = HEADER_BYTES + blen
    mall = read(mstart, mstart + align(mlen))
    mbytes, mpad = mall[:mlen], mall[mlen:]
    trailer = read(size - TRAILER_BYTES, size)
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
    info, entries, hashes = _check_manifest(man, blen - tlen)
    _need(tlen == (TABLE_ENTRY_BYTES * len(entries) if hashes else 0), "hash table length")
    if hashes and entries:
        tab = struct.unpack(f"<{4 * len(entries)}I", read(HEADER_BYTES, HEADER_BYTES + tlen))
        for k_, e in enumerate(entries):
            e.base_hash = fold_lanes(tab[4 * k_], tab[4 * k_ + 1])
            e.target_hash = fold_lanes(tab[4 * k_ + 2], tab[4 * k_ + 3])
    body_all = bucket[HEADER_BYTES:HEADER_BYTES + blen]
    a, b = struct.unpack("<II", trailer[:8])
    lanes = hash_bytes_lanes(body_all)
    body_bad = (lanes[0] != a) | (lanes[1] != b)
    return BucketContents(info, entries, bucket[HEADER_BYTES + tlen:HEADER_BYTES + blen], body_bad, hashes)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise CorruptPayloadError(f"bad bucket manifest: {msg}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_manifest(man: Any, blen: int) -> tuple[BucketInfo, list[EntryMeta], bool]:
    _need(isinstance(man, dict), "not an object")
    _need(man.get("format") == BUCKET_FORMAT, f"format {man.get('format')!r}")
    _need(isinstance(man.get("run_id"), str), "run_id")
    for k in ("base_version", "target_version", "index"):
        _need(_is_int(man.get(k)) and man[k] >= 0, k)
    for k in ("last", "anchor", "hashes"):
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
    return info, out, man["hashes"]


def _hex64(k: int, key: str, h: Any) -> int | None:
    try:
        v = None if h is None else int(h, 16)
    except (TypeError, ValueError):
        raise CorruptPayloadError(f"bad bucket manifest: entry {k} {key} {h!r}") from None
    _need(v is None or 0 <= v < 1 << 64, f"entry {k} {key} out of range")
    return v


def _entry_error(k: int, what: str) -> CorruptPayloadError:
    return CorruptPayloadError(f"bad bucket manifest: entry {k} {what}")


def _check_entry(k: int, e: Any, end: int, blen: int) -> EntryMeta:
    """Entry ``k`` of a manifest, checked field by field (``end``: where the previous body ended). Runs for every
    entry of every bucket applied, so a message is only formatted for a check that fails."""
    def need(cond: bool, what: str) -> None:
        if not cond:
            raise _entry_error(k, what)

    need(isinstance(e, dict), "is not an object")
    need(isinstance(e.get("name"), str), "name")
    dtype = dtype_from_name(e.get("dtype"))
    shape = e.get("shape")
    need(isinstance(shape, list) and all(_is_int(s) and s >= 0 for s in shape), "shape")
    for f in ("start", "length", "offset", "nbytes", "nchanged"):
        need(_is_int(e.get(f)) and e[f] >= 0, f)
    need(e["start"] + e["length"] <= math.prod(shape), "range beyond its tensor")
    need(e["nchanged"] <= e["length"], "nchanged > length")
    codec = e.get("codec")
    if not (isinstance(codec, str) and codec and codec != "auto"):
        raise _entry_error(k, f"codec {codec!r}")
    if not (e["offset"] % 16 == 0 and e["offset"] >= end and e["offset"] + e["nbytes"] <= blen):
        raise _entry_error(k, f"body range [{e['offset']}, +{e['nbytes']}) (body {blen} bytes)")
    span = None
    if codec in CODEC_NAMES:
        if "payload" in e:
            raise _entry_error(k, f"(a built-in {codec} entry) has a payload field")
        check_body_length(codec, dtype, e["length"], e["nchanged"], e["nbytes"])
        if codec == "compact":
            span = e.get("span_log2")
            if not (_is_int(span) and MIN_SPAN_LOG2 <= span <= MAX_SPAN_LOG2):
                raise _entry_error(k, f"span_log2 {span!r}")
        elif "span_log2" in e:
            raise _entry_error(k, f"(a {codec} entry) has a span_log2")
        payload = None
    else:  # a user codec: its body is checked by its own apply_
        payload = _check_user_payload(k, e.get("payload"))
    return EntryMeta(e["name"], dtype, tuple(shape), e["start"], e["length"], codec, e["offset"], e["nbytes"],
                     e["nchanged"], None, None, payload, span)


def _check_user_payload(k: int, p: Any) -> dict[str, Any]:
    _need(isinstance(p, dict) and set(p) == {"codec", "target_hash", "extra"},
          f"entry {k} payload {p!r} (a user codec entry needs codec, target_hash, extra)")
    _need(isinstance(p["codec"], str) and bool(p["codec"]), f"entry {k} payload codec {p['codec']!r}")
    _hex64(k, "payload target_hash", p["target_hash"])
    _need(isinstance(p["extra"], dict), f"entry {k} payload extra")
    return p

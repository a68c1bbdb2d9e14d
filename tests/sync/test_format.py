"""The wire formats: a compact body worked out by hand (pins the layout for both implementations), and buckets /
payloads of earlier formats refused with a clear error."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sparrow.sync as sync
from sparrow.kernels.sync import api, reference
from sparrow.sync import CorruptPayloadError, Payload, SyncReceiver, SyncSender
from sparrow.kernels.sync.common import combine_hash
from sparrow.sync._util import _hash_host_bytes, hash_bytes, hash_bytes_lanes
from sparrow.sync.bucket import BUCKET_FORMAT, HEADER_BYTES, parse_bucket

from .conftest import TRITON_DEVICE

IMPLS = ["reference"] + (["triton"] if api.triton_available() else [])


def _hand_case():
    # 8 bf16 elements; element 1 moves by -1 ULP (v = 1, k = 0), element 5 by +1 ULP (v = 2, k = 1)
    old = torch.tensor([100, 200, 300, 400, 500, 600, 700, 800], dtype=torch.int16)
    new = old.clone()
    new[1] -= 1
    new[5] += 1
    # one block (span 8, cnt 2, K 1): L = floor(log2(8 // 2)) = 2, high region 2 + (7 >> 2) = 3 bits
    want = [0, 1, 0,  # header: rank offset 0, value bits 1, body offset 0
            0b0101,  # A, low bits: u = 1 and 5, 2 bits each: 1 | 1 << 2
            0b0101,  # B, high parts in unary: bit (1 >> 2) + 0 = 0, bit (5 >> 2) + 1 = 2
            0b0101,  # C, code lengths in unary: bit k0 + 0 = 0, bit k0 + k1 + 1 = 2
            0]  # D, code bits: v0 = 1 has none, v1 = 2 keeps 2 - 2**1 = 0 in its 1 bit
    return old, new, want


@pytest.mark.parametrize("impl", IMPLS)
def test_compact_body_worked_by_hand(impl):
    old, new, want = _hand_case()
    dev = TRITON_DEVICE if impl == "triton" else torch.device("cpu")
    o, x = old.to(dev), new.to(dev)
    scan = api.scan_blocks([o], [x], span_log2=10, impl=impl)
    assert scan.counts.tolist() == [2] and scan.words.tolist() == [len(want)]
    out = torch.zeros(64, dtype=torch.uint8, device=dev)
    api.write_bodies([o], [x], scan, [2], [len(want)], ["compact"], out, [0])
    assert out[:4 * len(want)].view(torch.int32).tolist() == want
    assert reference.compact_encode(old, new, 10).tolist() == want
    pos, v = api.decode_compact(torch.tensor(want, dtype=torch.int32), 8, 16, 2, 10)
    assert pos.tolist() == [1, 5] and v.tolist() == [1, 2]


def test_old_bucket_format_is_refused_clearly():
    sender = SyncSender({"w": torch.zeros(64, dtype=torch.bfloat16)}, bucket_bytes=4096)
    new = {"w": torch.ones(64, dtype=torch.bfloat16)}
    (bucket, _), = list(sender.encode(new))
    raw = bytearray(bucket.numpy().tobytes())
    magic, fmt, *rest = struct.unpack_from("<8sIIQQQQQ", raw)
    assert fmt == BUCKET_FORMAT == 3
    head = struct.pack("<8sIIQQQQQ", magic, 2, *rest)  # the same bucket claiming the previous format
    raw[:HEADER_BYTES] = head + struct.pack("<Q", hash_bytes(head))
    with pytest.raises(CorruptPayloadError, match="unsupported bucket format 2.*same Sparrow version"):
        parse_bucket(bytes(raw))
    rx = SyncReceiver({"w": torch.zeros(64, dtype=torch.bfloat16)})
    with pytest.raises(CorruptPayloadError, match="format 2"):
        rx.apply_bucket(torch.frombuffer(raw, dtype=torch.uint8))
    assert torch.equal(rx.tensors["w"], torch.zeros(64, dtype=torch.bfloat16))


def test_old_payload_format_is_refused_clearly():
    p = sync.encode(torch.zeros(100), torch.ones(100), codec="coo")
    raw = bytearray(p.to_bytes())
    magic, hlen, fmt, blen, hh, bh = struct.unpack_from("<8sIIQQQ", raw)
    assert fmt == 2
    struct.pack_into("<8sIIQQQ", raw, 0, magic, hlen, 1, blen, hh, bh)
    with pytest.raises(CorruptPayloadError, match="unsupported payload format 1.*re-encode"):
        Payload.from_bytes(bytes(raw))


def test_compact_payload_needs_its_span():
    base = torch.randn(3000).to(torch.bfloat16)
    new = base.clone()
    new.view(torch.int16)[::7] += 1
    p = sync.encode(base, new, codec="compact", span_log2=11)
    assert p.extra["span_log2"] == 11
    q = Payload.from_bytes(p.to_bytes())
    out = base.clone()
    sync.apply_(out, q)
    assert torch.equal(out.view(torch.int16), new.view(torch.int16))
    for bad in ({}, {"span_log2": 9}, {"span_log2": "11"}):
        crafted = Payload("compact", p.dtype, p.shape, p.nchanged, p.data, extra=bad)
        with pytest.raises(CorruptPayloadError, match="span_log2"):
            Payload.from_bytes(crafted.to_bytes())


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_host_bytes_hash_equals_the_reference(data):
    """Header and manifest hashes (host bytes, numpy) are the reference's lanes over the zero-padded words. The
    negative control: the bytes without their last, partial word (non-zero) hash to something else."""
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
    assert _hash_host_bytes(data) == hash_bytes(data) == combine_hash(hash_bytes_lanes(t, impl="reference"))
    if len(data) % 4 and data[-(len(data) % 4):].strip(b"\0"):
        assert _hash_host_bytes(data[:len(data) - len(data) % 4]) != hash_bytes(data)


def test_host_bytes_hash_of_awkward_lengths_and_buffers():
    rng = torch.Generator().manual_seed(3)
    for n in (0, 1, 3, 4, 5, 63, 100, 123, 4097, 70001):
        raw = bytes(torch.randint(0, 256, (n,), generator=rng, dtype=torch.uint8).tolist())
        ref = combine_hash(hash_bytes_lanes(torch.tensor(list(raw), dtype=torch.uint8), impl="reference"))
        assert hash_bytes(raw) == hash_bytes(bytearray(raw)) == hash_bytes(memoryview(raw)) == ref, n
        if n % 2 == 0:  # a view of 2-byte items: its len() counts items, the hash reads its bytes
            assert hash_bytes(memoryview(raw).cast("H")) == ref, n


_COMPACT = {"name": "w", "dtype": "bfloat16", "shape": [4, 1024], "start": 1024, "length": 2048, "codec": "compact",
            "offset": 32, "nbytes": 64, "nchanged": 20, "span_log2": 12}


@pytest.mark.parametrize("change,match", [
    pytest.param(None, None, id="valid"),
    pytest.param({"name": 3}, "entry 2 name", id="name"),
    pytest.param({"dtype": "int8"}, "unknown dtype", id="dtype"),
    pytest.param({"shape": [4, -1]}, "entry 2 shape", id="shape"),
    pytest.param({"start": -1}, "entry 2 start", id="start"),
    pytest.param({"nbytes": True}, "entry 2 nbytes", id="bool-is-not-a-count"),
    pytest.param({"length": 3073}, "range beyond its tensor", id="beyond-tensor"),
    pytest.param({"nchanged": 2049}, "nchanged > length", id="nchanged"),
    pytest.param({"codec": "auto"}, "codec 'auto'", id="codec-auto"),
    pytest.param({"offset": 40}, r"body range \[40, \+64\)", id="offset-unaligned"),
    pytest.param({"offset": 16}, r"body range \[16, \+64\)", id="overlaps-previous"),
    pytest.param({"nbytes": 96}, r"body range \[32, \+96\) \(body 112 bytes\)", id="past-body"),
    pytest.param({"payload": {}}, "has a payload field", id="builtin-with-payload"),
    pytest.param({"span_log2": 9}, "span_log2 9", id="span-too-small"),
    pytest.param({"span_log2": None}, "span_log2 None", id="span-missing"),
    pytest.param({"nbytes": 62}, "compact body of 62 bytes", id="body-length"),
    pytest.param({"codec": "coo", "nchanged": 8, "nbytes": 48}, "has a span_log2", id="coo-with-span"),
])
def test_manifest_entry_checks(change, match):
    """Every check of a bucket manifest's entry refuses its own kind of bad field with a message naming the entry
    (entry 2, the previous body ending at byte 32 of a 112-byte body); the valid entry passes unchanged."""
    from sparrow.sync.bucket import _check_entry

    e = dict(_COMPACT, **(change or {}))
    if change is None:
        meta = _check_entry(2, e, 32, 112)
        assert meta.to_json() == e and meta.span_log2 == 12
        return
    with pytest.raises(CorruptPayloadError, match=match):
        _check_entry(2, e, 32, 112)

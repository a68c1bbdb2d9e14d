"""Bad input to ``Payload.from_bytes`` / ``apply_``: a clear error and the target untouched (bitwise)."""

from __future__ import annotations

import struct

import pytest
import torch

import sparrow.sync as sync
from sparrow.sync import (
    CorruptPayloadError,
    HashMismatchError,
    Payload,
    ShapeMismatchError,
    TruncatedPayloadError,
)

from .conftest import bits, bits_equal, make_pair


@pytest.fixture(params=["compact", "coo", "dense"])
def encoded(request):
    base, new = make_pair(torch.bfloat16, 3000, 0.05, seed=11)
    return base, new, sync.encode(base, new, codec=request.param)


def _untouched_after(fn, target: torch.Tensor, exc):
    before = bits(target).clone()
    with pytest.raises(exc) as info:
        fn()
    assert torch.equal(bits(target), before), "target modified by a failed apply"
    return str(info.value)


def test_truncated_and_trailing(encoded):
    base, _, p = encoded
    raw = p.to_bytes()
    for cut in (0, 10, 39, 40, len(raw) // 2, len(raw) - 1):
        with pytest.raises(TruncatedPayloadError):
            Payload.from_bytes(raw[:cut])
    with pytest.raises(TruncatedPayloadError, match="trailing"):
        Payload.from_bytes(raw + b"\0")


def test_every_corrupted_byte_is_detected(encoded):
    base, _, p = encoded
    raw = bytearray(p.to_bytes())
    step = max(1, len(raw) // 97)
    for k in range(0, len(raw), step):
        bad = bytearray(raw)
        bad[k] ^= 0x40
        with pytest.raises(CorruptPayloadError):
            Payload.from_bytes(bytes(bad))


def test_bad_magic_and_format(encoded):
    _, _, p = encoded
    raw = bytearray(p.to_bytes())
    raw[:4] = b"XXXX"
    with pytest.raises(CorruptPayloadError, match="magic"):
        Payload.from_bytes(bytes(raw))


def test_wrong_target_shape_dtype(encoded):
    base, _, p = encoded
    for target in (torch.zeros(2999, dtype=torch.bfloat16), torch.zeros(3000, dtype=torch.float16),
                   torch.zeros(3, 1000, dtype=torch.bfloat16)):
        msg = _untouched_after(lambda: sync.apply_(target, p), target, ShapeMismatchError)
        assert "target is" in msg


def test_wrong_base_is_detected_by_hash_and_undone(encoded):
    base, new, p = encoded
    other = base.clone()
    other.view(torch.int16)[5] ^= 1  # receiver diverged by one bit
    if p.codec == "dense":  # a dense payload does not depend on the base
        sync.apply_(other, p)
        assert bits_equal(other, new)
        return
    msg = _untouched_after(lambda: sync.apply_(other, p), other, HashMismatchError)
    assert "resync" in msg


def _craft(base, codec, nchanged, body: torch.Tensor, extra: dict | None = None) -> Payload:
    """A payload with valid checksums but a malicious body."""
    extra = extra if extra is not None else ({"span_log2": 10} if codec == "compact" else {})
    return Payload.from_bytes(Payload(codec, base.dtype, tuple(base.shape), nchanged, body, extra=extra).to_bytes())


def test_out_of_range_and_unordered_indices_rejected_before_write():
    base = torch.randn(100).to(torch.bfloat16)
    vals = torch.tensor([1, 2], dtype=torch.int16).view(torch.uint8)
    for idx in ([5, 100], [-1, 5], [7, 7], [9, 3]):
        body = torch.cat([torch.tensor(idx, dtype=torch.int32).view(torch.uint8), vals])
        p = _craft(base, "coo", 2, body)
        _untouched_after(lambda: sync.apply_(base, p), base, CorruptPayloadError)
    # compact body whose block header claims more changes than the block holds
    b2, n2 = make_pair(torch.bfloat16, 100, 0.2, seed=2)
    good = sync.encode(b2, n2, codec="compact")
    words = good.data.view(torch.int32).clone()
    words[0] = 100  # the first block's rank offset must be 0
    p = _craft(b2, "compact", good.nchanged, words.view(torch.uint8), good.extra)
    _untouched_after(lambda: sync.apply_(b2, p), b2, CorruptPayloadError)


def test_body_length_inconsistent():
    base = torch.randn(10).to(torch.float32)
    with pytest.raises(CorruptPayloadError, match="expected"):
        _craft(base, "dense", 0, torch.zeros(39, dtype=torch.uint8))
    with pytest.raises(CorruptPayloadError, match="expected"):
        _craft(base, "coo", 2, torch.zeros(15, dtype=torch.uint8))


def test_header_fields_validated():
    base = torch.randn(10).to(torch.float32)
    p = Payload("dense", base.dtype, (10,), 0, base.view(torch.uint8))
    raw = p.to_bytes()
    magic, hlen, fmt, blen, _, bh = struct.unpack_from("<8sIIQQQ", raw)
    head = raw[40:40 + hlen].replace(b'"float32"', b'"float64"')
    from sparrow.sync._util import hash_bytes

    forged = struct.pack("<8sIIQQQ", magic, len(head), fmt, blen, hash_bytes(head), bh) + head + raw[40 + hlen:]
    with pytest.raises(CorruptPayloadError, match="dtype"):
        Payload.from_bytes(forged)


def test_encode_input_validation():
    a = torch.zeros(4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="shape"):
        sync.encode(a, torch.zeros(5, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="dtype"):
        sync.encode(a, torch.zeros(4, dtype=torch.float16))
    with pytest.raises(TypeError, match="unsupported dtype"):
        sync.encode(torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="unknown codec"):
        sync.encode(a, a, codec="zip")


def test_payload_roundtrip_fields(encoded):
    base, new, p = encoded
    q = Payload.from_bytes(p.to_bytes())
    assert (q.codec, q.dtype, q.shape, q.nchanged, q.target_hash) == (p.codec, p.dtype, p.shape, p.nchanged,
                                                                      p.target_hash)
    assert torch.equal(q.data, p.data) and q.nbytes == p.nbytes
    out = base.clone()
    sync.apply_(out, q)
    assert bits_equal(out, new)


def test_compact_ratio_at_one_percent():
    """>= 100x smaller than dense bf16 at 1 % density with realistic +-1..3 ULP changes."""
    base, new = make_pair(torch.bfloat16, 1 << 20, 0.01, seed=5, special_frac=0.0, big_frac=0.0)
    p = sync.encode(base, new, codec="compact")
    ratio = p.dense_nbytes / p.nbytes
    bound = sync.position_entropy_bits(base.numel(), p.nchanged) / 8
    assert ratio >= 100, ratio
    assert p.nbytes >= bound  # cannot beat the entropy of the positions

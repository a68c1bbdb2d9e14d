"""Property: ``apply_(base, encode(base, new))`` reproduces ``new`` bit for bit, for every codec, dtype,
size (empty, 1, awkward, > 2^24 on GPU), density 0-100 % and special values - plus negative controls
showing that float ``!=`` or a NaN sentinel break exactly this property."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

import sparrow.sync as sync
from sparrow.sync import Payload, WeightCodec

from .conftest import BITS, FLOAT_DTYPES, bits, bits_equal, make_pair, specials

CODECS = ["dense", "coo", "compact", "auto"]
SETTINGS = dict(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)


@st.composite
def pairs(draw):
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    n = draw(st.one_of(st.just(0), st.just(1), st.integers(2, 64), st.integers(65, 5000)))
    density = draw(st.one_of(st.sampled_from([0.0, 0.001, 0.01, 0.1, 0.5, 1.0]), st.floats(0.0, 1.0)))
    special_frac = draw(st.sampled_from([0.0, 0.05, 0.5]))
    seed = draw(st.integers(0, 2**31 - 1))
    base, new = make_pair(dtype, n, density, seed=seed, special_frac=special_frac)
    shape = draw(st.sampled_from(["flat", "2d"]))
    if shape == "2d" and n % 4 == 0 and n:
        base, new = base.view(4, -1), new.view(4, -1)
    return base, new


def roundtrip_ok(codec, base: torch.Tensor, new: torch.Tensor, via_bytes: bool = True) -> bool:
    """The property body: encode, (serialise), apply to a copy of base, compare bit patterns."""
    before = bits(base).clone()
    payload = sync.encode(base, new, codec=codec)
    assert torch.equal(bits(base), before), "encode must not modify base"
    if via_bytes:
        payload = Payload.from_bytes(payload.to_bytes())
    out = base.clone()
    sync.apply_(out, payload, verify=False)
    return bits_equal(out, new)


@pytest.mark.parametrize("codec", CODECS)
@settings(**SETTINGS)
@given(pair=pairs())
def test_lossless(codec, pair):
    base, new = pair
    assert roundtrip_ok(codec, base, new)


@settings(**SETTINGS)
@given(pair=pairs())
def test_auto_is_smallest_and_never_worse_than_dense(pair):
    base, new = pair
    p = sync.encode(base, new, codec="auto")
    sizes = p.extra["sizes"]
    assert p.nbytes == min(sizes.values())
    assert p.nbytes <= base.numel() * base.element_size()
    assert p.nchanged == int((bits(base) != bits(new)).sum())


def test_special_values_every_transition():
    """Every special value to every other special value (incl. +0 <-> -0 and NaN payload changes)."""
    for dtype in FLOAT_DTYPES:
        sp = specials(dtype)
        base = sp.repeat_interleave(sp.numel()).view(dtype)
        new = sp.repeat(sp.numel()).view(dtype)
        for codec in CODECS:
            assert roundtrip_ok(codec, base, new), (dtype, codec)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("codec", ["compact", "auto", "coo"])
def test_lossless_large_gpu(codec):
    n = (1 << 24) + 12345
    base, new = make_pair(torch.bfloat16, n, 0.02, seed=3)
    base, new = base.cuda(), new.cuda()
    assert roundtrip_ok(codec, base, new, via_bytes=False)


# ---------------------------------------------------------------------------------------------------
# negative controls
# ---------------------------------------------------------------------------------------------------

class FloatNeCodec(WeightCodec):
    """Deliberately broken: finds changes with float ``!=`` (misses +0.0 <-> -0.0)."""

    name = "float-ne"

    def encode(self, base, new):
        idx = torch.nonzero((base != new).reshape(-1)).reshape(-1)
        vals = bits(new).reshape(-1)[idx]
        body = torch.cat([idx.to(torch.int32).view(torch.uint8), vals.contiguous().view(torch.uint8)])
        return Payload("coo", base.dtype, tuple(base.shape), idx.numel(), body)

    def apply_(self, base, payload):
        sync.apply_(base, payload, verify=False)


class NanSentinelCodec(WeightCodec):
    """Deliberately broken: dense values with NaN meaning "unchanged" (loses changes *to* NaN)."""

    name = "nan-sentinel"

    def encode(self, base, new):
        changed = bits(base) != bits(new)
        out = torch.where(changed, new, torch.full_like(new, float("nan")))
        return Payload("dense", base.dtype, tuple(base.shape), int(changed.sum()), bits(out).reshape(-1).view(torch.uint8))

    def apply_(self, base, payload):
        vals = payload.data.view(BITS[base.dtype]).view(base.dtype).view(base.shape)
        keep = torch.isnan(vals)
        base.copy_(torch.where(keep, base, vals))


def _broken_roundtrip_ok(codec: WeightCodec, base, new) -> bool:
    out = base.clone()
    codec.apply_(out, codec.encode(base, new))
    return bits_equal(out, new)


@pytest.mark.parametrize("codec", [FloatNeCodec(), NanSentinelCodec()], ids=lambda c: c.name)
def test_negative_control_fails_crafted(codec):
    for dtype in FLOAT_DTYPES:
        base = torch.tensor([0.0, 1.0, float("nan"), -0.0, 2.0], dtype=dtype)
        new = torch.tensor([-0.0, 1.0, float("nan"), 0.0, float("nan")], dtype=dtype)
        assert not _broken_roundtrip_ok(codec, base, new)
        assert roundtrip_ok("auto", base, new)


@pytest.mark.parametrize("codec", [FloatNeCodec(), NanSentinelCodec()], ids=lambda c: c.name)
def test_negative_control_fails_the_property(codec):
    """Hypothesis, with the same strategy as the lossless property, finds a counterexample."""
    base, new = find(pairs(), lambda p: not _broken_roundtrip_ok(codec, *p),
                     settings=settings(max_examples=300, deadline=None, database=None))
    assert not _broken_roundtrip_ok(codec, base, new)
    assert roundtrip_ok("compact", base, new)

"""The cores the single-payload API and the bucketed sender / receiver share, checked from both entry points:

* :func:`sparrow.sync._util.cut_runs` (buckets of at most ``bucket_bytes``, encode and decode launches of at most
  so many changes): a property test, with a negative control that must fail it;
* the encode core (:func:`sparrow.sync.codecs.plan_encode` + ``write_jobs``): ``sync.encode`` of a tensor and the
  ``SyncSender``'s bucket entry of the same change hold the same body, byte for byte;
* the apply core (:func:`sparrow.sync.apply.apply_entries`): ``sync.apply_`` of a payload and ``SyncReceiver``'s
  apply of a bucket carrying the same body give the same bits, or refuse with the same error and write nothing,
  for intact and corrupted bodies alike (a property test, with a negative control that must fail it).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

import sparrow.sync as sync
from sparrow.kernels.sync import api
from sparrow.kernels.sync.common import combine_hash
from sparrow.sync import BucketInfo, EntryMeta, Payload, SyncError, SyncReceiver, SyncSender, build_bucket, parse_bucket
from sparrow.sync._util import cut_runs

from .conftest import FLOAT_DTYPES, TRITON_DEVICE, bits, make_pair

IMPLS = ["reference"] + (["triton"] if api.triton_available() else [])

SETTINGS = dict(max_examples=200, deadline=None, database=None)


def _cap_at_a_prefix_sum(sizes: list[int]):
    """``sizes`` with a cap equal to one of its prefix sums: the boundary where a run fills the cap exactly."""
    sums = [s for s in itertools.accumulate(sizes) if s > 0]
    return st.tuples(st.just(sizes), st.sampled_from(sums) if sums else st.integers(1, 120))


# random caps rarely equal a run's sum, so half the cases are drawn at that boundary
sizes_and_caps = st.one_of(
    st.tuples(st.lists(st.integers(0, 50), max_size=30), st.integers(1, 120)),
    st.lists(st.integers(0, 50), min_size=1, max_size=30).flatmap(_cap_at_a_prefix_sum),
)


def runs_are_greedy(sizes: list[int], cap: int, runs: list[tuple[int, int]]) -> bool:
    """The cut's contract: consecutive runs covering every item in order, each of at least one item, summing to at
    most ``cap`` unless it is one item, and each as long as it can be (the next item would not fit)."""
    ends = [0, *(b for _, b in runs)]
    if [a for a, _ in runs] != ends[:-1] or ends[-1] != len(sizes):
        return False
    for a, b in runs:
        if b <= a or (b - a > 1 and sum(sizes[a:b]) > cap):
            return False
        if b < len(sizes) and sum(sizes[a:b + 1]) <= cap:
            return False
    return True


@settings(**SETTINGS)
@given(case=sizes_and_caps)
def test_cut_runs_property(case):
    sizes, cap = case
    assert runs_are_greedy(sizes, cap, cut_runs(sizes, cap))


def test_cut_runs_examples():
    assert cut_runs([], 10) == []
    assert cut_runs([3, 4, 3, 1], 10) == [(0, 3), (3, 4)]
    assert cut_runs([11, 2, 12], 10) == [(0, 1), (1, 2), (2, 3)]  # an item over the cap is a run of its own
    assert cut_runs([0, 0, 5, 5], 10) == [(0, 4)]


def test_negative_control_a_strict_cut_fails_the_property():
    """A cut that stops one item early (``<`` for ``<=``) is found by the same property and strategy."""
    def strict(sizes, cap):
        runs, a = [], 0
        while a < len(sizes):
            b = a + 1
            while b < len(sizes) and sum(sizes[a:b + 1]) < cap:
                b += 1
            runs.append((a, b))
            a = b
        return runs

    sizes, cap = find(sizes_and_caps, lambda c: not runs_are_greedy(*c, strict(*c)), settings=settings(**SETTINGS))
    assert not runs_are_greedy(sizes, cap, strict(sizes, cap))


# ---------------------------------------------------------------------------------------------------
# the encode core
# ---------------------------------------------------------------------------------------------------

def _device(impl: str) -> torch.device:
    return TRITON_DEVICE if impl == "triton" else torch.device("cpu")


def _entry_bodies(bucket: torch.Tensor) -> dict[str, tuple[str, int, bytes]]:
    """``{tensor name: (codec, nchanged, body bytes)}`` of a bucket whose entries are whole tensors."""
    c = parse_bucket(bucket)
    body = c.body.cpu()
    return {e.name: (e.codec, e.nchanged, body[e.offset:e.offset + e.nbytes].numpy().tobytes()) for e in c.entries}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("codec", ["auto", "compact", "coo", "dense"])
def test_encode_and_the_sender_write_the_same_bodies(codec, impl):
    """Both entry points of the encode core, on the same changes: one ``sync.encode`` per tensor and one
    ``SyncSender`` sync of all of them give the same codec, change count and body bytes per tensor."""
    dev = _device(impl)
    cases = {"bf16": (torch.bfloat16, 3001, 0.05), "fp16": (torch.float16, 1, 1.0), "fp32": (torch.float32, 700, 0.6),
             "empty": (torch.bfloat16, 0, 0.0), "same": (torch.bfloat16, 100, 0.0),
             "bf16-dense": (torch.bfloat16, 257, 0.9)}
    pairs = {k: [t.to(dev) for t in make_pair(dt, n, d, seed=n + 7)] for k, (dt, n, d) in cases.items()}
    sender = SyncSender({k: b for k, (b, _) in pairs.items()}, codec=codec, bucket_bytes=1 << 20, impl=impl,
                        span_log2=10)
    (bucket, _), = list(sender.encode({k: x for k, (_, x) in pairs.items()}))
    got = _entry_bodies(bucket)
    for k, (b, x) in pairs.items():
        p = sync.encode(b, x, codec=codec, impl=impl, span_log2=10)
        assert got[k] == (p.codec, p.nchanged, p.data.cpu().numpy().tobytes()), k


# ---------------------------------------------------------------------------------------------------
# the apply core
# ---------------------------------------------------------------------------------------------------

def _flip(data: torch.Tensor, at: int | None, mask: int) -> torch.Tensor:
    """``data`` (uint8) with byte ``at`` (taken mod its length) xor ``mask``; unchanged for ``at=None``."""
    out = data.clone()
    if at is not None and out.numel():
        out[at % out.numel()] ^= mask
    return out


def via_apply_(base: torch.Tensor, p: Payload, impl: str, verify: bool = True):
    """Entry point 1: ``sync.apply_`` on a copy of ``base``. Returns ``(error class or None, the copy's bits)``."""
    out = base.clone()
    try:
        sync.apply_(out, p, impl=impl, verify=verify)
    except SyncError as exc:
        return type(exc), bits(out)
    return None, bits(out)


def via_receiver(base: torch.Tensor, p: Payload, impl: str, verify: bool | str = "full"):
    """Entry point 2: the same body as the one entry of a bucket, applied by a ``SyncReceiver`` holding a copy of
    ``base`` (hashes of base and target in the bucket's table, verified in full)."""
    n = base.numel()
    meta = EntryMeta("w", base.dtype, tuple(base.shape), 0, n, p.codec, 0, p.nbytes, p.nchanged,
                     target_hash=p.target_hash, base_hash=combine_hash(api.hash_bits(bits(base).reshape(-1), 0)),
                     span_log2=p.extra.get("span_log2"))
    bucket = build_bucket(BucketInfo("core", 0, 1, 0, True, False), [(meta, p.data)])
    rx = SyncReceiver({"w": base.clone()}, verify=verify, impl=impl)
    try:
        rx.apply_bucket(bucket)
    except SyncError as exc:
        return type(exc), bits(rx.tensors["w"])
    return None, bits(rx.tensors["w"])


@st.composite
def corrupted_payloads(draw, max_n: int = 3000):
    """A payload of a random change (every built-in codec, dtype, size) whose body may have one byte flipped."""
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    n = draw(st.one_of(st.just(1), st.integers(2, 64), st.integers(65, max_n)))
    density = draw(st.sampled_from([0.0, 0.01, 0.2, 1.0]))
    base, new = make_pair(dtype, n, density, seed=draw(st.integers(0, 2**31 - 1)))
    codec = draw(st.sampled_from(["compact", "coo", "dense"]))
    p = sync.encode(base, new, codec=codec, span_log2=10)
    at = draw(st.one_of(st.none(), st.integers(0, 1 << 20)))
    data = _flip(p.data, at, draw(st.sampled_from([0x01, 0x10, 0x80])))
    return base, new, Payload(p.codec, p.dtype, p.shape, p.nchanged, data, p.target_hash, extra=p.extra)


def same_outcome(case, impl: str = "reference", receiver_verify: bool | str = "full") -> bool:
    base, new, p = case
    dev = _device(impl)
    base, p = base.to(dev), Payload(p.codec, p.dtype, p.shape, p.nchanged, p.data.to(dev), p.target_hash,
                                    extra=p.extra)
    (e1, b1), (e2, b2) = via_apply_(base, p, impl), via_receiver(base, p, impl, receiver_verify)
    if e1 is not None and not torch.equal(b1, bits(base)):
        return False  # a refused apply must leave its target as it was
    return e1 == e2 and torch.equal(b1, b2)


CORE_SETTINGS = dict(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@settings(**CORE_SETTINGS)
@given(case=corrupted_payloads())
def test_apply_and_the_receiver_agree(case):
    assert same_outcome(case)


@pytest.mark.skipif("triton" not in IMPLS, reason="triton not installed")
@settings(**dict(CORE_SETTINGS, max_examples=60 if torch.cuda.is_available() else 4))
@given(case=corrupted_payloads(max_n=1500))
def test_apply_and_the_receiver_agree_triton(case):
    assert same_outcome(case, "triton")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("codec", ["compact", "coo", "dense"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=["bf16", "fp16", "fp32"])
def test_apply_and_the_receiver_write_the_same_bits(dtype, codec, impl):
    """Intact payloads: both entry points reproduce ``new``, bit for bit (compared as integer bit patterns)."""
    base, new = make_pair(dtype, 2049, 0.05, seed=4)
    p = sync.encode(base, new, codec=codec, span_log2=10)
    dev = _device(impl)
    p.data = p.data.to(dev)
    (e1, b1), (e2, b2) = via_apply_(base.to(dev), p, impl), via_receiver(base.to(dev), p, impl)
    assert e1 is None and e2 is None
    assert torch.equal(b1, b2) and torch.equal(b1.cpu(), bits(new))


def test_negative_control_an_unverified_receiver_fails_the_property():
    """The same property against a receiver that does not verify hashes (``verify=False``) finds a corrupted body
    that ``apply_`` refuses and the receiver writes."""
    case = find(corrupted_payloads(), lambda c: not same_outcome(c, receiver_verify=False),
                settings=settings(**dict(CORE_SETTINGS, max_examples=300)))
    assert not same_outcome(case, receiver_verify=False) and same_outcome(case)

"""The cores the single-payload API and the bucketed sender / receiver share, checked from both entry points:

* :func:`sparrow.sync._util.cut_runs` (buckets of at most ``bucket_bytes``, encode and decode launches of at most
  so many changes): a property test, with a negative control that must fail it;
* the encode core (:func:`sparrow.sync.codecs.plan_encode` + ``write_jobs``): ``sync.encode`` of a tensor and the
  ``SyncSender``'s bucket entry of the same change hold the same body, byte for byte.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st

import sparrow.sync as sync
from sparrow.kernels.sync import api
from sparrow.sync import SyncSender, parse_bucket
from sparrow.sync._util import cut_runs

from .conftest import TRITON_DEVICE, make_pair

IMPLS = ["reference"] + (["triton"] if api.triton_available() else [])

SETTINGS = dict(max_examples=200, deadline=None, database=None)
sizes_and_caps = st.tuples(st.lists(st.integers(0, 50), max_size=30), st.integers(1, 120))


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

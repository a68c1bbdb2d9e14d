"""sparrow.sync.warmup: the kernels run once on private copies; the caller's tensors stay as they were."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sparrow.sync as ssync
from sparrow.kernels.sync import api
from sparrow.kernels.sync.common import bits_view
from sparrow.sync.warmup import flip_lowest_bits

from .conftest import TRITON_DEVICE

IMPLS = ["reference"] + (["triton"] if api.triton_available() else [])
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _state(device):
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(300, 7, generator=g).to(torch.bfloat16), "b": torch.randn(13, generator=g),
            "h": torch.randn(4096 + 5, generator=g).to(torch.float16), "e": torch.empty(0, dtype=torch.bfloat16)}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("codec", ["auto", "compact", "coo", "dense"])
def test_warmup_leaves_the_callers_tensors_alone(impl, codec):
    dev = TRITON_DEVICE if impl == "triton" else torch.device("cpu")
    state = {n: t.to(dev) for n, t in _state(dev).items()}
    before = {n: bits_view(t).clone() for n, t in state.items()}
    assert ssync.warmup(state, codec=codec, bucket_bytes=4096, impl=impl) >= 0.0
    assert all(torch.equal(bits_view(state[n]), before[n]) for n in state)


def test_warmup_takes_tensors_up_to_max_bytes(monkeypatch):
    seen = []
    real = ssync.warmup.__globals__["SyncSender"]

    class Spy(real):
        def __init__(self, named, **kw):
            seen.append(list(named))
            super().__init__(named, **kw)

    monkeypatch.setitem(ssync.warmup.__globals__, "SyncSender", Spy)
    state = _state("cpu")
    ssync.warmup(state, max_bytes=5000)
    assert seen == [["w", "b"]]  # 4200 + 52 bytes; "h" (8202) would pass 5000
    ssync.warmup(state, max_bytes=None)
    assert seen[-1] == list(state)


def test_warmup_syncs_reach_every_path_of_auto(monkeypatch):
    # the first sync changes a few elements, the last nearly all (blocks with several chunks of changes)
    seen = []
    real = ssync.warmup.__globals__["SyncSender"]

    class Spy(real):
        def send(self, new, transport, **kw):
            s = super().send(new, transport, **kw)
            seen.append(s.density)
            return s

    monkeypatch.setitem(ssync.warmup.__globals__, "SyncSender", Spy)
    ssync.warmup(_state("cpu"))
    assert len(seen) == 3 and seen[0] < 0.01 and seen[-1] > 0.85


def test_warmup_catches_a_receiver_that_does_not_apply(monkeypatch):
    # negative control: the bit-for-bit check at the end is what makes a warm-up a test of the codec too
    def drop(self, transport, **kw):  # takes every bucket off the transport, applies none
        while not transport.recv_bucket()[1]:
            pass

    monkeypatch.setattr(ssync.SyncReceiver, "receive", drop)
    with pytest.raises(RuntimeError, match="does not hold the sender's bits"):
        ssync.warmup(_state("cpu"))


def _changed_lowest_bits(before: torch.Tensor, after: torch.Tensor) -> tuple[int, bool]:
    """How many elements differ, and whether every difference is the lowest bit alone."""
    x = bits_view(before) ^ bits_view(after)
    return int((x != 0).sum()), bool(((x == 0) | (x == 1)).all())


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 700), density=st.floats(1e-4, 1.0), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 99))
def test_flip_lowest_bits_changes_the_lowest_bit_of_about_density_of_the_elements(n, density, dtype, seed):
    t = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)
    before = t.clone()
    k = flip_lowest_bits(t, density, host=torch.Generator().manual_seed(seed),
                         device=torch.Generator().manual_seed(seed))
    changed, lowest_only = _changed_lowest_bits(before, t)
    assert lowest_only
    if n == 0:
        assert k == 0 and changed == 0
    elif 2 * k <= n:  # random positions: a repeat flips one fewer
        assert 1 <= changed <= k == max(1, int(density * n))
    else:  # most: exactly k in one wrapped run
        assert changed == k


def test_flip_lowest_bits_negative_control():
    # a version that draws the run's positions at random (the old repeat problem) changes far fewer than k
    t = torch.randn(10_000).to(torch.bfloat16)
    before = t.clone()
    k = int(0.9 * t.numel())
    idx = torch.randint(0, t.numel(), (k,), generator=torch.Generator().manual_seed(0))
    bits = bits_view(t)
    bits[idx] = bits[idx] ^ 1
    changed, _ = _changed_lowest_bits(before, t)
    assert changed < 0.7 * k  # what the exact-count check above would refuse
    t = before.clone()
    assert _changed_lowest_bits(before, t)[0] == 0
    flip_lowest_bits(t, 0.9, host=torch.Generator().manual_seed(0), device=torch.Generator().manual_seed(0))
    assert _changed_lowest_bits(before, t)[0] == k

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


def _check_flips(flip, n: int, density: float, dtype: torch.dtype, seed: int) -> None:
    """``flip`` (as :func:`flip_lowest_bits`) on ``n`` random elements: only lowest bits change; a few drawn positions
    change at most ``k`` and at least one element, most of them exactly ``k``."""
    t = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)
    before = bits_view(t.clone())
    k = flip(t, density, host=torch.Generator().manual_seed(seed), device=torch.Generator().manual_seed(seed))
    x = before ^ bits_view(t)
    changed = int((x != 0).sum())
    assert bool(((x == 0) | (x == 1)).all()), "a bit other than the lowest changed"
    assert k == (0 if n == 0 else max(1, min(n, int(density * n))))
    if n and 2 * k <= n:  # random positions: a repeat flips one fewer
        assert 1 <= changed <= k
    else:  # most: exactly k, in one run that wraps
        assert changed == k, (changed, k)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(0, 700), density=st.floats(1e-4, 1.0), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 99))
def test_flip_lowest_bits_changes_the_lowest_bit_of_about_density_of_the_elements(n, density, dtype, seed):
    _check_flips(flip_lowest_bits, n, density, dtype, seed)


def _no_wrap(t, density, *, host, device):
    """Broken: the run of "most" stops at the end of the tensor instead of wrapping to its start."""
    bits = bits_view(t)
    n = bits.numel()
    k = max(1, min(n, int(density * n)))
    start = int(torch.randint(0, n, (1,), generator=host))
    bits[start:start + k] ^= 1
    return k


def _second_bit(t, density, *, host, device):
    """Broken: the same positions, bit 1 flipped instead of bit 0."""
    before = bits_view(t).clone()
    k = flip_lowest_bits(t, density, host=host, device=device)
    bits = bits_view(t)
    changed = bits != before
    bits[changed] = before[changed] ^ 2
    return k


@pytest.mark.parametrize("broken", [_no_wrap, _second_bit], ids=["no-wrap", "second-bit"])
def test_flip_check_negative_control(broken):
    """The check above fails a flip that does not wrap (90% of 500 from most starts runs past the end) and one that
    changes another bit than the lowest."""
    with pytest.raises(AssertionError):
        for seed in range(20):
            _check_flips(broken, 500, 0.9, torch.bfloat16, seed)

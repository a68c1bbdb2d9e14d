"""Fixtures and helpers for the SparseRL-Sync tests.

Without a GPU the Triton kernels run in the Triton interpreter: ``TRITON_INTERPRET=1`` must be set
before the kernels module is imported (it is imported lazily by ``sparrow.kernels.sync.api``).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

#: Where the Triton kernels run in the tests: compiled on a GPU, interpreted on the CPU otherwise.
TRITON_DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]

# Special bit patterns per dtype: +0, -0, +inf, -inf, quiet NaN, NaN with payloads (both signs),
# signalling NaN, smallest / largest subnormal, largest finite, -1 ULP around zero.
SPECIALS = {
    torch.int16: {
        torch.bfloat16: [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7FC1, 0xFFD5, 0x7F81, 0x0001, 0x007F, 0x7F7F,
                         0x8001, 0xFFFF],
        torch.float16: [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0x7E01, 0xFE55, 0x7C01, 0x0001, 0x03FF, 0x7BFF,
                        0x8001, 0xFFFF],
    },
    torch.int32: {
        torch.float32: [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7FC00001, 0xFFC12345,
                        0x7F800001, 0x00000001, 0x007FFFFF, 0x7F7FFFFF, 0x80000001, 0xFFFFFFFF],
    },
}


def specials(dtype: torch.dtype) -> torch.Tensor:
    """Special bit patterns of ``dtype`` as its bit dtype."""
    bd = BITS[dtype]
    vals = SPECIALS[bd][dtype]
    width = 16 if bd == torch.int16 else 32
    return torch.tensor([v - (1 << width) if v >= 1 << (width - 1) else v for v in vals], dtype=bd)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(BITS[t.dtype])


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (never float ==)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def make_pair(dtype: torch.dtype, n: int, density: float, *, seed: int = 0, special_frac: float = 0.05,
              big_frac: float = 0.02) -> tuple[torch.Tensor, torch.Tensor]:
    """A realistic (base, new) pair: random weights with specials; a ``density`` fraction of elements
    changed by a few ULPs of their bit pattern, some by random bits or to / from special values."""
    g = torch.Generator().manual_seed(seed)
    bd = BITS[dtype]
    width = 16 if bd == torch.int16 else 32
    base = (torch.randn(n, generator=g) * 0.02).to(dtype)
    bb = base.view(bd)
    sp = specials(dtype)
    if n and special_frac:
        k = torch.rand(n, generator=g) < special_frac
        bb[k] = sp[torch.randint(0, sp.numel(), (int(k.sum()),), generator=g)]
    nb = bb.clone()
    ch = torch.rand(n, generator=g) < density
    step = torch.randint(1, 4, (n,), generator=g) * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)
    nb64 = nb.to(torch.int64) + torch.where(ch, step, 0)
    nb64 = (nb64 + (1 << width)) % (1 << width)
    nb = (nb64 - ((nb64 >> (width - 1)) << width)).to(bd)
    big = ch & (torch.rand(n, generator=g) < big_frac)
    if big.any():
        lo, hi = (-(1 << 15), 1 << 15) if width == 16 else (-(1 << 31), (1 << 31) - 1)
        nb[big] = torch.randint(lo, hi, (int(big.sum()),), generator=g).to(bd)
    spc = ch & (torch.rand(n, generator=g) < special_frac)
    if spc.any():
        nb[spc] = sp[torch.randint(0, sp.numel(), (int(spc.sum()),), generator=g)]
    return base, nb.view(dtype)


@pytest.fixture
def pair_factory():
    return make_pair

"""Compile the sync kernels before the first real sync (:func:`warmup`)."""

from __future__ import annotations

import time
from typing import Mapping, Sequence

import torch

from ..kernels.common.impl import Impl
from ..kernels.sync.common import bits_view
from ._util import public_impl
from .base import WeightCodec
from .codecs import builtin_codec_name
from .receiver import SyncReceiver
from .sender import SyncSender
from .transport import InProcessTransport


def warmup(named_tensors: Mapping[str, torch.Tensor], *, codec: str | WeightCodec = "auto",
           bucket_bytes: int = 256 << 20, densities: Sequence[float] = (1e-3, 0.1, 0.9),
           max_bytes: int | None = 1 << 30, seed: int = 0, impl: Impl = "auto") -> float:
    """Send and apply a few syncs of made-up changes between private copies of ``named_tensors``, so that the
    sender's and receiver's kernels compile (Triton, on a GPU) now rather than inside the first sync that
    carries changed elements (a cost paid once per process). Each sync flips the lowest bit of a ``density``
    fraction of every tensor's elements (one sync per entry of ``densities``: sparse, dense-ish and nearly
    all-changed slices take different code paths of ``"auto"``) and the result is checked bit for bit.

    Args:
        named_tensors: the tensors a real sync will carry (read only; bf16 / fp16 / fp32).
        codec, bucket_bytes, impl: as the real :class:`SyncSender` / :class:`SyncReceiver` will use (a user
            :class:`~sparrow.sync.WeightCodec` is given to the private receiver too; ``impl=None``:
            deprecated spelling of ``"auto"``).
        max_bytes: take tensors in order until this many bytes (None: all); memory is three copies of them.

    Returns: the seconds it took.

    Raises:
        RuntimeError: the receiver's copy does not hold the sender's bits afterwards (a broken codec).
        ValueError / TypeError: as :class:`SyncSender` for a bad ``codec``, ``bucket_bytes`` or ``impl``.
    """
    t0 = time.perf_counter()
    impl = public_impl(impl)
    user = [] if isinstance(codec, str) or builtin_codec_name(codec) is not None else [codec]
    chosen: dict[str, torch.Tensor] = {}
    total = 0
    for name, t in named_tensors.items():
        if max_bytes is not None and chosen and total + t.numel() * t.element_size() > max_bytes:
            break
        chosen[name] = t.detach()
        total += t.numel() * t.element_size()
    sender = SyncSender(chosen, codec=codec, bucket_bytes=bucket_bytes, impl=impl)
    held = {n: t.clone(memory_format=torch.contiguous_format) for n, t in chosen.items()}
    receiver = SyncReceiver(held, codecs=user, impl=impl)
    new = {n: t.clone(memory_format=torch.contiguous_format) for n, t in chosen.items()}
    transport = InProcessTransport()
    g = torch.Generator().manual_seed(seed)
    devices: dict[torch.device, torch.Generator] = {}
    for density in densities:
        for t in new.values():
            dev = devices.setdefault(t.device, torch.Generator(device=t.device).manual_seed(seed))
            flip_lowest_bits(t, density, host=g, device=dev)
        sender.send(new, transport)
        receiver.receive(transport)
    if not all(torch.equal(bits_view(held[n]), bits_view(new[n])) for n in new):
        raise RuntimeError("sync warm-up: the receiver's copy does not hold the sender's bits")
    if any(t.is_cuda for t in new.values()):
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def flip_lowest_bits(t: torch.Tensor, density: float, *, host: torch.Generator, device: torch.Generator) -> int:
    """Flip the lowest bit of about ``density`` of the contiguous tensor ``t``'s elements, in place; returns how many
    positions were drawn (``k``). A few (``2k <= numel``): ``k`` random positions drawn on ``t``'s device with the
    generator ``device`` (a repeat now and then flips one position fewer, which matters to no code path); most:
    exactly ``k`` in one run from a random start (``host``, on the CPU) that wraps at the end (random draws repeat:
    90% drawn is 59% changed). No index is made on the host, so a gigabyte of weights costs the host nothing."""
    bits = bits_view(t)
    n = bits.numel()
    if n == 0:
        return 0
    k = max(1, min(n, int(density * n)))
    if 2 * k <= n:
        idx = torch.randint(0, n, (k,), generator=device, device=t.device)
        bits[idx] = bits[idx] ^ 1
    else:
        start = int(torch.randint(0, n, (1,), generator=host))
        head = min(k, n - start)
        bits[start:start + head] ^= 1
        bits[: k - head] ^= 1
    return k

"""The host syncs of a sync, counted: every read of a tensor's values into Python during ``send`` / ``receive``
(``tolist``, ``item``, ``bool`` / ``int`` / ``float``, ``cpu``). The sender reads once per sync (its
sizes, whatever the number of buckets), the receiver twice per bucket (the bucket's ends when it arrives, the
verdict after the apply). Hashing host bytes (the manifest, the header) touches no device and is not counted,
nor is the Triton interpreter's own bookkeeping."""

from __future__ import annotations

import sys
from contextlib import contextmanager

import pytest
import torch

from sparrow.kernels.sync import api
from sparrow.sync import InProcessTransport, SyncReceiver, SyncSender
from sparrow.sync import _util
from sparrow.sync import apply as apply_core

from .conftest import TRITON_DEVICE, bits

pytestmark = pytest.mark.skipif(not api.triton_available(), reason="triton not installed")

_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "cpu")  # numpy() needs cpu() first


@contextmanager
def count_host_reads(monkeypatch):
    """Counts value reads of tensors made outside the installed packages (so not by torch or the Triton
    interpreter), except while hashing host bytes."""
    seen: list[str] = []
    host_only = [0]
    real_hash_bytes = _util.hash_bytes

    def hash_bytes(data, impl="auto"):
        host_only[0] += 1
        try:
            return real_hash_bytes(data, impl)
        finally:
            host_only[0] -= 1

    def spy(name, real):
        def wrapped(self, *a, **kw):
            if not host_only[0]:
                f = sys._getframe(1)
                if "site-packages" not in f.f_code.co_filename:  # ours, not torch's or the interpreter's
                    seen.append(f"{f.f_code.co_filename.rsplit('/', 1)[-1]}:{f.f_lineno} {name}")
            return real(self, *a, **kw)
        return wrapped

    for mod in ("sparrow.sync.bucket", "sparrow.sync.base"):
        monkeypatch.setattr(sys.modules[mod], "hash_bytes", hash_bytes)
    for name in _READS:
        monkeypatch.setattr(torch.Tensor, name, spy(name, getattr(torch.Tensor, name)))
    yield seen


def _moved(state, density, seed):
    """``state`` with a ``density`` fraction of each tensor's bit patterns moved by one."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in state.items():
        bd = torch.int16 if v.element_size() == 2 else torch.int32
        b = v.cpu().view(bd).clone()
        at = torch.rand(b.numel(), generator=g) < density
        b[at] += 1
        out[k] = b.view(v.dtype).to(v.device)
    return out


def _state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": (torch.randn(6000, generator=g) * 0.02).to(torch.bfloat16),
            "v": (torch.randn(3000, generator=g) * 0.02).to(torch.bfloat16), "b": torch.randn(64, generator=g)}


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 1024], ids=["one-bucket", "many-buckets"])
def test_one_read_per_sync_sender_two_per_bucket_receiver(monkeypatch, bucket_bytes):
    state = {k: v.to(TRITON_DEVICE) for k, v in _state(0).items()}
    sender = SyncSender(state, bucket_bytes=bucket_bytes, impl="triton", span_log2=10, max_slice_elems=4096)
    rx = SyncReceiver({k: v.clone() for k, v in state.items()}, impl="triton", verify="incremental")
    rx.rehash([(n, s, ln) for n, s, ln in sender._slices])  # steady state: the running hashes are known
    new = _moved(state, 0.02 if bucket_bytes > 1024 else 0.4, 1)
    tr = InProcessTransport()
    with count_host_reads(monkeypatch) as seen:
        stats = sender.send(new, tr)
        sent = list(seen)
        seen.clear()
        rx.receive(tr)
        received = list(seen)
    assert stats.buckets >= (3 if bucket_bytes == 1024 else 1) and stats.codec_entries.get("compact", 0) > 0
    assert len(sent) == 1, sent
    assert len(received) == 2 * stats.buckets, received
    assert all(torch.equal(bits(rx.tensors[k]), bits(new[k])) for k in new)


def test_the_counter_sees_a_stray_read(monkeypatch):
    """Negative control: one ``.item()`` added to the apply path is counted."""
    state = {k: v.to(TRITON_DEVICE) for k, v in _state(2).items()}
    sender = SyncSender(state, bucket_bytes=1 << 20, impl="triton", span_log2=10)
    rx = SyncReceiver({k: v.clone() for k, v in state.items()}, impl="triton", verify=False)
    real = apply_core._write_sparse

    def with_a_read(st, keep_records, impl):
        real(st, keep_records, impl)
        st.err.item()

    monkeypatch.setattr(apply_core, "_write_sparse", with_a_read)
    new = _moved(state, 0.02, 3)
    tr = InProcessTransport()
    sender.send(new, tr)
    with count_host_reads(monkeypatch) as seen:
        rx.receive(tr)
    assert len(seen) == 3, seen

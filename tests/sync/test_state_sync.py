"""SyncSender / SyncReceiver: buckets, versions, anchors, integrity, transports."""

from __future__ import annotations

import pytest
import torch

from sparrow.sync import (
    CorruptPayloadError,
    FileTransport,
    HashMismatchError,
    InProcessTransport,
    OutOfOrderError,
    ReplayError,
    ResyncRequiredError,
    ShapeMismatchError,
    SyncReceiver,
    SyncSender,
    TruncatedPayloadError,
    VersionMismatchError,
    parse_bucket,
)

from .conftest import bits


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.GELU(), torch.nn.Linear(96, 40))


def _bf16(model):
    return {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}


def _step(model, opt):
    x = torch.randn(16, model[0].in_features)
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _same(receiver: SyncReceiver, ref: dict) -> bool:
    return all(torch.equal(bits(receiver.tensors[n]).cpu(), bits(t).cpu()) for n, t in ref.items())


def _snapshot(receiver: SyncReceiver) -> dict:
    return {n: bits(t).clone() for n, t in receiver.tensors.items()}


def _unchanged(receiver: SyncReceiver, snap: dict) -> bool:
    return all(torch.equal(bits(receiver.tensors[n]), b) for n, b in snap.items())


@pytest.fixture
def setup():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    sender = SyncSender(_bf16(model), bucket_bytes=2048, run_id="run-a")
    receiver = SyncReceiver({n: t.clone() for n, t in _bf16(model).items()})
    return model, opt, sender, receiver


def _sync_buckets(model, opt, sender):
    _step(model, opt)
    return list(sender.encode(dict(model.named_parameters())))


@pytest.mark.parametrize("codec", ["auto", "compact", "coo", "dense"])
def test_training_sync_bitwise(codec):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sender = SyncSender(_bf16(model), codec=codec, bucket_bytes=8192, anchor_every=4)
    tr = InProcessTransport(num_receivers=2)
    rx = [SyncReceiver({n: t.clone() for n, t in _bf16(model).items()}) for _ in range(2)]
    for step in range(6):
        _step(model, opt)
        stats = sender.send(dict(model.named_parameters()), tr)  # fp32 params are cast to bf16
        assert stats.buckets >= 1 and stats.anchor == ((step + 1) % 4 == 0)
        for i, r in enumerate(rx):
            rs = r.receive(tr.endpoint(i))
            assert rs.target_version == step + 1 and r.version == step + 1
            assert _same(r, _bf16(model))
        if codec in ("auto", "compact") and not stats.anchor:
            assert stats.wire_bytes < stats.dense_bytes


@pytest.mark.parametrize("verify", [True, "incremental"])
def test_a_tensor_whose_storage_moved_is_written_where_it_is_now(verify):
    """A receiver tensor given new storage after the receiver was built (``param.data = ...``, as fusing
    projections does) receives the next sync there, bit for bit. Negative control: a receiver that keeps its
    first bit views leaves the new storage stale."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    sender = SyncSender(_bf16(model), codec="compact", bucket_bytes=1 << 20)
    params = {n: torch.nn.Parameter(t.clone(), requires_grad=False) for n, t in _bf16(model).items()}
    rx = SyncReceiver(params, verify=verify)
    tr = InProcessTransport(num_receivers=1)
    _step(model, opt)
    sender.send(dict(model.named_parameters()), tr)
    rx.receive(tr.endpoint(0))
    for p in params.values():
        p.data = p.data.clone()  # new storage, same bits
    _step(model, opt)
    sender.send(dict(model.named_parameters()), tr)
    rx.receive(tr.endpoint(0))
    assert _same(rx, _bf16(model))

    stale = SyncReceiver({n: torch.nn.Parameter(t.clone(), requires_grad=False) for n, t in _bf16(model).items()},
                         version=2, run_id=rx.run_id, verify=verify)
    stale._follow = lambda name: None
    for p in stale.tensors.values():
        p.data = p.data.clone()
    _step(model, opt)
    sender.send(dict(model.named_parameters()), tr)
    stale.receive(tr.endpoint(0))
    assert not _same(stale, _bf16(model))


def test_moved_storage_with_other_bits_is_hashed_again():
    """``verify="incremental"``: a tensor given new storage holding other bits (here in an element the next
    sync does not touch) is hashed in full at the next sync, so the divergence is caught before anything is
    written; a running hash kept from the old storage would let the delta apply on top of the wrong base."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(4096, generator=g) * 0.02).to(torch.bfloat16)
    sender = SyncSender({"w": w}, codec="compact", bucket_bytes=1 << 20)
    rx = SyncReceiver({"w": torch.nn.Parameter(w.clone(), requires_grad=False)}, verify="incremental")
    tr = InProcessTransport()

    def moved(t):  # the second half of the bit patterns moved by one
        b = bits(t).clone()
        b[2048:] += 1
        return b.view(torch.bfloat16)

    v1 = moved(w)
    sender.send({"w": v1}, tr)
    rx.receive(tr)
    assert _same(rx, {"w": v1}) and rx._hashes  # running hashes known from here on
    p = rx.tensors["w"]
    other = p.data.clone()
    bits(other)[0] ^= 1  # an element the next sync leaves alone
    p.data = other
    snap = _snapshot(rx)
    sender.send({"w": moved(v1)}, tr)
    with pytest.raises(HashMismatchError, match="base"):
        rx.receive(tr)
    assert _unchanged(rx, snap)


def test_corrupt_truncated_reordered_replayed(setup):
    model, opt, sender, rx = setup
    good = _sync_buckets(model, opt, sender)
    assert len(good) >= 3
    snap = _snapshot(rx)
    b0 = good[0][0]
    # corrupted bytes anywhere in the bucket
    for k in (3, 70, b0.numel() // 2, b0.numel() - 3):
        bad = b0.clone()
        bad[k] ^= 0x01
        with pytest.raises(CorruptPayloadError):
            rx.apply_bucket(bad)
        assert _unchanged(rx, snap)
    with pytest.raises(TruncatedPayloadError):
        rx.apply_bucket(b0[:-5])
    with pytest.raises(OutOfOrderError):
        rx.apply_bucket(good[1][0])  # bucket 1 before bucket 0
    assert _unchanged(rx, snap)
    # the good sync still applies afterwards (nothing was written)
    for b, _ in good:
        rx.apply_bucket(b)
    assert rx.version == 1 and _same(rx, _bf16(model))
    snap = _snapshot(rx)
    with pytest.raises(ReplayError):
        rx.apply_bucket(good[0][0])  # replay of an applied sync
    assert _unchanged(rx, snap)


def test_wrong_base_and_run_id(setup):
    model, opt, sender, rx = setup
    first = _sync_buckets(model, opt, sender)
    second = _sync_buckets(model, opt, sender)  # base 1, receiver still at 0
    snap = _snapshot(rx)
    with pytest.raises(VersionMismatchError, match="base version 1"):
        rx.apply_bucket(second[0][0])
    assert _unchanged(rx, snap)
    other = SyncReceiver({n: t.clone() for n, t in _bf16(_model()).items()}, run_id="run-b")
    snap_o = _snapshot(other)
    with pytest.raises(VersionMismatchError, match="run"):
        other.apply_bucket(first[0][0])
    assert _unchanged(other, snap_o)


def test_failure_mid_sync_requires_anchor(setup):
    model, opt, sender, rx = setup
    buckets = _sync_buckets(model, opt, sender)
    rx.apply_bucket(buckets[0][0])
    with pytest.raises(OutOfOrderError):
        rx.apply_bucket(buckets[2][0])  # lost bucket 1
    assert rx.needs_resync and rx.resync_requested
    nxt = _sync_buckets(model, opt, sender)
    with pytest.raises(ResyncRequiredError):
        rx.apply_bucket(nxt[0][0])
    sender.request_resync()
    anchor = _sync_buckets(model, opt, sender)
    assert parse_bucket(anchor[0][0]).info.anchor
    for b, _ in anchor:
        rx.apply_bucket(b)
    assert not rx.needs_resync and _same(rx, _bf16(model))


def test_diverged_receiver_hash_mismatch_rollback_and_resync():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sender = SyncSender(_bf16(model), codec="compact", bucket_bytes=1 << 20)
    tr = InProcessTransport()
    rx = SyncReceiver({n: t.clone() for n, t in _bf16(model).items()})
    name = next(iter(rx.tensors))
    bits(rx.tensors[name]).view(-1)[0] ^= 1  # the rollout copy diverged by one bit
    snap = _snapshot(rx)
    _step(model, opt)
    sender.send(dict(model.named_parameters()), tr)
    with pytest.raises(HashMismatchError, match="dense resync"):
        rx.receive(tr)
    assert _unchanged(rx, snap) and rx.version == 0
    _step(model, opt)
    stats = sender.send(dict(model.named_parameters()), tr)  # the in-process transport carried the request
    assert stats.anchor
    rx.receive(tr)
    assert _same(rx, _bf16(model)) and rx.version == 2


def test_shape_mismatch_rejected(setup):
    model, opt, sender, _ = setup
    buckets = _sync_buckets(model, opt, sender)
    wrong = {n: t.clone() for n, t in _bf16(model).items()}
    first = next(iter(wrong))
    wrong[first] = torch.zeros(wrong[first].numel() + 1, dtype=torch.bfloat16)
    rx = SyncReceiver(wrong)
    snap = _snapshot(rx)
    with pytest.raises(ShapeMismatchError):
        rx.apply_bucket(buckets[0][0])
    assert _unchanged(rx, snap)
    with pytest.raises(ShapeMismatchError, match="missing"):
        sender.send({}, InProcessTransport())


def test_bucket_size_bound_and_slicing():
    t = {"big": torch.randn(10000).to(torch.bfloat16), "small": torch.randn(7).to(torch.float32)}
    sender = SyncSender(t, codec="dense", bucket_bytes=4096)
    new = {k: (v.float() + 1).to(v.dtype) for k, v in t.items()}
    buckets = list(sender.encode(new))
    for b, _ in buckets:
        assert parse_bucket(b).body.numel() <= 4096
    rx = SyncReceiver({k: v.clone() for k, v in t.items()})
    for b, _ in buckets:
        rx.apply_bucket(b)
    assert all(torch.equal(bits(rx.tensors[k]), bits(v)) for k, v in new.items())


def test_file_transport(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sender = SyncSender(_bf16(model), bucket_bytes=8192, anchor_every=3)
    tx = FileTransport(tmp_path, keep=2)
    rxt = FileTransport(tmp_path, timeout_s=5)
    rx = SyncReceiver({n: t.clone() for n, t in _bf16(model).items()})
    for _ in range(4):
        _step(model, opt)
        sender.send(dict(model.named_parameters()), tx)
        rx.receive(rxt)
        assert _same(rx, _bf16(model))
    assert len(list(tmp_path.glob("sync_*.json"))) == 2
    assert not list(tmp_path.rglob("*.tmp*"))


def test_triton_pipeline_interpreter():
    """The sender / receiver pipeline with the Triton kernels (interpreter on CPU)."""
    from sparrow.kernels.sync.api import triton_available

    if not triton_available():
        pytest.skip("triton not installed")
    from .conftest import TRITON_DEVICE

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sender = SyncSender({n: t.to(TRITON_DEVICE) for n, t in _bf16(model).items()}, bucket_bytes=8192, impl="triton")
    rx = SyncReceiver({n: t.to(TRITON_DEVICE) for n, t in _bf16(model).items()}, impl="triton")
    tr = InProcessTransport()
    for _ in range(2):
        _step(model, opt)
        stats = sender.send(dict(model.named_parameters()), tr)
        rx.receive(tr)
        assert _same(rx, _bf16(model))
    assert stats.codec_entries.get("compact", 0) > 0

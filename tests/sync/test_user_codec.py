"""A user WeightCodec end to end through SyncSender / SyncReceiver: bit-exact in the same buckets, with the same
versions, hashes and all-or-nothing apply as the built-in codecs; negative controls (a broken codec, a receiver
that does not know the codec) are refused with the weights untouched."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

import sparrow.sync as sync
from sparrow.kernels.sync import api as K
from sparrow.kernels.sync.common import combine_hash
from sparrow.sync import (
    BucketInfo,
    CompactCodec,
    CorruptPayloadError,
    EntryMeta,
    FileTransport,
    HashMismatchError,
    InProcessTransport,
    Payload,
    SyncReceiver,
    SyncSender,
    UnknownCodecError,
    WeightCodec,
    build_bucket,
    parse_bucket,
)

from ._user_codec import OffByOneXorCodec, WritesThenFailsCodec, XorDeltaCodec
from .conftest import BITS, FLOAT_DTYPES, bits, make_pair, specials

SETTINGS = dict(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)


def _state(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Tensors of ``dtype`` with special values (NaN payloads, +-0, inf, subnormals) mixed in; one empty."""
    g = torch.Generator().manual_seed(seed)
    sp = specials(dtype)
    out = {}
    for name, n in (("w", 3001), ("b", 37), ("e", 0), ("s", sp.numel())):
        t = (torch.randn(n, generator=g) * 0.02).to(dtype)
        if n:
            k = torch.randint(0, sp.numel(), (n,), generator=g)
            t.view(BITS[dtype])[::5] = sp[k][::5]
        out[name] = t
    out["s"] = sp.view(dtype).clone()
    return out


def _perturb(t: torch.Tensor, density: float, seed: int, special_frac: float = 0.1) -> torch.Tensor:
    """``t`` with a ``density`` fraction of its bit patterns moved by +-1..3 steps, and some of those set to
    special values (NaN payloads, +-0, inf, subnormals)."""
    if t.numel() == 0:
        return t.clone()
    g = torch.Generator().manual_seed(seed)
    bd = BITS[t.dtype]
    width = 8 * t.element_size()
    b = bits(t).reshape(-1).to(torch.int64)
    n = b.numel()
    ch = torch.rand(n, generator=g) < density
    step = torch.randint(1, 4, (n,), generator=g) * (torch.randint(0, 2, (n,), generator=g) * 2 - 1)
    v = (b + torch.where(ch, step, 0)) % (1 << width)
    v = v - ((v >> (width - 1)) << width)
    spc = ch & (torch.rand(n, generator=g) < special_frac)
    sp = specials(t.dtype).to(torch.int64)
    v[spc] = sp[torch.randint(0, sp.numel(), (int(spc.sum()),), generator=g)]
    return v.to(bd).view(t.dtype).reshape(t.shape)


def _changed(state: dict[str, torch.Tensor], seed: int, density: float = 0.03) -> dict[str, torch.Tensor]:
    """Sparse changes of every tensor; ``"s"`` (one of each special value) goes to a rotation of itself, so
    special values turn into other special values (+0 <-> -0, one NaN payload into another, ...)."""
    out = {}
    for k, (name, t) in enumerate(state.items()):
        if name == "s":
            out[name] = bits(t).roll(1 + seed % (t.numel() - 1)).view(t.dtype)
        else:
            out[name] = _perturb(t, density, 1000 * seed + k)
    return out


def _same(rx: SyncReceiver, ref: dict) -> bool:
    return all(torch.equal(bits(rx.tensors[n]), bits(t)) for n, t in ref.items())


def _snapshot(rx: SyncReceiver) -> dict:
    return {n: bits(t).clone() for n, t in rx.tensors.items()}


def _unchanged(rx: SyncReceiver, snap: dict) -> bool:
    return all(torch.equal(bits(rx.tensors[n]), b) for n, b in snap.items())


def _copy(state: dict) -> dict:
    return {n: t.clone() for n, t in state.items()}


# ---------------------------------------------------------------------------------------------------
# end to end
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=["bf16", "fp16", "fp32"])
def test_user_codec_in_process_bit_exact(dtype):
    state = _state(dtype)
    sender = SyncSender(state, codec=XorDeltaCodec(), bucket_bytes=1024, max_slice_elems=1000, anchor_every=4,
                        run_id="user")
    tr = InProcessTransport(num_receivers=2)
    rx = [SyncReceiver(_copy(state), codecs=[XorDeltaCodec()], verify=v) for v in ("full", "incremental")]
    for step in range(6):
        state = _changed(state, step + 1, density=0.1)
        buckets = list(sender.encode(state))
        infos = [parse_bucket(b) for b, _ in buckets]
        for b, info in buckets:
            tr.send_bucket(b, info)
        anchor = (step + 1) % 4 == 0
        assert len(buckets) > 1 and all(p.info.anchor == anchor for p in infos)
        entries = [e for p in infos for e in p.entries]
        assert {e.codec for e in entries} == ({"dense"} if anchor else {"xor-delta"})
        assert sum(e.name == "w" for e in entries) >= 4  # tensors cut into slices, one entry each
        if not anchor:
            assert all(e.payload == {"codec": "xor-delta", "target_hash": None, "extra": {"v": 1}} for e in entries)
            assert all(e.target_hash is not None and e.base_hash is not None for e in entries)
        for i, r in enumerate(rx):
            stats = r.receive(tr.endpoint(i))
            assert r.version == step + 1 and _same(r, state)
            if not anchor:
                assert set(stats.codec_entries) == {"xor-delta"} and stats.changed > 0


def test_user_codec_file_transport(tmp_path):
    state = _state(torch.bfloat16, seed=3)
    sender = SyncSender(state, codec=XorDeltaCodec(), bucket_bytes=1024)
    tx, rxt = FileTransport(tmp_path, keep=2), FileTransport(tmp_path, timeout_s=5)
    rx = SyncReceiver(_copy(state), codecs=[XorDeltaCodec()])
    for step in range(3):
        state = _changed(state, step + 10)
        stats = sender.send(state, tx)
        rx.receive(rxt)
        assert _same(rx, state) and stats.codec_entries == {"xor-delta": stats.entries}


@st.composite
def _runs(draw):
    """A state dict (1-3 tensors of mixed dtypes and sizes, special values mixed in) and 1-3 later states,
    each a random sparse change of the one before, plus a bucket size."""
    dtypes = draw(st.lists(st.sampled_from(FLOAT_DTYPES), min_size=1, max_size=3))
    sizes = draw(st.lists(st.one_of(st.just(0), st.integers(1, 9), st.integers(10, 2500)),
                          min_size=len(dtypes), max_size=len(dtypes)))
    seed = draw(st.integers(0, 2**31 - 1))
    special_frac = draw(st.sampled_from([0.0, 0.05, 0.5]))
    state = {f"t{k}": make_pair(dtype, n, 0.0, seed=seed + k, special_frac=special_frac)[0]
             for k, (dtype, n) in enumerate(zip(dtypes, sizes))}
    news, cur = [], state
    for s in range(draw(st.integers(1, 3))):
        density = draw(st.sampled_from([0.0, 0.001, 0.02, 0.3, 1.0]))
        cur = {n: _perturb(t, density, seed + 31 * s + k, special_frac) for k, (n, t) in enumerate(cur.items())}
        news.append(cur)
    return state, news, draw(st.sampled_from([1024, 4096, 1 << 20]))


def _sync_ok(rx_codec: WeightCodec, run, verify=True) -> bool:
    """The property body: every state of ``run`` reaches the receiver bit for bit through the user codec."""
    state, news, bucket_bytes = run
    sender = SyncSender(state, codec=XorDeltaCodec(), bucket_bytes=bucket_bytes)
    rx = SyncReceiver(_copy(state), codecs=[rx_codec], verify=verify)
    tr = InProcessTransport()
    for new in news:
        sender.send(new, tr)
        rx.receive(tr)
        if not _same(rx, new):
            return False
    return True


@settings(**SETTINGS)
@given(run=_runs())
def test_user_codec_property_bit_exact(run):
    assert _sync_ok(XorDeltaCodec(), run)


def test_negative_control_off_by_one_fails_the_property():
    """With verification off, hypothesis finds a run where the off-by-one codec loses the bits (so the
    property above can fail); with it on, the same run is refused instead of applied wrongly."""
    run = find(_runs(), lambda r: not _sync_ok(OffByOneXorCodec(), r, verify=False),
               settings=settings(max_examples=200, deadline=None, database=None))
    assert not _sync_ok(OffByOneXorCodec(), run, verify=False)
    with pytest.raises(HashMismatchError):
        _sync_ok(OffByOneXorCodec(), run, verify=True)


# ---------------------------------------------------------------------------------------------------
# refusals leave the weights untouched
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("verify", ["full", "incremental"])
def test_broken_codec_caught_by_target_hash_and_undone(verify):
    state = _state(torch.float16, seed=5)
    sender = SyncSender(state, codec=XorDeltaCodec(), bucket_bytes=1 << 20, max_slice_elems=1000)
    rx = SyncReceiver(_copy(state), codecs=[OffByOneXorCodec()], verify=verify)
    tr = InProcessTransport()
    snap = _snapshot(rx)
    new = _changed(state, 1)
    sender.send(new, tr)
    assert tr.pending() == 1  # one bucket holding every slice: the later slices fail after the first applied
    with pytest.raises(HashMismatchError, match="xor-delta.*undone"):
        rx.receive(tr)
    assert _unchanged(rx, snap) and rx.version == 0 and rx.resync_requested
    # the resync request reached the sender: the next sync is a dense anchor, which needs no user codec
    new2 = _changed(new, 2)
    stats = sender.send(new2, tr)
    assert stats.anchor and set(stats.codec_entries) == {"dense"}
    rx.receive(tr)
    assert _same(rx, new2) and rx.version == 2


def test_codec_that_raises_mid_apply_is_undone():
    state = _state(torch.bfloat16, seed=6)
    sender = SyncSender(state, codec=XorDeltaCodec(), bucket_bytes=1 << 20, max_slice_elems=1000)
    rx = SyncReceiver(_copy(state), codecs=[WritesThenFailsCodec()])
    tr = InProcessTransport()
    snap = _snapshot(rx)
    sender.send(_changed(state, 1), tr)
    with pytest.raises(CorruptPayloadError, match="could not apply.*IndexError") as info:
        rx.receive(tr)
    assert isinstance(info.value.__cause__, IndexError)
    assert _unchanged(rx, snap) and rx.resync_requested


def test_receiver_without_the_codec_refuses_the_bucket():
    state = _state(torch.float32, seed=7)
    sender = SyncSender(state, codec=XorDeltaCodec(), bucket_bytes=1024, anchor_every=0)
    tr = InProcessTransport(num_receivers=2)
    knows, blind = SyncReceiver(_copy(state), codecs=[XorDeltaCodec()]), SyncReceiver(_copy(state))
    snap = _snapshot(blind)
    new = _changed(state, 1)
    sender.send(new, tr)
    knows.receive(tr.endpoint(0))
    with pytest.raises(UnknownCodecError, match="'xor-delta'.*codecs=") as info:
        blind.receive(tr.endpoint(1))
    assert "compact, coo, dense" in str(info.value)
    assert _same(knows, new) and _unchanged(blind, snap) and blind.resync_requested and blind.version == 0
    new2 = _changed(new, 2)
    assert sender.send(new2, tr).anchor  # the blind receiver's request: a dense anchor for everyone
    for i, r in enumerate((knows, blind)):
        r.receive(tr.endpoint(i))
        assert _same(r, new2) and r.version == 2


def _mixed_bucket(b0: dict, b1: dict) -> torch.Tensor:
    """One bucket with a built-in compact entry ("a") and a user codec entry ("u")."""
    pa = sync.encode(b0["a"], b1["a"], codec="compact")
    pu = XorDeltaCodec().encode(b0["u"], b1["u"])

    def h(t):
        return combine_hash(K.hash_bits(bits(t).reshape(-1), 0))

    ents = [(EntryMeta("a", torch.bfloat16, (b0["a"].numel(),), 0, b0["a"].numel(), "compact", 0, 0, pa.nchanged,
                       pa.target_hash, h(b0["a"]), span_log2=pa.extra["span_log2"]), pa.data),
            (EntryMeta("u", torch.float16, (b0["u"].numel(),), 0, b0["u"].numel(), "xor-delta", 0, 0, pu.nchanged,
                       h(b1["u"]), h(b0["u"]), {"codec": pu.codec, "target_hash": None, "extra": pu.extra}),
             pu.data)]
    return build_bucket(BucketInfo("mix", 0, 1, 0, True, False), ents)


@pytest.mark.parametrize("codec,error", [(OffByOneXorCodec(), HashMismatchError),
                                         (WritesThenFailsCodec(), CorruptPayloadError)],
                         ids=["off-by-one", "raises"])
def test_failing_user_entry_undoes_the_builtin_entries_of_its_bucket(codec, error):
    a0, a1 = make_pair(torch.bfloat16, 5000, 0.05, seed=1)
    u0, u1 = make_pair(torch.float16, 700, 0.1, seed=2)
    b0, b1 = {"a": a0, "u": u0}, {"a": a1, "u": u1}
    bucket = _mixed_bucket(b0, b1)
    good = SyncReceiver(_copy(b0), codecs=[XorDeltaCodec()])
    good.apply_bucket(bucket)
    assert _same(good, b1)
    bad = SyncReceiver(_copy(b0), codecs=[codec])
    snap = _snapshot(bad)
    with pytest.raises(error):
        bad.apply_bucket(bucket)
    assert _unchanged(bad, snap)


def test_user_entry_without_payload_fields_is_corrupt():
    u0, u1 = make_pair(torch.float16, 100, 0.1, seed=3)
    pu = XorDeltaCodec().encode(u0, u1)
    meta = EntryMeta("u", torch.float16, (100,), 0, 100, "xor-delta", 0, 0, pu.nchanged, None, None)  # no payload
    bucket = build_bucket(BucketInfo("r", 0, 1, 0, True, False), [(meta, pu.data)])
    rx = SyncReceiver({"u": u0.clone()}, codecs=[XorDeltaCodec()])
    with pytest.raises(CorruptPayloadError, match="payload"):
        rx.apply_bucket(bucket)
    assert torch.equal(bits(rx.tensors["u"]), bits(u0))


# ---------------------------------------------------------------------------------------------------
# argument checks, built-in instances, impl spelling
# ---------------------------------------------------------------------------------------------------

class _Named(XorDeltaCodec):
    def __init__(self, name):
        self.name = name


class _BadPayload(XorDeltaCodec):
    def __init__(self, how: str):
        self.how = how

    def encode(self, base, new):
        p = super().encode(base, new)
        if self.how == "shape":
            p.shape = (1, base.numel())
        elif self.how == "data":
            p.data = p.data.to(torch.int32)
        elif self.how == "extra":
            p.extra = {"t": torch.zeros(1)}
        elif self.how == "nchanged":
            p.nchanged = base.numel() + 1
        elif self.how == "type":
            return p.data
        return p


def test_sender_and_receiver_argument_checks():
    state = _state(torch.bfloat16)
    for name in ("compact", "auto", "", None):
        with pytest.raises(ValueError, match="name"):
            SyncSender(state, codec=_Named(name))
    with pytest.raises(ValueError, match="unknown codec 'zip'"):
        SyncSender(state, codec="zip")
    with pytest.raises(TypeError, match="WeightCodec"):
        SyncSender(state, codec=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="two codecs named 'x'"):
        SyncReceiver(state, codecs=[_Named("x"), _Named("x")])
    with pytest.raises(TypeError, match="sequence"):
        SyncReceiver(state, codecs=XorDeltaCodec())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="WeightCodec"):
        SyncReceiver(state, codecs=["xor-delta"])  # type: ignore[list-item]
    rx = SyncReceiver(state, codecs=[CompactCodec(), XorDeltaCodec()])  # built-in instances: always known
    assert list(rx.codecs) == ["xor-delta"]


@pytest.mark.parametrize("how", ["shape", "data", "extra", "nchanged", "type"])
def test_bad_user_payload_rejected_before_the_snapshot_moves(how):
    state = _state(torch.bfloat16)
    sender = SyncSender(state, codec=_BadPayload(how), bucket_bytes=4096)
    before = {n: bits(t).clone() for n, t in sender.snapshot.items()}
    hashes = sender.slice_hashes()
    with pytest.raises((ValueError, TypeError), match="codec 'xor-delta' on w\\[0:"):
        list(sender.encode(_changed(state, 1)))
    assert sender.version == 0 and sender.slice_hashes() == hashes
    assert all(torch.equal(bits(sender.snapshot[n]), b) for n, b in before.items())


def test_builtin_codec_instance_is_the_fast_path_byte_for_byte():
    state = _state(torch.bfloat16)
    new = _changed(state, 1)
    by_name = [b for b, _ in SyncSender(state, codec="compact", run_id="r", bucket_bytes=2048).encode(new)]
    by_instance = [b for b, _ in SyncSender(state, codec=CompactCodec(), run_id="r", bucket_bytes=2048).encode(new)]
    assert len(by_name) == len(by_instance) and all(torch.equal(a, b) for a, b in zip(by_name, by_instance))


def test_user_payload_travels_standalone_but_not_through_builtin_apply():
    base, new = make_pair(torch.float32, 300, 0.1, seed=4)
    p = Payload.from_bytes(sync.encode(base, new, codec=XorDeltaCodec()).to_bytes())
    assert p.codec == "xor-delta" and p.extra == {"v": 1}
    out = base.clone()
    XorDeltaCodec().apply_(out, p)
    assert torch.equal(bits(out), bits(new))
    target = base.clone()
    with pytest.raises(CorruptPayloadError, match="not built in"):
        sync.apply_(target, p)
    assert torch.equal(bits(target), bits(base))


def test_warmup_with_a_user_codec():
    state = _state(torch.bfloat16)
    before = {n: bits(t).clone() for n, t in state.items()}
    assert sync.warmup(state, codec=XorDeltaCodec(), bucket_bytes=2048) >= 0.0
    assert all(torch.equal(bits(state[n]), b) for n, b in before.items())
    with pytest.raises(HashMismatchError):  # a broken codec is refused by the private receiver's hashes
        sync.warmup(state, codec=OffByOneXorCodec(), bucket_bytes=2048)
    assert all(torch.equal(bits(state[n]), b) for n, b in before.items())


def test_warmup_final_check_catches_a_broken_codec_without_verification(monkeypatch):
    real = sync.warmup.__globals__["SyncReceiver"]
    monkeypatch.setitem(sync.warmup.__globals__, "SyncReceiver", lambda *a, **kw: real(*a, **kw, verify=False))
    with pytest.raises(RuntimeError, match="does not hold the sender's bits"):
        sync.warmup(_state(torch.bfloat16), codec=OffByOneXorCodec(), bucket_bytes=2048)


def test_impl_none_is_a_deprecated_auto():
    state = _state(torch.bfloat16)
    base, new = state["w"], _changed(state, 1)["w"]
    with pytest.warns(DeprecationWarning, match="impl='auto'"):
        assert SyncSender(state, impl=None).impl == "auto"
    with pytest.warns(DeprecationWarning):
        assert SyncReceiver(_copy(state), impl=None).impl == "auto"
    with pytest.warns(DeprecationWarning):
        p = sync.encode(base, new, impl=None)
    out = base.clone()
    with pytest.warns(DeprecationWarning):
        sync.apply_(out, p, impl=None)
    assert torch.equal(bits(out), bits(new))
    with pytest.warns(DeprecationWarning):
        sync.warmup({"w": base}, impl=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SyncSender(state, impl="auto")
        SyncReceiver(_copy(state), impl="reference")
    for bad in ("cuda", "Auto", ""):
        with pytest.raises(ValueError, match=f"got {bad!r}"):
            SyncSender(state, impl=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=f"got {bad!r}"):
            SyncReceiver(state, impl=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="got None"):  # below the public entry points None is not accepted
        K.hash_bits(torch.zeros(4, dtype=torch.int16), impl=None)  # type: ignore[arg-type]


def test_user_codec_with_the_triton_kernels():
    """Hashes and the sparse undo records of user entries through the Triton kernels (interpreter on CPU)."""
    if not K.triton_available():
        pytest.skip("triton not installed")
    from .conftest import TRITON_DEVICE

    state = {n: t.to(TRITON_DEVICE) for n, t in _state(torch.bfloat16, seed=8).items()}
    sender = SyncSender(state, codec=XorDeltaCodec(), bucket_bytes=1 << 20, max_slice_elems=1000, impl="triton")
    good = SyncReceiver(_copy(state), codecs=[XorDeltaCodec()], impl="triton")
    bad = SyncReceiver(_copy(state), codecs=[OffByOneXorCodec()], impl="triton")
    tr = InProcessTransport(num_receivers=2)
    snap = _snapshot(bad)
    new = {n: t.to(TRITON_DEVICE) for n, t in _changed({n: t.cpu() for n, t in state.items()}, 1).items()}
    sender.send(new, tr)
    good.receive(tr.endpoint(0))
    with pytest.raises(HashMismatchError):
        bad.receive(tr.endpoint(1))
    assert _same(good, new) and _unchanged(bad, snap)

"""Weight-only int8 linear: the Triton kernel against the reference, the quantizer's error bound (with a
negative control), the module's in-place requantization, and bad input."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparrow.kernels.int8_linear import Int8Linear, int8_linear, quantize_int8
from sparrow.kernels.int8_linear.reference import int8_linear_reference
from sparrow.kernels.int8_linear.triton_int8_linear import int8_linear_triton, launch_config
from tests.helpers import DEVICE, rel_err

# (leading dims of x, N, K): decode-sized row counts, odd widths, K not a multiple of the K step
SHAPES = [((1,), 40, 72), ((3,), 130, 200), ((17,), 64, 128), ((2, 5), 24, 17), ((33,), 96, 300), ((70,), 48, 40),
          ((130,), 20, 24)]


def _case(lead, N, K, dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, K, generator=g).to(dtype)
    w = torch.randn(N, K, generator=g) * 0.05
    w[0] *= 20  # rows of very different ranges: per-channel scales must follow them
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    q, s = quantize_int8(w)
    return (x.to(DEVICE), q.to(DEVICE), s.to(DEVICE), None if b is None else b.to(DEVICE)), w


@pytest.mark.parametrize("lead,N,K", SHAPES)
@pytest.mark.parametrize("split_k", [None, 1, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_triton_matches_reference_float32(lead, N, K, split_k, bias):
    (x, q, s, b), _ = _case(lead, N, K, torch.float32, bias)
    out = int8_linear_triton(x, q, s, b, split_k=split_k)
    ref = int8_linear_reference(x.cpu(), q.cpu(), s.cpu(), None if b is None else b.cpu())
    assert out.shape == (*lead, N) and out.dtype == torch.float32
    assert rel_err(out, ref) < 1e-5


@pytest.mark.skipif(DEVICE.type != "cuda", reason="bfloat16 dots need a GPU (the interpreter's are wrong)")
@pytest.mark.parametrize("lead,N,K", SHAPES + [((64,), 4864, 896), ((8,), 896, 4864)])
def test_triton_matches_reference_bfloat16(lead, N, K):
    (x, q, s, b), _ = _case(lead, N, K, torch.bfloat16)
    out = int8_linear(x, q, s, b, impl="triton")
    ref = int8_linear_reference(x, q, s, b)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 1e-2


def test_reference_is_the_dequantized_linear():
    (x, q, s, b), w = _case((4,), 33, 50, torch.float64 if DEVICE.type == "cpu" else torch.float32)
    x, q, s, b = (t.cpu() for t in (x, q, s, b))
    want = x.double() @ (q.double() * s.double()[:, None]).t() + b.double()
    assert rel_err(int8_linear(x, q, s, b, impl="reference"), want) < 1e-6
    # and close to the float linear it replaces (per-channel int8: ~0.5% relative error)
    dense = x.double() @ w.double().t() + b.double()
    assert rel_err(int8_linear(x.double(), q, s, b.double(), impl="reference"), dense) < 0.02


def quantization_error_ok(w: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> bool:
    """Every element within half a step of its value, codes within [-127, 127], each row's step tight."""
    err = (w.double() - q.double() * s.double()[:, None]).abs()
    tight = (q.abs().amax(1) == 127) | (w.abs().amax(1) == 0)
    within = (err <= s.double()[:, None] * 0.5 * (1 + 1e-6) + 1e-30).all()
    return bool(within and (q.abs() <= 127).all() and tight.all())


_matrices = st.tuples(st.integers(1, 6), st.integers(1, 40), st.floats(1e-4, 1e3), st.integers(0, 2**31 - 1))


def _matrix(n, k, magnitude, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * magnitude
    w[torch.rand(n, k, generator=g) < 0.2] = 0.0
    if n > 1:
        w[-1] = 0.0  # an all-zero row
    return w


@settings(max_examples=60, deadline=None)
@given(_matrices)
def test_quantizer_error_is_at_most_half_a_step(m):
    w = _matrix(*m)
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (w.shape[0],)
    assert quantization_error_ok(w, q, s)


def test_error_bound_catches_a_truncating_quantizer():
    """Negative control: rounding toward zero instead of to nearest breaks the half-step bound."""
    w = _matrix(4, 64, 1.0, 7)
    amax = w.abs().amax(1)
    s = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.trunc(w / s[:, None]).to(torch.int8)
    assert not quantization_error_ok(w, q, s)


def test_module_requantizes_in_place():
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(48, 32, generator=g), torch.randn(48, generator=g)
    lin = Int8Linear(w.to(DEVICE), b.to(DEVICE))
    ptrs = (lin.qweight.data_ptr(), lin.scale.data_ptr())
    w2 = torch.randn(48, 32, generator=g) * 3
    lin.requantize_(w2.to(DEVICE))
    fresh = Int8Linear(w2.to(DEVICE), b.to(DEVICE))
    assert (lin.qweight.data_ptr(), lin.scale.data_ptr()) == ptrs
    assert torch.equal(lin.qweight, fresh.qweight)
    assert torch.equal(lin.scale.view(torch.int32), fresh.scale.view(torch.int32))  # bitwise
    x = torch.randn(5, 32, generator=g).to(DEVICE)
    assert rel_err(lin(x), x @ w2.to(DEVICE).t() + b.to(DEVICE)) < 0.02
    with pytest.raises(ValueError, match="shape"):
        lin.requantize_(torch.randn(32, 48))


def test_bad_input_is_named():
    q, s = quantize_int8(torch.randn(8, 16))
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="int8"):
        int8_linear(x, q.float(), s)
    with pytest.raises(ValueError, match="last dimension"):
        int8_linear(torch.randn(2, 15), q, s)
    with pytest.raises(ValueError, match="scale"):
        int8_linear(x, q, s.double())
    with pytest.raises(ValueError, match="bias"):
        int8_linear(x, q, s, torch.randn(7))
    with pytest.raises(ValueError, match="floating"):
        int8_linear(x.long(), q, s)
    with pytest.raises(ValueError, match="impl"):
        int8_linear(x, q, s, impl="cuda")
    with pytest.raises(ValueError, match="2-D float"):
        Int8Linear(torch.randn(3, 4, 5))


def test_launch_config_splits_k_for_small_batches():
    few = launch_config(8, 896, 896, num_sms=132)
    many = launch_config(256, 4864, 896, num_sms=132)
    assert few["SPLIT_K"] > 1 and many["SPLIT_K"] == 1
    assert few["SPLIT_K"] <= -(-896 // few["BLOCK_K"])  # never more splits than K steps


@pytest.mark.parametrize("bias", [True, False])
def test_custom_op_schema_fake_and_compiled_graph(bias):
    """The kernel runs as one opaque custom op: its fake kernel gives the real shapes, and a fullgraph
    compiled step (dynamic row count, as the engine's buckets) calls it without graph breaks."""
    from sparrow.kernels.int8_linear.triton_int8_linear import _int8_linear_op

    (x, q, s, b), _ = _case((3, 5), 40, 72, torch.float32, bias)
    torch.library.opcheck(_int8_linear_op, (x, q, s, b, -1), test_utils=("test_schema", "test_faketensor"))
    step = torch.compile(lambda x: int8_linear(x, q, s, b, impl="triton", validate=False) * 2, fullgraph=True,
                         dynamic=True)
    for rows in (x, x[:1]):
        ref = int8_linear_reference(rows.cpu(), q.cpu(), s.cpu(), None if b is None else b.cpu())
        assert rel_err(step(rows), 2 * ref) < 1e-5

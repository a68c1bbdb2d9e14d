import pytest
import torch

import sparrow.models as sm
from sparrow.rollout.roofline import DecodeFootprint, decode_step_roofline


def test_qwen2_5_0_5b_step_floors():
    """The model of docs/benchmarks.md on the Qwen2.5-0.5B shape (groups of 8 rows, 64 generated tokens read per
    row on average over 128 new tokens): the floors the engine is measured against."""
    with torch.device("meta"):
        model = sm.qwen2_5_0_5b(max_seq_len=1024)
    f = DecodeFootprint.of(model, torch.bfloat16)
    assert (f.params, f.weight_bytes, f.kv_bytes_per_token) == (494_032_768, 988_065_536, 24 * 2 * 2 * 64 * 2)
    floors = {}
    for L, B in ((1024, 1), (8192, 32), (8192, 256), (32768, 128)):
        G = min(8, B)
        floors[L, B] = round(decode_step_roofline(f, [L] * (B // G), [64] * B).seconds * 1e3, 2)
    assert floors == {(1024, 1): 0.24, (8192, 32): 0.34, (8192, 256): 1.05, (32768, 128): 1.79}
    # reading every row's prompt (no sharing) would cost about 8x the prompt bytes
    unshared = decode_step_roofline(f, [8192] * 256, [64] * 256)
    assert unshared.bytes - f.weight_bytes > 7.5 * (floors[8192, 256] * 1e-3 * 4.2e12 - f.weight_bytes)


def test_bound_fraction_and_validation():
    f = DecodeFootprint(params=10**9, weight_bytes=2 * 10**9, kv_bytes_per_token=0)
    few, many = decode_step_roofline(f, [1], [1]), decode_step_roofline(f, [1], [1] * 4096, tokens_per_row=2)
    assert few.bound == "bytes" and many.bound == "flops"
    assert many.seconds == pytest.approx(2 * 10**9 * 4096 * 2 / 778e12)
    assert few.fraction(2 * few.seconds) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="row"):
        decode_step_roofline(f, [1], [])
    with pytest.raises(ValueError, match="measured_s"):
        few.fraction(0.0)
    with pytest.raises(ValueError, match="bandwidth"):
        decode_step_roofline(f, [1], [1], bandwidth=0)

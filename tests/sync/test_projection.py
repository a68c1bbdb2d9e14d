"""The sync-time projection (``sparrow.sync.projection``): hand-computed figures, interpolation between measured
points, and properties over sizes and links, with a negative control."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import torch
from sparrow.sync.projection import CHECKPOINT_ENGINE_S_PER_PARAM, SyncRates, project_sync, rates_at
from sparrow.sync.synthetic import perturb_bits


def test_hand_computed_projection():
    r = SyncRates(0.01, encode_s_per_param=1e-12, apply_s_per_param=5e-13, payload_bytes_per_param=0.015)
    p = project_sync(7_000_000_000, r, 10.0, copy_gbs=4000.0)
    assert p.payload_bytes == pytest.approx(1.05e8)
    assert p.transfer_s == pytest.approx(1.05e8 / 1.25e9)  # 10 Gbit/s = 1.25 GB/s
    assert p.encode_s == pytest.approx(7e-3) and p.apply_s == pytest.approx(3.5e-3)
    assert p.sparse_s == pytest.approx(7e-3 + 3.5e-3 + 0.084)
    assert p.dense_bytes == 14_000_000_000
    assert p.dense_s == pytest.approx(14e9 / 1.25e9 + 28e9 / 4e12)
    assert p.pipelined_dense_s == pytest.approx(14e9 / 1.25e9)
    assert p.checkpoint_engine_s == pytest.approx(7e9 * CHECKPOINT_ENGINE_S_PER_PARAM) == pytest.approx(0.14)
    assert p.speedup_vs_dense == pytest.approx(p.dense_s / p.sparse_s)


def test_interpolation_hits_the_points_and_stays_between():
    a = SyncRates(0.005, 1e-12, 2e-13, 0.01)
    b = SyncRates(0.04, 2e-12, 1e-12, 0.05)
    assert rates_at([b, a], 0.005) == a and rates_at([a, b], 0.04) == b
    m = rates_at([a, b], 0.01)
    assert a.payload_bytes_per_param < m.payload_bytes_per_param < b.payload_bytes_per_param
    # log-log: a third of the way in log density is a third of the way in log cost
    t = math.log(0.01 / 0.005) / math.log(0.04 / 0.005)
    assert m.apply_s_per_param == pytest.approx(math.exp((1 - t) * math.log(2e-13) + t * math.log(1e-12)))
    with pytest.raises(ValueError, match="outside"):
        rates_at([a, b], 0.002)
    with pytest.raises(ValueError):
        rates_at([], 0.01)
    with pytest.raises(ValueError):
        SyncRates(0.0, 1e-12, 1e-12, 0.01)
    with pytest.raises(ValueError):
        project_sync(0, a, 10.0, copy_gbs=1.0)


def _broken_project(params, rates, link_gbit, *, copy_gbs):
    """Negative control: a link in bytes instead of bits (8x too fast)."""
    return project_sync(params, rates, link_gbit * 8, copy_gbs=copy_gbs)


rates_st = st.builds(SyncRates, st.floats(1e-4, 0.5), st.floats(1e-14, 1e-10), st.floats(1e-14, 1e-10),
                     st.floats(1e-4, 1.0))


@settings(max_examples=60, deadline=None, database=None)
@given(rates=rates_st, params=st.integers(10**6, 10**12), link=st.floats(1.0, 1000.0))
def test_projection_properties(rates, params, link):
    p = project_sync(params, rates, link, copy_gbs=4000.0)
    faster = project_sync(params, rates, 2 * link, copy_gbs=4000.0)
    bigger = project_sync(2 * params, rates, link, copy_gbs=4000.0)
    assert faster.sparse_s <= p.sparse_s and faster.dense_s <= p.dense_s
    assert bigger.sparse_s == pytest.approx(2 * p.sparse_s)  # every cost scales with the parameters
    assert p.pipelined_dense_s <= p.dense_s
    # the transfer is exactly the payload over the link in bytes per second
    assert p.transfer_s * link * 1e9 / 8 == pytest.approx(p.payload_bytes)


def test_negative_control_bits_for_bytes_is_caught():
    r = SyncRates(0.01, 1e-12, 1e-12, 0.02)
    p = _broken_project(10**9, r, 10.0, copy_gbs=4000.0)
    assert p.transfer_s * 10.0 * 1e9 / 8 != pytest.approx(p.payload_bytes)


def test_perturb_bits_density_and_mix():
    g = torch.Generator().manual_seed(0)
    base = (torch.randn(1 << 16, generator=g) * 0.02).to(torch.bfloat16)
    new = perturb_bits(base, 0.05, g)
    d = new.view(torch.int16).to(torch.int32) - base.view(torch.int16).to(torch.int32)
    changed = d != 0
    assert abs(changed.float().mean().item() - 0.05) < 0.005
    mag = d[changed].abs()
    assert mag.max().item() <= 3 and abs((mag == 1).float().mean().item() - 0.9) < 0.03
    with pytest.raises(TypeError):
        perturb_bits(torch.zeros(4), 0.1, g)


def test_memory_floor_counts_the_traffic():
    from sparrow.sync.projection import memory_floor_ms

    f = memory_floor_ms(1000, 10, 100, copy_gbs=1e-3)  # 1 MB/s: a byte is a microsecond
    assert f["encode_floor_ms"] == pytest.approx((4000 + 20 + 100) * 1e-3)  # old + new bits, snapshot, payload
    assert f["apply_floor_ms"] == pytest.approx((100 + 40) * 1e-3)  # payload, changed elements read + written
    assert f["floor_ms"] == pytest.approx(f["encode_floor_ms"] + f["apply_floor_ms"])
    assert f["floor_full_ms"] == pytest.approx(f["floor_ms"] + 2000 * 1e-3)  # the receiver's weights read
    assert memory_floor_ms(1000, 10, 100, copy_gbs=2e-3)["floor_ms"] == pytest.approx(f["floor_ms"] / 2)
    with pytest.raises(ValueError):
        memory_floor_ms(1000, 10, 100, copy_gbs=0.0)

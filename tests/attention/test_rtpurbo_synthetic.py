"""The synthetic RTPurbo decode layer: planted hot blocks, its caches and backend, the 15%-model speedups."""

from __future__ import annotations

import math

import pytest
import torch

from sparrow.attention.rtpurbo_synthetic import (SyntheticDecodeLayer, decode_speedups, hot_indexer_keys,
                                                triton_vs_reference)
from tests.helpers import DEVICE


def test_hot_indexer_keys_plant_the_density():
    u = torch.nn.functional.normalize(torch.randn(16), dim=0)
    ik = hot_indexer_keys(4, 64 * 200, 0.3, 64, u, seed=0, top_p=0.6)
    assert ik.shape == (4, 1, 64 * 200, 16)
    hot = (ik[:, 0] @ u > 6).view(4, 200, 64)
    assert bool((hot.all(-1) | ~hot.any(-1)).all())  # whole blocks
    assert not hot[:, 0].any()  # never the first block
    assert 0.44 < hot.all(-1).float().mean() < 0.56  # density / top_p = 0.5, not the density 0.3
    again = hot_indexer_keys(4, 64 * 200, 0.3, 64, u, seed=0, top_p=0.6)
    assert torch.equal(hot, (again[:, 0] @ u > 6).view(4, 200, 64))  # the same blocks for the same seed


def test_layer_caches_and_backend_point_at_the_hot_blocks():
    c = SyntheticDecodeLayer(256, 2, 8, 4, 32, 64, 16, torch.float32, "cpu")
    assert c.q.shape == (2, 8, 1, 32) and c.pk.shape == (2, 4, 256, 32) and c.gk.shape == (3, 4, 16, 32)
    cache = c.cache(1, hot_indexer_keys(2, 256, 0.2, 16, c.u, seed=1))
    assert cache.prefix_k.shape[1] == 1 and cache.prefix_ik.shape == (2, 1, 256, 16)
    assert c.cache(0, None).prefix_ik.shape == (2, 0, 256, 16)
    b = c.backend(1, impl="reference")
    q_idx, _ = b.index(c.q, c.k_new)  # the indexer query of the shared query: along u
    v = q_idx.reshape(-1, 16)[0].float()
    assert torch.nn.functional.cosine_similarity(v, c.u, dim=0) > 0.99
    assert torch.equal(SyntheticDecodeLayer(256, 2, 8, 4, 32, 64, 16, torch.float32, "cpu").pk, c.pk)


def _rows(graph: bool):
    t = dict(sdpa=8.0, dense_triton=4.0, dense_step=5.0)
    rows = [dict(L=1024, B=1, config=k, pipeline="-", n_ret=0, density=1.0, ms=v) for k, v in t.items()]
    rows += [dict(L=1024, B=1, config="rtpurbo", pipeline="fused", n_ret=0, density=0.0, ms=1.0),
             dict(L=1024, B=1, config="rtpurbo", pipeline="fused", n_ret=1, density=0.1, ms=2.0,
                  density_source="planted", ret_density=0.12),
             dict(L=1024, B=1, config="rtpurbo_step", pipeline="library", n_ret=0, density=0.0, ms=1.5),
             dict(L=1024, B=1, config="rtpurbo_step", pipeline="library", n_ret=1, density=0.1, ms=3.0)]
    return [dict(r, eager_ms=r["ms"] * 2, graph_ms=r["ms"] if graph else math.nan) for r in rows]


def test_decode_speedups():
    (s,) = decode_speedups(_rows(graph=True))
    assert s["timing"] == "graph_ms" and s["rtpurbo15_ms"] == pytest.approx(0.6 * 2.0 + 0.4 * 1.0)
    assert s["vs_sdpa"] == pytest.approx(8.0 / 1.6) and s["vs_triton"] == pytest.approx(4.0 / 1.6)
    assert s["step_speedup"] == pytest.approx(5.0 / (0.6 * 3.0 + 0.4 * 1.5))
    assert (s["density"], s["density_source"], s["ret_density"], s["pipeline"]) == (0.1, "planted", 0.12, "fused")
    (e,) = decode_speedups(_rows(graph=False))  # no graph times: the eager column
    assert e["timing"] == "eager_ms" and e["sdpa_ms"] == 16.0
    with pytest.raises(StopIteration):
        decode_speedups([r for r in _rows(True) if r["config"] != "sdpa"])


def test_triton_pipelines_agree_with_the_reference():
    err = triton_vs_reference(DEVICE, torch.float32, 4, 2, 16, 64, L=256, B=1, block=16)
    assert 0.0 <= err < 1e-3


def test_prefill_indexer_plants_the_density():
    from sparrow.attention.rtpurbo_synthetic import prefill_indexer

    q, k = prefill_indexer(64 * 200 - 10, 0.3, 64, 16, "cpu", torch.float32, seed=3, top_p=0.6)
    assert q.shape == k.shape == (1, 1, 64 * 200 - 10, 16) and q.dtype == torch.float32 and q.is_contiguous()
    u = q[0, 0].mean(0)
    u = u / u.norm()
    hot = torch.nn.functional.pad(k[0, 0] @ u > 6, (0, 10)).view(200, 64)
    assert bool((hot.all(-1) | ~hot.any(-1))[:-1].all())  # whole blocks (the last one cut short)
    assert not hot[0].any()  # never the sink block
    assert 0.4 < hot.any(-1).float().mean() < 0.6  # density / top_p = 0.5, not the density 0.3
    again = prefill_indexer(64 * 200 - 10, 0.3, 64, 16, "cpu", torch.bfloat16, seed=3, top_p=0.6)
    assert again[1].dtype == torch.bfloat16 and torch.equal(again[1], k.to(torch.bfloat16))  # the seed fixes it
    assert not torch.equal(prefill_indexer(640, 0.3, 64, 16, "cpu", torch.float32, seed=4, top_p=0.6)[1], k[..., :640, :])


@pytest.mark.slow  # FlexAttention compiles on the CPU: about 20 s
def test_fast_prefill_agrees_with_the_reference():
    from sparrow.attention.rtpurbo_synthetic import prefill_vs_reference
    from sparrow.kernels.sparse_prefill import SparsePrefillConfig

    cfg = SparsePrefillConfig(top_p=0.9, block=32, num_sinks=4, window=64, ret_window=32)
    err = prefill_vs_reference(DEVICE, torch.float32, 4, 2, 16, cfg, S=200, flex_dynamic=None)
    assert 0.0 <= err < 1e-3

"""Several RTPurbo configurations of one model: the local heads' share of prefill and the model copies."""

from __future__ import annotations

import pytest
import torch

from sparrow.calibrate.variants import local_prefill_fraction


def brute_force(S: int, window: int, sinks: int) -> float:
    kept = sum(len({k for k in range(q + 1) if k < sinks or k > q - window}) for q in range(S))
    return kept / (S * (S + 1) / 2)


@pytest.mark.parametrize("S,window,sinks", [(10, 3, 1), (64, 16, 4), (5, 8, 2), (33, 1, 0)])
def test_local_prefill_fraction_counts_sinks_and_window(S, window, sinks):
    assert local_prefill_fraction(S, window, sinks) == pytest.approx(brute_force(S, window, sinks))


def test_rtpurbo_model_is_a_copy():
    from sparrow.attention.rtpurbo import HeadProfile, IndexerWeights, RTPurboConfig, rtpurbo_backends
    from sparrow.calibrate.variants import rtpurbo_model
    from sparrow.models import qwen2

    model = qwen2(vocab_size=32, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, intermediate_dim=64,
                  max_seq_len=128)
    prof = HeadProfile(torch.tensor([[1.0, 0.0], [0.0, 0.0]]), torch.tensor([[True, False], [False, False]]))
    idx = IndexerWeights({0: torch.zeros(1, 2 * 8, 16)}, {0: torch.zeros(1, 8, 16)})
    sparse = rtpurbo_model(model, prof, idx, RTPurboConfig(window=16, decode_block=16, prefill_block=16))
    assert sparse is not model and len(rtpurbo_backends(sparse)) == 2
    with pytest.raises(ValueError, match="DenseAttention"):  # the model itself is left dense
        rtpurbo_backends(model)

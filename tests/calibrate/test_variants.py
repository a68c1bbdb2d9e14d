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


def test_parse_variants_names_and_types():
    from sparrow.calibrate.variants import parse_variants

    out = parse_variants(" top_p=0.95,ratio=0.25 ; ratio=0.15;;decode_block=32")
    assert out == {"ratio=0.25,top_p=0.95": {"ratio": 0.25, "top_p": 0.95}, "ratio=0.15": {"ratio": 0.15},
                   "decode_block=32": {"decode_block": 32}}
    assert isinstance(out["decode_block=32"]["decode_block"], int) and parse_variants("") == {}
    with pytest.raises(ValueError, match="unknown variant keys"):
        parse_variants("ratio=0.1,blocks=4")
    with pytest.raises(ValueError, match="key=value"):
        parse_variants("ratio")
    with pytest.raises(ValueError):
        parse_variants("decode_block=3.5")


def test_calibrate_and_save_writes_what_the_recipe_loads(tmp_path):
    from sparrow.attention.rtpurbo import RTPurboConfig
    from sparrow.calibrate import load_rtpurbo
    from sparrow.calibrate.variants import calibrate_and_save
    from sparrow.models import tiny_qwen2
    from sparrow.training import TOKENIZER, init_weights

    torch.manual_seed(0)
    model = tiny_qwen2(vocab_size=TOKENIZER.vocab_size, max_seq_len=160).eval()
    init_weights(model, 0.02)
    cfg = RTPurboConfig.for_context(128, retrieval_ratio=0.5, decode_block=16, prefill_block=16, ret_window=16)
    rec = calibrate_and_save(model, cfg, 128, tmp_path / "cal", profile_seqs=1, fit_seqs=1, fit_steps=2,
                             queries_per_seq=8, lr=1e-3)
    profile, indexer, saved = load_rtpurbo(tmp_path / "cal", with_config=True)
    assert rec["context"] == 128 and rec["seconds"] >= 0 and saved == cfg
    assert rec["retrieval_heads"] == sorted(map(list, profile.retrieval.nonzero().tolist()))
    assert len(rec["retrieval_heads"]) == 2  # half of 2 layers x 2 kv heads
    assert rec["rtpurbo_config"]["retrieval_ratio"] == 0.5 and "recall" in rec["indexer"]
    with pytest.raises(ValueError):
        calibrate_and_save(model, cfg, 128, tmp_path / "none", profile_seqs=0, fit_seqs=1, fit_steps=1,
                           queries_per_seq=8, lr=1e-3)

import copy
import json
import math

import pytest
import torch

from sparrow.attention import LayerShape, rtpurbo
from sparrow.attention.rtpurbo import HeadProfile, IndexerWeights, RTPurboConfig, rtpurbo_attention, rtpurbo_backends
from sparrow.calibrate import fit_indexer, load_rtpurbo, repeat_span_sequences, save_rtpurbo
from sparrow.calibrate.selection import measure_selection
from sparrow.models import use_attention
from tests.calibrate.test_calibrate import _planted_copy_model

PROFILE = HeadProfile(torch.tensor([[0.0, 0.0], [0.0, 1.0]]), torch.tensor([[False, False], [False, True]]))


def _planted():
    """The planted copy model with kv head 1's two query heads made identical (bias included): its group attends
    with the logits q . k / sqrt(16) of either head (no RoPE in that layer)."""
    model = _planted_copy_model()
    attn = model.layers[1].attn
    d = attn.head_dim
    with torch.no_grad():
        attn.q_proj.weight[3 * d:4 * d] = attn.q_proj.weight[2 * d:3 * d]
        attn.q_proj.bias[3 * d:4 * d] = attn.q_proj.bias[2 * d:3 * d]
    return model


def _exact_indexer(model) -> IndexerWeights:
    """An indexer of dimension 16 = head_dim that reproduces the planted head's logits exactly."""
    d = model.layers[1].attn.head_dim
    wq = torch.cat([torch.eye(d) / math.sqrt(d), torch.zeros(d, d)])[None]  # [1, 2 * d, d]: the group's first head
    return IndexerWeights({1: wq}, {1: torch.eye(d)[None]})


def test_an_exact_indexer_selects_the_dense_sets_and_a_wrong_one_does_not():
    """Oracle check of the measurement: an indexer whose scores are the attention's logits keeps the dense top-p
    sets at every granularity (same density, recall 1); a perturbed one (negative control) does not."""
    model = _planted()
    seqs = repeat_span_sequences(2, 96, 64, span=16, seed=4)
    exact = measure_selection(model, PROFILE, _exact_indexer(model), seqs, block=8, prefill_block=16, chunk=32)
    (h,) = exact.heads
    for g in ("token", "block", "prefill"):  # up to rounding at the top-p boundary (the logits' sums differ)
        assert getattr(h, f"indexer_{g}") == pytest.approx(getattr(h, f"dense_{g}"), abs=2e-3)
        assert getattr(h, f"recall_{g}") > 0.998
        assert 0 < getattr(h, f"dense_{g}") < 1
    assert h.block_recall > 0.998 and h.queries == 2 * 95 and h.query_blocks == 2 * 6
    assert "prefill" in exact.table() and exact.summary()["num_heads"] == 1
    g = torch.Generator().manual_seed(0)
    w = _exact_indexer(model)
    wrong = IndexerWeights(w.q, {1: w.k[1] + torch.randn(w.k[1].shape, generator=g)})
    (h2,) = measure_selection(model, PROFILE, wrong, seqs, block=8, prefill_block=16, chunk=32).heads
    assert h2.recall_token < 0.9 and h2.recall_block < 0.95
    last = measure_selection(model, PROFILE, _exact_indexer(model), seqs, block=8, prefill_block=16, last=5)
    assert last.heads[0].queries == 2 * 5 and last.heads[0].recall_token > 0.998


def test_measure_selection_rejects_bad_input():
    model = _planted()
    seqs = repeat_span_sequences(1, 64, 64, span=16)
    for kw, match in ((dict(top_p=0.0), "top_p"), (dict(chunk=8, prefill_block=16), "chunk"), (dict(last=0), "last")):
        with pytest.raises(ValueError, match=match):
            measure_selection(model, PROFILE, _exact_indexer(model), seqs, **kw)
    with pytest.raises(ValueError, match="no weights for layer 1"):
        measure_selection(model, PROFILE, IndexerWeights(), seqs)


@pytest.mark.parametrize("sharpness", [3.0, 1 / 3.0])
def test_temperature_calibration_undoes_a_mis_scaled_indexer(sharpness):
    """An exact indexer made 3x too sharp (over-confident: its top-p misses attention mass) or 3x too flat
    (mass-covering: it keeps too many blocks) gets a temperature near 3 (1/3): calibrated, it keeps the blocks the
    dense top-p set keeps. Uncalibrated (negative control), it covers less mass or keeps more blocks."""
    model = _planted()
    w = _exact_indexer(model)
    scaled = IndexerWeights({1: w.q[1] * sharpness}, w.k)
    seqs = repeat_span_sequences(3, 160, 64, span=16, seed=1)
    kw = dict(steps=0, init=scaled, block=8, queries_per_seq=96, dim=16)
    cal, rep = fit_indexer(model, PROFILE, seqs, **kw)
    _, raw = fit_indexer(model, PROFILE, seqs, calibrate_temperature=False, **kw)
    (h,), (r,) = rep.heads, raw.heads
    assert abs(math.log(h.temperature / sharpness)) < math.log(1.3)
    assert float(cal.temperature[1][0]) == h.temperature and r.temperature == 1.0
    assert h.density == pytest.approx(h.dense_density, abs=0.03) and h.recall > 0.97
    if sharpness > 1:
        assert r.mass < h.mass - 0.02 and r.recall < h.recall
    else:
        assert r.density > h.density + 0.05
    assert (h.density_t1, h.mass_t1) == pytest.approx((r.density, r.mass))
    with pytest.raises(ValueError, match="mass_target"):
        fit_indexer(model, PROFILE, seqs, mass_target=1.5, **kw)


def test_temperatures_are_saved_applied_and_old_files_load_at_one(tmp_path):
    model = _planted()
    w = _exact_indexer(model)
    w.temperature[1] = torch.tensor([2.5])
    save_rtpurbo(tmp_path, PROFILE, w)
    doc = json.loads((tmp_path / "rtpurbo.json").read_text())
    assert doc["version"] == 2
    _, back = load_rtpurbo(tmp_path)
    assert back.temperature[1].tolist() == [2.5]
    sparse = use_attention(copy.deepcopy(model), rtpurbo_attention(PROFILE, back, RTPurboConfig(window=64)))
    b = rtpurbo_backends(sparse)[1]
    assert b.temperature.tolist() == [2.5]
    q_pre, k_pre = torch.randn(1, 4, 5, 16), torch.randn(1, 2, 5, 16)
    q_idx, _ = b.index(q_pre, k_pre)
    b.load_indexer(b.indexer_q.detach(), b.indexer_k.detach())  # temperature 1
    torch.testing.assert_close(q_idx, b.index(q_pre, k_pre)[0] / 2.5)
    with pytest.raises(ValueError, match="positive"):
        b.load_indexer(b.indexer_q.detach(), b.indexer_k.detach(), torch.tensor([0.0]))
    w.temperature[1] = torch.tensor([-1.0])
    with pytest.raises(ValueError, match="positive"):
        save_rtpurbo(tmp_path / "bad", PROFILE, w)
    # version 1 files: no temperature, which then is 1 (the selection they were made for)
    from safetensors.torch import load_file, save_file

    saved = load_file(str(tmp_path / "rtpurbo_indexer.safetensors"))
    tensors = {k: v for k, v in saved.items() if "temperature" not in k}
    save_file(tensors, str(tmp_path / "rtpurbo_indexer.safetensors"))
    doc["version"] = 1
    (tmp_path / "rtpurbo.json").write_text(json.dumps(doc))
    b1 = rtpurbo(str(tmp_path))(LayerShape(1, 4, 2, 16))
    assert b1.temperature.tolist() == [1.0]
    doc["version"] = 2  # a version 2 file must carry its temperatures
    (tmp_path / "rtpurbo.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="temperature"):
        load_rtpurbo(tmp_path)
    doc["version"] = 3
    (tmp_path / "rtpurbo.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="version 3"):
        load_rtpurbo(tmp_path)


def test_mean_over_leaves_out_heads_without_data_only_when_asked():
    """``mean_over``: every head weighs the same; ``skip_nan`` drops the NaN entries (heads without data), else one
    makes the mean NaN; nothing left is NaN."""
    import math
    from types import SimpleNamespace

    from sparrow.calibrate.indexer import mean_over

    heads = [SimpleNamespace(x=1.0), SimpleNamespace(x=3.0), SimpleNamespace(x=float("nan"))]
    assert mean_over(heads, "x", skip_nan=True) == 2.0
    assert math.isnan(mean_over(heads, "x")) and math.isnan(mean_over(heads[2:], "x", skip_nan=True))
    assert mean_over(heads[:2], "x") == 2.0

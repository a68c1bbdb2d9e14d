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


def test_variant_configs_override_the_base():
    from sparrow.attention.rtpurbo import RTPurboConfig
    from sparrow.calibrate.variants import variant_configs

    cfgs = variant_configs("ratio=0.25;ratio=0.5,top_p=0.95;window=64", 4096, top_p=0.9, decode_block=32,
                           impl="reference")
    assert list(cfgs) == ["ratio=0.25", "ratio=0.5,top_p=0.95", "window=64"]
    assert cfgs["ratio=0.25"] == RTPurboConfig.for_context(4096, retrieval_ratio=0.25, top_p=0.9, decode_block=32,
                                                          impl="reference")
    assert (cfgs["ratio=0.5,top_p=0.95"].top_p, cfgs["ratio=0.5,top_p=0.95"].retrieval_ratio) == (0.95, 0.5)
    assert cfgs["window=64"].window == 64 and cfgs["window=64"].retrieval_ratio == 0.15  # the default ratio
    assert cfgs["ratio=0.25"].window == 4096 // 16  # scaled to the context
    assert variant_configs("top_p=0.8", 1024, default_ratio=0.3)["top_p=0.8"].retrieval_ratio == 0.3
    with pytest.raises(ValueError, match="unknown variant keys"):
        variant_configs("heads=3", 1024)


def test_variant_densities_count_local_heads_exactly():
    from sparrow.attention.rtpurbo import HeadProfile, RTPurboConfig
    from sparrow.calibrate.variants import local_prefill_fraction, variant_densities

    prof = HeadProfile(torch.zeros(2, 2), torch.tensor([[True, False], [False, False]]))  # 1 retrieval head of 4
    cfg = RTPurboConfig(window=32, num_sinks=4, decode_block=16, prefill_block=16)
    st = {"decode_density": 0.5, "decode_ret_density": 0.25, "prefill_ret_density": 0.2}
    d = variant_densities(st, prof, cfg, 127)
    local = local_prefill_fraction(128, 32, 4)
    assert d["prefill_density"] == pytest.approx((0.2 + 3 * local) / 4)
    assert (d["decode_density"], d["decode_ret_density"], d["prefill_ret_density"]) == (0.5, 0.25, 0.2)
    assert (d["window"], d["window_frac"], d["retrieval_heads"]) == (32, 32 / 128, 1)
    none = variant_densities(st, HeadProfile(torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.bool)), cfg, 127)
    assert none["prefill_density"] == pytest.approx(local) and none["retrieval_heads"] == 0
    with pytest.raises(KeyError):
        variant_densities({"decode_density": 0.5}, prof, cfg, 127)


def _head(layer: int, v: float) -> dict:
    stats = {f"{k}_{g}": v for k in ("dense", "indexer", "recall") for g in ("token", "block", "prefill")}
    return {"layer": layer, "kv_head": 0, **stats}


RUN_VALUES = {"calibrated_all": 0.2, "t1_all": 0.1, "calibrated_decode": 0.5, "t1_decode": 0.4}


def _record():
    runs = {run: {"num_heads": 2, "heads": [_head(0, v), _head(1, v + 0.2)]} for run, v in RUN_VALUES.items()}
    return {"configs": {"a": {"selection": runs}, "b": {"selection": {"t1_all": {"heads": [_head(0, 0.1)]}}}}}


def test_selection_rows_and_plot(tmp_path, monkeypatch):
    import matplotlib

    from sparrow.calibrate import variants
    from sparrow.calibrate.variants import plot_selection, selection_rows

    matplotlib.use("Agg")
    rows = selection_rows(_record())
    assert len(rows) == 4 * 2 + 1 and rows[0] == {"config": "a", "run": "calibrated_all", **_head(0, 0.2)}
    assert [r["config"] for r in rows].count("b") == 1 and rows[-1]["run"] == "t1_all"
    plot_selection([r for r in rows if r["config"] == "a"], tmp_path / "sel.png", "selection")
    assert (tmp_path / "sel.png").stat().st_size > 0
    figs = []
    monkeypatch.setattr(variants, "save_figure", lambda fig, path, title: figs.append((fig, title)))
    plot_selection([r for r in rows if r["config"] == "a"], tmp_path / "again.png", "again")
    (fig, title), = figs
    for ax, run in zip(fig.axes, ("all", "decode")):  # bars: dense top-p (T=1), indexer T=1, indexer calibrated
        t1, cal = RUN_VALUES[f"t1_{run}"] + 0.1, RUN_VALUES[f"calibrated_{run}"] + 0.1  # the mean over two heads
        assert [b.get_height() for b in ax.patches] == pytest.approx([t1] * 6 + [cal] * 3)
        assert [t.get_text() for t in ax.texts] == [f"{t1:.2f}"] * 3 + [f"{cal:.2f}"] * 3  # the indexer's recall
    assert title == "again"
    matplotlib.pyplot.close(fig)
    with pytest.raises(ZeroDivisionError):  # no decode rows of b
        plot_selection([r for r in rows if r["config"] == "b"], tmp_path / "b.png", "b")
    with pytest.raises(KeyError):
        selection_rows({"configs": {"a": {}}})


def test_calibration_options_parse():
    from sparrow.bench import base_parser, fill_defaults
    from sparrow.calibrate.variants import CALIBRATION_DEFAULTS, calibration_options

    p = base_parser("q", calibration_options(200, prefill_impl="reference"))
    args = fill_defaults(p.parse_args(["--fit-seqs", "3"]), False, fit_steps=(20, 200), **CALIBRATION_DEFAULTS)
    assert (args.top_p, args.decode_impl, args.prefill_impl, args.fit_lr) == (0.9, "auto", "reference", 3e-3)
    assert (args.profile_seqs, args.fit_seqs, args.fit_steps, args.queries_per_seq) == (8, 3, 200, 256)
    quick = fill_defaults(p.parse_args(["--quick"]), True, fit_steps=(20, 200), **CALIBRATION_DEFAULTS)
    assert (quick.profile_seqs, quick.fit_seqs, quick.fit_steps, quick.queries_per_seq) == (2, 2, 20, 64)
    assert "default 200" in p.format_help() and base_parser("q", calibration_options()).parse_args([]).prefill_impl \
        == "auto"


@pytest.mark.parametrize("script", ["bench_rtpurbo_prefill.py", "bench_rtpurbo_decode.py"])
def test_density_benchmarks_read_keys_the_accuracy_rows_have(script, tmp_path):
    """``--density ACCURACY.json`` of the synthetic RTPurbo benchmarks reads a key that
    ``bench_rtpurbo_accuracy.py``'s rows (:func:`variant_densities`) carry; a key they lack would stop the run."""
    import json
    import re

    from sparrow import bench
    from sparrow.attention.rtpurbo import HeadProfile, RTPurboConfig
    from sparrow.calibrate.variants import variant_densities

    text = (bench.REPO / "benchmarks" / script).read_text()
    (key,) = re.findall(r'planted_and_measured\([^)]*"(\w+)"\)', text)
    prof = HeadProfile(torch.zeros(1, 2), torch.tensor([[True, False]]))
    st = {"decode_density": 0.5, "decode_ret_density": 0.25, "prefill_ret_density": 0.2}
    row = dict(context=127, **variant_densities(st, prof, RTPurboConfig(window=32, decode_block=16, prefill_block=16), 127))
    f = tmp_path / "acc.json"
    f.write_text(json.dumps({"rows": [row]}))
    assert bench.density_arg(str(f), key) == [row[key]]
    old = "retrieval_" + key.split("_")[0] + "_density"  # negative control: the key the scripts once read
    with pytest.raises(SystemExit, match="has no"):
        bench.density_arg(str(f), old)

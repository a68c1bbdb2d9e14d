import copy

import pytest
import torch

from sparrow.attention.rtpurbo import HeadProfile, RTPurboConfig, rtpurbo_attention, rtpurbo_backends
from sparrow.calibrate import (
    ablation_scores,
    fit_indexer,
    head_scores,
    indexer_from_model,
    load_rtpurbo,
    main,
    profile_heads,
    refresh_indexer,
    repeat_span_sequences,
    save_rtpurbo,
)
from sparrow.models import use_attention
from tests.helpers import random_tiny


def test_repeat_span_sequences():
    seqs = repeat_span_sequences(3, 200, 50, span=20, offset=8, seed=1)
    for s in seqs:
        assert s.tokens.shape == (200,) and int(s.tokens.max()) < 50
        assert torch.equal(s.tokens[8:28], s.tokens[180:200]) and (s.first, s.second, s.span) == (8, 180, 20)
    with pytest.raises(ValueError):
        repeat_span_sequences(1, 30, 50, span=20)


def test_profile_finds_a_planted_copy_head():
    """Make kv head 1 of layer 1 attend by content (q = k for every token): its queries on the second copy
    find the first copy, so it must score highest."""
    model = random_tiny("qwen2", std=0.05)
    attn = model.layers[1].attn
    with torch.no_grad():
        d = attn.head_dim
        attn.k_proj.weight[d:2 * d] = attn.q_proj.weight[2 * d:3 * d] = 4.0 * torch.randn(d, 64)
        attn.q_proj.weight[3 * d:4 * d] = attn.k_proj.weight[d:2 * d]
        attn.pos_embeddings = None  # no RoPE in this layer: pure content matching
    seqs = repeat_span_sequences(2, 160, 64, span=16, seed=0)
    scores = head_scores(model, seqs)
    assert scores.shape == (2, 2) and (scores >= 0).all() and (scores <= 1).all()
    assert scores.argmax() == 3 and scores[1, 1] > 1.5 * scores.flatten()[:3].max()
    prof = profile_heads(model, seqs, 0.25)
    assert prof.retrieval.tolist() == [[False, False], [False, True]]
    assert prof.meta["seq_len"] == 160


def test_local_head_restricts_one_head_and_restores_the_model():
    """Inside ``local_head`` only the chosen kv head's query heads change, and they equal attention over sinks +
    window computed by hand; on exit the model is dense again. A window covering the whole sequence changes
    nothing."""
    from sparrow.calibrate.capture import capture_attention, local_head

    model = random_tiny("qwen2", std=0.1)
    tokens = torch.randint(0, 64, (1, 40))
    dense = model(tokens)
    seen = {}

    def grab(layer, t):
        seen[layer] = t

    with capture_attention(model, grab, {1}):
        model(tokens)
    q, k, v = seen[1]["q"], seen[1]["k"], seen[1]["v"]
    backend = model.layers[1].attn.backend
    with local_head(model, 1, 1, window=5, sinks=2):
        out = backend.forward_train(q, k, v)
        assert not torch.equal(model(tokens), dense)
    ref = backend.forward_train(q, k, v)
    qpk = q.shape[1] // k.shape[1]
    assert torch.equal(out[:, :qpk], ref[:, :qpk])  # kv head 0's query heads: untouched
    S = q.shape[2]
    for i in (0, 3, 20, S - 1):  # kv head 1's: sinks 0, 1 and the last 5 positions up to i, by hand
        keep = [j for j in range(i + 1) if j < 2 or j > i - 5]
        for h in range(qpk, 2 * qpk):
            w = torch.softmax(q[0, h, i] @ k[0, 1, keep].T / q.shape[-1] ** 0.5, -1)
            torch.testing.assert_close(out[0, h, i], w @ v[0, 1, keep], rtol=1e-5, atol=1e-5)
    assert torch.equal(model(tokens), dense)  # restored
    with local_head(model, 0, 0, window=S, sinks=0):
        assert torch.equal(model(tokens), dense) or torch.allclose(model(tokens), dense, atol=1e-5)


def test_ablation_scores_find_the_head_the_answer_needs_not_the_one_that_only_looks():
    """Two copy heads: layer 1's carries what it reads into the logits (the planted retrieval model); layer 0's
    kv head 0 attends to the first copy just as well but its values are zero, so nothing it reads reaches the
    output. Attention mass ranks both high; the ablation ranks the carrying head first and the looking-only
    head at zero. A window over the whole sequence costs nothing anywhere."""
    model = _planted_copy_model()
    attn = model.layers[0].attn
    with torch.no_grad():
        d = attn.head_dim
        attn.k_proj.weight[:d] = attn.q_proj.weight[:d] = 4.0 * torch.randn(d, 64)
        attn.q_proj.weight[d:2 * d] = attn.k_proj.weight[:d]
        attn.pos_embeddings = None
        attn.v_proj.weight[:d] = 0.0
    seqs = repeat_span_sequences(2, 160, 64, span=16, seed=0)
    looks = head_scores(model, seqs)
    assert looks[0, 0] > 2 * max(looks[0, 1], looks[1, 0])  # attention mass: the looking-only head stands out
    scores = ablation_scores(model, seqs, window=8, sinks=2)
    assert scores.shape == (2, 2) and scores.argmax() == 3 and scores[1, 1] > 10 * scores.flatten()[:3].max()
    assert abs(scores[0, 0]) < 1e-5  # zero values: local or not, the same output
    assert ablation_scores(model, seqs, window=160, sinks=0).abs().max() < 1e-4


def test_fit_indexer_reduces_kl_and_round_trips(tmp_path):
    model = random_tiny("qwen2")
    prof = HeadProfile.from_scores(torch.tensor([[1.0, 0.0], [0.5, 0.7]]), 0.75)
    seqs = repeat_span_sequences(3, 128, 64, seed=2)
    w, rep = fit_indexer(model, prof, seqs, steps=60, dim=16, queries_per_seq=48, block=16, lr=1e-2)
    assert sorted(w.q) == [0, 1] and w.q[1].shape == (2, 2 * 16, 16) and w.k[0].shape == (1, 16, 16)
    assert len(rep.heads) == 3
    assert rep.mean("kl_final") < rep.mean("kl_init")
    assert all(0 <= h.recall <= 1 and 0 < h.density <= 1 for h in rep.heads)
    assert "recall" in rep.table()
    save_rtpurbo(tmp_path, prof, w, config=RTPurboConfig(window=64), report=rep.summary())
    p2, w2, cfg = load_rtpurbo(tmp_path, with_config=True)
    assert torch.equal(p2.retrieval, prof.retrieval) and cfg.window == 64
    assert all(torch.equal(w2.q[l], w.q[l]) and torch.equal(w2.k[l], w.k[l]) for l in w.q)
    sparse = use_attention(copy.deepcopy(model), rtpurbo_attention(p2, w2, RTPurboConfig(window=64)))
    b = rtpurbo_backends(sparse)[1]
    assert b.retrieval_heads == (0, 1) and torch.equal(b.indexer_k.detach(), w.k[1])
    from sparrow.calibrate import rtpurbo_from_checkpoint

    again = use_attention(copy.deepcopy(model), rtpurbo_from_checkpoint(tmp_path, top_p=0.5))
    assert rtpurbo_backends(again)[1].config.top_p == 0.5 and rtpurbo_backends(again)[1].config.window == 64
    prof_back, w_back = indexer_from_model(sparse)
    assert torch.equal(prof_back.retrieval, prof.retrieval) and torch.equal(w_back.q[0], w.q[0])
    before = b.indexer_q.detach().clone()
    rep2 = refresh_indexer(sparse, seqs[:1], steps=3, queries_per_seq=16)
    assert len(rep2.heads) == 3 and not torch.equal(before, b.indexer_q.detach())


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="calibrate"):
        load_rtpurbo(tmp_path)
    prof = HeadProfile.from_scores(torch.tensor([[1.0, 0.0]]), 0.5)
    from sparrow.attention.rtpurbo import IndexerWeights

    with pytest.raises(ValueError, match="no weights"):
        save_rtpurbo(tmp_path, prof, IndexerWeights())


def test_cli_end_to_end(tmp_path, capsys):
    from safetensors.torch import save_file

    model = random_tiny("qwen2")
    ckpt = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(ckpt))
    rc = main(["--model", "tiny_qwen2", "--checkpoint", str(ckpt), "--seq-len", "128", "--num-seqs", "2",
               "--steps", "5", "--block", "16", "--ratio", "0.5", "--queries-per-seq", "32", "--no-progress",
               "--device", "cpu", "--dtype", "float32"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "retrieval heads (2 of 4" in out and "recall" in out
    prof, w, cfg = load_rtpurbo(tmp_path, with_config=True)
    assert prof.retrieval.sum() == 2 and cfg.window == 128  # for_context(128): never below two decode blocks


def _planted_copy_model():
    """A tiny model whose layer-1 kv head 1 retrieves by content (q = k per token, no RoPE), with its values
    amplified so that what it reads matters for the logits."""
    model = random_tiny("qwen2", std=0.05, max_seq_len=512)
    attn = model.layers[1].attn
    with torch.no_grad():
        d = attn.head_dim
        attn.k_proj.weight[d:2 * d] = attn.q_proj.weight[2 * d:3 * d] = 4.0 * torch.randn(d, 64)
        attn.q_proj.weight[3 * d:4 * d] = attn.k_proj.weight[d:2 * d]
        attn.pos_embeddings = None
        attn.v_proj.weight[d:2 * d] *= 20
    return model


def _decode_error(model, profile, indexer, cfg):
    """Prefill a repeated-span sequence up to 12 tokens before its end, decode the last 12 teacher-forced:
    max |logit - dense logit| and the retrieval heads' measured density."""
    from sparrow.attention import CacheSpec, DecodeMeta, PrefillMeta
    from sparrow.attention.rtpurbo import collect_selection_stats
    from sparrow.rollout.forward import decode_hidden, logits_from_hidden, prefill_hidden

    m = use_attention(copy.deepcopy(model), rtpurbo_attention(profile, indexer, cfg))
    for b in rtpurbo_backends(m):
        b.enable_stats()
    s = repeat_span_sequences(1, 320, 64, span=16, seed=5)[0].tokens
    caches = [b.init_cache(CacheSpec(1, 320, 2, 32), dtype=torch.float32, device=torch.device("cpu"))
              for b in rtpurbo_backends(m)]
    n = 320 - 12
    outs = []
    with torch.no_grad():
        prefill_hidden(m, s[None, :n], caches, PrefillMeta(torch.tensor([0]), torch.tensor([n])))
        for g in range(12):
            meta = DecodeMeta(torch.tensor([0]), torch.tensor([0]), torch.tensor([n]), torch.tensor([g]))
            outs.append(logits_from_hidden(m, decode_hidden(m, s[None, n + g:n + g + 1], caches, meta))[0, 0])
        dense = model(s[None])[0, n:]
    return float((torch.stack(outs) - dense).abs().max()), collect_selection_stats(m)["decode_ret_density"]


def test_calibrated_rtpurbo_tracks_dense_on_a_retrieval_model():
    """End to end on a model with a real retrieval head: the profile finds it, the indexer reaches high
    recall of the dense top-p set, and sparse decode (16-token window, top-p 0.9) stays close to dense where
    dropping the retrieval head (local heads only) does not."""
    model = _planted_copy_model()
    prof = profile_heads(model, repeat_span_sequences(1, 320, 64, span=16, seed=0), 0.25)
    assert prof.retrieval.tolist() == [[False, False], [False, True]]
    w, rep = fit_indexer(model, prof, repeat_span_sequences(3, 320, 64, span=16, seed=1), steps=50, block=16,
                         queries_per_seq=96, lr=1e-2)
    assert rep.mean("recall") > 0.9 and rep.mean("density") < 0.8
    cfg = RTPurboConfig(decode_block=16, prefill_block=16, ret_window=16, window=16, top_p=0.9, impl="reference",
                        prefill_impl="reference")
    err, density = _decode_error(model, prof, w, cfg)
    err_local, _ = _decode_error(model, HeadProfile.uniform(2, 2, False), None, cfg)
    assert density < 0.8
    assert err < 0.4 * err_local


def test_a_directory_in_the_version_1_format_loads(tmp_path):
    """Files written field by field as version 1 of the format (not through save_rtpurbo) load: profile,
    indexer, config, and the attention factory built from them."""
    import json

    from safetensors.torch import save_file

    from sparrow.attention import LayerShape, rtpurbo

    g = torch.Generator().manual_seed(0)
    wq, wk = torch.randn(1, 2 * 16, 16, generator=g), torch.randn(1, 16, 16, generator=g)
    save_file({"layers.1.indexer_q": wq, "layers.1.indexer_k": wk}, str(tmp_path / "rtpurbo_indexer.safetensors"),
              metadata={"format": "sparrow-rtpurbo", "version": "1"})
    config = dict(retrieval_ratio=0.25, num_sinks=4, window=64, ret_window=128, indexer_dim=16, top_p=0.8,
                  decode_block=64, prefill_block=128, ring_slack=64, impl="auto", prefill_impl="auto",
                  dense_prefill_below=0)
    doc = {"format": "sparrow-rtpurbo", "version": 1, "indexer_dim": 16,
           "profile": {"num_layers": 2, "num_kv_heads": 2, "scores": [[0.1, 0.2], [0.9, 0.3]],
                       "retrieval": [[False, False], [True, False]], "meta": {"ratio": 0.25}},
           "config": config, "report": {"steps": 3}}
    (tmp_path / "rtpurbo.json").write_text(json.dumps(doc, indent=1))
    prof, w, cfg = load_rtpurbo(tmp_path, with_config=True)
    assert prof.retrieval.tolist() == [[False, False], [True, False]] and prof.meta == {"ratio": 0.25}
    assert torch.equal(w.q[1], wq) and torch.equal(w.k[1], wk) and sorted(w.q) == [1]
    assert cfg == RTPurboConfig(**config)
    b = rtpurbo(str(tmp_path), top_p=0.5)(LayerShape(1, 4, 2, 16))  # the recipe's `_component_` entry point
    assert b.retrieval_heads == (0,) and b.config.top_p == 0.5 and b.config.window == 64
    assert torch.equal(b.indexer_q.detach(), wq) and torch.equal(b.indexer_k.detach(), wk)
    doc["format"] = "something-else"
    (tmp_path / "rtpurbo.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="something-else"):
        load_rtpurbo(tmp_path)

"""RTPurbo calibration data from the synthetic tasks: the marked spans really repeat; the fit sequences; an
indexer cut to a smaller head set."""

from __future__ import annotations

import pytest
import torch

from sparrow.attention.rtpurbo import HeadProfile, IndexerWeights
from sparrow.calibrate.data import calibration_sequences, fit_sequences, subset_indexer
from sparrow.rl import CharTokenizer, KVRetrieval, VariableTracking


@pytest.mark.parametrize("context", [pytest.param(100, id="short"), pytest.param(257, id="odd")])
def test_calibration_sequences_mark_real_repeats(context):
    seqs = calibration_sequences(context, 3, seed=5)
    assert len(seqs) == 9
    for s in seqs:
        t = s.tokens
        assert t.dtype == torch.int64 and t[0] == CharTokenizer.bos_id and CharTokenizer.eos_id not in t.tolist()
        assert s.first + s.span <= s.second and s.second + s.span <= t.numel()
        assert torch.equal(t[s.first:s.first + s.span], t[s.second:s.second + s.span])
    # the kv pair's second copy is the question + answer, at the end of the sequence
    kv = seqs[0]
    assert kv.second + kv.span == kv.tokens.numel()
    # a negative control: one position off, the spans differ
    assert not torch.equal(kv.tokens[kv.first + 1:kv.first + 1 + kv.span], kv.tokens[kv.second:kv.second + kv.span])


def test_fit_sequences_alternate_the_tasks():
    tok = CharTokenizer()
    seqs = fit_sequences(128, 4, seed=9)
    kv, vt = KVRetrieval(128).example(9, 0), VariableTracking(128).example(9, 1)
    assert seqs[0].tolist() == tok.encode(kv.prompt + kv.answer)
    assert seqs[1].tolist() == tok.encode(vt.prompt + vt.answer)
    assert len(seqs) == 4 and all(s.dtype == torch.int64 for s in seqs)
    with pytest.raises(ValueError, match="n must be >= 1"):
        fit_sequences(128, 0)
    with pytest.raises(ValueError, match="n must be >= 1"):
        calibration_sequences(128, 0)


def test_subset_indexer_takes_the_smaller_profiles_heads():
    scores = torch.tensor([[0.9, 0.1, 0.8], [0.2, 0.7, 0.3]])
    big, small = HeadProfile.from_scores(scores, 4 / 6), HeadProfile.from_scores(scores, 2 / 6)
    assert big.retrieval_heads(0) == [0, 2] and small.retrieval_heads(0) == [0, 2] and small.retrieval_heads(1) == []
    w = IndexerWeights()
    for layer in range(2):
        n = len(big.retrieval_heads(layer))
        w.q[layer], w.k[layer] = torch.randn(n, 8, 4), torch.randn(n, 4, 4)
    out = subset_indexer(big, HeadProfile.from_scores(scores, 1 / 6), w)
    assert list(out.q) == [0] and torch.equal(out.q[0], w.q[0][:1]) and torch.equal(out.k[0], w.k[0][:1])
    out = subset_indexer(big, small, w)
    assert torch.equal(out.q[0], w.q[0]) and 1 not in out.q
    wrong = HeadProfile(scores, torch.tensor([[False, True, False], [False, False, False]]))
    with pytest.raises(ValueError, match=r"heads \[1\] are not among the fitted \[0, 2\]"):
        subset_indexer(big, wrong, w)

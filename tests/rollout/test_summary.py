"""sparrow.rollout.summary: one generate call as a record, several side by side per bucket."""

from __future__ import annotations

import pytest
import torch

from sparrow.rollout import Generation, GenerationStats, Sample
from sparrow.rollout.summary import bucket_comparison, generation_summary


def _gen(lengths, stops, **stats) -> Generation:
    samples = [Sample(0, i, torch.zeros(n, dtype=torch.int64), torch.zeros(n), "stop" if s else "length")
               for i, (n, s) in enumerate(zip(lengths, stops))]
    return Generation(samples, GenerationStats(**stats))


def test_generation_summary_of_a_speculative_and_a_plain_call():
    spec = _gen([3, 10, 5, 7], [True, False, True, True], prefill_s=0.5, generated_tokens=25, decode_steps=6,
                spec_cycles=4, spec_row_cycles=10, draft_proposed=20, draft_accepted=15, draft_len_hist={4: 2, 2: 2},
                block_tokens={4: 20, 2: 5, 1: 0}, block_time_s={4: 0.5, 2: 0.25, 1: 0.0}, active_hist={4: 3, 2: 3},
                spec_hist={4: 2, 2: 2})
    r = generation_summary("SD", spec, 1.5)
    assert (r["run"], r["latency_s"], r["decode_s"], r["tokens"]) == ("SD", 1.5, 1.0, 25)
    assert r["decode_tok_s"] == pytest.approx(25.0)
    assert r["acceptance"] == pytest.approx(0.75) and r["tokens_per_cycle"] == pytest.approx(2.5)
    assert (r["len_p50"], r["len_p90"], r["len_max"], r["stop_frac"]) == (7, 7, 10, 0.75)
    assert r["bucket_tok_s"] == {2: 20.0, 4: 40.0}  # bucket 1 ran no block time: left out
    assert list(r["draft_len_hist"]) == [2, 4] and r["bucket_spec_steps"] == {2: 2, 4: 2}
    plain = generation_summary("AR", _gen([4], [False], prefill_s=1.0, generated_tokens=4), 1.0)
    assert plain["acceptance"] is None and plain["tokens_per_cycle"] is None and plain["decode_tok_s"] == 0.0
    with pytest.raises(ValueError):
        generation_summary("none", _gen([], []), 1.0)


def test_bucket_comparison_against_the_first_run():
    rows = [{"run": "AR", "bucket_tok_s": {1: 10.0, 8: 40.0}, "bucket_steps": {}, "bucket_spec_steps": {}},
            {"run": "SD toggle+adaptive", "bucket_tok_s": {1: 20.0}, "bucket_steps": {1: 4, 8: 2},
             "bucket_spec_steps": {1: 3}},
            {"run": "SD always k=4", "bucket_tok_s": {1: 5.0, 8: 80.0}, "bucket_steps": {}, "bucket_spec_steps": {}}]
    t = bucket_comparison(rows)
    assert [r["bucket"] for r in t] == [1, 8]
    assert t[0]["SD toggle+adaptive /AR"] == 2.0 and t[0]["SD always k=4 /AR"] == 0.5 and t[0]["toggle SD frac"] == 0.75
    assert t[1]["SD toggle+adaptive"] is None and t[1]["SD toggle+adaptive /AR"] is None
    assert t[1]["SD always k=4 /AR"] == 2.0 and t[1]["toggle SD frac"] == 0.0
    assert "AR /AR" not in t[0]

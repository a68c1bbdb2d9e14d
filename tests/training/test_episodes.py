"""The Markov-episode task: ids, episode ends, prompts ending inside a fresh episode, its batches."""

from __future__ import annotations

import pytest
import torch

from sparrow.training import ANSWER, EpisodeBatches, MarkovEpisodes


def test_streams_follow_each_class_chain():
    task = MarkovEpisodes(n_classes=3, per_class=16, successors=4, min_mean=4, max_mean=16)
    g = torch.Generator().manual_seed(0)
    s = task.streams(8, 200, g)
    assert s.shape == (8, 200) and s.min() >= 1 and s.max() < task.vocab_needed
    assert ((s == MarkovEpisodes.EOS) | (s >= task.first)).all()
    local = s - task.first
    for row in local.tolist():  # inside an episode, a token moves to one of its successors
        for a, b in zip(row, row[1:]):
            if a >= 0 and b >= 0:
                assert b in task.succ[a].tolist()
    assert (s == MarkovEpisodes.EOS).float().mean() > 0.02  # episodes end
    assert task.entropy() > 0 and task.means == pytest.approx([4, 8, 16])


def test_prompts_end_inside_a_fresh_episode_of_their_class():
    task = MarkovEpisodes(n_classes=4, per_class=8, min_mean=8, max_mean=64)
    prompts, classes = task.prompts(5, 40, 120, seed=3, tail=10)
    for p, c in zip(prompts, classes):
        assert 40 <= len(p) <= 120 and p[-11] == MarkovEpisodes.EOS
        assert all(task.first + c * 8 <= t < task.first + (c + 1) * 8 for t in p[-10:])
    assert task.prompts(5, 40, 120, seed=3, tail=10) == (prompts, classes)  # deterministic by seed


def test_batches_are_language_model_batches_renewed_every_64():
    source = EpisodeBatches(MarkovEpisodes(n_classes=2, per_class=8), seq_len=12, batch=3)
    first_pool = source.pool
    b = source.next(4096)
    assert b.tokens.shape == (3, 13) and b.roles.shape == (3, 12) and (b.roles == ANSWER).all()
    assert source.longest_sequence(1) == 13 and b.context == 12
    for _ in range(63):
        source.next(0)
    assert source.pool is not first_pool


def test_bad_settings():
    with pytest.raises(ValueError, match="first > 1"):
        MarkovEpisodes(first=1)
    with pytest.raises(ValueError, match="seq_len and batch must be >= 1, got 0, 2"):
        EpisodeBatches(MarkovEpisodes(n_classes=1, per_class=4), 0, 2)


def test_train_on_episodes_lowers_the_loss():
    from sparrow.models import tiny_qwen2
    from sparrow.training import init_weights, train_on_episodes

    task = MarkovEpisodes(n_classes=2, per_class=8, min_mean=4, max_mean=8)
    torch.manual_seed(0)
    model = tiny_qwen2(vocab_size=task.vocab_needed, max_seq_len=64)
    init_weights(model, 0.02)
    lines = []
    out = train_on_episodes(model, task, seq_len=32, batch=4, lr=3e-3, warmup_steps=2, steps=40, log=lines.append,
                            log_every_s=0.0)
    assert out["steps"] == 40 and out["tokens"] > 0 and out["seconds"] >= 0 and lines
    losses = [loss for _, loss in out["loss_curve"]]
    assert out["final_loss"] == losses[-1] < losses[0]
    with pytest.raises(ValueError):
        train_on_episodes(model, task, seq_len=32, batch=4, lr=1e-3, warmup_steps=0)  # neither minutes nor steps

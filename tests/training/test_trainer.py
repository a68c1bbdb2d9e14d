"""The teacher-forced trainer: the loss's terms and means, the schedule, config checks, a real (tiny) run."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from sparrow.models import tiny_qwen2
from sparrow.rl import KVRetrieval, hidden_states
from sparrow.training import (
    ANSWER, EOS, FAMILIES, IGNORED, PROMPT, CurriculumConfig, EvalConfig, LossConfig, OptimizerConfig, TaskMixStream,
    TrainConfig, Trainer, draw_prompt_positions, init_weights, teacher_forced_loss,
)
from tests.helpers import train_and_stop

# two examples: prompt tokens, an answer of 1 / 3 tokens, <eos>, padding
ROLES = torch.tensor([[PROMPT, PROMPT, ANSWER, EOS, IGNORED, IGNORED],
                      [PROMPT, ANSWER, ANSWER, ANSWER, EOS, IGNORED]], dtype=torch.int8)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 6, 11, generator=g), torch.randint(0, 11, (2, 6), generator=g)


def _nll(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)


def test_example_mean_weighs_every_example_the_same():
    logits, targets = _inputs()
    nll = _nll(logits, targets)
    parts = teacher_forced_loss(logits, targets, ROLES, LossConfig(prompt_weight=0.5))
    a = (nll[0, 2] + nll[0, 3]) / 2
    b = nll[1, 1:5].mean()
    assert torch.allclose(parts.answer_rows, torch.stack([a, b]))
    prompt = torch.stack([nll[0, 0], nll[0, 1], nll[1, 0]]).mean()
    assert torch.allclose(parts.prompt, prompt) and torch.allclose(parts.loss, (a + b) / 2 + 0.5 * prompt)


def test_token_mean_over_the_whole_sequence_without_eos_in_the_answer():
    """The tiny warm start's loss: answer tokens pooled (no <eos>), plus the mean over every real token."""
    logits, targets = _inputs(1)
    ours, theirs = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    cfg = LossConfig(prompt_weight=0.1, prompt_tokens="sequence", answer_eos=False, answer_mean="token")
    parts = teacher_forced_loss(ours, targets, ROLES, cfg)
    answer, whole = ROLES == ANSWER, ROLES != IGNORED
    want = F.cross_entropy(theirs[answer], targets[answer]) + 0.1 * F.cross_entropy(theirs[whole], targets[whole])
    assert torch.allclose(parts.loss, want)
    parts.loss.backward()
    want.backward()
    assert torch.equal(ours.grad, theirs.grad)  # the gradient of the mean reduction, bit for bit
    nll = _nll(logits, targets)
    assert torch.allclose(parts.answer_rows, torch.stack([nll[0, 2], nll[1, 1:4].mean()]))
    assert (ours.grad[ROLES == IGNORED] == 0).all() and (ours.grad[ROLES == EOS] != 0).all()
    # a negative control: the example mean of unequal answers is another loss
    tokens = (ROLES == ANSWER) | (ROLES == EOS)
    example = teacher_forced_loss(logits, targets, ROLES, LossConfig(prompt_weight=0.0)).loss
    assert not torch.allclose(example, F.cross_entropy(logits[tokens], targets[tokens]))
    token = teacher_forced_loss(logits, targets, ROLES, LossConfig(prompt_weight=0.0, answer_mean="token")).loss
    assert torch.allclose(token, F.cross_entropy(logits[tokens], targets[tokens]))


def test_prompt_weight_zero_is_the_answer_alone():
    logits, targets = _inputs(2)
    parts = teacher_forced_loss(logits, targets, ROLES, LossConfig(prompt_weight=0.0, answer_mean="token"))
    mask = (ROLES == ANSWER) | (ROLES == EOS)
    assert parts.prompt is None and torch.equal(parts.loss, F.cross_entropy(logits[mask], targets[mask]))


def test_schedule_warms_up_then_decays_or_stays():
    cos = OptimizerConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=10)
    assert cos.lr_at(0, 0.0) == pytest.approx(0.1) and cos.lr_at(9, 0.0) == pytest.approx(1.0)
    assert cos.lr_at(50, 0.5) == pytest.approx(0.55) and cos.lr_at(99, 1.0) == pytest.approx(0.1)
    const = OptimizerConfig(lr=2.0, warmup_steps=4, schedule="constant")
    assert [const.lr_at(s, 0.9) for s in (0, 3, 50)] == [0.5, 2.0, 2.0]
    assert TrainConfig(steps=10, minutes=1.0).progress(5, 30.0) == 0.5  # the larger of the two fractions
    assert TrainConfig(steps=10, minutes=1.0).progress(2, 45.0) == 0.75


@pytest.mark.parametrize("build,match", [
    pytest.param(lambda: TrainConfig(), "give steps, minutes or both", id="no-length"),
    pytest.param(lambda: TrainConfig(steps=0), "steps must be >= 1", id="steps"),
    pytest.param(lambda: OptimizerConfig(lr=0.0, betas=(0.9, 1.0)), r"\{'lr': 0.0, 'betas': \(0.9, 1.0\)\}",
                 id="optim"),
    pytest.param(lambda: OptimizerConfig(schedule="linear"), "schedule must be one of", id="schedule"),
    pytest.param(lambda: LossConfig(prompt_weight=-1.0), "prompt_weight must be >= 0, got -1.0", id="weight"),
    pytest.param(lambda: LossConfig(answer_mean="row"), "answer_mean one of", id="mean"),
    pytest.param(lambda: LossConfig(prompt_fraction=0.0), r"prompt_fraction must be in \(0, 1\].* got 0.0", id="fraction"),
    pytest.param(lambda: LossConfig(prompt_fraction=0.5, prompt_tokens="sequence"), "1 unless prompt_tokens is",
                 id="fraction-sequence"),
    pytest.param(lambda: EvalConfig(tasks=()), "at least one task", id="eval-tasks"),
    pytest.param(lambda: EvalConfig(examples=0), "examples=0", id="eval-examples"),
])
def test_configs_refuse_bad_values(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def _setup(steps=30, mix=None, context=64, key_len=1, **model_kw):
    torch.manual_seed(0)
    model = tiny_qwen2(vocab_size=48, **({"max_seq_len": 80} | model_kw))
    init_weights(model, 0.02)
    families = {"kv": lambda n: KVRetrieval(n, key_len=key_len, value_len=2)}
    source = TaskMixStream({**FAMILIES, **families}, mix or {"kv": 1.0}, seed=1, batch_size=16)
    cfg = TrainConfig(steps=steps, log_every_s=1e9,
                      curriculum=CurriculumConfig(min_context=context, max_context=context),
                      optimizer=OptimizerConfig(lr=3e-3, warmup_steps=5, weight_decay=0.0),
                      eval=EvalConfig(tasks=("kv",), every_s=0))
    return model, source, cfg, families


def test_a_short_run_lowers_the_loss_and_leaves_the_model_as_it_found_it():
    model, source, cfg, families = _setup()
    model.requires_grad_(False).eval()
    trainer = Trainer(model, cfg, source, eval_tasks=families, log=lambda _: None)
    batch = TaskMixStream(families, {"kv": 1.0}, seed=99, batch_size=32).next(64)
    with torch.no_grad():
        before = teacher_forced_loss(model(batch.tokens[:, :-1]), batch.tokens[:, 1:], batch.roles, cfg.loss).loss
    stats = trainer.train()
    with torch.no_grad():
        after = teacher_forced_loss(model(batch.tokens[:, :-1]), batch.tokens[:, 1:], batch.roles, cfg.loss).loss
    assert stats["steps"] == 30 and stats["examples_seen"] == 480 and stats["final_max_context"] == 64
    assert after < before - 0.5, (before, after)  # held-out examples: the model learned the format
    assert not model.training and not any(p.requires_grad or p.grad is not None for p in model.parameters())
    assert stats["config"]["optimizer"]["lr"] == 3e-3


def test_the_same_seeds_train_the_same_bits():
    runs = []
    for _ in range(2):
        model, source, cfg, families = _setup(steps=4)
        Trainer(model, cfg, source, log=lambda _: None).train()
        runs.append(model.state_dict())
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


def test_trainer_refuses_a_model_too_short_for_its_sequences():
    model, source, cfg, families = _setup(mix={"kvl": 1.0}, context=64)
    with pytest.raises(ValueError, match=r"max_seq_len 80 is too short: .* up to 86 tokens at context 64"):
        Trainer(model, cfg, source)
    model, source, cfg, families = _setup()
    with pytest.raises(ValueError, match=r"eval.tasks names \['kv'\]"):
        Trainer(model, cfg, source, eval_tasks={"other": families["kv"]})


def test_progress_evaluations_move_the_auto_curriculum(monkeypatch):
    """With every held-out answer right, each evaluation doubles the longest context."""
    import sparrow.training.trainer as trainer_mod

    model, source, _, families = _setup(key_len=2, max_seq_len=300)
    cfg = TrainConfig(steps=6, log_every_s=1e9, curriculum=CurriculumConfig(min_context=64, max_context=256),
                      eval=EvalConfig(tasks=("kv",), every_s=1e-9, examples=2))
    monkeypatch.setattr(trainer_mod, "greedy_accuracy", lambda *a, **k: 1.0)
    stats = Trainer(model, cfg, source, eval_tasks=families, log=lambda _: None).train()
    assert [e["max_context"] for e in stats["curriculum_events"]] == [128, 256]
    assert [e["reason"] for e in stats["curriculum_events"]] == ["accuracy", "accuracy"]
    assert stats["progress"][0]["kv@64"] == 1.0 and stats["final_max_context"] == 256
    assert math.isfinite(stats["train_s"])


@pytest.mark.parametrize("chunk", [1, 5, 64], ids=["chunk1", "chunk5", "whole"])
@pytest.mark.parametrize("cfg", [LossConfig(prompt_weight=0.5), LossConfig(prompt_weight=0.0, answer_mean="token"),
                                 LossConfig(prompt_weight=0.1, prompt_tokens="sequence", answer_eos=False)],
                         ids=["example+prompt", "token", "sequence"])
def test_chunked_loss_equals_the_whole_logits_loss(chunk, cfg):
    """The large-vocabulary path (logits of a few positions at a time, recomputed in the backward) gives the
    loss and every gradient of the whole-logits path up to rounding; it never computes logits of ignored
    positions (a negative control: a target changed there moves neither)."""
    from sparrow.models import qwen2
    from sparrow.training import chunked_teacher_forced_loss

    torch.manual_seed(0)
    model = qwen2(vocab_size=11, num_layers=1, num_heads=2, num_kv_heads=1, embed_dim=16, intermediate_dim=32,
                  max_seq_len=16)
    x = torch.randint(0, 11, (2, 7))
    whole = teacher_forced_loss(model(x[:, :-1]).float(), x[:, 1:], ROLES, cfg)
    whole.loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    h = hidden_states(model, x[:, :-1])
    parts = chunked_teacher_forced_loss(model, h, x[:, 1:], ROLES, dataclasses.replace(cfg, logits_chunk=chunk))
    parts.loss.backward()
    assert torch.allclose(parts.loss, whole.loss, atol=1e-6) and torch.allclose(parts.answer_rows, whole.answer_rows)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, want[n], atol=1e-6), n
    ignored = (ROLES == IGNORED).nonzero()[0]
    y = x.clone()
    y[ignored[0], ignored[1] + 1] = (y[ignored[0], ignored[1] + 1] + 1) % 11
    moved = chunked_teacher_forced_loss(model, h, y[:, 1:], ROLES, dataclasses.replace(cfg, logits_chunk=chunk))
    assert torch.equal(moved.loss, parts.loss)
    with pytest.raises(ValueError, match="logits_chunk"):
        LossConfig(logits_chunk=-1)


# -- the prompt term from a share of its positions ---------------------------------------------------------------
def _draw_invariants(draw) -> None:
    """What a prompt-position draw must keep, for any roles, fraction and seed: only prompt positions change, and only
    to IGNORED; the same seed draws the same; fraction 1 changes nothing."""

    @settings(max_examples=60, deadline=None)
    @given(st.integers(1, 5), st.integers(1, 40), st.floats(0.01, 1.0), st.integers(0, 2**31), st.integers(0, 2**31))
    def check(rows, cols, fraction, seed, roles_seed):
        g = torch.Generator().manual_seed(roles_seed)
        roles = torch.tensor([PROMPT, ANSWER, EOS, IGNORED], dtype=torch.int8)[torch.randint(0, 4, (rows, cols),
                                                                                              generator=g)]
        out = draw(roles, fraction, seed)
        changed = out != roles
        assert out.dtype == roles.dtype and out.shape == roles.shape
        assert bool((roles[changed] == PROMPT).all()) and bool((out[changed] == IGNORED).all())
        assert torch.equal(out, draw(roles, fraction, seed))
        assert torch.equal(draw(roles, 1.0, seed), roles)

    check()


def test_a_prompt_draw_changes_only_prompt_positions():
    _draw_invariants(draw_prompt_positions)
    roles = torch.full((64, 512), PROMPT, dtype=torch.int8)
    for fraction in (0.1, 0.25, 0.5):  # the kept share is the fraction, and other seeds draw other positions
        kept = draw_prompt_positions(roles, fraction, 7) == PROMPT
        assert abs(kept.float().mean().item() - fraction) < 0.01
        assert not torch.equal(kept, draw_prompt_positions(roles, fraction, 8) == PROMPT)


def test_a_draw_that_drops_answers_is_caught():
    """Negative control: a draw over every position (answers too) breaks the invariants."""
    def careless(roles, fraction, seed):
        drop = torch.rand(roles.shape, generator=torch.Generator().manual_seed(seed)) >= fraction
        return roles.masked_fill(drop, IGNORED)

    with pytest.raises(AssertionError):
        _draw_invariants(careless)


def test_a_step_with_a_prompt_fraction_computes_only_the_drawn_logits(monkeypatch):
    """With logits_chunk, the output projection sees the answer positions and the drawn quarter of the prompt."""
    from sparrow.training import trainer as trainer_module

    model, trainer = _resumable(0)
    cfg = dataclasses.replace(trainer.config, loss=LossConfig(logits_chunk=64, prompt_fraction=0.25))
    trainer.config = cfg
    seen = []
    nll = trainer_module._position_nll
    monkeypatch.setattr(trainer_module, "_position_nll", lambda m, h, t: seen.append(len(t)) or nll(m, h, t))
    batch = trainer.source.next(32)
    trainer.train_step(batch, 1e-3)
    roles = draw_prompt_positions(batch.roles, 0.25, cfg.seed * 1_000_003 + 0)  # step 0's draw
    read = int(((roles == PROMPT) | (roles == ANSWER) | (roles == EOS)).sum())
    assert sum(seen) == 2 * read  # each chunk in the forward pass and again in the backward's recomputation
    prompt, answer = int((batch.roles == PROMPT).sum()), int(((batch.roles == ANSWER) | (batch.roles == EOS)).sum())
    assert answer < read < 0.5 * prompt + answer
    trainer.source.close()


# -- resuming: the same bits as a run never stopped ----------------------------------------------------------------
def _resumable(workers: int):
    torch.manual_seed(0)
    model = tiny_qwen2(vocab_size=48, max_seq_len=80)
    init_weights(model, 0.02)
    families = {"kv": lambda n: KVRetrieval(n, key_len=1, value_len=2),
                "kv1": lambda n: KVRetrieval(n, key_len=1, value_len=1)}
    source = TaskMixStream(families, {"kv": 2.0, "kv1": 1.0}, seed=1, batch_size=6, workers=workers, prefetch=2)
    cfg = TrainConfig(steps=8, log_every_s=1e9, eval=EvalConfig(tasks=("kv",), every_s=0),
                      curriculum=CurriculumConfig(min_context=32, max_context=64, mode="time", ramp=0.5),
                      optimizer=OptimizerConfig(lr=3e-3, warmup_steps=2),
                      loss=LossConfig(prompt_fraction=0.5))  # a resumed run draws the prompt positions the same
    return model, Trainer(model, cfg, source, log=lambda _: None)


@pytest.mark.parametrize("workers", [pytest.param(0, id="in-process"), pytest.param(2, id="workers-prefetching")])
def test_a_resumed_run_ends_with_the_same_bits(tmp_path, workers, monkeypatch):
    from sparrow.rl import latest_checkpoint, load_checkpoint

    bits = lambda m: {k: v.view(torch.int32).clone() for k, v in m.state_dict().items()}  # noqa: E731
    model, trainer = _resumable(workers)
    trainer.train()
    trainer.source.close()
    whole = bits(model)

    model, trainer = _resumable(workers)

    train_and_stop(trainer, model, tmp_path, 5)  # the queued batches' contexts differ from the next's

    def resumed(break_stream: bool):
        model, trainer = _resumable(workers)
        state = load_checkpoint(latest_checkpoint(tmp_path), model=model, optimizer=trainer.optimizer)
        if break_stream:  # negative control: the data stream started over instead of where it stood
            monkeypatch.setattr(trainer.source, "load_state_dict", lambda state: None)
        trainer.load_state_dict(state["trainer"])  # read back from JSON
        stats = trainer.train()
        trainer.source.close()
        return stats, bits(model)

    stats, again = resumed(False)
    assert stats["steps"] == 8 and stats["resumed_at"] == [5] and stats["examples_seen"] == 48
    assert all(torch.equal(whole[k], again[k]) for k in whole)
    _, broken = resumed(True)
    assert not all(torch.equal(whole[k], broken[k]) for k in whole)


def test_resume_refuses_a_state_of_another_curriculum_or_mix():
    model, trainer = _resumable(0)
    trainer.train()
    state = trainer.state_dict()
    _, fresh = _resumable(0)
    before = (fresh.step, dict(fresh.source.next_index), fresh.curriculum.stage)
    with pytest.raises(ValueError, match="curriculum state at level 5, but this curriculum has 2 levels"):
        fresh.load_state_dict({**state, "curriculum": {**state["curriculum"], "stage": 5}})
    with pytest.raises(ValueError, match=r"families \['kv', 'other'\] does not fit this mix \['kv', 'kv1'\]"):
        fresh.load_state_dict({**state, "source": {**state["source"], "next_index": {"kv": 0, "other": 0}}})
    assert (fresh.step, dict(fresh.source.next_index), fresh.curriculum.stage) == before


def test_a_checkpoints_own_time_is_not_the_runs():
    """The run's clock (its ``minutes``, ``train_s``) leaves the checkpoints' time out."""
    import time

    _, trainer = _resumable(0)
    calls = []
    t0 = time.perf_counter()
    stats = trainer.train(checkpoint=lambda: (calls.append(1), time.sleep(0.05)), checkpoint_every_s=1e-9)
    wall = time.perf_counter() - t0
    # the run's own clock, unrounded (stats["train_s"] is rounded to 0.1 s, as much as two checkpoints' sleep)
    train_s = trainer.run.elapsed_s
    assert stats["steps"] == 8 and len(calls) == 8  # after every step
    assert wall - train_s >= 0.9 * 8 * 0.05, (wall, train_s)
    assert abs(stats["train_s"] - train_s) <= 0.05

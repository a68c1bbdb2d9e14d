"""Depth and width growth: the shallow subset, the narrow slice, the function-preserving growths, growing runs and
their resume."""

from __future__ import annotations

import json

import pytest
import torch

from sparrow.models import tiny_qwen2
from sparrow.rl import KVRetrieval
from sparrow.training import (
    CurriculumConfig, EvalConfig, GrowthConfig, OptimizerConfig, TaskMixStream, TrainConfig, Trainer, Width,
    active_layers, grow_, init_weights, model_width, narrow_, shallow_layers, widen_,
)
from sparrow.training import growth as growth_module
from tests.helpers import bits_equal, train_and_stop


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _model(layers: int = 4, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = tiny_qwen2(vocab_size=64, num_layers=layers, max_seq_len=80)  # 16 ids more than the data holds
    init_weights(model, 0.02)  # random biases too (q / k / v): nothing about the test rests on zeros
    return model


@pytest.mark.parametrize("layers, start, want", [
    pytest.param(24, 6, [0, 4, 8, 12, 16, 20], id="0.5b"),
    pytest.param(5, 2, [0, 2], id="uneven"),
    pytest.param(7, 3, [0, 2, 4], id="odd"),
    pytest.param(3, 1, [0], id="one"),
    pytest.param(4, 3, [0, 1, 2], id="all-but-one"),
])
def test_shallow_layers_are_spread_in_order(layers, start, want):
    got = shallow_layers(layers, start)
    assert got == want and len(set(got)) == start and got == sorted(got) and got[-1] < layers


@pytest.mark.parametrize("start", [0, 4, 9])
def test_shallow_layers_refuse_a_subset_that_is_not_one(start):
    with pytest.raises(ValueError, match=rf"start_layers must be in \[1, 4\) .* got {start}"):
        shallow_layers(4, start)


@pytest.mark.parametrize("kw", [dict(start_layers=-1), dict(at_context=-2), dict(at_progress=0.0),
                                dict(at_progress=1.5), dict(warmup_steps=-1), dict(start_embed_dim=-8),
                                dict(start_num_heads=-1), dict(start_intermediate_dim=-3)])
def test_growth_config_names_bad_values(kw):
    [(key, value)] = kw.items()
    with pytest.raises(ValueError, match=rf"growth: need start_layers, .* >= 0 and 0 < at_progress <= 1, got "
                                         rf"\{{'{key}': {value}\}}"):
        GrowthConfig(**kw)


def test_growth_is_due_at_its_context_or_progress():
    g = GrowthConfig(start_layers=2, at_context=256, at_progress=0.4)
    assert not g.due(128, 0.39) and g.due(256, 0.0) and g.due(64, 0.4)
    assert not GrowthConfig(start_layers=2, at_progress=0.4).due(1 << 20, 0.1)  # at_context 0: progress only
    assert not GrowthConfig().enabled and GrowthConfig(start_layers=1).enabled


def test_grown_model_computes_the_shallow_models_bits():
    model = _model(layers=5).eval()
    x = torch.randint(0, 48, (3, 37))
    trained = shallow_layers(5, 2)
    with torch.no_grad(), active_layers(model, trained):
        assert len(model.layers) == 2
        shallow = model(x)
    assert len(model.layers) == 5
    with torch.no_grad():
        before = model(x)
    assert not bits_equal(before, shallow)  # the skipped layers did compute something
    assert grow_(model, trained) == [1, 3, 4]
    with torch.no_grad():
        grown = model(x)
    assert bits_equal(grown, shallow)
    for i in (1, 3, 4):
        assert not model.layers[i].attn.output_proj.weight.any() and not model.layers[i].mlp.w2.weight.any()
    assert model.layers[0].mlp.w2.weight.any() and model.layers[2].attn.output_proj.weight.any()


def test_growth_that_zeroes_one_branch_only_changes_the_function():
    """Negative control: the MLP branch left as it was, the grown model computes something else."""
    model = _model(layers=3).eval()
    x = torch.randint(0, 48, (2, 21))
    with torch.no_grad(), active_layers(model, [0]):
        shallow = model(x)
    with torch.no_grad():
        for i in (1, 2):
            model.layers[i].attn.output_proj.weight.zero_()
        assert not bits_equal(model(x), shallow)


def test_active_layers_restores_the_list_after_an_error():
    model = _model(layers=3)
    full = model.layers
    with pytest.raises(RuntimeError, match="inside"), active_layers(model, [0, 2]):
        assert [id(m) for m in model.layers] == [id(full[0]), id(full[2])]
        raise RuntimeError("inside")
    assert model.layers is full and len(model.layers) == 3
    with active_layers(model, None):
        assert model.layers is full


def test_grow_refuses_layers_without_the_projections_and_changes_nothing():
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)])
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="layer 0 .Linear. has no attn.output_proj and mlp.w2"):
        grow_(model, [0])
    assert all(bits_equal(a, p) for a, p in zip(before, model.parameters()))


def _run(growth: GrowthConfig, *, steps: int = 8, layers: int = 4, workers: int = 0):
    model = _model(layers=layers)
    families = {"kv": lambda n: KVRetrieval(n, key_len=1, value_len=2)}
    source = TaskMixStream(families, {"kv": 1.0}, seed=1, batch_size=6, workers=workers, prefetch=2)
    cfg = TrainConfig(steps=steps, log_every_s=1e9, eval=EvalConfig(tasks=("kv",), every_s=0),
                      curriculum=CurriculumConfig(min_context=32, max_context=64, mode="time", ramp=0.5),
                      optimizer=OptimizerConfig(lr=3e-3, warmup_steps=2), growth=growth)
    return model, Trainer(model, cfg, source, eval_tasks=families, log=lambda _: None)


def _never_stopped(growth: GrowthConfig) -> tuple[dict, dict[str, torch.Tensor]]:
    """What a run of ``growth`` returns and ends with when nothing stops it."""
    model, trainer = _run(growth)
    stats = trainer.train()
    trainer.source.close()
    return stats, _snapshot(model)


def test_a_growing_run_trains_the_subset_then_every_layer():
    model, trainer = _run(GrowthConfig(start_layers=2, at_progress=0.5, warmup_steps=3))
    assert trainer.active_layers == [0, 2]
    grown = {id(p) for i in (1, 3) for p in model.layers[i].parameters()}
    groups = trainer.optimizer.param_groups
    assert [g["grown"] for g in groups] == [False, False, True, True]
    assert all((id(p) in grown) == g["grown"] for g in groups for p in g["params"])
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    init = _snapshot(model)
    seen = []

    def checkpoint():  # after every step: what the skipped layers look like
        seen.append((trainer.step, trainer.active_layers,
                     all(bits_equal(init[k], v) for k, v in model.state_dict().items()
                         if k.startswith(("layers.1.", "layers.3."))),
                     [g["lr"] / groups[0]["lr"] for g in groups]))

    stats = trainer.train(checkpoint=checkpoint, checkpoint_every_s=1e-9)
    trainer.source.close()
    assert stats["grown_at"] == {"step": 4, "elapsed_s": stats["grown_at"]["elapsed_s"], "max_context": 64}
    # untouched (no gradient, no weight decay) until the growth at step 4, trained after it
    assert [s[2] for s in seen] == [True] * 4 + [False] * 4
    assert [s[1] for s in seen] == [[0, 2]] * 4 + [None] * 4  # the growth comes before the 5th step
    # the grown layers' learning rate: none before the growth, then warmed up over 3 steps
    assert [x for s in seen for x in s[3][2:]] == pytest.approx([0.0] * 8 + [1 / 3] * 2 + [2 / 3] * 2 + [1.0] * 4)
    assert all(s[3][:2] == [1.0, 1.0] for s in seen)
    assert trainer.active_layers is None and len(model.layers) == 4
    for i in (1, 3):  # the grown layers' output projections left zero and learned
        assert model.layers[i].attn.output_proj.weight.any() and model.layers[i].mlp.w2.weight.any()


def test_progress_evaluations_run_the_layers_the_steps_run(monkeypatch):
    """Before the growth the held-out accuracy is the subset's (the layers that sat out are still random), after it
    the whole model's."""
    import sparrow.training.trainer as trainer_module

    depths = []
    monkeypatch.setattr(trainer_module, "greedy_accuracy",
                        lambda model, *a, **kw: depths.append(len(model.layers)) or 0.0)
    model, trainer = _run(GrowthConfig(start_layers=2, at_progress=0.5))
    trainer.evaluate(4)
    trainer._grow(0.0)
    trainer.evaluate(4)
    trainer.source.close()
    assert depths == [2, 4]  # one context (the curriculum starts at its shortest, 32)
    assert len(model.layers) == 4


def test_growth_at_a_context_and_a_run_that_ends_before_it():
    _, trainer = _run(GrowthConfig(start_layers=1, at_context=64, at_progress=1.0))
    stats = trainer.train()  # the time-mode curriculum reaches 64 at half the run
    trainer.source.close()
    assert stats["grown_at"]["max_context"] == 64 and stats["grown_at"]["step"] == 4
    model, trainer = _run(GrowthConfig(start_layers=1, at_progress=1.0), steps=3)
    stats = trainer.train()  # progress reaches 1.0 only as the loop ends: grown whole on the way out
    trainer.source.close()
    assert stats["grown_at"]["step"] == 3 and trainer.active_layers is None
    assert not model.layers[1].mlp.w2.weight.any()  # identity layers: the shallow model's function


def test_trainer_refuses_more_starting_layers_than_the_model_has():
    with pytest.raises(ValueError, match=r"start_layers must be in \[1, 4\) for a model of 4 layers, got 4"):
        _run(GrowthConfig(start_layers=4))


@pytest.mark.parametrize("stop_at", [pytest.param(3, id="before-growth"), pytest.param(6, id="after-growth")])
def test_a_run_resumed_across_its_growth_ends_with_the_same_bits(tmp_path, stop_at):
    from sparrow.rl import latest_checkpoint, load_checkpoint

    growth = GrowthConfig(start_layers=2, at_progress=0.5)
    _, whole = _never_stopped(growth)

    model, trainer = _run(growth)

    train_and_stop(trainer, model, tmp_path / str(stop_at), stop_at)

    def resumed(forget_growth: bool):
        model, trainer = _run(growth)
        state = load_checkpoint(latest_checkpoint(tmp_path / str(stop_at)), model=model,
                                optimizer=trainer.optimizer)["trainer"]
        if forget_growth:  # negative control: a state that does not say the run grew
            state = {**state, "run": {**state["run"], "grown_at": None}}
        trainer.load_state_dict(state)
        stats = trainer.train()
        trainer.source.close()
        return stats, _snapshot(model)

    stats, again = resumed(False)
    assert stats["resumed_at"] == [stop_at] and stats["grown_at"]["step"] == 4
    assert all(bits_equal(whole[k], again[k]) for k in whole)
    if stop_at > 4:
        _, broken = resumed(True)
        assert not all(bits_equal(whole[k], broken[k]) for k in whole)


@pytest.mark.parametrize("with_checkpoint", [pytest.param(True, id="state-saved"), pytest.param(False, id="nowhere")])
def test_a_stop_request_ends_the_step_saves_the_state_and_the_run_resumes_to_the_same_bits(tmp_path, with_checkpoint):
    """What SIGTERM does in the recipe: the step in flight ends, the state is saved once, the run returns ungrown
    (the end-of-run growth is for runs that end), and the resumed run ends as the one never stopped."""
    from sparrow.rl import latest_checkpoint, load_checkpoint, save_checkpoint

    growth = GrowthConfig(start_layers=2, at_progress=0.5)
    _, whole = _never_stopped(growth)

    model, trainer = _run(growth)
    step, saved = trainer.train_step, []

    def stepping(batch, lr):  # the request arrives during step 3, as a signal would
        parts = step(batch, lr)
        if trainer.step == 3:
            trainer.request_stop()
        return parts

    def checkpoint():
        saved.append(trainer.step)
        save_checkpoint(tmp_path, trainer.step, model=model, optimizer=trainer.optimizer,
                        state={"trainer": trainer.state_dict()})

    trainer.train_step = stepping
    stats = trainer.train(checkpoint=checkpoint if with_checkpoint else None)  # no periodic checkpoints
    trainer.source.close()
    assert stats["stopped"] and stats["steps"] == 3 and stats["grown_at"] is None and trainer.active_layers == [0, 2]
    assert saved == ([3] if with_checkpoint else [])
    if not with_checkpoint:
        return
    model, trainer = _run(growth)
    trainer.load_state_dict(load_checkpoint(latest_checkpoint(tmp_path), model=model,
                                            optimizer=trainer.optimizer)["trainer"])
    stats = trainer.train()
    trainer.source.close()
    assert not stats["stopped"] and stats["resumed_at"] == [3] and stats["grown_at"]["step"] == 4
    assert all(bits_equal(whole[k], v) for k, v in _snapshot(model).items())



# -- width ---------------------------------------------------------------------------------------------------------
WIDTHS = [  # (model: embed, heads, kv heads, MLP, tied; head_dim 8 in each; 48 ids), start width
    pytest.param((48, 6, 2, 96, True), Width(24, 4, 40, 48), id="gqa-tied"),
    pytest.param((40, 5, 5, 72, False), Width(17, 5, 31, 48), id="mha-untied-odd"),
    pytest.param((64, 8, 2, 128, True), Width(64, 2, 128, 48), id="heads-only"),
    pytest.param((48, 6, 3, 96, False), Width(48, 6, 23, 48), id="mlp-only"),
    pytest.param((48, 6, 2, 96, True), Width(24, 4, 40, 29), id="gqa-tied-vocab"),
    pytest.param((40, 5, 5, 72, False), Width(40, 5, 72, 13), id="vocab-only-untied"),
]


def _wide(shape, layers: int = 2, seed: int = 0) -> torch.nn.Module:
    embed, heads, kv, mlp, tied = shape
    torch.manual_seed(seed)
    model = tiny_qwen2(vocab_size=48, num_layers=layers, num_heads=heads, num_kv_heads=kv, embed_dim=embed,
                       intermediate_dim=mlp, max_seq_len=80, tie_word_embeddings=tied)
    init_weights(model, 0.02, residual_scaling=True)
    return model


def _same_function(before: torch.Tensor, after: torch.Tensor) -> bool:
    """The logits agree to float32 rounding (the widening measured ~2e-7 of the largest logit; a norm's ``eps``
    left narrow moves them by ~1e-4)."""
    return bool((after - before).abs().max() <= 1e-5 * before.abs().max())


def _trained_narrow(shape, width: Width, steps: int = 4):
    """A model narrowed to ``width`` and trained a few AdamW steps, so nothing rests on initial values."""
    model = _wide(shape)
    narrowed = narrow_(model, width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, width.vocab, (3, 21), generator=torch.Generator().manual_seed(1))
    for _ in range(steps):
        opt.zero_grad()
        model(x).logsumexp(-1).mean().backward()
        opt.step()
    return model, narrowed, opt, x


def test_narrow_keeps_the_first_heads_of_each_key_value_group():
    model = _wide((48, 6, 2, 96, True))
    full = _snapshot(model)
    narrow_(model, Width(24, 4, 40, 48))
    assert model_width(model) == Width(24, 4, 40, 48) and model.layers[0].attn.backend.shape.num_heads == 4
    q = full["layers.0.attn.q_proj.weight"].view(6, 8, 48)  # heads 0 1 2 | 3 4 5 share kv heads 0 | 1
    assert bits_equal(model.layers[0].attn.q_proj.weight, q[[0, 1, 3, 4], :, :24].reshape(32, 24))
    assert bits_equal(model.layers[0].attn.k_proj.weight, full["layers.0.attn.k_proj.weight"][:, :24])
    assert bits_equal(model.layers[1].mlp.w2.weight, full["layers.1.mlp.w2.weight"][:24, :40])
    assert model.norm.eps == pytest.approx(1e-6 * 48 / 24)


@pytest.mark.parametrize("shape, width", WIDTHS)
def test_the_widened_model_computes_what_the_narrow_one_did(shape, width):
    model, narrowed, opt, x = _trained_narrow(shape, width)
    with torch.no_grad():
        before = model(x)
    widen_(model, narrowed, opt)
    embed, heads, _, mlp, _ = shape
    assert model_width(model) == Width(embed, heads, mlp, 48) and model.norm.eps == 1e-6
    fresh = _wide(shape)
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in fresh.state_dict().items()}
    with torch.no_grad():
        after = model(x)
    assert before.shape[-1] == width.vocab and after.shape[-1] == 48
    assert _same_function(before, after[..., :width.vocab])  # the narrow vocabulary's logits are kept
    # the ids outside the narrow vocabulary come back at their initial rows
    assert bits_equal(model.tok_embeddings.weight[width.vocab:], fresh.tok_embeddings.weight[width.vocab:])
    # the optimizer holds the new parameters, its moments widened with zeros outside the narrow slice
    held = [p for g in opt.param_groups for p in g["params"]]
    assert len(held) == len(list(model.parameters())) and all(a is b for a, b in zip(held, model.parameters()))
    w2 = model.layers[0].mlp.w2.weight
    assert opt.state[w2]["exp_avg"].shape == w2.shape and not opt.state[w2]["exp_avg"][:, width.intermediate_dim:].any()
    opt.zero_grad()  # and it trains on: every parameter gets a gradient of its new shape
    model(x).logsumexp(-1).mean().backward()
    opt.step()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


@pytest.mark.parametrize("sabotage", [
    pytest.param("writer", id="a-writer-not-zeroed"), pytest.param("norm", id="norms-not-rescaled"),
    pytest.param("eps", id="eps-kept-narrow")])
def test_a_broken_widening_changes_the_function(sabotage, monkeypatch):
    """Negative controls: each part of the function-preserving widening, left out, is caught."""
    shape, width = (48, 6, 2, 96, True), Width(24, 4, 40, 48)
    model, narrowed, opt, x = _trained_narrow(shape, width)
    with torch.no_grad():
        before = model(x)
    if sabotage == "writer":
        monkeypatch.setitem(growth_module._RULES, "mlp.w2.weight", (("E", "I"), False))
    elif sabotage == "norm":
        monkeypatch.setattr(growth_module.math, "sqrt", lambda v: 1.0)
    else:
        narrowed.eps = {k: v * 48 / 24 for k, v in narrowed.eps.items()}
    widen_(model, narrowed, opt)
    with torch.no_grad():
        after = model(x)
    assert not _same_function(before, after)


@pytest.mark.parametrize("width, message", [
    pytest.param(Width(96, 4, 40, 48), "cannot start at", id="wider"),
    pytest.param(Width(24, 3, 40, 48), "cannot start at", id="heads-not-a-multiple"),
    pytest.param(Width(24, 1, 40, 48), "cannot start at", id="fewer-than-kv-heads"),
    pytest.param(Width(0, 4, 40, 48), "cannot start at", id="zero"),
    pytest.param(Width(24, 4, 40, 49), "cannot start at", id="more-ids-than-the-vocabulary"),
    pytest.param(Width(24, 4, 40, 0), "cannot start at", id="no-ids"),
])
def test_narrow_refuses_a_width_the_model_cannot_start_at_and_changes_nothing(width, message):
    model = _wide((48, 6, 2, 96, True))
    before = _snapshot(model)
    with pytest.raises(ValueError, match=message):
        narrow_(model, width)
    assert model_width(model) == Width(48, 6, 96, 48)
    assert all(bits_equal(before[k], v) for k, v in model.state_dict().items())


def test_a_run_that_starts_narrow_and_shallow_grows_and_resumes_to_the_same_bits(tmp_path):
    """Width, vocabulary and depth together (the 0.5B config's way): narrow, the data's 48 of 64 ids, 2 of 4 layers
    until step 4, then the whole model; stopped before and after the growth, the resumed runs end with the bits of
    the run never stopped."""
    from sparrow.rl import latest_checkpoint, load_checkpoint

    growth = GrowthConfig(start_layers=2, start_embed_dim=32, start_num_heads=2, start_intermediate_dim=48,
                          start_vocab=48, at_progress=0.5)
    model, trainer = _run(growth)
    assert model_width(model) == Width(32, 2, 48, 48) and trainer.active_layers == [0, 2]
    stats, whole = _never_stopped(growth)
    assert stats["grown_at"]["step"] == 4 and whole["layers.0.mlp.w1.weight"].shape == (128, 64)
    assert whole["tok_embeddings.weight"].shape == (64, 64)
    for stop_at in (3, 6):
        model, trainer = _run(growth)
        train_and_stop(trainer, model, tmp_path / str(stop_at), stop_at)
        model, trainer = _run(growth)
        path = latest_checkpoint(tmp_path / str(stop_at))
        trainer.load_state_dict(json.loads((path / "state.json").read_text())["trainer"])  # widens if it grew
        load_checkpoint(path, model=model, optimizer=trainer.optimizer)
        stats = trainer.train()
        trainer.source.close()
        assert stats["resumed_at"] == [stop_at] and stats["grown_at"]["step"] == 4
        assert all(bits_equal(whole[k], v) for k, v in _snapshot(model).items()), stop_at

"""The recipe's partial rollout (``partial_rollout:``): the synchronous recipe at staleness 0, behaviour log-probs
and version stamps of rows that span a weight sync, deterministic restarts from a checkpoint, two processes."""

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from sparrow.rl.recipe_config import check_config, check_values, load_config
from tests.recipes.test_grpo_recipe import CONFIG, SHIPPED, TINY, in_process, run
from tests.rollout.stale_reference import stale_reference

TOL = 2e-3  # bf16 rollout weights: one row alone against rows batched with others
JSONL = ["metric_logger._component_=sparrow.rl.JsonlLogger", "checkpoint_every=0"]
# the shipped task model answers with an end token after a few characters: groups finish at different blocks
STALE = [*SHIPPED, *JSONL, "partial_rollout.enabled=true", "partial_rollout.overprovision=4", "engine.max_rows=32",
         "engine.block_steps=1"]


def _train(tmp_path: Path, monkeypatch, *overrides: str, base=TINY):
    _, recipe = in_process(tmp_path, monkeypatch, *JSONL, *overrides, base=base)
    recipe.train()
    records = [r for r in recipe.metric_logger.records if "time/step_s" in r]
    weights = {k: v.detach().clone() for k, v in recipe.model.state_dict().items()}
    recipe.cleanup()
    return records, weights


def _same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].view(torch.int32), b[k].view(torch.int32)) for k in a)


def _training_metrics(records):
    skip = ("time/", "setup/", "compile/", "engine/", "partial/", "rollout/tokens_per_s")  # clocks, counters
    return [{k: v for k, v in r.items() if not k.startswith(skip) and not k.endswith("_s")} for r in records]


def test_staleness_zero_is_the_synchronous_recipe_bit_for_bit(tmp_path, monkeypatch):
    """max_staleness 0 without over-provisioning: every step trains the same groups on the same tokens as the
    synchronous recipe; after three steps (two updates each) the weights and every training metric have the same
    bits, with either on_stale. Negative control: with staleness 1 and over-provisioned groups they differ."""
    sync, w_sync = _train(tmp_path / "sync", monkeypatch, "total_steps=3")
    for on_stale in ("finish", "drop"):
        part, w_part = _train(tmp_path / on_stale, monkeypatch, "total_steps=3", "partial_rollout.enabled=true",
                              "partial_rollout.max_staleness=0", "partial_rollout.overprovision=0",
                              f"partial_rollout.on_stale={on_stale}")
        assert _same_bits(w_sync, w_part), on_stale
        assert _training_metrics(part) == _training_metrics(sync), on_stale
        assert all(r["partial/staleness_0"] == 1.0 and r["partial/dropped_groups"] == 0 for r in part)
    _, w_stale = _train(tmp_path / "stale", monkeypatch, "total_steps=3", "partial_rollout.enabled=true",
                            "partial_rollout.max_staleness=1", "partial_rollout.overprovision=2",
                            "engine.max_rows=24")
    assert not _same_bits(w_sync, w_stale)


def test_rows_spanning_a_sync_carry_each_versions_logprobs(tmp_path, monkeypatch):
    """Partial rollout on the shipped task model, staleness 1: rows that were decoding when the weights changed
    are trained with, per token, the log-prob under the weights of the version it is stamped with, over the KV
    that earlier weights cached (a one-row reference holding every version's rollout weights, teacher-forced on
    the trained tokens). The staleness histogram counts the old tokens. Negative control: stamping every token of
    those rows with the newest version fails the check."""
    _, recipe = in_process(tmp_path, monkeypatch, "total_steps=2", "optimizer.lr=3e-3", base=STALE)
    models = {0: copy.deepcopy(recipe.rollout_model)}  # every version's bf16 rollout weights, as synced
    real_set = recipe.engine.set_policy_version

    def set_version(v):
        models[v] = copy.deepcopy(recipe.rollout_model)
        real_set(v)

    monkeypatch.setattr(recipe.engine, "set_policy_version", set_version)
    trained = []
    real_train = recipe._train_on

    def spy(rb, version=None):
        trained.append((rb, version))
        return real_train(rb, version)

    monkeypatch.setattr(recipe, "_train_on", spy)
    recipe.train()
    records = [r for r in recipe.metric_logger.records if "time/step_s" in r]
    params = recipe._sampling_params()
    recipe.cleanup()
    assert any(r["partial/staleness_1"] > 0 for r in records)
    wrong = []  # per spanning row: how far the log-probs are from those of the newest version alone
    for rb, version in trained:
        for i in range(rb.tokens.shape[0]):
            n, p = int(rb.response_len[i]), int(rb.prompt_len[i])
            versions = rb.versions[i, :n].tolist()
            assert versions == sorted(versions) and version - 1 <= versions[0] and versions[-1] <= version
            if len(set(versions)) == 1 and i % 4:
                continue  # every row that spans a sync, a quarter of the others
            tokens, behav = rb.tokens[i, p: p + n].tolist(), rb.behaviour_logprobs[i, :n]
            _, ref = stale_reference(models, rb.tokens[i, :p].tolist(), versions, params, forced=tokens)
            err = float((behav - torch.tensor(ref)).abs().max())
            assert err < TOL, (i, versions, err)
            if len(set(versions)) > 1:
                _, newest = stale_reference(models, rb.tokens[i, :p].tolist(), [versions[-1]] * n, params,
                                            forced=tokens)
                wrong.append(float((behav - torch.tensor(newest)).abs().max()))
    assert len(wrong) >= 3 and all(e > TOL for e in wrong)


def test_resume_restarts_the_in_flight_groups_deterministically(tmp_path, monkeypatch):
    """A checkpoint keeps the rows of the groups in flight (and those drawn, not started); two resumes from it
    queue them first and run an identical next step (weights, metrics and trained prompts, bit for bit). Negative
    control: a resume that loses the queue trains other prompts."""
    first = tmp_path / "first"
    _, recipe = in_process(first, monkeypatch, "total_steps=1", "checkpoint_every=1", base=STALE)
    recipe.train()
    recipe.cleanup()
    state = json.loads((first / "checkpoints/step_000001/state.json").read_text())
    queued = [r["prompt_ids"] for r in state["partial"]["ranks"][0]["queue"]]
    assert len(queued) >= 4  # the over-provisioned groups at least
    runs = {}
    for name in ("a", "b", "lost"):
        out = tmp_path / name
        shutil.copytree(first / "checkpoints", out / "checkpoints")
        if name == "lost":
            monkeypatch.setattr("sparrow.rl.partial.PartialRollout.load_state_dict", lambda self, state: None)
        mod, recipe = in_process(out, monkeypatch, "total_steps=2", "resume_from_checkpoint=true", base=STALE)
        prompts = []
        real = mod.build_rollout_batch

        def spy(pr, *a, real=real, prompts=prompts, **k):
            prompts.append([list(p) for p in pr])
            return real(pr, *a, **k)

        monkeypatch.setattr(mod, "build_rollout_batch", spy)
        recipe.train()
        records = _training_metrics([r for r in recipe.metric_logger.records if "time/step_s" in r])
        held = [r["prompt_ids"] for r in recipe.partial.state_dict()["queue"]]  # trained next, or restarted
        runs[name] = (records, {k: v.detach().clone() for k, v in recipe.model.state_dict().items()}, prompts,
                      prompts[0] + held)
        recipe.cleanup()
    (ra, wa, pa, seen), (rb, wb, pb, _), (_, _, lost, seen_lost) = runs["a"], runs["b"], runs["lost"]
    assert [r["step"] for r in ra] == [2]
    assert _same_bits(wa, wb) and ra == rb and pa == pb
    assert all(p in seen for p in queued)  # the groups in flight at the checkpoint were restarted: trained or held
    assert not all(p in seen_lost for p in queued) and lost[0] != pa[0]


@pytest.mark.parametrize("overrides,match", [
    (["partial_rollout.on_stale=wait"], "on_stale must be 'drop' or 'finish'"),
    (["partial_rollout.max_staleness=-1"], "max_staleness must be an integer >= 0"),
    (["partial_rollout.max_staleness=0"], "set overprovision 0"),
    (["partial_rollout.overprovision=5"], r"overprovision \(5\) above prompts_per_step \(4\)"),
    (["loss.is_level=none"], "needs an importance correction"),
    (["partial_rollout.budget=3"], "unknown config keys: partial_rollout.budget"),
])
def test_bad_partial_rollout_sections_fail_at_the_config_check(overrides, match, tmp_path):
    cfg = load_config(CONFIG, [*TINY, f"output_dir={tmp_path}", "partial_rollout.enabled=true",
                               "partial_rollout.overprovision=2", *overrides])
    with pytest.raises(ValueError, match=match):
        check_config(cfg)
        check_values(cfg)
    off = load_config(CONFIG, [*TINY, f"output_dir={tmp_path}", "partial_rollout.enabled=false"])
    check_config(off)
    check_values(off)
    assert OmegaConf.select(off, "partial_rollout.enabled") is False


@pytest.mark.slow
def test_partial_rollout_with_a_trainer_rank_and_a_rollout_rank(tmp_path):
    """Two processes (gloo): the rollout rank keeps its groups in flight, the prompts and version stamps travel
    to the trainer, the sync stays bit-exact, and the checkpoint holds the rollout rank's in-flight groups."""
    r = run(tmp_path / "d", "total_steps=2", "checkpoint_every=2", "sync.check_bitwise=1", "engine.max_rows=24",
            "partial_rollout.enabled=true", "partial_rollout.overprovision=2", "partial_rollout.max_staleness=1",
            "metric_logger._component_=sparrow.rl.JsonlLogger", nproc=2)
    assert r.returncode == 0, r.stderr[-4000:]
    from sparrow.rl import read_metrics

    steps = [m for m in read_metrics(tmp_path / "d" / "logs") if "time/step_s" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(abs(sum(v for k, v in m.items() if k.startswith("partial/staleness_")) - 1.0) < 1e-9 for m in steps)
    assert any(m["partial/staleness_1"] > 0 for m in steps)  # stamps of an older version reached the trainer
    assert all(m["sync/bitwise_checked"] == 1.0 for m in steps)
    state = json.loads((tmp_path / "d/checkpoints/step_000002/state.json").read_text())
    assert len(state["partial"]["ranks"]) == 1 and state["partial"]["ranks"][0]["queue"]

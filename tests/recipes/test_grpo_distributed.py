"""The real CLI (`tune run --nproc_per_node N sparrow_grpo`) in distributed mode on a tiny model: a trainer and a
rollout rank, a rank that dies, FSDP2 trainers against one trainer."""

import shutil
import time

import pytest

from tests.recipes.test_grpo_recipe import _assert_same_training, run, run_shipped


@pytest.mark.slow
def test_distributed_trainer_and_rollout_rank(tmp_path):
    r = run(tmp_path / "d", "total_steps=3", "checkpoint_every=3", "sync.check_bitwise=1", nproc=2)
    assert r.returncode == 0, r.stderr[-4000:]
    assert (tmp_path / "d/checkpoints/step_000003/model.safetensors").is_file()
    log = next((tmp_path / "d/logs").glob("*.txt")).read_text()
    assert "sync/wire_bytes" in log


@pytest.mark.slow
def test_a_dead_rank_stops_the_others(tmp_path):
    t0 = time.time()
    r = run(tmp_path / "f", "total_steps=50", "dist_timeout_s=30", nproc=2, env={"SPARROW_FAULT": "1:2"})
    assert r.returncode != 0
    assert time.time() - t0 < 150


@pytest.mark.slow
def test_fsdp2_trainers_match_one_trainer_and_resume_its_checkpoints(tmp_path):
    """trainer_ranks=2 (FSDP2 over ranks 0-1, rank 2 rolls out) takes the same optimizer steps as one trainer
    (gradients of the two halves of every minibatch summed), and its checkpoints are the single trainer's
    files: it resumes one written by a single trainer and continues identically."""
    one = tmp_path / "one"
    run_shipped(one, "total_steps=2", "checkpoint_every=1", nproc=2)
    two = tmp_path / "two"
    run_shipped(two, "total_steps=1", "checkpoint_every=1", "trainer_ranks=2", "sync.check_bitwise=1", nproc=3)
    _assert_same_training(one / "checkpoints/step_000001", two / "checkpoints/step_000001")
    res = tmp_path / "res"
    (res / "checkpoints").mkdir(parents=True)
    shutil.copytree(one / "checkpoints/step_000001", res / "checkpoints/step_000001")
    (res / "checkpoints/latest").write_text("step_000001")
    run_shipped(res, "total_steps=2", "checkpoint_every=1", "trainer_ranks=2", "resume_from_checkpoint=true",
                "sync.check_bitwise=1", nproc=3)
    _assert_same_training(one / "checkpoints/step_000002", res / "checkpoints/step_000002")

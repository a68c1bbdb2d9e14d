"""The real CLI on a tiny model in its other rollout modes: shared-prefix training, and RTPurbo rollouts with a
quantized self-drafter and codec sync (a part of their own on the GPU: each run compiles the engine afresh)."""

import pytest

from tests.recipes.test_grpo_recipe import _assert_same_training, _tiny_rtpurbo_dir, run, run_shipped


def test_shared_prefix_training_takes_the_same_steps(tmp_path):
    """shared_prefix=true (each prompt computed once per group) trains as the per-row trainer does: the same
    rollouts (one step, from the shipped checkpoint), the same optimizer step up to summation order; with
    several epochs the groups are shuffled whole."""
    plain, shared = tmp_path / "plain", tmp_path / "shared"
    common = ("total_steps=1", "checkpoint_every=1", "ppo_epochs=1", "micro_batch_size=4")
    run_shipped(plain, *common, nproc=1)
    run_shipped(shared, *common, "shared_prefix=true", nproc=1)
    _assert_same_training(plain / "checkpoints/step_000001", shared / "checkpoints/step_000001")
    # two epochs shuffle the batch: whole groups, or the packing refuses rows that do not share their prompt
    run_shipped(tmp_path / "epochs", "total_steps=1", "shared_prefix=true", "ppo_epochs=2", "micro_batch_size=4",
                nproc=1)


@pytest.mark.slow
def test_sparse_speculative_rollouts_dense_training(tmp_path):
    """RTPurbo rollouts + a quantized self-drafter + codec sync: trains, logs the mismatch, stays bit-exact."""
    ckpt, rt = _tiny_rtpurbo_dir(tmp_path)
    r = run(tmp_path / "s", "total_steps=3", f"checkpoint={ckpt}", "attention._component_=sparrow.attention.rtpurbo",
            f"attention.path={rt}", "indexer_refresh.every=2", "indexer_refresh.steps=2", "indexer_refresh.sequences=4",
            "speculative.drafter._component_=sparrow.speculative.DrafterConfig", "speculative.drafter.weight=int8",
            "speculative.toggle._component_=sparrow.speculative.always_on", "speculative.toggle.num_draft=2",
            "sync.check_bitwise=1", "checkpoint_every=3")
    assert r.returncode == 0, r.stderr[-4000:]
    log = next((tmp_path / "s/logs").glob("*.txt")).read_text()
    for key in ("mismatch_kl", "is_clip_frac", "spec/acceptance", "attention/decode_ret_density",
                "time/indexer_refresh_s", "time/drafter_refresh_s"):
        assert key in log, key

"""``sparrow.rollout.config``: the ladder of batch buckets, the engine's default one among them."""

from sparrow.rollout import EngineConfig, batch_buckets


def test_batch_buckets():
    assert batch_buckets(64, 2) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(64, 4) == [1, 4, 16, 64]
    assert batch_buckets(8, 2, smallest=2) == [2, 4, 8]
    assert batch_buckets(1, 2) == [1]


def test_the_engine_default_is_the_ladder_of_two():
    for rows in (1, 12, 64):
        assert EngineConfig(max_rows=rows).buckets == tuple(batch_buckets(rows, 2))
    assert EngineConfig(max_rows=12).buckets == (1, 2, 4, 8, 12)
    assert EngineConfig(max_rows=12, batch_buckets=(4, 2)).buckets == (2, 4, 12)  # given: sorted, max_rows added

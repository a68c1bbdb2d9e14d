"""``sparrow.rollout.config``: the ladder of batch buckets, the engine's default one among them."""

from sparrow.rollout import EngineConfig, batch_buckets
from sparrow.rollout.config import smallest_bucket


def test_batch_buckets():
    assert batch_buckets(64, 2) == [1, 2, 4, 8, 16, 32, 64]
    assert batch_buckets(64, 4) == [1, 4, 16, 64]
    assert batch_buckets(8, 2, smallest=2) == [2, 4, 8]
    assert batch_buckets(1, 2) == [1]


def test_the_engine_default_is_the_ladder_of_two():
    """Powers of two from the smallest bucket worth compiling (``smallest_bucket``: 1, or 2 where this torch would
    specialise size 1), and ``max_rows``."""
    one = smallest_bucket(True)
    for rows in (1, 12, 64):
        assert EngineConfig(max_rows=rows).buckets == tuple(batch_buckets(rows, 2, smallest=one))
        assert EngineConfig(max_rows=rows, compile=False).buckets == tuple(batch_buckets(rows, 2))
    assert EngineConfig(max_rows=12).buckets == (1, 2, 4, 8, 12)[one - 1:]
    assert EngineConfig(max_rows=12, batch_buckets=(4, 2)).buckets == (2, 4, 12)  # given: sorted, max_rows added

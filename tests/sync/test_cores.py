"""The cores the single-payload API and the bucketed sender / receiver share, checked from both entry points:

* :func:`sparrow.sync._util.cut_runs` (buckets of at most ``bucket_bytes``, encode and decode launches of at most
  so many changes): a property test, with a negative control that must fail it.
"""

from __future__ import annotations

from hypothesis import find, given, settings
from hypothesis import strategies as st

from sparrow.sync._util import cut_runs

SETTINGS = dict(max_examples=200, deadline=None, database=None)
sizes_and_caps = st.tuples(st.lists(st.integers(0, 50), max_size=30), st.integers(1, 120))


def runs_are_greedy(sizes: list[int], cap: int, runs: list[tuple[int, int]]) -> bool:
    """The cut's contract: consecutive runs covering every item in order, each of at least one item, summing to at
    most ``cap`` unless it is one item, and each as long as it can be (the next item would not fit)."""
    ends = [0, *(b for _, b in runs)]
    if [a for a, _ in runs] != ends[:-1] or ends[-1] != len(sizes):
        return False
    for a, b in runs:
        if b <= a or (b - a > 1 and sum(sizes[a:b]) > cap):
            return False
        if b < len(sizes) and sum(sizes[a:b + 1]) <= cap:
            return False
    return True


@settings(**SETTINGS)
@given(case=sizes_and_caps)
def test_cut_runs_property(case):
    sizes, cap = case
    assert runs_are_greedy(sizes, cap, cut_runs(sizes, cap))


def test_cut_runs_examples():
    assert cut_runs([], 10) == []
    assert cut_runs([3, 4, 3, 1], 10) == [(0, 3), (3, 4)]
    assert cut_runs([11, 2, 12], 10) == [(0, 1), (1, 2), (2, 3)]  # an item over the cap is a run of its own
    assert cut_runs([0, 0, 5, 5], 10) == [(0, 4)]


def test_negative_control_a_strict_cut_fails_the_property():
    """A cut that stops one item early (``<`` for ``<=``) is found by the same property and strategy."""
    def strict(sizes, cap):
        runs, a = [], 0
        while a < len(sizes):
            b = a + 1
            while b < len(sizes) and sum(sizes[a:b + 1]) < cap:
                b += 1
            runs.append((a, b))
            a = b
        return runs

    sizes, cap = find(sizes_and_caps, lambda c: not runs_are_greedy(*c, strict(*c)), settings=settings(**SETTINGS))
    assert not runs_are_greedy(sizes, cap, strict(sizes, cap))

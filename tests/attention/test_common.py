"""The cache writers both backends use: every (cache, values) pair lands at its slot's positions, nothing else
changes."""

import torch

from sparrow.attention.common import prefix_index, put, row_index, write_prefix, write_rows


def test_row_index_writes_each_pair_at_the_rows_positions_and_wraps_a_ring():
    g = torch.Generator().manual_seed(0)
    k, ik = torch.randn(2, 3, 4, 8, generator=g), torch.randn(2, 3, 4, 2, generator=g)
    slot, start = torch.tensor([2, 0]), torch.tensor([3, 1])
    for ring in (None, 5):
        L = ring or 9
        ck = torch.full((4, 3, L, 8), float("nan"))
        cik = torch.full((4, 3, L, 2), float("nan"), dtype=torch.bfloat16)
        put(row_index(k, slot, start, ring=ring), (ck, k), (cik, ik))
        written = torch.zeros(4, L, dtype=torch.bool)
        for a in range(2):
            for t in range(4):
                p = (int(start[a]) + t) % L
                assert torch.equal(ck[slot[a], :, p], k[a, :, t])
                assert torch.equal(cik[slot[a], :, p], ik[a, :, t].bfloat16())
                written[slot[a], p] = True
        assert torch.isnan(ck.permute(0, 2, 1, 3)[~written]).all()  # every other position untouched
        assert written.sum() == 8


def test_prefix_and_two_tensor_writers_agree_with_the_index_helpers():
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 2, 5, 4, generator=g), torch.randn(2, 2, 5, 4, generator=g)
    slot, start = torch.tensor([1, 0]), torch.tensor([0, 2])
    a = [torch.zeros(3, 2, 8, 4) for _ in range(4)]
    b = [torch.zeros(3, 2, 8, 4) for _ in range(4)]
    write_prefix(a[0], a[1], k, v, slot)
    put(prefix_index(k, slot), (b[0], k), (b[1], v))
    write_rows(a[2], a[3], k, v, slot, start)
    put(row_index(k, slot, start), (b[2], k), (b[3], v))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(a[0][1, :, :5], k[0]) and torch.equal(a[3][0, :, 2:7], v[1])
    assert not a[0][2].any()  # slot 2 was not written

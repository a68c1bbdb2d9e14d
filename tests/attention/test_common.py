"""The cache writers both backends use: every (cache, values) pair lands at its slot's positions, nothing else
changes; the trainer's attention of packed groups."""

import pytest
import torch

from sparrow.attention import PrefixPackMask
from sparrow.attention.common import prefix_index, put, row_index, train_attention, write_prefix, write_rows


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


# -- the trainer's attention of packed groups: the prompt on the causal kernel, the rest through its mask rows -----

@pytest.mark.parametrize("B,Hq,Hkv,P,T,D", [pytest.param(1, 2, 2, 5, 3, 8, id="mha"),
                                             pytest.param(2, 6, 2, 9, 7, 16, id="gqa"),
                                             pytest.param(3, 4, 1, 1, 11, 8, id="one-token-prompt"),
                                             pytest.param(2, 4, 2, 13, 1, 8, id="one-query-after")])
def test_prefix_pack_mask_equals_the_whole_mask(B, Hq, Hkv, P, T, D):
    """Causal prompt rows + random later rows: the same outputs and gradients as the whole [S, S] mask (which
    spells the prompt rows as causal)."""
    g = torch.Generator().manual_seed(B * 100 + P)
    S = P + T
    q = torch.randn(B, Hq, S, D, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64, requires_grad=True)
    rest = torch.rand(B, T, S, generator=g) < 0.4
    rest[:, torch.arange(T), P + torch.arange(T)] = True  # every row attends to something
    whole = torch.cat([torch.ones(P, S, dtype=torch.bool).tril().expand(B, P, S), rest], dim=1)
    w = torch.randn(B, Hq, S, D, generator=g, dtype=torch.float64)
    outs = []
    for mask in (whole, PrefixPackMask(P, rest)):
        o = train_attention(q, k, v, mask)
        grads = torch.autograd.grad((o * w).sum(), (q, k, v))
        outs.append((o, *grads))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    # negative control: a prompt region that is not causal in the whole mask gives other outputs
    leaky = whole.clone()
    leaky[:, :P, :P] = True
    if P > 1:
        assert not torch.allclose(train_attention(q, k, v, leaky), outs[1][0])


def test_prefix_pack_mask_refuses_what_does_not_fit():
    """A bad prefix or rest is refused when made; a rest of another batch or length where it is used."""
    rest = torch.ones(2, 3, 8, dtype=torch.bool)
    with pytest.raises(ValueError, match="prefix_len must be an int >= 0"):
        PrefixPackMask(-1, rest)
    with pytest.raises(ValueError, match=r"rest must be bool \[B, S - P, S\] with P = 4"):
        PrefixPackMask(4, rest)  # 3 queries + 4 = 7 keys, not 8
    with pytest.raises(ValueError, match="rest must be bool"):
        PrefixPackMask(5, rest.float())
    q = k = v = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"does not fit 1 sequences of 8 positions \(rest must be \[1, 3, 8\]\)"):
        train_attention(q, k, v, PrefixPackMask(5, rest))


def test_prefix_pack_mask_without_a_prefix_is_the_explicit_mask():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g, dtype=torch.float64) for _ in range(3))
    rest = torch.rand(2, 6, 6, generator=g) < 0.5
    rest[:, torch.arange(6), torch.arange(6)] = True
    a, b = train_attention(q, k, v, PrefixPackMask(0, rest)), train_attention(q, k, v, rest)
    assert torch.equal(a.view(torch.int64), b.view(torch.int64))  # bit for bit

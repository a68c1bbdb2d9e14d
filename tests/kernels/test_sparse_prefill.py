import pytest
import torch
import torch.nn.functional as F

from sparrow.kernels.sparse_prefill import (
    SparsePrefillConfig,
    local_block_mask,
    prefill_block_scores,
    retrieval_block_mask,
    sparse_prefill_attention,
)
from sparrow.kernels.sparse_prefill.api import select_prefill_blocks
from sparrow.kernels.sparse_prefill.reference import local_token_mask
from sparrow.kernels.topp.api import blocks_to_mask
from tests.helpers import rel_err, to_device


def _idx(P, H, S, r=16, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(P, H, S, r, generator=g) * scale, torch.randn(P, H, S, r, generator=g) * scale


@pytest.mark.parametrize("S,block", [(1, 16), (63, 16), (100, 32), (130, 32)])
def test_block_scores_triton_matches_reference(S, block):
    qi, ki = _idx(2, 2, S, scale=0.8)
    plen = torch.tensor([S, max(1, S // 2)])
    ref = prefill_block_scores(qi, ki, plen, block, impl="reference")
    out = prefill_block_scores(*to_device((qi, ki, plen)), block, impl="triton").cpu()
    nb = ref.shape[-1]
    tril = torch.ones(nb, nb, dtype=torch.bool).tril()
    a, b = ref[..., tril], out[..., tril]
    assert torch.equal(torch.isinf(a), torch.isinf(b))
    fin = torch.isfinite(a)
    assert (a[fin] - b[fin]).abs().max() < 1e-4
    # a query block's masses sum to one (per-query distributions averaged)
    real = (torch.arange(nb) * block)[None] < plen[:, None]
    sums = torch.exp(ref).nan_to_num(0).sum(-1)
    assert torch.allclose(sums[real[:, None].expand_as(sums)], torch.ones(()), atol=1e-5)


def test_selection_triton_matches_reference():
    qi, ki = _idx(2, 2, 130, scale=1.5, seed=3)
    plen = torch.tensor([130, 77])
    cfg = SparsePrefillConfig(top_p=0.7, block=16, num_sinks=4, window=32, ret_window=16)
    a = select_prefill_blocks(qi, ki, plen, cfg, impl="reference")
    b = to_device(select_prefill_blocks(*to_device((qi, ki, plen)), cfg, impl="triton"), "cpu")
    nb = 9
    ma, mb = blocks_to_mask(*a, nb), blocks_to_mask(*b, nb)
    real = ((torch.arange(nb) * 16)[None] < plen[:, None])[:, None].expand(2, 2, nb).reshape(-1)
    assert torch.equal(ma[real], mb[real])
    assert ma[real].sum() < real.sum() * (nb + 1) / 2  # sparse: fewer than all causal blocks
    for row in range(ma.shape[0]):  # the diagonal block is always kept, and last in the list
        qb = row % nb
        assert int(b[0][row, b[1][row] - 1]) == qb


def test_reference_p1_all_retrieval_is_causal_attention():
    P, Hkv, qpk, S, D = 2, 2, 2, 70, 16
    q, k, v = torch.randn(P, Hkv * qpk, S, D), torch.randn(P, Hkv, S, D), torch.randn(P, Hkv, S, D)
    qi, ki = _idx(P, Hkv, S)
    cfg = SparsePrefillConfig(top_p=1.0, block=16, num_sinks=4, window=8, ret_window=16)
    out = sparse_prefill_attention(q, k, v, qi, ki, torch.tensor([S, S]), torch.tensor([0, 1]),
                                   torch.zeros(0, dtype=torch.long), cfg, impl="reference")
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("S,block,sinks,window", [(100, 16, 4, 20), (130, 32, 0, 64), (64, 16, 4, 3), (33, 16, 4, 200)])
def test_local_block_mask_matches_token_mask(S, block, sinks, window):
    m = local_block_mask(S, block, num_sinks=sinks, window=window, device="cpu")
    dense = m.to_dense()[0, 0]  # block-level [Qb, KVb]: partial + full
    tok = local_token_mask(S, num_sinks=sinks, window=window, device="cpu")
    nb = -(-S // block)
    pad = F.pad(tok, (0, nb * block - S, 0, nb * block - S)).view(nb, block, nb, block)
    any_ = pad.any(3).any(1)
    assert torch.equal(dense.bool(), any_)  # exactly the blocks holding a visible pair
    full = m.full_kv_num_blocks[0, 0]
    for qb in range(nb):  # full blocks have every pair of the tile visible
        for kb in m.full_kv_indices[0, 0, qb, : full[qb]].tolist():
            assert pad[qb, : min(block, S - qb * block), kb, :].all()


def test_retrieval_block_mask_from_selection():
    qi, ki = _idx(1, 2, 100, scale=1.5, seed=1)
    cfg = SparsePrefillConfig(top_p=0.6, block=16, num_sinks=4, window=32, ret_window=16)
    idx, cnt = select_prefill_blocks(qi, ki, torch.tensor([100]), cfg, impl="reference")
    nb = 7
    m = retrieval_block_mask(idx.view(2, nb, nb), cnt.view(2, nb), 100, 16)
    assert torch.equal(m.to_dense()[:, 0].bool(), blocks_to_mask(idx, cnt, nb).view(2, nb, nb))


def test_flex_matches_reference():
    """Block-sparse FlexAttention (compiled on the CPU, ~30 s) against dense masks + SDPA."""
    torch.manual_seed(0)
    P, Hkv, qpk, S, D = 2, 3, 2, 200, 16
    q, k, v = torch.randn(P, Hkv * qpk, S, D), torch.randn(P, Hkv, S, D), torch.randn(P, Hkv, S, D)
    qi, ki = _idx(P, 1, S, scale=1.5, seed=2)
    plen = torch.tensor([200, 150])
    ret, loc = torch.tensor([1]), torch.tensor([0, 2])
    cfg = SparsePrefillConfig(top_p=0.5, block=32, num_sinks=4, window=50, ret_window=20)
    ref = sparse_prefill_attention(q, k, v, qi, ki, plen, ret, loc, cfg, impl="reference", score_impl="reference")
    out = sparse_prefill_attention(*to_device((q, k, v, qi, ki, plen, ret, loc)), cfg, impl="flex",
                                   score_impl="triton").cpu()
    for p in range(P):
        n = int(plen[p])
        assert rel_err(out[p, :, :n], ref[p, :, :n]) < 1e-5

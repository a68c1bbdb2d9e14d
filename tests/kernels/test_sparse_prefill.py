import pytest
import torch
import torch.nn.functional as F

from sparrow.kernels.sparse_prefill import (
    SparsePrefillConfig,
    local_block_mask,
    local_chunked,
    local_prefill_attention,
    prefill_block_scores,
    retrieval_block_mask,
    sparse_prefill_attention,
)
from sparrow.kernels.sparse_prefill.api import select_prefill_blocks
from sparrow.kernels.sparse_prefill.reference import local_prefill_reference, local_token_mask
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


@pytest.mark.parametrize("local_impl", ["flex", "chunked"])
def test_flex_matches_reference(local_impl):
    """Block-sparse FlexAttention (compiled on the CPU) for the retrieval head, the local heads by FlexAttention
    or by the chunked path, against dense masks + SDPA."""
    torch.manual_seed(0)
    P, Hkv, qpk, S, D = 2, 3, 2, 200, 16
    q, k, v = torch.randn(P, Hkv * qpk, S, D), torch.randn(P, Hkv, S, D), torch.randn(P, Hkv, S, D)
    qi, ki = _idx(P, 1, S, scale=1.5, seed=2)
    plen = torch.tensor([200, 150])
    ret, loc = torch.tensor([1]), torch.tensor([0, 2])
    cfg = SparsePrefillConfig(top_p=0.5, block=32, num_sinks=4, window=50, ret_window=20)
    ref = sparse_prefill_attention(q, k, v, qi, ki, plen, ret, loc, cfg, impl="reference", score_impl="reference")
    out = sparse_prefill_attention(*to_device((q, k, v, qi, ki, plen, ret, loc)), cfg, impl="flex",
                                   score_impl="triton", local_impl=local_impl).cpu()
    for p in range(P):
        n = int(plen[p])
        assert rel_err(out[p, :, :n], ref[p, :, :n]) < 1e-5


# (P, Hq, Hkv, S, D, sinks, window): chunks of window - 1 tokens, with and without a partial last chunk
LOCAL_CASES = [
    pytest.param((1, 2, 1, 1, 16, 4, 8), id="single-row"),
    pytest.param((2, 3, 1, 63, 16, 0, 8), id="S63-sink0-qpk3"),
    pytest.param((1, 4, 2, 100, 16, 4, 20), id="S100-tail5"),
    pytest.param((1, 2, 2, 257, 32, 4, 64), id="S257-4-chunks-and-tail"),
    pytest.param((2, 4, 2, 126, 16, 4, 64), id="S126-no-tail"),
    pytest.param((1, 4, 2, 40, 16, 4, 200), id="window-beyond-S"),
    pytest.param((1, 2, 1, 70, 16, 4, 1), id="window1"),
    pytest.param((1, 2, 1, 70, 16, 4, 2), id="window2"),
    pytest.param((1, 2, 1, 70, 16, 7, 5), id="sinks-beyond-window"),
]


def _qkv(P, Hq, Hkv, S, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(P, Hq, S, D, generator=g), torch.randn(P, Hkv, S, D, generator=g),
            torch.randn(P, Hkv, S, D, generator=g))


@pytest.mark.parametrize("case", LOCAL_CASES)
def test_local_chunked_matches_reference(case):
    P, Hq, Hkv, S, D, sinks, window = case
    q, k, v = _qkv(P, Hq, Hkv, S, D)
    ref = local_prefill_attention(q, k, v, num_sinks=sinks, window=window, impl="reference")
    out = local_prefill_attention(*to_device((q, k, v)), num_sinks=sinks, window=window, impl="chunked").cpu()
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("case", [LOCAL_CASES[3], LOCAL_CASES[8]])
def test_local_chunked_bf16_error_close_to_eager_bf16(case):
    P, Hq, Hkv, S, D, sinks, window = case
    q, k, v = _qkv(P, Hq, Hkv, S, D, seed=1)
    exact = local_prefill_reference(q.double(), k.double(), v.double(), num_sinks=sinks, window=window)
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    eager = local_prefill_reference(qb, kb, vb, num_sinks=sinks, window=window)
    out = local_prefill_attention(*to_device((qb, kb, vb)), num_sinks=sinks, window=window, impl="chunked")
    assert out.dtype == torch.bfloat16
    assert rel_err(out, exact) < 2.0 * rel_err(eager, exact)


@pytest.mark.parametrize("S,window", [(257, 64), (126, 64), (70, 1), (40, 200)])
def test_local_chunked_computes_exactly_the_window_band(S, window, monkeypatch):
    """The dense pieces cover each query's window once: the query-key pairs they compute (a causal L x L piece
    computes L (L + 1) / 2) sum to the band's, ``sum_i min(i + 1, window)`` — no fully masked tile, no padding."""
    pairs = []
    inner = local_chunked.attention_with_lse

    def counting(q, k, v, *, causal, scale):
        B, H, L, _ = q.shape
        pairs.append(B * H * (L * (L + 1) // 2 if causal else L * k.shape[2]))
        return inner(q, k, v, causal=causal, scale=scale)

    monkeypatch.setattr(local_chunked, "attention_with_lse", counting)
    q, k, v = _qkv(1, 2, 1, S, 16)
    out = local_prefill_attention(*to_device((q, k, v)), num_sinks=4, window=window, impl="chunked").cpu()
    band = sum(min(i + 1, window) for i in range(S))
    assert sum(pairs) == (2 * band if S > window else 0)  # S <= window: one plain causal call, nothing counted
    assert rel_err(out, local_prefill_reference(q, k, v, num_sinks=4, window=window)) < 1e-5


def test_attention_with_lse_matches_logsumexp():
    """The dense kernel with its log-sum-exp, whatever backend serves it (D=12: no fused kernel, the fallback)."""
    for D in (12, 16):
        for causal in (True, False):
            q, k, v = _qkv(2, 4, 2, 33, D)
            if not causal:
                k, v = k[:, :, :20], v[:, :, :20]
            out, lse = local_chunked.attention_with_lse(q, k, v, causal=causal, scale=0.3)
            s = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.3
            if causal:
                s = s.masked_fill(torch.ones(33, 33, dtype=torch.bool).triu(1), float("-inf"))
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3, enable_gqa=True)
            assert rel_err(out, ref) < 1e-5 and (lse - torch.logsumexp(s, -1)).abs().max() < 1e-4


def test_local_and_prefill_validation():
    q, k, v = _qkv(1, 4, 2, 10, 16)
    with pytest.raises(ValueError, match="impl"):
        local_prefill_attention(q, k, v, num_sinks=4, window=8, impl="flex")
    with pytest.raises(ValueError, match="window"):
        local_prefill_attention(q, k, v, num_sinks=4, window=0)
    with pytest.raises(ValueError, match="Hkv"):
        local_prefill_attention(q, k[:, :, :5], v, num_sinks=4, window=8)
    with pytest.raises(ValueError, match="head_dim"):
        local_prefill_attention(q[..., :12], k[..., :12], v[..., :12], num_sinks=4, window=8, impl="chunked")
    cfg = SparsePrefillConfig(top_p=0.5, block=16, num_sinks=4, window=8, ret_window=16)
    with pytest.raises(ValueError, match="local_impl"):
        sparse_prefill_attention(q, k, v, None, None, torch.tensor([10]), torch.zeros(0, dtype=torch.long),
                                 torch.tensor([0, 1]), cfg, local_impl="dense")

import pytest
import torch

from sparrow.attention import CacheSpec, DecodeMeta, DenseAttention, LayerShape, PrefillMeta
from sparrow.rollout.forward import decode_hidden, logits_from_hidden, prefill_hidden
from tests.helpers import DEVICE, random_tiny


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("T", [1, 4], ids=["T1", "T4"])
def test_cached_decode_equals_full_forward(impl, T):
    """Prefill two prompts into shared prefix slots, decode blocks of T tokens for three rows: the
    logits equal a full causal forward over each row's whole sequence."""
    from functools import partial

    dev = DEVICE if impl == "triton" else torch.device("cpu")  # Triton: CUDA, or the CPU's interpreter
    model = random_tiny("qwen2", attention=partial(DenseAttention, impl=impl)).to(dev)
    spec = CacheSpec(num_prefixes=3, max_prefix_len=16, num_rows=4, max_gen_len=12)
    caches = [layer.attn.backend.init_cache(spec, dtype=torch.float32, device=dev) for layer in model.layers]
    prompts = [torch.randint(0, 64, (n,)).to(dev) for n in (11, 6)]
    toks = torch.zeros(2, 11, dtype=torch.int64, device=dev)
    for i, p in enumerate(prompts):
        toks[i, : len(p)] = p
    slots, plen = torch.tensor([2, 0], device=dev), torch.tensor([11, 6], device=dev)
    with torch.no_grad():
        prefill_hidden(model, toks, caches, PrefillMeta(slots, plen))
        rows = torch.tensor([3, 0, 1], device=dev)
        prefix_of_row = torch.tensor([0, 1, 1], device=dev)  # rows 0 and 1 share prompt 1
        gen = torch.randint(0, 64, (3, 2 * T)).to(dev)
        for blk in range(2):
            meta = DecodeMeta(rows, slots[prefix_of_row], plen[prefix_of_row], torch.full((3,), blk * T, device=dev))
            h = decode_hidden(model, gen[:, blk * T:(blk + 1) * T], caches, meta)
            logits = logits_from_hidden(model, h)
            for r in range(3):
                seq = torch.cat([prompts[int(prefix_of_row[r])], gen[r, : (blk + 1) * T]])
                full = model(seq[None])[0, -T:]
                assert torch.allclose(logits[r], full, atol=1e-4, rtol=1e-4)


def test_cache_bytes_and_validation():
    b = DenseAttention(LayerShape(0, 4, 2, 16))
    cache = b.init_cache(CacheSpec(2, 8, 3, 5), dtype=torch.bfloat16, device=torch.device("cpu"))
    assert b.cache_nbytes(cache) == 2 * (2 * 2 * 8 * 16 + 4 * 2 * 5 * 16) * 2
    assert b.validate_configuration(dtype=torch.int8, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="impl"):
        DenseAttention(LayerShape(0, 4, 2, 16), impl="flash")
    with pytest.raises(ValueError, match="positive"):
        CacheSpec(0, 8, 3, 5)


def test_auto_falls_back_where_triton_cannot_run_and_an_explicit_triton_says_why():
    """``impl="auto"`` picks the reference for a head_dim the Triton kernel cannot take, so the backend can run
    (no reason); an explicit ``"triton"`` cannot, and says so. RTPurbo gives the same reasons (one check)."""
    from sparrow.attention.common import decode_impl
    from sparrow.attention.rtpurbo import RTPurboAttention, RTPurboConfig

    cpu = torch.device("cpu")
    assert decode_impl("auto", 24, torch.device("cuda")) == "reference"
    assert decode_impl("auto", 32, torch.device("cuda")) == "triton"
    assert DenseAttention(LayerShape(0, 4, 2, 24)).validate_configuration(dtype=torch.float32, device=cpu) == []
    reasons = DenseAttention(LayerShape(0, 4, 2, 24), impl="triton").validate_configuration(dtype=torch.float32,
                                                                                           device=cpu)
    assert len(reasons) == 1 and "head_dim" in reasons[0] and "24" in reasons[0]
    for impl in ("auto", "reference", "triton"):
        for head_dim in (16, 24):
            for dtype in (torch.float32, torch.int8):
                shape = LayerShape(0, 4, 2, head_dim)
                dense = DenseAttention(shape, impl=impl).validate_configuration(dtype=dtype, device=cpu)
                sparse = RTPurboAttention(shape, RTPurboConfig(impl=impl)).validate_configuration(dtype=dtype,
                                                                                                  device=cpu)
                assert sparse == dense

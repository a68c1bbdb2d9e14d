import pytest
import torch

from sparrow.attention import CacheSpec, DecodeMeta, DenseAttention, LayerShape, PrefillMeta
from sparrow.rollout.forward import decode_hidden, logits_from_hidden, prefill_hidden
from tests.helpers import DEVICE, random_tiny


@pytest.mark.parametrize("impl,T,shared", [("reference", 1, "auto"), ("reference", 4, True), ("triton", 1, "auto"),
                                           ("triton", 4, True)],
                         ids=["reference-T1", "reference-T4-shared", "triton-T1-per-row", "triton-T4-shared"])
def test_cached_decode_equals_full_forward(impl, T, shared):
    """Prefill two prompts into shared prefix slots, decode blocks of T tokens for three rows: the
    logits equal a full causal forward over each row's whole sequence (``shared``: through the shared-prefix
    kernel, rows 1 and 2 one group; T = 4 is a verify step's shape)."""
    from functools import partial

    dev = DEVICE if impl == "triton" else torch.device("cpu")  # Triton: CUDA, or the CPU's interpreter
    model = random_tiny("qwen2", attention=partial(DenseAttention, impl=impl, shared_prefix=shared)).to(dev)
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
    # the device Triton runs on here (CUDA, or the CPU's interpreter), so head_dim is the one reason
    reasons = DenseAttention(LayerShape(0, 4, 2, 24), impl="triton").validate_configuration(dtype=torch.float32,
                                                                                           device=DEVICE)
    assert len(reasons) == 1 and "head_dim" in reasons[0] and "24" in reasons[0]
    for impl in ("auto", "reference", "triton"):
        for head_dim in (16, 24):
            for dtype in (torch.float32, torch.int8):
                shape = LayerShape(0, 4, 2, head_dim)
                dense = DenseAttention(shape, impl=impl).validate_configuration(dtype=dtype, device=cpu)
                sparse = RTPurboAttention(shape, RTPurboConfig(impl=impl)).validate_configuration(dtype=dtype,
                                                                                                  device=cpu)
                assert sparse == dense


def test_shared_prefix_choice():
    """``"auto"`` takes the shared-prefix kernel exactly when the metadata groups the rows and Triton runs; True and
    False decide alone; anything else is refused."""
    from sparrow.attention.common import shared_prefix_on

    rows = torch.arange(3)
    plain = DecodeMeta(rows, torch.tensor([0, 0, 1]), torch.tensor([5, 5, 2]), torch.zeros(3, dtype=torch.int64))
    grouped = plain.grouped()
    assert grouped.group_start.tolist() == [0, 0, 2] and grouped.grouped() is grouped
    assert [shared_prefix_on("auto", m, i) for m in (plain, grouped) for i in ("reference", "triton")] == \
        [False, False, False, True]
    assert all(shared_prefix_on(True, m, i) for m in (plain, grouped) for i in ("reference", "triton"))
    assert not any(shared_prefix_on(False, m, "triton") for m in (plain, grouped))
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="shared_prefix"):
            DenseAttention(LayerShape(0, 4, 2, 16), shared_prefix=bad)


def test_engine_with_the_shared_prefix_kernel_matches_the_naive_generator(monkeypatch):
    """A GRPO rollout whose rows finish at different times (groups shrink unevenly) through the shared-prefix
    Triton kernel (the CPU's interpreter without CUDA): the same tokens as a generator that recomputes every
    sequence with dense attention. ``shared_prefix=True`` turns the small-batch hand-off to the per-row kernel off
    (``min_rows=0`` on every call, so on CUDA too the cascade runs); ``"auto"`` leaves it to the kernel."""
    from functools import partial

    import importlib

    from sparrow.rollout import EngineConfig, RolloutEngine, SamplingParams, generate_reference

    dense_module = importlib.import_module("sparrow.attention.dense")  # (the package exports a ``dense`` function)
    seen, real = [], dense_module.cascade_decode_attention

    def spy(*args, **kw):
        seen.append(kw["min_rows"])
        return real(*args, **kw)

    monkeypatch.setattr(dense_module, "cascade_decode_attention", spy)
    model = random_tiny("qwen2", std=0.15, attention=partial(DenseAttention, impl="triton", shared_prefix=True))
    model = model.to(DEVICE)
    prompts = [[5, 9, 2, 7, 7, 1, 3], [4, 8]]
    eng = RolloutEngine(model, EngineConfig(max_rows=8, max_prompt_len=16, max_new_tokens=4, compile=False,
                                            block_steps=1))
    for seed in range(2, 12):  # the first seed whose rows leave their groups at different steps (device RNGs differ)
        params = SamplingParams(temperature=1.0, max_new_tokens=4, stop_token_ids=tuple(range(0, 64, 6)), seed=seed)
        out = eng.generate(prompts, 3, params)
        if len({s.length for s in out}) > 1:
            break
    assert len({s.length for s in out}) > 1
    ref = generate_reference(model, prompts, 3, params)
    assert [s.tokens.tolist() for s in out] == [s.tokens.tolist() for s in ref]
    assert max(float((a.logprobs - b.logprobs).abs().max()) for a, b in zip(out, ref)) < 1e-4
    assert seen and set(seen) == {0}
    seen.clear()
    auto = random_tiny("qwen2", num_layers=1, attention=partial(DenseAttention, impl="triton")).to(DEVICE)
    RolloutEngine(auto, EngineConfig(max_rows=4, max_prompt_len=16, max_new_tokens=2, compile=False)).generate(
        prompts[:1], 2, SamplingParams(temperature=1.0, max_new_tokens=2))
    assert seen and set(seen) == {None}

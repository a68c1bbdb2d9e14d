import pytest
import torch

from sparrow.rollout import EngineConfig, RolloutEngine, SamplingParams, generate_reference
from sparrow.rollout.steps import STOP_SLOTS, decode_step, is_stop, stop_slots
from tests.helpers import DEVICE, random_tiny

PROMPT_LENS = [5, 17, 3, 30, 9]


def _prompts(vocab=64, lens=PROMPT_LENS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def _engine(model, **kw):
    cfg = dict(max_rows=4, max_prompt_len=64, max_new_tokens=24, compile=False, block_steps=3)
    cfg.update(kw)
    return RolloutEngine(model, EngineConfig(**cfg))


def _assert_same(got, ref, lp_tol=1e-5):
    assert len(got) == len(ref)
    for a, b in zip(got, ref):
        assert (a.prompt_index, a.sample_index) == (b.prompt_index, b.sample_index)
        assert a.tokens.tolist() == b.tokens.tolist()
        assert a.finish_reason == b.finish_reason
        assert a.length == len(a.logprobs)
        assert torch.allclose(a.logprobs, b.logprobs, atol=lp_tol, rtol=0)


@pytest.mark.parametrize("family", ["qwen2", "llama3"])
def test_greedy_matches_naive_reference(family):
    model = random_tiny(family)
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    got = _engine(model).generate(_prompts(), 2, params)
    _assert_same(got.samples, generate_reference(model, _prompts(), 2, params))


@pytest.mark.parametrize(
    "params",
    [
        pytest.param(SamplingParams(temperature=1.0, max_new_tokens=20, stop_token_ids=(7, 11), seed=3), id="t1-stop"),
        pytest.param(SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=12, seed=5), id="t0.7-p0.9-k20"),
    ],
)
def test_sampling_matches_naive_reference(params):
    model = random_tiny("qwen2")
    got = _engine(model).generate(_prompts(), 3, params)
    _assert_same(got.samples, generate_reference(model, _prompts(), 3, params))
    assert {s.finish_reason for s in got} <= {"stop", "length"}
    for s in got:
        if s.finish_reason == "stop":
            assert s.tokens[-1].item() in params.stop_token_ids
            assert not set(s.tokens[:-1].tolist()) & set(params.stop_token_ids)
        else:
            assert s.length == params.max_new_tokens


def test_prefix_sharing_and_compaction_do_not_change_results():
    model = random_tiny("qwen2")
    params = SamplingParams(temperature=1.0, max_new_tokens=20, stop_token_ids=(3,), seed=11)
    base = _engine(model, max_rows=32, share_prefix=False, block_steps=1).generate(_prompts(), 4, params)
    for kw in (dict(max_rows=32), dict(max_rows=4, block_steps=5), dict(max_rows=8, batch_buckets=(8,)),
               dict(max_rows=12, max_prompts=2, prefill_tokens=8)):
        _assert_same(_engine(model, **kw).generate(_prompts(), 4, params).samples, base.samples, lp_tol=1e-5)


def test_finished_rows_leave_the_batch():
    model = random_tiny("qwen2", std=0.1)  # flat distributions: stop tokens hit at varied times
    params = SamplingParams(temperature=1.0, max_new_tokens=24, stop_token_ids=tuple(range(8)), seed=0)
    g = _engine(model, max_rows=16, block_steps=2).generate(_prompts(lens=[4] * 4), 4, params)
    lengths = sorted(s.length for s in g)
    assert lengths[0] < lengths[-1]
    assert len(g.stats.active_hist) > 1  # the batch shrank through smaller buckets
    assert g.stats.row_steps < g.stats.decode_steps * 16


def test_seeded_runs_are_reproducible():
    model = random_tiny("qwen2")
    eng = _engine(model)
    p = SamplingParams(temperature=1.0, max_new_tokens=10, seed=42)
    a, b = eng.generate(_prompts(), 2, p), eng.generate(_prompts(), 2, p)
    assert [s.tokens.tolist() for s in a] == [s.tokens.tolist() for s in b]
    c = eng.generate(_prompts(), 2, SamplingParams(temperature=1.0, max_new_tokens=10, seed=43))
    assert [s.tokens.tolist() for s in a] != [s.tokens.tolist() for s in c]


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_decode_step_compiles_without_graph_breaks(impl):
    from functools import partial

    from sparrow.attention import DenseAttention

    model = random_tiny("qwen2", attention=partial(DenseAttention, impl=impl))
    if impl == "triton":
        model = model.to(DEVICE)  # compiled Triton on CUDA; the interpreter on the CPU
    eng = _engine(model, compile=True, compile_backend="eager", max_rows=8)
    # 4 tokens: each decode step through the Triton interpreter costs ~1 s on a CPU
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=10, max_new_tokens=4, stop_token_ids=(1,))
    out = eng.generate(_prompts(), 2, params)
    _assert_same(out.samples, _engine(model, max_rows=8).generate(_prompts(), 2, params).samples)
    slots = torch.tensor([0, 1, 2, eng.scratch], device=eng.device)
    explain = torch._dynamo.explain(decode_step)(eng.state, slots)
    assert explain.graph_break_count == 0 and explain.graph_count == 1


def test_bad_inputs():
    model = random_tiny("qwen2", max_seq_len=64)
    eng = _engine(model, max_prompt_len=48, max_new_tokens=16)
    p = SamplingParams(max_new_tokens=16)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        eng.generate([[1, 2], []], 1, p)
    with pytest.raises(ValueError, match="longer than the model's context"):
        eng.generate([[1] * 60], 1, p)
    with pytest.raises(ValueError, match="max_prompt_len"):
        eng.generate([[1] * 49], 1, SamplingParams(max_new_tokens=1))
    with pytest.raises(ValueError, match="unknown stop token"):
        eng.generate([[1, 2]], 1, SamplingParams(max_new_tokens=4, stop_token_ids=(64,)))
    with pytest.raises(ValueError, match="outside"):
        eng.generate([[1, 99]], 1, p)
    with pytest.raises(ValueError, match="n_samples"):
        eng.generate([[1, 2]], 5, p)
    with pytest.raises(ValueError, match="capacity"):
        eng.generate([[1, 2]], 1, SamplingParams(max_new_tokens=17))
    with pytest.raises(ValueError, match="no prompts"):
        eng.generate([], 1, p)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_compiled_step_ignores_the_callers_grad_mode():
    """A policy that is also being trained (requires_grad) must compile for inference: aot_autograd would
    otherwise try to differentiate through the decode kernels."""
    from functools import partial

    from sparrow.attention import DenseAttention

    model = random_tiny("qwen2", attention=partial(DenseAttention, impl="triton")).to(DEVICE)
    model.requires_grad_(True)
    eng = _engine(model, compile=True, compile_backend="aot_eager", max_rows=4)
    eng.generate(_prompts(lens=[5]), 2, SamplingParams(temperature=0.0, max_new_tokens=4))
    assert torch.is_grad_enabled()
    slots = torch.tensor([0, 1, eng.scratch, eng.scratch], device=eng.device)
    eng.compiler.step("decode")(eng.state, slots)  # outside no_grad


def test_alternating_sampling_modes_keep_each_modes_compiled_step():
    """Sampled rollouts and greedy evaluation alternate in GRPO: each mode compiles once and is reused, the
    stop ids of each mode stay its own, and the results equal those of engines that only ever saw one mode."""
    model = random_tiny("qwen2")
    sampled = SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=8, stop_token_ids=(1,), seed=3)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(2, 5))
    eng = _engine(model, max_rows=8, compile=True, compile_backend="eager")
    first = eng.generate(_prompts(), 2, sampled).samples
    step_sampled = eng.compiler.step("decode")
    g1 = eng.generate(_prompts(), 1, greedy).samples
    step_greedy = eng.compiler.step("decode")
    again = eng.generate(_prompts(), 2, sampled).samples
    assert eng.compiler.step("decode") is step_sampled and step_greedy is not step_sampled
    assert eng.state.stop_ids.tolist() == [1] + [-1] * 7
    g2 = eng.generate(_prompts(), 1, greedy).samples
    assert eng.compiler.step("decode") is step_greedy and eng.state.stop_ids.tolist() == [2, 5] + [-1] * 6
    assert eng.sampling_modes == 2 and eng.captured_graphs == 0  # no CUDA graphs off the GPU
    _assert_same(first, _engine(model, max_rows=8).generate(_prompts(), 2, sampled).samples)
    _assert_same(again, first)
    _assert_same(g1, _engine(model, max_rows=8).generate(_prompts(), 1, greedy).samples)
    _assert_same(g2, g1)


def test_stop_sets_share_a_modes_compiled_step():
    """The stop ids live in a padded buffer: another stop set, or none, reuses the mode's compiled step (no
    recompile, no new CUDA graphs), and each run stops exactly where an engine that only saw its set stops.
    More ids than the buffer holds make a mode of their own."""
    model = random_tiny("qwen2")
    eng = _engine(model, max_rows=8, compile=True, compile_backend="eager")
    base = dict(temperature=0.0, max_new_tokens=8)
    free = eng.generate(_prompts(), 1, SamplingParams(**base)).samples  # no stop ids
    step = eng.compiler.step("decode")
    # stop on a token greedy decoding emits after the first one, so the stop set visibly changes the output
    stop = int(free[0].tokens[2])
    stopped = eng.generate(_prompts(), 1, SamplingParams(**base, stop_token_ids=(stop,))).samples
    assert eng.compiler.step("decode") is step and eng.state.stop_ids.tolist() == [stop] + [-1] * (STOP_SLOTS - 1)
    assert stopped[0].tokens.numel() <= 3 and stopped[0].finish_reason == "stop"
    _assert_same(stopped, _engine(model, max_rows=8).generate(
        _prompts(), 1, SamplingParams(**base, stop_token_ids=(stop,))).samples)
    again = eng.generate(_prompts(), 1, SamplingParams(**base)).samples
    assert eng.compiler.step("decode") is step
    _assert_same(again, free)
    many = tuple(range(40, 40 + STOP_SLOTS + 1))
    eng.generate(_prompts(), 1, SamplingParams(**base, stop_token_ids=many))
    assert eng.compiler.step("decode") is not step
    assert eng.state.stop_ids.numel() == stop_slots(len(many)) == 2 * STOP_SLOTS


def test_prepare_compiles_ahead_and_changes_no_result():
    """prepare() runs the decode step of every batch bucket once, on the scratch row alone: a compiled engine
    then generates without compiling anything (an unprepared one compiles inside generate), and its results
    equal those of an engine that was never prepared."""
    from torch._dynamo.utils import counters

    model = random_tiny("qwen2")
    params = SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=8, stop_token_ids=(1,), seed=3)
    torch.compiler.reset()
    fresh = _engine(model, max_rows=8, compile=True, compile_backend="eager")
    counters.clear()
    fresh.generate(_prompts(), 2, params)
    assert counters["stats"]["unique_graphs"] >= 1  # the count sees compilation inside generate
    torch.compiler.reset()
    eng = _engine(model, max_rows=8, compile=True, compile_backend="eager")
    eng.prepare(params)
    counters.clear()
    got = eng.generate(_prompts(), 2, params).samples
    assert counters["stats"]["unique_graphs"] == 0
    _assert_same(got, _engine(model, max_rows=8).generate(_prompts(), 2, params).samples)
    with pytest.raises(TypeError, match="SamplingParams"):
        eng.prepare({"temperature": 1.0})


@pytest.mark.parametrize("shape,n_stop", [((7,), 1), ((3, 5), 11), ((1, 1), 16)], ids=["A", "AxT", "pad-free"])
def test_is_stop_is_membership_and_the_padding_matches_nothing(shape, n_stop):
    """The stop check (a broadcast compare a CUDA graph can capture in eager mode) is ``torch.isin``; the -1 padding
    of the stop buffer never matches a token."""
    g = torch.Generator().manual_seed(n_stop)
    tokens = torch.randint(0, 20, shape, generator=g)
    stop = torch.randperm(20, generator=g)[:n_stop]
    padded = torch.cat([stop, torch.full((stop_slots(n_stop) - n_stop,), -1)])
    assert torch.equal(is_stop(tokens, padded), torch.isin(tokens, stop))
    assert not is_stop(tokens, torch.full((4,), -1)).any()


def test_inductor_options_are_checked_and_reach_the_compiled_steps_and_the_compile_key(monkeypatch):
    """``EngineConfig.inductor_options``: a name Inductor does not have, a non-mapping, or options without Inductor
    fail at construction naming the problem; the options reach ``torch.compile`` beside the engine's own, and
    they are part of the compile key (another option, another cache directory)."""
    with pytest.raises(ValueError, match=r"\['triton.no_such_option'\] are not torch._inductor.config names"):
        EngineConfig(inductor_options={"triton.no_such_option": True})
    nested = EngineConfig(inductor_options={"triton": {"enable_pdl": True}, "max_autotune": False})  # a YAML section
    assert nested.inductor_options == {"triton.enable_pdl": True, "max_autotune": False}
    with pytest.raises(ValueError, match="must be a mapping"):
        EngineConfig(inductor_options=["triton.enable_pdl"])
    with pytest.raises(ValueError, match="need compile_backend='inductor'"):
        EngineConfig(inductor_options={"triton.enable_pdl": True}, compile_backend="eager")

    seen = []
    real = torch.compile

    def spy(fn, **kw):  # record the options, compile with the eager backend (no C++ compiler needed)
        seen.append(kw.get("options"))
        return real(fn, **{**kw, "backend": "eager", "options": None})

    monkeypatch.setattr(torch, "compile", spy)
    model = random_tiny("qwen2", num_layers=1)
    tuned = _engine(model, compile=True, inductor_options={"triton.enable_pdl": True})
    out = tuned.generate(_prompts(), 2, SamplingParams(temperature=1.0, max_new_tokens=4, seed=5))
    ref = _engine(model).generate(_prompts(), 2, SamplingParams(temperature=1.0, max_new_tokens=4, seed=5))
    _assert_same(out.samples, ref.samples)
    assert seen and all(o == {"triton.coalesce_tiling_analysis": False, "triton.enable_pdl": True} for o in seen)
    plain = _engine(model, compile=True)
    assert tuned.compile_key()["engine"] != plain.compile_key()["engine"]
    assert '"triton.enable_pdl": true' in tuned.compile_key()["engine"]


def test_an_engine_without_a_drafter_takes_only_a_toggle_that_never_speculates():
    """``AlwaysOff`` (plain decoding, the baseline of every comparison) goes on an engine without a drafter, at
    construction and by assignment; a toggle that would speculate is refused both ways, leaving the engine as it
    was."""
    from sparrow.speculative import AlwaysOff, AlwaysOn

    model = random_tiny("qwen2", num_layers=1)
    eng = _engine(model)
    with pytest.raises(ValueError, match="only AlwaysOff"):
        RolloutEngine(model, EngineConfig(max_rows=4, compile=False), toggle=AlwaysOn(2))
    off = AlwaysOff()
    assert RolloutEngine(model, EngineConfig(max_rows=4, compile=False), toggle=off).toggle is off
    eng.toggle = off
    assert eng.toggle is off
    with pytest.raises(ValueError, match="a toggle needs a drafter"):
        eng.toggle = AlwaysOn(2)
    assert eng.toggle is off


def test_rows_apart_where_they_share_their_prompts_too_little(monkeypatch):
    """A block whose rows share each prompt fewer than ``CASCADE_MIN_SHARE`` times on average runs inside
    ``per_row_decode`` (the attention op's per-row kernel: every row reads its own prompt), a block of full groups
    the cascade; as a group's samples finish, its later blocks go apart. Tokens equal the reference generator's
    throughout. The counts are the op's own per-row launches, not the engine's flag; on CUDA the batches are wide
    enough (``CASCADE_MIN_ROWS``) that the op would otherwise run the cascade, and its hand-off of narrower buckets
    is counted apart. The eager reference never goes apart."""
    from functools import partial

    import sparrow.kernels.decode_attention.triton_cascade as tc
    from sparrow.attention import DenseAttention
    from sparrow.kernels.decode_attention import CASCADE_MIN_ROWS, CASCADE_MIN_SHARE

    per_row, real = [], tc.decode_attention_triton
    monkeypatch.setattr(tc, "decode_attention_triton", lambda *a, **k: (per_row.append(1), real(*a, **k))[1])
    model = random_tiny("qwen2", std=0.15, attention=partial(DenseAttention, impl="triton")).to(DEVICE)
    layers = len(model.layers)
    cuda = DEVICE.type == "cuda"
    width = CASCADE_MIN_ROWS if cuda else CASCADE_MIN_SHARE  # rows of each generation below
    # without CUDA graphs: the op runs (and is counted) at every step
    eng = _engine(model, max_rows=width, block_steps=1, cuda_graphs=False)

    def launches(gen):  # per-row launches the op makes: the apart steps, and on CUDA every narrow bucket's steps
        narrow = sum(n for b, n in gen.stats.active_hist.items() if cuda and b < CASCADE_MIN_ROWS)
        return layers * (gen.stats.apart_steps + narrow)

    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
    prompts = _prompts(lens=[5, 17, 3, 9] * (width // 4))
    thin = eng.generate(prompts, 1, greedy)  # groups of one
    assert thin.stats.apart_steps == thin.stats.decode_steps > 0 and len(per_row) == launches(thin)
    _assert_same(thin.samples, generate_reference(model, prompts, 1, greedy), lp_tol=1e-4)
    per_row.clear()
    groups = prompts[:width // CASCADE_MIN_SHARE]
    full = eng.generate(groups, CASCADE_MIN_SHARE, greedy)  # full groups: greedy rows end together
    assert full.stats.apart_steps == 0 and full.stats.decode_steps > 0 and not per_row
    for seed in range(2, 40):  # a seed whose rows finish at different steps while the batch is still wide
        params = SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=tuple(range(0, 64, 5)), seed=seed)
        per_row.clear()
        out = eng.generate(groups, CASCADE_MIN_SHARE, params)
        if 0 < out.stats.apart_steps < out.stats.decode_steps:
            break
    assert 0 < out.stats.apart_steps < out.stats.decode_steps and len(per_row) == launches(out)
    _assert_same(out.samples, generate_reference(model, groups, CASCADE_MIN_SHARE, params), lp_tol=1e-4)
    eager = random_tiny("qwen2", attention=partial(DenseAttention, impl="reference")).to(DEVICE)
    assert _engine(eager, max_rows=width, cuda_graphs=False).generate(prompts, 1, greedy).stats.apart_steps == 0

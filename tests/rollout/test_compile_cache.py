"""Start-up: each kind of step compiles once for every batch bucket and draft length, bit for bit what per-bucket
static compiles give; compiled code comes back from the on-disk compile cache of the same key, never another's."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import sparrow
import sparrow.rollout.compiler as compiler_module
import sparrow.rollout.config as config_module
import sparrow.rollout.steps as steps_module
from sparrow.compile_cache import CompileCache, digest, module_signature
from sparrow.rollout import EngineConfig, RolloutEngine, SamplingParams
from sparrow.speculative.drafter import DrafterConfig, QuantizedSelfDrafter
from sparrow.speculative.toggle import AlwaysOn
from tests.helpers import random_tiny

WORKER = Path(__file__).with_name("_compile_worker.py")
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=(1, 2, 3, 4), seed=0)
PROMPTS = [[1, 5, 9], [3, 3, 7, 2], [4], [7, 7, 7, 7, 7]]


@pytest.fixture
def inductor_dirs():
    """Inductor's and Triton's cache directories put back as they were after a test that activates a cache."""
    from torch._inductor.utils import clear_caches

    saved = {name: os.environ.get(name) for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    clear_caches()


class Lengths(AlwaysOn):
    """Speculate always, and name several draft lengths for prepare() to compile."""

    def __init__(self, lengths: tuple[int, ...]) -> None:
        super().__init__(max(lengths))
        self.lengths = lengths

    def draft_lengths(self) -> tuple[int, ...]:
        return self.lengths


def _spec_engine(model, **kw) -> RolloutEngine:
    cfg = dict(max_rows=4, max_prompt_len=16, max_new_tokens=8, block_steps=1, compile=True, compile_backend="eager",
               max_draft=3)
    cfg.update(kw)
    return RolloutEngine(model, EngineConfig(**cfg), drafter=QuantizedSelfDrafter(model, DrafterConfig(weight="int8")),
                         toggle=Lengths((1, 3)))


# ------------------------------------------------------------------------------------------ compile counts
UNBACKED = pytest.mark.skipif(not compiler_module.bounded_unbacked_sizes(),
                              reason="this torch's mark_unbacked takes no bounds (min/max/shape_id, torch >= 2.13): "
                                     "the steps compile with backed dynamic sizes")


@UNBACKED
def test_each_kind_of_step_compiles_once_for_every_bucket_and_draft_length():
    """Buckets 1, 2, 4 and draft lengths 1 and 3 (= max_draft): one decode, one draft and one verify graph, and a
    generation compiles nothing more."""
    model = random_tiny("qwen2", num_layers=1, std=0.1)  # flat distributions: rows stop at different steps
    eng = _spec_engine(model)
    eng.prepare(PARAMS)
    assert eng.compiled_graphs == {"decode": 1, "draft": 1, "verify": 1}
    assert {"setup/compile_decode_s", "setup/compile_draft_s", "setup/compile_verify_s"} <= set(eng.setup_seconds)
    out = eng.generate(PROMPTS, 2, PARAMS)
    assert eng.compiled_graphs == {"decode": 1, "draft": 1, "verify": 1}
    assert out.stats.spec_cycles > 0


def test_backed_sizes_specialise_bucket_one_and_generate_what_the_eager_engine_does(monkeypatch):
    """Negative control of the test above, and what a torch without bounded unbacked sizes gets: backed dynamic
    sizes specialise bucket 1 (0/1) and compile a graph of its own."""
    model = random_tiny("qwen2", num_layers=1, std=0.1)
    monkeypatch.setattr(compiler_module, "bounded_unbacked_sizes", lambda: False)
    backed = RolloutEngine(model, EngineConfig(max_rows=4, max_prompt_len=16, max_new_tokens=8, compile=True,
                                               compile_backend="eager", batch_buckets=(1, 2, 4)))
    backed.prepare(PARAMS)
    assert backed.compiled_graphs == {"decode": 2}  # bucket 1, then one graph for 2 and 4
    got = backed.generate(PROMPTS, 2, PARAMS).samples
    ref = RolloutEngine(model, EngineConfig(max_rows=4, max_prompt_len=16, max_new_tokens=8, compile=False)).generate(
        PROMPTS, 2, PARAMS).samples
    assert [s.tokens.tolist() for s in got] == [s.tokens.tolist() for s in ref]


@pytest.mark.parametrize("bounded", [True, False], ids=["unbacked-sizes", "backed-sizes"])
def test_default_buckets_leave_out_1_only_where_it_would_compile_a_graph_of_its_own(monkeypatch, bounded):
    """With backed dynamic sizes (a torch without bounded unbacked ones) a compiled engine's default buckets start at
    2: one decode graph instead of two, a lone row padded with the scratch row, sampling what an eager engine with
    the same buckets does. Uncompiled, static or explicit buckets keep 1. Negative control: the bucket-1 engine of
    the backed case compiles 2 graphs."""
    monkeypatch.setattr(config_module, "bounded_unbacked_sizes", lambda: bounded)
    assert EngineConfig(max_rows=8).buckets == ((1, 2, 4, 8) if bounded else (2, 4, 8))
    for kw in ({"compile": False}, {"dynamic_batch": False}, {"batch_buckets": (1, 8)}):
        assert EngineConfig(max_rows=8, **kw).buckets[0] == 1, kw
    assert EngineConfig(max_rows=1).buckets == (1,)
    if bounded and not compiler_module.bounded_unbacked_sizes():
        return  # this torch's mark_unbacked takes no bounds: its engines compile with backed sizes only
    monkeypatch.setattr(compiler_module, "bounded_unbacked_sizes", lambda: bounded)
    model = random_tiny("qwen2", num_layers=1, std=0.1)  # flat distributions: rows stop at different steps
    kw = dict(max_rows=4, max_prompt_len=16, max_new_tokens=8, compile_backend="eager")
    eng = RolloutEngine(model, EngineConfig(compile=True, **kw))
    eng.prepare(PARAMS)
    assert eng.compiled_graphs == {"decode": 1}
    ref = RolloutEngine(model, EngineConfig(compile=False, batch_buckets=eng.config.buckets, **kw))
    for prompts, n in ((PROMPTS, 1), (PROMPTS[:1], 1)):  # a full batch, and a lone row (padded up to bucket 2)
        got = eng.generate(prompts, n, PARAMS)
        assert [s.tokens.tolist() for s in got] == [s.tokens.tolist() for s in ref.generate(prompts, n, PARAMS)]
    assert eng.compiled_graphs == {"decode": 1}
    if not bounded:
        torch._dynamo.reset()  # engines of one shape share compiled graphs: count this one's from nothing
        with_one = RolloutEngine(model, EngineConfig(compile=True, batch_buckets=(1, 2, 4), **kw))
        with_one.prepare(PARAMS)
        assert with_one.compiled_graphs == {"decode": 2}


@UNBACKED
def test_a_step_that_cannot_trace_unbacked_sizes_falls_back_to_backed_ones(monkeypatch):
    """Model code that branches on the batch size cannot be traced with an unbacked size: the step warns and
    compiles with backed dynamic sizes (bucket 1 on its own), and generates what the eager engine does."""
    real = steps_module.decode_hidden

    def branching(model, tokens, caches, meta):
        h = real(model, tokens, caches, meta)
        return h * 1.0 if tokens.shape[0] == 1 else h  # a guard on the batch size

    model = random_tiny("qwen2", num_layers=1)
    params = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=(1, 2, 3))
    ref = RolloutEngine(model, EngineConfig(max_rows=4, max_prompt_len=16, max_new_tokens=8, compile=False)).generate(
        PROMPTS, 1, params)
    monkeypatch.setattr(steps_module, "decode_hidden", branching)
    eng = RolloutEngine(model, EngineConfig(max_rows=4, max_prompt_len=16, max_new_tokens=8, compile=True,
                                            compile_backend="eager"))
    with pytest.warns(RuntimeWarning, match="cannot be compiled with unbacked"):
        eng.prepare(params)
    assert eng.compiled_graphs == {"decode": 2}  # bucket 1, and one graph for buckets 2 and 4
    got = eng.generate(PROMPTS, 1, params)
    assert [s.tokens.tolist() for s in got] == [s.tokens.tolist() for s in ref]


# ------------------------------------------------------------------------------ the on-disk cache, Inductor
def _worker(cache: Path, modes: str, out: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if not torch.cuda.is_available():
        # scalar C++ kernels: a third of the compile time on 2 cores (the comparison still covers Inductor's
        # fusion and loops with symbolic against static sizes, not its choice of vector width)
        env["TORCHINDUCTOR_VEC_ISA_OK"] = "0"
    r = subprocess.run([sys.executable, str(WORKER), str(cache), modes, str(out)], capture_output=True, text=True,
                       env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_a_second_process_loads_compiled_code_and_static_compiles_give_the_same_bits(tmp_path):
    """With Inductor, in fresh processes: the dynamic engine compiles one decode graph for buckets 1 and 2 (an
    empty cache: misses); a static engine (another key, so another directory: misses, never the dynamic one's
    entries) compiles one per bucket, and both sample the same tokens with the same log-prob bits; a second process
    of the dynamic key finds its graph on disk (hits, no miss) and samples the same bits."""
    cache = tmp_path / "cache"
    cold = _worker(cache, "dynamic,static", tmp_path / "cold.json")
    dyn, static = cold["dynamic"], cold["static"]
    assert dyn["buckets"] == [1, 2] and static["buckets"] == [1, 2]  # both buckets ran
    one = 1 if compiler_module.bounded_unbacked_sizes() else 2  # backed sizes: bucket 1 specialises
    assert dyn["compiled_graphs"] == {"decode": one} and static["compiled_graphs"] == {"decode": 2}
    for r in (dyn, static):
        assert r["lookups"]["fxgraph_cache_miss"] >= 1 and r["lookups"]["fxgraph_cache_hit"] == 0
    assert dyn["tokens"] == static["tokens"] and dyn["logprob_bits"] == static["logprob_bits"]
    keys = sorted(cache.glob("compile/*/key.json"))
    assert len(keys) == 2  # one directory per compile key
    assert {json.loads(k.read_text())["key"]["engine"].count('"dynamic_batch": true') for k in keys} == {0, 1}

    warm = _worker(cache, "dynamic", tmp_path / "warm.json")["dynamic"]
    assert warm["lookups"]["fxgraph_cache_hit"] >= 1 and warm["lookups"]["fxgraph_cache_miss"] == 0
    assert warm["setup_seconds"]["setup/fxgraph_cache_hit"] >= 1
    assert warm["compiled_graphs"] == {"decode": one}
    assert warm["tokens"] == dyn["tokens"] and warm["logprob_bits"] == dyn["logprob_bits"]


# ------------------------------------------------------------------------------------------------- keys
KEYS = st.dictionaries(st.text(min_size=1, max_size=8).filter(lambda k: k not in ("torch", "cuda", "triton",
                                                                                  "sparrow", "device")),
                       st.text(max_size=12), min_size=1, max_size=6)


def _separates(make, key: dict, name: str, value: str) -> bool:
    """Whether ``make(key)`` and ``make(key with name = value)`` name different directories (when they differ)."""
    other = {**key, name: value}
    return other == key or make(key).path != make(other).path


@settings(max_examples=30, deadline=None)
@given(key=KEYS, data=st.data())
def test_a_changed_key_is_another_directory_and_the_same_key_the_same(tmp_path_factory, key, data):
    root = tmp_path_factory.getbasetemp() / "keys"
    make = partial(CompileCache, root)
    assert make(key).path == make(dict(reversed(list(key.items())))).path  # order does not matter
    name = data.draw(st.sampled_from(sorted(key)))
    assert _separates(make, key, name, data.draw(st.text(max_size=12)))
    assert make(key).path.parent == root / "compile"


def test_the_key_check_catches_a_cache_that_ignores_a_field(tmp_path):
    """Negative control: a cache whose directory leaves one field out of the digest fails the property."""

    class Lossy(CompileCache):
        @property
        def digest(self) -> str:
            return digest({k: v for k, v in self.key.items() if k != "model"})

    key = {"model": "a", "engine": "b"}
    assert _separates(partial(CompileCache, tmp_path), key, "model", "c")
    assert not _separates(partial(Lossy, tmp_path), key, "model", "c")


def test_library_versions_and_device_are_part_of_every_key(tmp_path, monkeypatch):
    base = CompileCache(tmp_path, {"model": "m"})
    assert {"torch", "cuda", "triton", "sparrow", "device"} <= set(base.key)
    monkeypatch.setattr(sparrow, "__version__", "9.9.9")
    assert CompileCache(tmp_path, {"model": "m"}).path != base.path
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    assert CompileCache(tmp_path, {"model": "m"}).path != base.path


def test_compile_cache_validates_its_arguments(tmp_path):
    with pytest.raises(TypeError, match="root must be a path"):
        CompileCache(3, {"a": "b"})
    with pytest.raises(ValueError, match="must not be empty"):
        CompileCache("", {"a": "b"})
    with pytest.raises(TypeError, match="mapping with string names"):
        CompileCache(tmp_path, {1: "b"})
    with pytest.raises(ValueError, match="sets itself"):
        CompileCache(tmp_path, {"torch": "2.0"})
    with pytest.raises(ValueError, match="compile_cache must be a directory path"):
        EngineConfig(compile_cache="")
    assert EngineConfig(compile_cache=tmp_path).compile_cache == str(tmp_path)


def test_activate_points_inductor_and_triton_at_the_keys_directory(tmp_path, inductor_dirs, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    a, b = CompileCache(tmp_path, {"model": "a"}), CompileCache(tmp_path, {"model": "b"})
    assert not a.warm
    assert a.activate() == a.path
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(a.path / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(a.path / "triton")
    assert json.loads((a.path / "key.json").read_text())["key"] == a.key
    b.activate()  # another key: both directories move (the Triton one was ours)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(b.path / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(b.path / "triton")
    mine = str(tmp_path / "my_triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", mine)  # a user's own choice is kept
    a.activate()
    assert os.environ["TRITON_CACHE_DIR"] == mine and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(a.path / "inductor")
    (a.path / "key.json").write_text(json.dumps({"key": {"model": "z"}}))  # entries made for another key
    with pytest.raises(RuntimeError, match="another key"):
        CompileCache(tmp_path, {"model": "a"}).activate()


def test_the_engines_compile_key_follows_what_the_steps_depend_on():
    from sparrow.attention.rtpurbo import RTPurboConfig, rtpurbo_attention
    from sparrow.models import use_attention

    model = random_tiny("qwen2", num_layers=1)
    cfg = dict(max_rows=4, max_prompt_len=16, max_new_tokens=8, compile=False)

    def key(m=model, drafter=None, **kw):
        c = {**cfg, **kw, "max_draft": 2 if drafter else 0}
        return digest(RolloutEngine(m, EngineConfig(**c), drafter=drafter).compile_key())

    base = key()
    assert key(random_tiny("qwen2", num_layers=1, seed=5)) == base  # weights are inputs, not part of the code
    same = {key(block_steps=3), key(prefill_tokens=64), key(progress=True), key(compile_cache="elsewhere")}
    assert same == {base}
    small = dict(decode_block=16, prefill_block=16, ret_window=16, ring_slack=4)
    sparse = [use_attention(copy.deepcopy(model), rtpurbo_attention(None, None, RTPurboConfig(**small, window=w)))
              for w in (8, 16)]
    variants = [key(batch_buckets=(2, 4)), key(dynamic_batch=False), key(max_rows=8), key(copy.deepcopy(model).to(torch.bfloat16)),
                key(random_tiny("qwen2", num_layers=1, intermediate_dim=96)), key(sparse[0]), key(sparse[1]),
                key(drafter=QuantizedSelfDrafter(model, DrafterConfig(weight="int8"))),
                key(drafter=QuantizedSelfDrafter(model, DrafterConfig(weight="int8", window=8)))]
    assert len({base, *variants}) == len(variants) + 1


def test_module_signature_reads_settings_shapes_and_dtypes_not_values():
    a, b = random_tiny("qwen2", num_layers=1), random_tiny("qwen2", num_layers=1, seed=3)
    assert module_signature(a) == module_signature(b)
    eps = copy.deepcopy(a)
    eps.norm.eps = 1e-3  # a setting baked into the compiled code
    wider = random_tiny("qwen2", num_layers=1, embed_dim=96)
    assert len({module_signature(a), module_signature(eps), module_signature(wider),
                module_signature(copy.deepcopy(a).to(torch.float64))}) == 4


def test_prepare_records_its_phases_without_compiling(tmp_path):
    """Without compilation prepare's first runs are warm-up; the engine's compile cache still names the
    calibrations' folder (nothing is activated, nothing written)."""
    eng = RolloutEngine(random_tiny("qwen2", num_layers=1),
                        EngineConfig(max_rows=2, max_prompt_len=8, max_new_tokens=4, compile=False,
                                     compile_cache=str(tmp_path)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        eng.prepare(PARAMS)
    assert set(eng.setup_seconds) == {"setup/warmup_s"} and eng.compiled_graphs == {}
    assert eng.compile_cache.costs_dir == tmp_path / "costs" and not any(tmp_path.iterdir())


def test_engines_of_other_shapes_in_one_process_compile_past_dynamos_default_limit(monkeypatch):
    """Dynamo counts its recompile limit per code object, and every engine's decode step is one: engines of other
    shapes (a benchmark's three engines and their breakdown engines passed the default 8) share that count. The
    engine's limit covers them: here two engines of 2 decode graphs each (backed sizes) under a default of 2, each
    sampling what its eager twin does. Negative control: with the engine's limit at 2 the second engine fails."""
    model = random_tiny("qwen2", num_layers=1)
    monkeypatch.setattr(compiler_module, "bounded_unbacked_sizes", lambda: False)  # 2 graphs: bucket 1, buckets 2 and 4
    monkeypatch.setattr(compiler_module, "RECOMPILE_LIMIT", compiler_module.RECOMPILE_LIMIT)  # restored after

    def engine(prompt_len: int, compile: bool = True) -> RolloutEngine:
        return RolloutEngine(model, EngineConfig(max_rows=4, max_prompt_len=prompt_len, max_new_tokens=8,
                                                 compile=compile, compile_backend="eager", batch_buckets=(1, 2, 4)))

    with torch._dynamo.config.patch(recompile_limit=2):  # (a monkeypatch's undo deletes a config entry)
        for prompt_len in (16, 24):  # other cache shapes: graphs of their own
            eng = engine(prompt_len)
            eng.prepare(PARAMS)
            assert eng.compiled_graphs == {"decode": 2}
            ref = engine(prompt_len, compile=False).generate(PROMPTS, 2, PARAMS)
            assert [s.tokens.tolist() for s in eng.generate(PROMPTS, 2, PARAMS)] == [s.tokens.tolist() for s in ref]

        torch._dynamo.reset()
        compiler_module.RECOMPILE_LIMIT = 2
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
            for prompt_len in (16, 24):
                engine(prompt_len).prepare(PARAMS)
    torch._dynamo.reset()

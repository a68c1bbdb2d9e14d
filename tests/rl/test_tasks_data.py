import json

import pytest

from sparrow.rl import (
    CharTokenizer,
    CombinedReward,
    ExactMatch,
    FormatReward,
    KVListRetrieval,
    KVRetrieval,
    ListSource,
    MathAnswer,
    NeedleQA,
    TaskSource,
    VariableTracking,
    extract_final_answer,
    prompt_loader,
    read_jsonl,
)

TASKS = [KVRetrieval(context_len=200), VariableTracking(context_len=300, hops=3), NeedleQA(context_len=400),
         KVListRetrieval(context_len=300, max_asked=8)]


@pytest.mark.parametrize("task", TASKS, ids=lambda t: type(t).__name__)
def test_tasks_are_deterministic_exact_length_and_answerable(task):
    tok = CharTokenizer()
    a, b = task.example(3, 17), task.example(3, 17)
    assert a == b and task.example(4, 17) != a
    for i in range(20):
        ex = task.example(0, i)
        assert len(ex.prompt) == task.context_len
        assert tok.decode(tok.encode(ex.prompt)) == ex.prompt
        assert ex.answer.replace(";", "").isdigit()


def test_answers_follow_from_the_context():
    kv = KVRetrieval(context_len=150).example(0, 5)
    body, q = kv.prompt.split("?")
    assert f"{q}{kv.answer};" in body
    vt = VariableTracking(context_len=300, hops=3, chains=2).example(1, 2)
    body, q = vt.prompt.split("?")
    assign = dict(s.split("=") for s in body.replace(".", "").split(";") if s)
    v = q.rstrip("=")
    while not assign[v].isdigit():
        v = assign[v]
    assert assign[v] == vt.answer


def test_kv_list_answers_follow_from_the_context_with_a_long_tail():
    task = KVListRetrieval(context_len=400, max_asked=16, tail=1.5)
    sizes = []
    for i in range(400):
        ex = task.example(2, i)
        body, q = ex.prompt.split("?")
        keys, values = q.rstrip("=").split(","), ex.answer.split(";")
        assert len(keys) == len(values) == len(set(keys)) and len(keys) <= task.most_asked
        assert all(f"{k}={v};" in body for k, v in zip(keys, values))
        sizes.append(len(keys))
    # a long tail: mostly one key, some asking for many
    assert sizes.count(1) > len(sizes) / 3 and max(sizes) >= 8
    assert KVListRetrieval(context_len=40).most_asked == 3  # what fits: 3 pairs and a 3-key question


def test_bad_task_configs():
    with pytest.raises(ValueError, match="too short"):
        KVRetrieval(context_len=10)
    with pytest.raises(ValueError, match="too short"):
        VariableTracking(context_len=20, hops=5)
    with pytest.raises(ValueError, match="too short"):
        KVListRetrieval(context_len=10)
    with pytest.raises(ValueError, match="tail"):
        KVListRetrieval(tail=-1.0)
    with pytest.raises(ValueError, match="alphabet"):
        CharTokenizer().encode("héllo")


def test_loader_resumes_exactly():
    tok = CharTokenizer()
    loader = prompt_loader(TaskSource(KVRetrieval(context_len=64), seed=1), tok, batch_size=3, max_prompt_len=65)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    expect = [next(it) for _ in range(2)]
    loader2 = prompt_loader(TaskSource(KVRetrieval(context_len=64), seed=1), tok, batch_size=3, max_prompt_len=65)
    loader2.load_state_dict(state)
    it2 = iter(loader2)
    assert [next(it2) for _ in range(2)] == expect


def test_prompt_longer_than_the_context_is_an_error():
    loader = prompt_loader(TaskSource(KVRetrieval(context_len=64)), CharTokenizer(), batch_size=2, max_prompt_len=32)
    with pytest.raises(ValueError, match="longer than max_prompt_len"):
        next(iter(loader))


def test_jsonl(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in [{"prompt": "what is 2+2?", "answer": 4},
                                                    {"prompt": "1+1?", "answer": "2"}]))
    rows = read_jsonl(p)
    assert [r.answer for r in rows] == ["4", "2"]
    src = ListSource(rows, seed=0)
    src.reset()
    first_epoch = {src.next().answer for _ in range(2)}
    assert first_epoch == {"4", "2"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "answer": "1"}\n{"prompt": "no answer"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: row has no 'answer'"):
        read_jsonl(bad)
    bad.write_text('{"prompt": "x"')
    with pytest.raises(ValueError, match="not valid JSON"):
        read_jsonl(bad)
    with pytest.raises(FileNotFoundError):
        read_jsonl(tmp_path / "missing.jsonl")


def test_rewards():
    assert ExactMatch()("123", " 123 ") == 1.0 and ExactMatch()("123", "124") == 0.0
    assert extract_final_answer(r"so \boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert MathAnswer()("42", r"the answer is \boxed{42.0}") == 1.0
    assert MathAnswer()("42", "<answer> 42 </answer>") == 1.0
    assert MathAnswer()("42", "42") == 0.0
    fmt = FormatReward("answer_tags", 0.2)
    assert fmt("1", "<answer>7</answer>") == 0.2 and fmt("1", "7") == 0.0
    both = CombinedReward([MathAnswer(), FormatReward("answer_tags", 0.1)], [1.0, 0.5])
    assert both("7", "<answer>7</answer>") == pytest.approx(1.05)
    from sparrow.rl import CharAccuracy

    assert CharAccuracy()("1234", "1234") == 1.0 and CharAccuracy()("1234", "1299") == 0.5
    assert CharAccuracy()("12", "1234") == 0.5 and CharAccuracy()("12", "") == 0.0
    with pytest.raises(ValueError, match="weights"):
        CombinedReward([MathAnswer()], [1.0, 2.0])
    # as a recipe's YAML lists them: component configs
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"components": [{"_component_": "sparrow.rl.MathAnswer"},
                                           {"_component_": "sparrow.rl.FormatReward", "style": "boxed"}]})
    from_yaml = CombinedReward(cfg.components)
    assert from_yaml("7", r"\boxed{7}") == pytest.approx(1.1) and from_yaml("7", r"\boxed{8}") == pytest.approx(0.1)
    with pytest.raises(ValueError, match="_component_"):
        CombinedReward([{"style": "boxed"}])
    with pytest.raises(ValueError, match="must be rewards"):
        CombinedReward([3])


import re  # noqa: E402

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from sparrow.rl.tokenizer import CHARS, SPECIALS  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.sampled_from(CHARS + CHARS.upper() + "#é\t{"), max_size=60),
       bos=st.booleans(), eos=st.booleans())
def test_encode_is_the_per_character_map(text, bos, eos):
    """The one-pass encode equals the per-character dictionary it replaces, and refuses exactly the texts
    with a character outside the alphabet, naming the first one."""
    tok = CharTokenizer()
    table = {c: i + len(SPECIALS) for i, c in enumerate(CHARS)}
    bad = [c for c in text.lower() if c not in table]
    if bad:
        with pytest.raises(ValueError, match=re.escape(f"character {bad[0]!r}")):
            tok.encode(text, add_bos=bos, add_eos=eos)
        return
    want = [tok.bos_id] * bos + [table[c] for c in text.lower()] + [tok.eos_id] * eos
    assert tok.encode(text, add_bos=bos, add_eos=eos) == want

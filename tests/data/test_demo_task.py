"""The demo task: seeded problems, short prompts, worked solutions, files and the char tokenizer."""

import json

import pytest

from jaxrl4llm.data import (
    build_char_tokenizer,
    demo_solution,
    format_prompt,
    load_problems,
    make_demo_problems,
    write_demo_task,
)
from jaxrl4llm.rewards import batch_math_reward, extract_answer


def test_seeded_and_controllable():
    a = make_demo_problems(20, seed=7, digits=3, ops="+-*", steps=2)
    b = make_demo_problems(20, seed=7, digits=3, ops="+-*", steps=2)
    assert a == b
    assert a != make_demo_problems(20, seed=8, digits=3, ops="+-*", steps=2)
    assert all(p.problem.count(".") == 3 for p in a)  # start sentence + two steps
    one_digit = make_demo_problems(50, seed=0, digits=1, ops="+")
    assert all(int(p.answer) <= 18 for p in one_digit)


@pytest.mark.parametrize("ops, steps", [("+", 1), ("-", 1), ("*", 1), ("+-", 2), ("+-*", 3)])
def test_answers_are_exact_nonnegative_integers(ops, steps):
    for p in make_demo_problems(200, seed=1, ops=ops, steps=steps):
        assert int(p.answer) >= 0 and str(int(p.answer)) == p.answer


def test_prompts_and_solutions_are_short():
    for p in make_demo_problems(200, seed=0):  # default difficulty: 2 digits, +-, 1 step
        assert 40 <= len(format_prompt(p, "demo")) <= 80
        assert len(demo_solution(p)) <= 30
    p = make_demo_problems(1, seed=0, steps=1, ops="+")[0]
    a, b = [int(x) for x in p.problem.split() if x.rstrip(".").isdigit()]
    assert demo_solution(p) == rf"{a}+{b}={a + b} \boxed{{{a + b}}}"


def test_solutions_pass_the_same_verifier():
    problems = make_demo_problems(300, seed=3, digits=3, ops="+-*", steps=3)
    solutions = [demo_solution(p) for p in problems]
    assert batch_math_reward(solutions, [p.answer for p in problems]) == [1.0] * len(problems)
    assert batch_math_reward(["1+1=2 \\boxed{2}"], [str(int(problems[0].answer) + 1)]) == [0.0]
    assert extract_answer(solutions[0]) == problems[0].answer


def test_write_demo_task_layout(tmp_path):
    paths = write_demo_task(tmp_path, num_train=50, num_test=20, seed=0)
    train, test = load_problems(paths["train"]), load_problems(paths["test"])
    assert len(train) == 50 and len(test) == 20
    assert not {p.problem for p in train} & {p.problem for p in test}
    record = json.loads(open(paths["test"]).readline())
    assert {"problem", "answer", "id", "solution"} <= set(record)
    assert record["solution"] == demo_solution(record["problem"])


def test_bad_settings_are_clear_errors():
    with pytest.raises(ValueError, match="ops"):
        make_demo_problems(1, ops="/")
    with pytest.raises(ValueError, match="steps"):
        make_demo_problems(1, steps=5)
    with pytest.raises(ValueError, match="not a demo problem"):
        demo_solution("What is 2+2?")


def test_char_tokenizer_roundtrip(tmp_path, char_tokenizer):
    tok = char_tokenizer
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<|pad|>", "<|bos|>", "<|endoftext|>")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    text = "Q: Ann has 12 pens. Gets 30 more. How many?\nA: 12+30=42 \\boxed{42}"
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text) and tok.unk_token_id not in ids
    assert tok.decode(ids) == text
    with_eos = tok(text + tok.eos_token)["input_ids"]
    assert with_eos[-1] == tok.eos_token_id and len(with_eos) == len(text) + 1
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "user: hi\nassistant:"
    assert len(tok) < 120
    assert (tmp_path / "x").exists() is False  # nothing written outside the tokenizer folder
    path = build_char_tokenizer(tmp_path / "tok")
    assert (tmp_path / "tok" / "tokenizer.json").is_file() and path.endswith("tok")


def test_write_demo_task_script_writes_the_asked_difficulty_and_rejects_bad_settings(tmp_path, capsys):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "write_demo_task.py"
    spec = importlib.util.spec_from_file_location("write_demo_task_script", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main([str(tmp_path), "--digits", "1", "--steps", "1", "--num-train", "20", "--num-test", "5"])
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 20 and all(r["steps"] == 1 and r["digits"] == 1 for r in rows)
    assert len((tmp_path / "test.jsonl").read_text().splitlines()) == 5
    with pytest.raises(SystemExit):
        script.main([str(tmp_path), "--digits", "7"])
    assert "digits must be in 1..4, got 7" in capsys.readouterr().err

"""load_problems on the community layouts (MATH-500, GSM8K, AMC, AIME) and on bad input."""

import json

import pytest

from jaxrl4llm.data import Problem, format_gold, load_problems


def test_math500(shared_data):
    problems = load_problems(shared_data / "math500_test.jsonl")
    assert len(problems) == 500
    first = problems[0]
    assert isinstance(first, Problem)
    assert first.answer == r"\left( 3, \frac{\pi}{2} \right)"
    assert first.id == "test/precalculus/807.json"
    assert first.problem.startswith("Convert the point")
    assert first.metadata["level"] == 2 and "solution" in first.metadata


def test_gsm8k_hash_answers(shared_data):
    problems = load_problems(shared_data / "gsm8k_test.jsonl")
    assert len(problems) == 1319
    assert problems[0].answer == "18"
    assert all("####" not in p.answer and p.answer for p in problems)
    assert problems[0].problem.startswith("Janet")  # the "question" field


def test_amc_numeric_gold_becomes_clean_string(shared_data):
    problems = load_problems(shared_data / "amc23_test.jsonl")
    assert len(problems) == 40
    assert problems[0].answer == "27"
    assert all(not p.answer.endswith(".0") for p in problems)


def test_aime(shared_data):
    problems = load_problems(shared_data / "aime24_test.jsonl")
    assert len(problems) == 30 and problems[0].answer == "204"


def test_solution_only_uses_the_boxed_answer(tmp_path):
    path = tmp_path / "math.jsonl"
    rows = [{"problem": "1+1?", "solution": r"We add: $1+1=\boxed{2}$."},
            {"problem": "Half of 1?", "solution": r"It is $\boxed{\frac{1}{2}}$."}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    problems = load_problems(path)
    assert [p.answer for p in problems] == ["2", r"\frac{1}{2}"]
    assert [p.id for p in problems] == ["math-0", "math-1"]


def test_json_parquet_and_folder_splits(tmp_path):
    import datasets

    rows = {"question": ["What is 2+3?", "What is 4*5?"], "final_answer": [5, 20.0]}
    (tmp_path / "train.json").write_text(json.dumps([{"question": q, "final_answer": a} for q, a in
                                                      zip(rows["question"], rows["final_answer"])]))
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "test.parquet"))
    from_json = load_problems(tmp_path / "train.json")
    from_parquet = load_problems(tmp_path, split="test")
    assert [p.answer for p in from_json] == ["5", "20"] == [p.answer for p in from_parquet]
    assert load_problems(tmp_path)[0].problem == "What is 2+3?"  # folder default: test split


def test_explicit_keys(tmp_path):
    path = tmp_path / "custom.jsonl"
    path.write_text(json.dumps({"q": "2+2?", "gold": "4", "answer": "wrong field"}))
    problems = load_problems(path, problem_key="q", answer_key="gold")
    assert problems[0].problem == "2+2?" and problems[0].answer == "4"


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_problems(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError, match="no validation split"):
        load_problems(tmp_path, split="validation")


def test_missing_fields_list_the_available_ones(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"text": "2+2?", "result": "4"}))
    with pytest.raises(KeyError, match=r"no problem field.*available fields: \['text', 'result'\].*problem_key"):
        load_problems(path)
    with pytest.raises(KeyError, match=r"no answer field.*available fields.*answer_key"):
        load_problems(path, problem_key="text")
    with pytest.raises(KeyError, match=r"'gold' not found; available fields"):
        load_problems(path, problem_key="text", answer_key="gold")


def test_empty_answer_names_the_row(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text(json.dumps({"problem": "a", "answer": "1"}) + "\n" + json.dumps({"problem": "b", "answer": ""}))
    with pytest.raises(ValueError, match="row 1"):
        load_problems(path)


@pytest.mark.parametrize("value, text", [(27.0, "27"), (0.5, "0.5"), (3, "3"), ("  12 ", "12"),
                                         ("Step...\n#### 1,000", "1,000")])
def test_format_gold(value, text):
    assert format_gold(value) == text


def test_format_gold_rejects_nonsense():
    with pytest.raises(ValueError):
        format_gold(True)
    with pytest.raises(ValueError):
        format_gold(float("nan"))


def test_broken_file_is_a_clear_error(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"problem": "a", "answer": 5}\n{"problem": "b", "answer": \n')
    with pytest.raises(ValueError, match=r"could not read .*broken.jsonl.*one JSON object"):
        load_problems(path)


def test_mixed_answer_types(tmp_path):
    path = tmp_path / "mixed.jsonl"
    path.write_text('{"problem": "a", "answer": 5}\n{"problem": "b", "answer": "x+1"}\n')
    assert [p.answer for p in load_problems(path)] == ["5", "x+1"]

"""load_problems on the community layouts (MATH-500, GSM8K, AMC, AIME; TRL's and verl's chat
prompts; Hub datasets) and on bad input."""

import json

import pytest

from jaxrl4llm.data import Problem, format_gold, load_problems
from tests.hub_cache import offline_hub  # noqa: F401 (a fixture)


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


# --- The study's other benchmarks and GSM8K train (files in ../shared/data, never in the repo) ---


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _last_boxed(text):
    """The content of the last \\boxed{...} (nested braces), written independently of the verifier."""
    start = text.rindex("\\boxed{") + len("\\boxed{")
    depth, i = 1, start
    while depth:
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        i += 1
    return text[start : i - 1]


@pytest.mark.parametrize("name, rows", [("math500_test.jsonl", 500), ("aime24_test.jsonl", 30),
                                        ("amc23_test.jsonl", 40), ("olympiadbench_test.jsonl", 675),
                                        ("minerva_math_test.jsonl", 272), ("gsm8k_test.jsonl", 1319),
                                        ("gsm8k_train.jsonl", 7473)])
def test_every_shared_file_loads_every_row(shared_data, name, rows):
    path = shared_data / name
    problems = load_problems(path)  # no extra arguments
    assert len(problems) == len(_rows(path)) == rows
    assert all(p.problem.strip() and p.answer.strip() for p in problems)
    assert len({p.id for p in problems}) == rows


def test_olympiadbench(shared_data):
    path = shared_data / "olympiadbench_test.jsonl"
    rows, problems = _rows(path), load_problems(path)
    assert problems[0].answer == rows[0]["final_answer"][0] == "2"
    assert problems[0].problem == rows[0]["question"] and problems[0].id == "1606"
    assert problems[1].answer == r"\frac{1}{2 n+2}"  # "$\frac{1}{2 n+2}$" without the delimiters
    for row, problem in zip(rows, problems):
        assert len(row["final_answer"]) == 1 and "$" not in problem.answer
        assert problem.answer == row["final_answer"][0].replace("$,$", ", ").replace("$", "").strip()
        assert problem.metadata["answer_type"] == row["answer_type"] and "solution" in problem.metadata
    by_raw = {r["final_answer"][0]: p.answer for r, p in zip(rows, problems)}
    assert by_raw["$69$,$84$"] == "69, 84"  # one element holding two math spans


def test_olympiadbench_golds_grade_like_the_raw_field(shared_data):
    from jaxrl4llm.rewards import math_equal

    path = shared_data / "olympiadbench_test.jsonl"
    for row, problem in zip(_rows(path), load_problems(path)):
        assert math_equal(problem.answer, row["final_answer"][0]), (row["id"], problem.answer)


def test_context_is_prepended(tmp_path):
    path = tmp_path / "olympiad_like.jsonl"
    rows = [{"id": 1, "context": "Let $f(x)=x^2$.", "question": "Find $f(3)$.", "final_answer": ["$9$"]},
            {"id": 2, "context": None, "question": "Find $2+2$.", "final_answer": ["$4$"]},
            {"id": 3, "context": "  ", "question": "Find $1+2$.", "final_answer": ["$3$", "$x$"]}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    problems = load_problems(path)
    assert problems[0].problem == "Let $f(x)=x^2$.\n\nFind $f(3)$."
    assert [p.problem for p in problems[1:]] == ["Find $2+2$.", "Find $1+2$."]
    assert [p.answer for p in problems] == ["9", "4", "3, x"]


def test_minerva_gold_is_the_last_box(shared_data):
    path = shared_data / "minerva_math_test.jsonl"
    rows, problems = _rows(path), load_problems(path)
    assert "answer" not in rows[0]
    assert problems[0].answer == _last_boxed(rows[0]["solution"]) == "1.6"
    assert problems[1].answer == "4.5e33"
    assert all(p.answer == _last_boxed(r["solution"]).strip() for r, p in zip(rows, problems))
    assert problems[0].metadata["solution"] == rows[0]["solution"] and problems[0].id == "0"


def test_gsm8k_train(shared_data):
    problems = load_problems(shared_data / "gsm8k_train.jsonl")
    assert len(problems) == 7473
    assert problems[0].answer == "72" and problems[1].answer == "10"
    assert problems[0].problem.startswith("Natalia sold clips") and problems[0].id == "gsm8k_train-0"
    assert all("####" not in p.answer for p in problems)


@pytest.mark.parametrize("value, text", [(["$2$"], "2"), (["$2^{1009}$"], "2^{1009}"), (["$69$,$84$"], "69, 84"),
                                         (["1,3,5"], "1,3,5"), (["$3$", "$5$"], "3, 5"), ([27.0], "27"),
                                         ([r"\$5"], r"\$5"), ([], "")])
def test_format_gold_lists(value, text):
    assert format_gold(value) == text


def test_empty_final_answer_list_names_the_row(tmp_path):
    path = tmp_path / "empty_list.jsonl"
    path.write_text(json.dumps({"question": "a", "final_answer": ["$1$"]}) + "\n"
                    + json.dumps({"question": "b", "final_answer": []}))
    with pytest.raises(ValueError, match="row 1"):
        load_problems(path)


# --- The peers' layouts (TRL, verl), dotted keys, rows without a gold answer, Hub datasets ---

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _verl_rows():
    """verl's parquet layout (examples/data_preprocess/gsm8k.py)."""
    return [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i}+1?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
             "extra_info": {"split": "train", "index": i}} for i in range(3)]


def test_a_prompt_of_chat_messages_is_kept_as_messages(tmp_path):
    """TRL's layout: `prompt` holds chat messages (it was 'an empty field' before), `solution` the answer."""
    path = _jsonl(tmp_path / "trl.jsonl", [{"prompt": CHAT, "solution": "5"},
                                           {"prompt": [{"role": "user", "content": "x?"}], "solution": "\\frac{1}{2}"}])
    first, second = load_problems(path)
    assert first.messages == tuple(CHAT) and first.problem == "What is 2+3?" and first.answer == "5"
    assert second.answer == "\\frac{1}{2}"  # a one-line solution without \boxed is the answer itself
    assert "prompt" not in first.metadata


def test_verl_layout_reads_the_nested_ground_truth(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(_verl_rows()), path)
    for answer_key in (None, "reward_model.ground_truth"):  # found automatically, or named
        problems = load_problems(path, answer_key=answer_key)
        assert [p.answer for p in problems] == ["1", "2", "3"]
        assert problems[2].messages == ({"role": "user", "content": "What is 2+1?"},)
        assert problems[0].metadata["extra_info"] == {"split": "train", "index": 0}
    with pytest.raises(KeyError, match=r"'reward_model.truth' not found"):
        load_problems(path, answer_key="reward_model.truth")


def test_a_list_that_is_no_chat_names_the_row_the_key_and_the_fix(tmp_path):
    path = _jsonl(tmp_path / "bad.jsonl", [{"prompt": CHAT, "answer": "5"}, {"prompt": ["2+3?"], "answer": "5"},
                                           {"prompt": 7, "answer": "1"}])
    with pytest.raises(ValueError, match=r"row 1's 'prompt' field is a list whose item 0 \('2\+3\?'\) is not a chat "
                                         r"message .* a prompt is a string or a list of chat messages"):
        load_problems(path)
    path = _jsonl(tmp_path / "bad2.jsonl", [{"prompt": 7, "answer": "1"}])
    with pytest.raises(ValueError, match=r"row 0's 'prompt' field is '7' \(int\), not a string or a list of chat"):
        load_problems(path)


def test_rows_without_a_gold_answer_when_none_is_required(tmp_path):
    path = _jsonl(tmp_path / "open.jsonl", [{"prompt": CHAT}, {"prompt": "Write a haiku."}])
    with pytest.raises(KeyError, match="no answer field"):
        load_problems(path)
    assert [(p.problem, p.answer) for p in load_problems(path, require_answer=False)] == \
        [("What is 2+3?", ""), ("Write a haiku.", "")]


def test_jsonl_is_read_without_datasets(tmp_path, monkeypatch):
    """datasets (and pyarrow) load only for parquet files and Hub datasets."""
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` fails
    path = _jsonl(tmp_path / "a.jsonl", [{"problem": "a", "answer": 5}, {"problem": "b", "answer": "x", "id": "q"}])
    problems = load_problems(path)
    assert [(p.answer, p.id) for p in problems] == [("5", "a-0"), ("x", "q")]
    assert problems[0].metadata == {"id": None}  # a field another row has is None here, as datasets reads it
    (tmp_path / "b.json").write_text(json.dumps([{"question": "c", "answer": 1.0}]))
    assert load_problems(tmp_path / "b.json")[0].answer == "1"


def test_hub_dataset_names():
    from jaxrl4llm.data.problems import parse_hub_dataset, source_name

    assert parse_hub_dataset("hf://openai/gsm8k:main@train") == ("openai/gsm8k", "main", "train")
    assert parse_hub_dataset("hf://trl-lib/DeepMath-103K") == ("trl-lib/DeepMath-103K", None, None)
    assert source_name("hf://openai/gsm8k:main@test") == "gsm8k-test" and source_name("d/x.jsonl") == "x"
    for bad in ("hf://gsm8k", "hf://a/b/c", "hf://a/b@", "hf://a/b:@x"):
        with pytest.raises(ValueError, match="not a Hub dataset name; write hf://org/name"):
            parse_hub_dataset(bad)


def test_hub_datasets_load_offline_from_the_cache(offline_hub):
    """A verl parquet and a TRL jsonl dataset in huggingface_hub's cache, named hf://..., read with
    HF_HUB_OFFLINE=1; an absent one names the command that fetches it."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.hub_cache import write_hub_repo

    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(_verl_rows()), buffer)
    write_hub_repo(offline_hub, "org/verl_math", {"data/train-00000-of-00001.parquet": buffer.getvalue()},
                   repo_type="dataset")
    rows = "".join(json.dumps({"prompt": CHAT, "solution": str(i)}) + "\n" for i in range(2))
    card = "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train.jsonl\n" \
           "  - split: test\n    path: main/test.jsonl\n---\n"
    write_hub_repo(offline_hub, "org/trl_math", {"README.md": card.encode(), "main/train.jsonl": rows.encode(),
                                                 "main/test.jsonl": rows.encode()}, repo_type="dataset")
    verl = load_problems("hf://org/verl_math")  # its only split
    assert [p.answer for p in verl] == ["1", "2", "3"] and verl[0].id == "verl_math-train-0" and verl[0].messages
    trl = load_problems("hf://org/trl_math:main@test")
    assert [(p.answer, p.messages) for p in trl] == [("0", tuple(CHAT)), ("1", tuple(CHAT))]
    with pytest.raises(ValueError, match=r"has the splits \['test', 'train'\]: name one, e.g. "
                                         r"hf://org/trl_math:main@test"):
        load_problems("hf://org/trl_math:main")
    with pytest.raises(ValueError, match=r"no split 'dev'; its splits are \['test', 'train'\]"):
        load_problems("hf://org/trl_math:main@dev")
    with pytest.raises(FileNotFoundError, match=r"not in the Hugging Face cache .* hf download org/absent --repo-type "
                                                r"dataset --include README.md"):
        load_problems("hf://org/absent@train")

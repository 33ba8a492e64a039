"""Easy/Medium/Hard binning by correct counts, written files, and the generate_fn driver."""

import json

import pytest

from jaxrl4llm.data import (
    bin_by_correct_counts,
    default_thresholds,
    demo_solution,
    load_problems,
    make_demo_problems,
    run_difficulty_binning,
    write_difficulty_bins,
)


def test_bins():
    labels = bin_by_correct_counts([0, 1, 2, 3, 5, 6, 7, 8], num_rollouts=8, easy_min=6, hard_max=2)
    assert labels == ["hard", "hard", "hard", "medium", "medium", "easy", "easy", "easy"]
    assert default_thresholds(8) == (6, 2) and default_thresholds(16) == (12, 4)


@pytest.mark.parametrize("kwargs", [dict(easy_min=2, hard_max=2), dict(easy_min=9, hard_max=1), dict(easy_min=5, hard_max=-1)])
def test_bad_thresholds(kwargs):
    with pytest.raises(ValueError, match="hard_max < easy_min"):
        bin_by_correct_counts([1], num_rollouts=8, **kwargs)


def test_bad_counts_name_the_problem():
    with pytest.raises(ValueError, match="problem 1"):
        bin_by_correct_counts([1, 9], num_rollouts=8, easy_min=6, hard_max=2)


def test_write_bins_roundtrip(tmp_path):
    problems = make_demo_problems(10, seed=1)
    counts = [0, 8, 4, 8, 1, 7, 3, 8, 2, 5]
    summary = write_difficulty_bins(problems, counts, tmp_path, num_rollouts=8)
    assert summary["bin_sizes"] == {"easy": 4, "medium": 3, "hard": 3}
    assert summary["histogram"] == {"0": 1, "1": 1, "2": 1, "3": 1, "4": 1, "5": 1, "6": 0, "7": 1, "8": 3}
    easy = load_problems(tmp_path / "easy.jsonl")
    assert [p.id for p in easy] == [problems[i].id for i in (1, 3, 5, 7)]
    assert easy[0].metadata["correct_count"] == 8 and easy[0].metadata["difficulty"] == "easy"
    assert json.loads((tmp_path / "histogram.json").read_text())["num_rollouts"] == 8
    assert (tmp_path / "histogram.png").read_bytes()[:4] == b"\x89PNG"


def test_run_binning_with_a_fake_generate_fn(tmp_path):
    problems = make_demo_problems(12, seed=2)
    calls = []

    def generate_fn(prompts, num_samples):
        calls.append((len(prompts), num_samples))
        out = []
        for prompt in prompts:
            index = next(i for i, p in enumerate(problems) if p.problem in prompt)
            right = index % (num_samples + 1)  # problem i gets i mod 9 correct answers
            out.append([demo_solution(problems[index])] * right + ["no idea"] * (num_samples - right))
        return out

    result = run_difficulty_binning(problems, generate_fn, rollouts=8, template="demo", out_dir=tmp_path, batch_size=5)
    assert calls == [(5, 8), (5, 8), (2, 8)]
    assert result.counts == [i % 9 for i in range(12)]
    assert result.labels[:9] == ["hard"] * 3 + ["medium"] * 3 + ["easy"] * 3
    assert result.summary["bin_sizes"] == {"easy": 3, "medium": 3, "hard": 6}
    assert (tmp_path / "medium.jsonl").is_file()


def test_run_binning_checks_the_generate_fn_shape():
    problems = make_demo_problems(2)
    with pytest.raises(ValueError, match="one list of 4 completions per prompt"):
        run_difficulty_binning(problems, lambda prompts, n: [["x"] * n], rollouts=4, template="demo")

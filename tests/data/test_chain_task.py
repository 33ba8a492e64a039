"""The chain task (data/chain_task.py): problems, worked solutions in three styles, teacher
mixtures and the held-out files by chain length."""

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl4llm.data import load_problems
from jaxrl4llm.data.chain_task import (ALIGNED_LIKE, BASE_LIKE, CHAIN_BANDS, STYLES, VALUE_MAX, TeacherMixture,
                                       chain_operations, chain_solution, make_chain_problems, teacher_completion,
                                       write_chain_task)
from jaxrl4llm.rewards import math_reward
from jaxrl4llm.train.metrics import repetition_score


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), low=st.integers(1, 8), span=st.integers(0, 7))
def test_problems_keep_the_running_value_in_range_and_every_style_reaches_the_gold(seed, low, span):
    high = min(low + span, 8)
    for p in make_chain_problems(20, seed=seed, min_ops=low, max_ops=high):
        start, operations = chain_operations(p)
        assert low <= len(operations) == p.metadata["ops"] <= high
        value = start
        for op, operand in operations:
            assert 1 <= operand <= 9
            value = value + operand if op == "+" else value - operand
            assert 0 <= value <= VALUE_MAX
        assert p.answer == str(value)
        for style in STYLES:
            assert math_reward(chain_solution(p, style), p.answer) == 1.0


def test_the_three_styles_of_one_problem():
    (p,) = [q for q in make_chain_problems(200, seed=3) if q.metadata["ops"] == 3][:1]
    start, ops = chain_operations(p)
    full, merged, direct = (chain_solution(p, s) for s in STYLES)
    assert full.count("=") == 3 and merged.count("=") == 2 and direct == rf"\boxed{{{p.answer}}}"
    assert full.startswith(f"{start}{ops[0][0]}{ops[0][1]}=")
    assert len(direct) < len(merged) < len(full) <= 74
    with pytest.raises(ValueError, match="not a chain problem"):
        chain_operations("Ann has 3 pens. How many?")


def test_teacher_mixtures_draw_their_styles_and_degenerate_continuations():
    problems = make_chain_problems(2000, seed=1)
    rng = random.Random(0)
    base = [teacher_completion(p, BASE_LIKE, rng, max_chars=96) for p in problems]
    aligned = [teacher_completion(p, ALIGNED_LIKE, rng, max_chars=96) for p in problems]
    assert all(stops for _, stops in aligned)
    not_stopping = [text for text, stops in base if not stops]
    assert 0.15 < len(not_stopping) / len(base) < 0.25  # loop 0.12 + run-on 0.08
    assert all(len(text) == 96 for text in not_stopping)
    loops = [t for t in not_stopping if repetition_score(list(t)) > 0.5]
    assert 0.4 < len(loops) / len(not_stopping) < 0.8  # the loops repeat; run-ons go on into new questions
    wrong = lambda rows: sum(math_reward(t, p.answer) == 0 for (t, s), p in zip(rows, problems) if s) / sum(
        s for _, s in rows)
    assert 0.3 < wrong(base) < 0.4 and wrong(aligned) < 0.1
    direct = lambda rows: sum(t.startswith("\\boxed") for t, _ in rows) / len(rows)
    assert direct(aligned) == 0 and 0.2 < direct(base) < 0.35
    with pytest.raises(ValueError, match="loop \\+ run_on"):
        TeacherMixture(full=1, merged=0, direct=0, wrong_box=0, loop=0.6, run_on=0.6)


def test_write_chain_task_splits_held_out_files_by_chain_length(tmp_path):
    paths = write_chain_task(tmp_path, num_train=300, num_test_per_band=20, seed=0)
    assert set(paths) == {"train", *CHAIN_BANDS}
    train = {p.problem for p in load_problems(paths["train"])}
    for band, (low, high) in CHAIN_BANDS.items():
        held_out = load_problems(paths[band])
        assert len(held_out) == 20 and not train & {p.problem for p in held_out}
        assert all(low <= p.metadata["ops"] <= high for p in held_out)
    record = json.loads(open(paths["train"]).readline())
    assert record["solution"].endswith(f"\\boxed{{{record['answer']}}}")

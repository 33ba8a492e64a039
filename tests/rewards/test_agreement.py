"""Agreement of the verifier with mathematically labelled cases (target >= 98% on each set)."""

import json

from jaxrl4llm.rewards import batch_math_reward
from tests.rewards.labelled_cases import CASES

TARGET = 0.98


def _agreement(name, responses, golds, expected):
    rewards = batch_math_reward(responses, golds)
    wrong = [i for i, (r, e) in enumerate(zip(rewards, expected)) if (r == 1.0) != e]
    figure = 1 - len(wrong) / len(expected)
    print(f"\n{name}: agreement {figure:.2%} ({len(expected) - len(wrong)}/{len(expected)}); disagreements at {wrong}")
    return figure, wrong


def test_own_labelled_set_covers_every_rule_and_is_large_enough():
    assert len(CASES) >= 250
    rules = {rule.split()[0] for *_, rule in CASES}
    for needed in ("boxed", "fbox", "after", "final", "gsm8k", "last", "left", "degrees", "percent",
                   "units", "thousands", "assignment", "multiple", "tuple", "interval", "set", "union",
                   "matrix", "relation", "sqrt", "scientific", "25", "sign"):
        assert any(r.startswith(needed) for r in rules), needed
    assert sum(1 for c in CASES if c[2]) > 100 and sum(1 for c in CASES if not c[2]) > 70


def test_agreement_on_own_labelled_cases():
    figure, wrong = _agreement("own labelled cases", [c[0] for c in CASES], [c[1] for c in CASES], [c[2] for c in CASES])
    assert figure >= TARGET, [CASES[i] for i in wrong]


def test_agreement_on_public_cases(shared_data):
    rows = [json.loads(line) for line in (shared_data / "verifier_cases_public.jsonl").read_text().splitlines() if line.strip()]
    strict = [r for r in rows if not r.get("ambiguous")]
    assert len(strict) >= 250
    figure, wrong = _agreement("public cases (non-ambiguous)", [r["pred"] for r in strict], [r["gold"] for r in strict],
                               [r["equal"] for r in strict])
    assert figure >= TARGET, [(strict[i]["pred"][-120:], strict[i]["gold"]) for i in wrong]


def test_known_failure_modes_of_other_verifiers():
    responses = [r"\fbox{9}", r"\boxed{1.5e3}", r"\boxed{9.}", r"\boxed{1 + \frac{1}{e}}", "25", "0.25", "2500", "27.0"]
    golds = ["9", "1500", "9", r"1 - \frac{1}{e}", "0.25", "2500", "25", 27.0]
    assert batch_math_reward(responses, golds) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0]


def test_math500_solutions_extract_to_their_answers(shared_data):
    rows = [json.loads(line) for line in (shared_data / "math500_test.jsonl").read_text().splitlines()]
    rewards = batch_math_reward([r["solution"] for r in rows], [r["answer"] for r in rows])
    assert sum(rewards) / len(rows) >= 0.99


def test_gsm8k_reference_answers_verify(shared_data):
    rows = [json.loads(line) for line in (shared_data / "gsm8k_test.jsonl").read_text().splitlines()][:300]
    golds = [r["answer"].split("####")[-1].strip() for r in rows]
    assert batch_math_reward([r["answer"] for r in rows], golds) == [1.0] * len(rows)

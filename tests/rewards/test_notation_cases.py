"""Every notation case of ``notation_cases.CASES`` is judged right; hostile variants stay bounded."""

import time

import pytest

from jaxrl4llm.rewards import batch_math_reward
from tests.rewards.notation_cases import CASES

# Cases the verifier cannot judge yet: index -> reason (run as strict xfail so a fix shows up).
KNOWN_FAILURES: dict[int, str] = {}


def test_cases_are_balanced_and_unique():
    assert len({(r, g) for r, g, *_ in CASES}) == len(CASES)
    positives = sum(1 for c in CASES if c[2])
    assert positives >= 40 and len(CASES) - positives >= 30


@pytest.fixture(scope="module")
def rewards():
    return batch_math_reward([c[0] for c in CASES], [c[1] for c in CASES])


@pytest.mark.parametrize(
    "index",
    [
        pytest.param(i, id=f"{i}-{c[3]}", marks=pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[i]))
        if i in KNOWN_FAILURES
        else pytest.param(i, id=f"{i}-{c[3]}")
        for i, c in enumerate(CASES)
    ],
)
def test_notation_case(rewards, index):
    response, gold, equal, rule = CASES[index]
    assert (rewards[index] == 1.0) == equal, (rule, response, gold)


HOSTILE = [
    (r"\boxed{100000!}", "1"),
    (r"\boxed{(10^{10})!}", "1"),
    (r"\boxed{10^{10}!}", "1"),
    (r"\boxed{1001!}", "2"),
    (r"\boxed{((20)!)!}", "1"),
    (r"\boxed{(1000!)^{10000}}", "1"),
    (r"\boxed{1000!}", "1001!"),
    (r"\boxed{999999!!}", "1"),
    (r"\boxed{\frac{100000!}{99999!}}", "1"),
    (r"\boxed{\sin(10^{100000}^\circ)}", "0"),
    (r"\boxed{0.\overline{" + "3" * 1900 + "}}", r"\frac{1}{7}"),
    (r"\boxed{0." + "1" * 1900 + r"\overline{3}}", r"\frac{1}{3}"),
    (r"\boxed{" + r"\overline{3}" * 150 + "}", r"\frac{1}{3}"),
    (r"\boxed{" + r"\boxed{" * 30 + "5" + "}" * 31, "5"),
]


def test_hostile_factorials_angles_and_repeating_decimals_are_bounded():
    start = time.monotonic()
    rewards = batch_math_reward([h[0] for h in HOSTILE], [h[1] for h in HOSTILE], timeout=3.0)
    assert time.monotonic() - start < 20.0
    assert rewards[:-1] == [0.0] * (len(HOSTILE) - 1)

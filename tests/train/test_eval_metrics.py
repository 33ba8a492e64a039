"""train/eval_metrics.py: pass@k against its definition, mean@n, maj@k and its tie rule."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl4llm.train.eval_metrics import maj_at_k, majority_vote, pass_at_k, pass_ks, sample_metrics

rows = st.lists(st.booleans(), min_size=1, max_size=8)


@settings(max_examples=60, deadline=None)
@given(rows, st.data())
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_sample(correct, data):
    """pass@k = P(a uniformly drawn k-subset of the n samples holds a correct one), by enumeration."""
    n = len(correct)
    k = data.draw(st.integers(1, n))
    subsets = list(itertools.combinations(range(n), k))
    expected = sum(any(correct[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, sum(correct), k) == pytest.approx(expected, abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.lists(rows, min_size=1, max_size=5).filter(lambda r: len({len(x) for x in r}) == 1))
def test_pass_at_1_is_mean_accuracy_and_pass_at_k_grows_with_k(problems):
    correct = np.array(problems, bool)
    n = correct.shape[1]
    metrics = sample_metrics(correct, [[None] * n for _ in problems])
    assert metrics["pass@1"] == pytest.approx(correct.mean()) == pytest.approx(metrics[f"mean@{n}"])
    curve = [np.mean([pass_at_k(n, int(c.sum()), k) for c in correct]) for k in range(1, n + 1)]
    assert all(a <= b + 1e-12 for a, b in zip(curve, curve[1:]))


def test_pass_at_k_is_finite_and_exact_at_large_n():
    """The product form: no C(1024, 512) is formed; one correct of n gives k / n."""
    assert pass_at_k(1024, 1, 512) == pytest.approx(0.5)
    assert pass_at_k(1024, 0, 512) == 0.0 and pass_at_k(1024, 600, 512) == 1.0
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


def test_pass_ks_are_powers_of_two_then_n():
    assert pass_ks(1) == [1] and pass_ks(4) == [1, 2, 4] and pass_ks(6) == [1, 2, 4, 6] and pass_ks(16)[-1] == 16


def test_majority_vote_breaks_ties_by_first_occurrence():
    assert majority_vote(["2", "3", "3", "2"]) == 0  # 2 against 2: "2" came first
    assert majority_vote(["3", "2", "2", "3"]) == 0
    assert majority_vote(["7", "2", "2"]) == 1  # the larger group wins, at its first member
    assert majority_vote([None, None, "5"]) == 2  # no answer abstains
    assert majority_vote([None, None]) is None and majority_vote([]) is None


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "c", None]), min_size=1, max_size=8))
def test_majority_vote_picks_a_largest_group_at_its_first_member(keys):
    winner = majority_vote(keys)
    votes = [k for k in keys if k is not None]
    if not votes:
        assert winner is None
        return
    best = max(votes.count(k) for k in votes)
    assert votes.count(keys[winner]) == best and keys.index(keys[winner]) == winner
    assert all(keys.index(k) > winner for k in set(votes) if votes.count(k) == best and k != keys[winner])


def test_maj_at_k_reads_the_first_k_samples_and_counts_abstentions_wrong():
    keys = [["1", "2", "2", "2"], [None, None, "9", "9"], ["5", "6", "6", "6"]]
    correct = np.array([[1, 0, 0, 0], [0, 0, 1, 1], [0, 1, 1, 1]], bool)
    assert maj_at_k(keys, correct, 1) == pytest.approx(1 / 3)  # "1" right; abstains; "5" wrong
    assert maj_at_k(keys, correct, 2) == pytest.approx(1 / 3)  # tie -> "1" (first), right; abstains; tie -> "5", wrong
    assert maj_at_k(keys, correct, 4) == pytest.approx(2 / 3)  # "2" wrong; "9" right; "6" right
    metrics = sample_metrics(correct, keys)
    assert [m for m in metrics if m.startswith("maj@")] == ["maj@1", "maj@2", "maj@4"]
    assert metrics["maj@4"] == pytest.approx(2 / 3) and metrics["mean@4"] == pytest.approx(6 / 12)

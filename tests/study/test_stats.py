"""Student t distribution, t intervals and Welch's test: closed forms, tables, properties, scipy."""

import math

import pytest
from hypothesis import given, settings, strategies as st

from jaxrl4llm.study.stats import (
    mean_interval, regularized_incomplete_beta, student_t_cdf, student_t_ppf, student_t_sf2, welch_test,
)

FAST = settings(max_examples=40, deadline=None)
samples = st.lists(st.floats(-100, 100, allow_nan=False, allow_infinity=False), min_size=2, max_size=8)


@pytest.mark.parametrize("t", [-30.0, -2.0, -0.3, 0.0, 0.7, 4.0, 50.0])
def test_cdf_matches_the_closed_forms_of_one_and_two_degrees_of_freedom(t):
    assert student_t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-13)  # Cauchy
    assert student_t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-13)


@pytest.mark.parametrize("df, q", [(1, 12.706204736), (2, 4.302652730), (3, 3.182446305), (4, 2.776445105),
                                   (9, 2.262157163), (29, 2.045229642), (1e6, 1.959966)])
def test_975_quantiles_match_the_table(df, q):
    assert student_t_ppf(0.975, df) == pytest.approx(q, rel=1e-6)
    assert student_t_ppf(0.025, df) == pytest.approx(-q, rel=1e-6)


def test_incomplete_beta_known_values_and_edges():
    assert regularized_incomplete_beta(1, 1, 0.3) == pytest.approx(0.3)  # uniform
    assert regularized_incomplete_beta(2, 3, 0.4) == pytest.approx(0.5248)  # 1 - sum binomial, by hand
    assert regularized_incomplete_beta(0.5, 0.5, 0.5) == pytest.approx(0.5)
    assert regularized_incomplete_beta(3, 2, 0.0) == 0.0 and regularized_incomplete_beta(3, 2, 1.0) == 1.0
    with pytest.raises(ValueError):
        regularized_incomplete_beta(0, 1, 0.5)


@FAST
@given(st.floats(-40, 40), st.floats(0.5, 200))
def test_cdf_symmetric_and_quantile_inverts_it(t, df):
    assert student_t_cdf(t, df) + student_t_cdf(-t, df) == pytest.approx(1.0, abs=1e-12)
    p = student_t_cdf(t, df)
    if 1e-9 < p < 1 - 1e-9:
        assert student_t_cdf(student_t_ppf(p, df), df) == pytest.approx(p, abs=1e-9)


def test_mean_interval_by_hand():
    iv = mean_interval([1.0, 2.0, 3.0])  # mean 2, s = 1, half = 4.302653 / sqrt(3)
    assert iv.mean == 2.0 and iv.n == 3
    assert iv.high - 2.0 == pytest.approx(4.302652730 / math.sqrt(3), rel=1e-8)
    one = mean_interval([0.7])
    assert one.mean == 0.7 and one.n == 1 and math.isnan(one.low) and math.isnan(one.high)


@FAST
@given(samples)
def test_interval_contains_the_mean(xs):
    iv = mean_interval(xs)
    assert iv.low <= iv.mean + 1e-9 and iv.mean <= iv.high + 1e-9


def test_interval_shrinks_with_more_seeds_of_the_same_spread():
    widths = [mean_interval([0.0, 1.0] * k).high - mean_interval([0.0, 1.0] * k).low for k in (1, 2, 4, 8)]
    assert all(a > b for a, b in zip(widths, widths[1:]))


def test_welch_by_hand():
    # a: mean 0.70333, s^2 = 0.000233; b: mean 0.76333, s^2 = 0.001033 (hand arithmetic)
    c = welch_test([0.70, 0.72, 0.69], [0.75, 0.80, 0.74])
    assert c.diff == pytest.approx(0.06)
    se = math.sqrt((0.00023333333 + 0.00103333333) / 3)
    assert c.diff / se == pytest.approx(2.9199856, rel=1e-6)
    assert c.df == pytest.approx(2.8594059, rel=1e-6)
    assert c.p_value == pytest.approx(0.0652057, rel=1e-5)
    assert c.low < 0 < c.high  # p > 0.05 <=> the 95% interval covers 0


@FAST
@given(samples, samples)
def test_welch_p_symmetric_and_interval_agrees_with_p(a, b):
    ab, ba = welch_test(a, b), welch_test(b, a)
    if math.isnan(ab.p_value):
        return
    assert ab.p_value == pytest.approx(ba.p_value, abs=1e-12)
    assert ab.diff == pytest.approx(-ba.diff)
    assert 0.0 <= ab.p_value <= 1.0
    if ab.p_value < 0.049:
        assert not ab.low <= 0 <= ab.high
    elif ab.p_value > 0.051:
        assert ab.low <= 0 <= ab.high


def test_welch_degenerate_cases():
    small = welch_test([1.0], [2.0, 3.0])
    assert math.isnan(small.p_value) and small.diff == pytest.approx(1.5) and small.n_a == 1
    assert welch_test([1.0, 1.0], [1.0, 1.0]).p_value == 1.0
    assert welch_test([1.0, 1.0], [2.0, 2.0]).p_value == 0.0


def test_against_scipy_when_installed():
    scipy_stats = pytest.importorskip("scipy.stats")
    for df in (1, 2.5, 7, 40):
        for t in (-3.0, -0.5, 0.1, 2.2):
            assert student_t_cdf(t, df) == pytest.approx(scipy_stats.t.cdf(t, df), abs=1e-12)
        assert student_t_ppf(0.975, df) == pytest.approx(scipy_stats.t.ppf(0.975, df), rel=1e-9)
    a, b = [3.1, 2.9, 3.5, 3.0], [3.6, 3.9, 3.4]
    ref = scipy_stats.ttest_ind(b, a, equal_var=False)
    assert welch_test(a, b).p_value == pytest.approx(ref.pvalue, rel=1e-9)
    assert student_t_sf2(2.0, 5) == pytest.approx(2 * scipy_stats.t.sf(2.0, 5), rel=1e-10)

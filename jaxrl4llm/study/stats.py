"""Small-sample statistics for comparing runs over seeds: Student t quantiles and p-values,
t confidence intervals of a mean, Welch's two-sample t-test (`jaxrl4llm report`).

No scipy at run time: the t distribution comes from the regularized incomplete beta function,
evaluated by its continued fraction (modified Lentz, Numerical Recipes 3rd ed., section 6.4):

    P(|T| > t) = I_x(df / 2, 1 / 2),   x = df / (df + t^2)

tests/study/test_stats.py checks it against closed forms (df = 1, 2), tabulated quantiles and,
when it is installed, scipy.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

_EPS = 1e-15
_TINY = 1e-300


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b) (converges fast for x < (a + 1) / (a + b + 2))."""
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > _TINY else _TINY)
            c = 1.0 + num / c
            c = c if abs(c) > _TINY else _TINY
            h *= d * c
        if abs(d * c - 1.0) < _EPS:
            return h
    raise ArithmeticError(f"incomplete beta continued fraction did not converge (a={a}, b={b}, x={x})")


def _ibeta(a: float, b: float, x: float, y: float) -> float:
    """I_x(a, b) given both x and y = 1 - x (each computed directly: no cancellation near 0 or 1)."""
    if x <= 0.0 or y <= 0.0:
        return 0.0 if x <= 0.0 else 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log(y)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, y) / b


def regularized_incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b) = B(x; a, b) / B(a, b) for a, b > 0 and 0 <= x <= 1; returns a float in [0, 1]."""
    if not (a > 0 and b > 0):
        raise ValueError(f"incomplete beta needs a > 0 and b > 0, got a={a}, b={b}")
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"incomplete beta needs 0 <= x <= 1, got x={x}")
    return _ibeta(a, b, x, 1.0 - x)


def student_t_sf2(t: float, df: float) -> float:
    """Two-sided tail P(|T| >= |t|) of Student's t with `df` (> 0, may be fractional) degrees of freedom."""
    if df <= 0:
        raise ValueError(f"degrees of freedom must be > 0, got {df}")
    if math.isinf(t):
        return 0.0
    return _ibeta(df / 2.0, 0.5, df / (df + t * t), t * t / (df + t * t))


def student_t_cdf(t: float, df: float) -> float:
    """P(T <= t) of Student's t with `df` degrees of freedom."""
    half_tail = 0.5 * student_t_sf2(t, df)
    return 1.0 - half_tail if t > 0 else half_tail


def student_t_ppf(p: float, df: float) -> float:
    """The quantile t with P(T <= t) = p (0 < p < 1), by bisection on the CDF (to ~1e-12)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"quantile level must be in (0, 1), got {p}")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -student_t_ppf(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while student_t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if student_t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


class Interval(NamedTuple):
    """A mean with its two-sided t confidence interval; low = high = nan when n < 2."""

    mean: float
    low: float
    high: float
    n: int


def mean_interval(values: Sequence[float], level: float = 0.95) -> Interval:
    """Mean of `values` and its t interval mean +- t_{(1+level)/2, n-1} * s / sqrt(n) (s: the
    sample standard deviation); returns Interval(mean, low, high, n), nan bounds when n < 2."""
    xs = [float(v) for v in values]
    n = len(xs)
    if n == 0:
        return Interval(math.nan, math.nan, math.nan, 0)
    mean = math.fsum(xs) / n
    if n < 2:
        return Interval(mean, math.nan, math.nan, n)
    sd = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (n - 1))
    half = student_t_ppf(0.5 + level / 2.0, n - 1) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


class Comparison(NamedTuple):
    """Welch's test of mean(b) - mean(a): the difference, its t interval, the two-sided p-value
    and the Welch-Satterthwaite degrees of freedom; nan statistics when an arm has n < 2."""

    diff: float
    low: float
    high: float
    p_value: float
    df: float
    n_a: int
    n_b: int


def welch_test(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> Comparison:
    """Welch's unequal-variance t-test of mean(b) - mean(a) = 0.

    se = sqrt(s_a^2/n_a + s_b^2/n_b), t = diff / se,
    df = se^4 / ((s_a^2/n_a)^2/(n_a-1) + (s_b^2/n_b)^2/(n_b-1)),
    interval diff +- t_{(1+level)/2, df} * se, p = P(|T_df| >= |t|).
    With both variances 0 the test degenerates: p = 1 when the means are equal, else 0, and
    the interval is the point diff. Returns a Comparison (nan statistics when n_a or n_b < 2)."""
    ia, ib = mean_interval(a, level), mean_interval(b, level)
    diff = ib.mean - ia.mean
    if ia.n < 2 or ib.n < 2:
        return Comparison(diff, math.nan, math.nan, math.nan, math.nan, ia.n, ib.n)
    va = math.fsum((float(x) - ia.mean) ** 2 for x in a) / (ia.n - 1) / ia.n
    vb = math.fsum((float(x) - ib.mean) ** 2 for x in b) / (ib.n - 1) / ib.n
    se2 = va + vb
    if se2 == 0.0:
        return Comparison(diff, diff, diff, 1.0 if diff == 0 else 0.0, float(ia.n + ib.n - 2), ia.n, ib.n)
    se = math.sqrt(se2)
    ra, rb = va / se2, vb / se2  # the same df, scaled so tiny variances do not underflow to 0 / 0
    df = 1.0 / (ra * ra / (ia.n - 1) + rb * rb / (ib.n - 1))
    half = student_t_ppf(0.5 + level / 2.0, df) * se
    return Comparison(diff, diff - half, diff + half, student_t_sf2(diff / se, df), df, ia.n, ib.n)

"""Shared input generators for the core tests.

Hypothesis draws a seed (plus a few discrete knobs) and numpy builds arrays of a FEW FIXED
shapes from it: every new shape is an XLA compile, so shapes stay fixed and values vary.
"""

import numpy as np
from hypothesis import settings, strategies as st

B, G, T, V = 8, 4, 6, 5  # 2 prompts x 4 responses, 6 response tokens, vocab 5

seeds = st.integers(0, 2**32 - 1)
FAST = settings(max_examples=25, deadline=None)
FEW = settings(max_examples=10, deadline=None)


def rng(seed):
    return np.random.default_rng(seed)


def rewards(r, b=B, kind=None):
    """Binary-ish, discrete or continuous rewards; discrete kinds produce all-equal groups."""
    kind = kind if kind is not None else r.integers(3)
    if kind == 0:
        return r.integers(0, 2, size=b).astype(np.float32)
    if kind == 1:
        return r.choice(np.array([-1.0, 0.0, 0.5, 1.0], np.float32), size=b)
    return r.normal(size=b).astype(np.float32)


def mask(r, b=B, t=T, allow_empty=True):
    """Right-padded response masks with random lengths (0 allowed)."""
    lengths = r.integers(0 if allow_empty else 1, t + 1, size=b)
    return (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)


def logps(r, b=B, t=T, spread=0.3):
    """(logp, old_logp): negative log-probs with a log-ratio of scale `spread`."""
    old = -r.exponential(1.0, size=(b, t)).astype(np.float32)
    logp = (old + spread * r.normal(size=(b, t))).astype(np.float32)
    return logp, old


def assert_finite(*xs):
    for x in xs:
        x = np.asarray(x)
        assert np.all(np.isfinite(x)), x

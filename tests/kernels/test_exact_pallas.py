"""The Pallas kernels of exact numerics (kernels/exact_pallas.py) in Pallas' interpreter: each output
row's bits do not depend on the rows it is computed with, its place among them, or (attention) the
layout its keys come in: a training row's packed segment or a decode step's gathered pages."""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl4llm.kernels import exact, exact_pallas
from jaxrl4llm.plan.gpu import missing_gpu_packages
from tests.gpu_kernels import compile_for_h100, h100_spec

# each output bit-identical across batch compositions: at XLA's default LLVM optimisation level (tests/conftest.py)
pytestmark = pytest.mark.xla_default_opt

RNG = np.random.default_rng(0)
X = RNG.standard_normal((40, 200)).astype(np.float32)
W = RNG.standard_normal((200, 150)).astype(np.float32)
EXAMPLES = settings(max_examples=5, deadline=None)


@pytest.fixture(scope="module")
def full_matmul():
    return np.asarray(exact_pallas.matmul(X, W, interpret=True))


@given(first=st.integers(0, 30), rows=st.integers(1, 9))
@EXAMPLES
def test_matmul_row_ignores_the_other_rows(full_matmul, first, rows):
    """Rows [first, first + rows) alone: other tiles, other places in their tile, the same bits."""
    part = np.asarray(exact_pallas.matmul(X[first:first + rows], W, interpret=True))
    np.testing.assert_array_equal(part, full_matmul[first:first + rows])


def test_matmul_value(full_matmul):
    np.testing.assert_allclose(full_matmul, X @ W, rtol=0, atol=5e-5)


def test_attention_decode_step_equals_the_training_row():
    """Training: one row of 40 positions packing three sequences (ids 1, 2, 3); query 30 of the
    second sequence (positions 12..33) sees keys 12..30. Decode: that query alone, its 19 keys
    gathered at the start of a row of 128 slots (the rest garbage), range [0, 19)."""
    b, t, h, kvh, dh = 1, 40, 4, 2, 16
    q, k, v = (RNG.standard_normal(s).astype(np.float32) for s in ((b, t, h, dh), (b, t, kvh, dh), (b, t, kvh, dh)))
    ids = jnp.asarray([[1] * 12 + [2] * 22 + [3] * 6])
    ranges = exact.segment_ranges(ids)
    train = np.asarray(exact_pallas.attention(q, k, v, ranges, interpret=True))
    np.testing.assert_allclose(train, exact._reference(q, k, v, ranges), rtol=0, atol=2e-6)
    slot_k = RNG.standard_normal((1, 128, kvh, dh)).astype(np.float32)
    slot_v = RNG.standard_normal((1, 128, kvh, dh)).astype(np.float32)
    slot_k[0, :19], slot_v[0, :19] = k[0, 12:31], v[0, 12:31]
    decode = exact_pallas.attention(q[:, 30:31], slot_k, slot_v, jnp.asarray([[[0, 19, 0, 0]]]), interpret=True)
    np.testing.assert_array_equal(np.asarray(decode)[0, 0], train[0, 30])
    # a prompt and its response in two ranges (shared-prompt rows): the same keys, the same bits
    both = np.concatenate([slot_k[:, :10], slot_k[:, 10:19]], axis=1), np.concatenate([slot_v[:, :10], slot_v[:, 10:19]], 1)
    split = exact_pallas.attention(q[:, 30:31], *both, jnp.asarray([[[0, 10, 10, 19]]]), interpret=True)
    np.testing.assert_array_equal(np.asarray(split)[0, 0], train[0, 30])


def test_row_kernels_ignore_the_other_rows():
    z = RNG.standard_normal((37, 300)).astype(np.float32) * 3
    tokens = jnp.asarray(RNG.integers(0, 300, 37))
    logp = np.asarray(exact_pallas.token_logprob(z, tokens, interpret=True))
    np.testing.assert_allclose(logp, np.asarray(exact.token_logprobs(z, tokens)), rtol=0, atol=3e-6)
    inverse = np.asarray(exact_pallas.rms_inverse(X, 1e-6, interpret=True))
    np.testing.assert_allclose(inverse, 1 / np.sqrt((X * X).mean(-1) + 1e-6), rtol=3e-6)
    x = RNG.standard_normal((37, 2, 16)).astype(np.float32)
    cos, sin = exact.rope_tables(jnp.arange(37), 1.0 / 10000 ** (np.arange(0, 16, 2) / 16))
    rope = np.asarray(exact_pallas.apply_rope(x, cos, sin, interpret=True))
    np.testing.assert_allclose(rope, exact._apply_rope_reference(x[None], cos[None], sin[None])[0], atol=2e-6)
    for first, rows in [(0, 1), (5, 3), (20, 17)]:
        s = slice(first, first + rows)
        np.testing.assert_array_equal(exact_pallas.token_logprob(z[s], tokens[s], interpret=True), logp[s])
        np.testing.assert_array_equal(exact_pallas.rms_inverse(X[s], 1e-6, interpret=True), inverse[s])
        np.testing.assert_array_equal(exact_pallas.apply_rope(x[s], cos[s], sin[s], interpret=True), rope[s])


@pytest.mark.skipif(bool(missing_gpu_packages()),
                    reason="XLA's CUDA compiler is not installed (opt-in): pip install -e .[gpu] (or .[gpu13])")
@pytest.mark.parametrize("kernel", ["matmul", "attention", "rms_inverse", "token_logprob", "apply_rope"])
def test_each_kernel_compiles_for_an_h100_at_real_widths(kernel):
    """Triton takes what the interpreter does not check: no slice of a loaded value, power-of-two tiles.
    Each kernel is compiled for sm_90a on this CPU (jax's CUDA plugin, an abstract H100) at widths no
    power of two: SmolLM2's hidden 576 and 9:3 heads of 64, 300 positions, Qwen3's 151936 tokens. On
    an H100 they then ran and kept their bits (`scripts/gpu_check --phases exact`, docs/gpu.md)."""
    spec = h100_spec
    fn, args = {
        "matmul": (exact_pallas.matmul, (spec((40, 576)), spec((576, 1536)))),
        "attention": (exact_pallas.attention, (spec((1, 300, 9, 64)), spec((1, 300, 3, 64)), spec((1, 300, 3, 64)),
                                               spec((1, 300, 4), jnp.int32))),
        "rms_inverse": (lambda x: exact_pallas.rms_inverse(x, 1e-6), (spec((40, 576)),)),
        "token_logprob": (exact_pallas.token_logprob, (spec((40, 151936)), spec((40,), jnp.int32))),
        "apply_rope": (exact_pallas.apply_rope, (spec((40, 9, 64)), spec((40, 64)), spec((40, 64)))),
    }[kernel]
    compile_for_h100(fn, *args)

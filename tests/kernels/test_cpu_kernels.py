"""The C++ CPU kernels (jaxrl4llm.kernels) against the XLA formulations they replace.

decode attention: equal to models.decode.xla_decode_attention (float32: to round-off; bfloat16: to
the rounding of the probabilities), and what sampling.decode_backends.CpuBackend(kernels=True)
attends with; paged attention: the same pool writes as sampling.paged_cache.write_tokens and the outputs of its
paged_attention; top-k: bit-identical to jax.lax.top_k, ties and IEEE total
order included. Plus the build switch and its errors.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl4llm.kernels import KernelBuildError, decode_attention, load_kernels, require_kernels, top_k
from jaxrl4llm.kernels import native
from jaxrl4llm.kernels.matmul import matmul, pack_weight
from jaxrl4llm.kernels.paged_attention import paged_attention as kernel_paged_attention
from jaxrl4llm.models.decode import xla_decode_attention
from jaxrl4llm.sampling.decode_backends import CpuBackend, pair_keys, pair_values
from jaxrl4llm.sampling.paged_cache import paged_attention, write_tokens

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="CPU kernels")


@pytest.fixture(scope="module", autouse=True)
def kernels():
    require_kernels()  # CI builds them: a build failure fails the tests, it does not skip them


def _attention_case(rng, *, prompts, g, kvh, hg, dh, t, blk, sealed, slot, dtype, q_scale=1.0):
    n = prompts * g
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32).astype(dtype)
    mask = (rng.random((prompts, t)) < 0.7).astype(np.int32)
    mask[0] = 0  # a prompt with no real token: the row attends to its generated slots only
    return dict(
        q=jnp.asarray(rng.normal(size=(n, kvh * hg, dh)) * q_scale, jnp.float32),
        prompt_k=normal(prompts, kvh, dh, t), prompt_v=normal(prompts, kvh, t, dh), prompt_mask=jnp.asarray(mask),
        done_k=[normal(n, kvh, dh, blk) for _ in range(sealed)], done_v=[normal(n, kvh, blk, dh) for _ in range(sealed)],
        cur_k=normal(n, kvh, blk, dh), cur_v=normal(n, kvh, blk, dh), slot=jnp.int32(slot))


def _both(case, dtype):
    kernel = jax.jit(lambda c: decode_attention(**c))(case)
    reference = jax.jit(lambda c: xla_decode_attention(**c, dtype=jnp.dtype(dtype)))(case)
    return np.asarray(kernel), np.asarray(reference)


@settings(max_examples=24, deadline=None)
@given(data=st.data())
def test_decode_attention_equals_xla(data):
    dtype = data.draw(st.sampled_from(["float32", "bfloat16"]))
    blk = data.draw(st.sampled_from([8, 20, 32]))
    shape = dict(prompts=data.draw(st.integers(1, 3)), g=data.draw(st.integers(1, 3)), kvh=data.draw(st.integers(1, 2)),
                 hg=data.draw(st.sampled_from([1, 2, 5])),  # 5 query heads: a group of 4 and one of 1
                 dh=data.draw(st.sampled_from([8, 24, 64])), t=data.draw(st.sampled_from([1, 7, 16, 37])),
                 blk=blk, sealed=data.draw(st.integers(0, 2)), slot=data.draw(st.integers(0, blk - 1)))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    kernel, reference = _both(_attention_case(rng, dtype=dtype, **shape), dtype)
    assert kernel.shape == reference.shape
    tol = 1e-5 if dtype == "float32" else 2e-2  # bf16: a probability may round the other way
    np.testing.assert_allclose(kernel, reference, rtol=tol, atol=tol)


def _to_pairs(case):
    """The same operands in the kernel's pair layout (prompt/sealed keys and values)."""
    to_slot_major = lambda k: jnp.swapaxes(k, -1, -2)  # keys [.., Dh, S] -> [.., S, Dh]
    return {**case, "prompt_k": pair_keys(to_slot_major(case["prompt_k"])), "prompt_v": pair_values(case["prompt_v"]),
            "done_k": [pair_keys(to_slot_major(k)) for k in case["done_k"]],
            "done_v": [pair_values(v) for v in case["done_v"]]}


@pytest.mark.skipif(not native.bf16_pairs(), reason="this CPU has no AVX512-BF16: the kernels use one layout")
@settings(max_examples=16, deadline=None)
@given(data=st.data())
def test_decode_attention_pair_layout_equals_xla(data):
    """bf16 operands in the pair layout (AVX512-BF16 dot products) against the XLA ops on the usual layout."""
    blk = data.draw(st.sampled_from([8, 20, 32]))
    shape = dict(prompts=data.draw(st.integers(1, 3)), g=data.draw(st.integers(1, 3)), kvh=data.draw(st.integers(1, 2)),
                 hg=data.draw(st.sampled_from([1, 2, 5])), dh=data.draw(st.sampled_from([8, 24, 64, 70])),
                 t=data.draw(st.sampled_from([2, 16, 38, 80])), blk=blk, sealed=data.draw(st.integers(0, 2)),
                 slot=data.draw(st.integers(0, blk - 1)))
    case = _attention_case(np.random.default_rng(data.draw(st.integers(0, 2**16))), dtype="bfloat16", **shape)
    kernel = np.asarray(jax.jit(lambda c: decode_attention(**c))(_to_pairs(case)))
    reference = np.asarray(jax.jit(lambda c: xla_decode_attention(**c, dtype=jnp.bfloat16))(case))
    np.testing.assert_allclose(kernel, reference, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_attention_peaked_scores(dtype):
    """Scores far apart (exp underflows to 0 for most slots): still the XLA result."""
    rng = np.random.default_rng(1)
    case = _attention_case(rng, prompts=2, g=2, kvh=2, hg=2, dh=64, t=16, blk=16, sealed=1, slot=9, dtype=dtype,
                           q_scale=40.0)
    kernel, reference = _both(case, dtype)
    np.testing.assert_allclose(kernel, reference, rtol=2e-2, atol=2e-2 if dtype == "bfloat16" else 1e-4)
    # The sampler's hook: CpuBackend(kernels=True) attends with the kernel, kernels=False with the XLA ops.
    attend = lambda backend: np.asarray(jax.jit(lambda c: backend.attend(**c, dtype=jnp.dtype(dtype)))(case))
    np.testing.assert_array_equal(attend(CpuBackend(kernels=True)), kernel)
    np.testing.assert_array_equal(attend(CpuBackend(kernels=False)), reference)


def test_decode_attention_shape_errors():
    rng = np.random.default_rng(0)
    case = _attention_case(rng, prompts=2, g=2, kvh=1, hg=1, dh=8, t=4, blk=8, sealed=1, slot=0, dtype="float32")
    with pytest.raises(ValueError, match="multiple of prompts"):
        decode_attention(**{**case, "q": case["q"][:3]})
    with pytest.raises(ValueError, match="sealed key blocks"):
        decode_attention(**{**case, "done_v": []})


def _paged_case(rng, *, d, s, kvh, hg, dh, page, width, lengths, dtype):
    """A pool of random pages (16-bit: as uint16 bits, as the CPU engine holds it), each slot's
    table a random draw of pages (slots may share pages, as a prompt's G rows do), and each slot's
    new token written at its last position (idle slots, length 0: the trash page)."""
    pages = 2 * width + 1
    pool = jnp.asarray(rng.normal(size=(d, pages, page, 2 * kvh, dh)), jnp.float32).astype(dtype)
    if jnp.dtype(dtype).itemsize == 2:
        pool = jax.lax.bitcast_convert_type(pool, jnp.uint16)
    table = np.stack([np.stack([rng.permutation(np.arange(1, pages))[:width] for _ in range(s)]) for _ in range(d)])
    lengths = np.asarray(lengths, np.int32).reshape(d, s)
    last = np.maximum(lengths - 1, 0)
    write_page = np.where(lengths > 0, np.take_along_axis(table, (last // page)[..., None], 2)[..., 0], 0)
    new = lambda: jnp.asarray(rng.normal(size=(d, s, kvh, dh)), jnp.float32)
    return dict(q=jnp.asarray(rng.normal(size=(d, s, kvh, hg, dh)), jnp.float32), pool=pool, k_new=new(), v_new=new(),
                write_page=jnp.asarray(write_page, jnp.int32), write_offset=jnp.asarray(last % page, jnp.int32),
                table=jnp.asarray(table, jnp.int32), kv_len=jnp.asarray(lengths))


def _paged_reference(case, dtype):
    """sampling.paged_cache: write_tokens, then paged_attention over every chunk (1 page each)."""
    pool = write_tokens(case["pool"], case["write_page"], case["write_offset"], case["k_new"], case["v_new"], dtype)
    page, width = pool.shape[2], case["table"].shape[2]
    counts = jnp.clip(case["kv_len"][..., None] - jnp.arange(width) * page, 0, page)
    out = paged_attention(case["q"], pool, case["table"], counts, jnp.int32(width), pages_per_chunk=1,
                          dtype=jnp.dtype(dtype), value_dtype=jnp.dtype(dtype))
    return out, pool


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_paged_attention_equals_the_xla_path(data):
    """Page sizes below, at and above 16 tokens (the kernel's score block), slots of length 0 (idle)
    up to their whole table, GQA groups of 1, 2 and 5 query heads, bf16 and f32: the same pool after
    the writes (bit for bit), the same outputs for live slots (to round-off; bf16: to the rounding
    of a probability), 0 for idle slots."""
    dtype = data.draw(st.sampled_from(["float32", "bfloat16"]))
    page, width = data.draw(st.sampled_from([4, 16, 24])), data.draw(st.integers(1, 4))
    d, s = data.draw(st.integers(1, 2)), data.draw(st.integers(1, 4))
    lengths = data.draw(st.lists(st.integers(0, page * width), min_size=d * s, max_size=d * s))
    shape = dict(d=d, s=s, kvh=data.draw(st.integers(1, 2)), hg=data.draw(st.sampled_from([1, 2, 5])),
                 dh=data.draw(st.sampled_from([8, 24, 64])), page=page, width=width, lengths=lengths)
    case = _paged_case(np.random.default_rng(data.draw(st.integers(0, 2**16))), dtype=dtype, **shape)
    out, pool = jax.jit(lambda c: kernel_paged_attention(**c))(case)
    want, want_pool = jax.jit(lambda c: _paged_reference(c, dtype))(case)
    np.testing.assert_array_equal(np.asarray(pool), np.asarray(want_pool))
    live = np.asarray(case["kv_len"]) > 0
    tol = 1e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(out)[live], np.asarray(want)[live], rtol=tol, atol=tol)
    assert not np.asarray(out)[~live].any()


def test_paged_attention_shape_errors():
    case = _paged_case(np.random.default_rng(0), d=1, s=2, kvh=2, hg=2, dh=8, page=4, width=2, lengths=[3, 5],
                       dtype="float32")
    with pytest.raises(ValueError, match="pool"):
        kernel_paged_attention(**{**case, "pool": case["pool"][..., :2, :]})
    with pytest.raises(ValueError, match="dtype"):
        kernel_paged_attention(**{**case, "pool": case["pool"].astype(jnp.float16)})


def _top_k_rows(rng, n, v, kind):
    x = rng.normal(size=(n, v)).astype(np.float32)
    if kind == "ties":
        x = np.round(x * 2) / 2
    elif kind == "special":  # -inf, +inf, NaN, -0.0 among the entries
        x = np.round(x * 2) / 2
        x[rng.random((n, v)) < 0.3] = -np.inf
        x[rng.random((n, v)) < 0.05] = np.inf
        x[rng.random((n, v)) < 0.05] = np.nan
        x[rng.random((n, v)) < 0.1] = -0.0
    elif kind == "constant":
        x[:] = 1.5
    return jnp.asarray(x)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 4), v=st.integers(1, 3000), data=st.data())
def test_top_k_equals_lax(n, v, data):
    k = data.draw(st.integers(1, min(v, 150)))
    kind = data.draw(st.sampled_from(["normal", "ties", "special", "constant"]))
    x = _top_k_rows(np.random.default_rng(data.draw(st.integers(0, 2**16))), n, v, kind)
    values, ids = jax.jit(top_k, static_argnums=1)(x, k)
    want_values, want_ids = jax.lax.top_k(x, k)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))


def test_top_k_equals_lax_at_sampler_shape():
    """The study's top_k = 100 over a 32000 vocabulary, 64 rows (the benchmark's shape)."""
    x = _top_k_rows(np.random.default_rng(2), 64, 32000, "normal") * 3.0
    values, ids = jax.jit(top_k, static_argnums=1)(x, 100)
    want_values, want_ids = jax.lax.top_k(x, 100)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))


def test_top_k_errors():
    x = jnp.zeros((2, 5))
    with pytest.raises(ValueError, match=r"k=6 must be in \[1, V=5\]"):
        top_k(x, 6)
    with pytest.raises(ValueError, match=r"expected x \[N, V\]"):
        top_k(jnp.zeros(5), 1)


@pytest.mark.skipif(not native.bf16_pairs(), reason="the matmul kernel needs AVX512-BF16")
@settings(max_examples=20, deadline=None)
@given(m=st.integers(1, 70), k2=st.integers(1, 100), panels=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_matmul_equals_xla_bf16_dot(m, k2, panels, seed):
    """Every row-tile size (M % 8), any even K: the XLA bf16 x bf16 -> f32 dot, to f32 round-off."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(m, 2 * k2)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(32 * panels, 2 * k2)), jnp.float32).astype(jnp.bfloat16)
    got = np.asarray(jax.jit(lambda x, w: matmul(x, pack_weight(w)))(x, w))
    want = np.asarray(jnp.einsum("mk,nk->mn", x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_matmul_shape_errors():
    with pytest.raises(ValueError, match="N % 32 == 0 and K even"):
        pack_weight(jnp.zeros((40, 8)))
    with pytest.raises(ValueError, match="does not match the packed weight"):
        matmul(jnp.zeros((4, 6)), pack_weight(jnp.zeros((32, 8))))


def test_switch_off_and_required(monkeypatch):
    monkeypatch.setenv("JAXRL4LLM_CPU_KERNELS", "0")
    assert load_kernels() is False
    with pytest.raises(KernelBuildError, match="JAXRL4LLM_CPU_KERNELS=0"):
        require_kernels()
    monkeypatch.setenv("JAXRL4LLM_CPU_KERNELS", "maybe")
    with pytest.raises(ValueError, match="use 0 \\(off\\), 1 \\(required\\)"):
        load_kernels()


def test_build_errors_name_the_problem(monkeypatch, tmp_path):
    monkeypatch.setenv("JAXRL4LLM_KERNEL_CACHE", str(tmp_path))
    with pytest.raises(KernelBuildError, match="no C\\+\\+ compiler '/no/such/c\\+\\+'"):
        native.build("/no/such/c++")
    with pytest.raises(KernelBuildError, match="building the CPU kernels failed"):
        native.build("false")  # a "compiler" that fails
    assert list(tmp_path.iterdir()) == []  # no half-built library left behind


def test_failed_build_falls_back_with_a_warning(tmp_path):
    """Unset switch + no compiler: load_kernels() warns and returns False (the sampler uses XLA)."""
    env = {**os.environ, "CXX": "/no/such/c++", "JAXRL4LLM_KERNEL_CACHE": str(tmp_path)}
    env.pop("JAXRL4LLM_CPU_KERNELS", None)
    code = ("import warnings; warnings.simplefilter('always')\n"
            "from jaxrl4llm.kernels import load_kernels\n"
            "print('available', load_kernels())\n")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "available False" in result.stdout
    assert "CPU kernels unavailable" in result.stderr and "no C++ compiler" in result.stderr


_FALLBACK_CHECK = """
import jax, jax.numpy as jnp, numpy as np
from jaxrl4llm.kernels import bf16_pairs, decode_attention, require_kernels, top_k
from jaxrl4llm.models.decode import xla_decode_attention
from jaxrl4llm.kernels.paged_attention import paged_attention as kernel_paged_attention
from tests.kernels.test_cpu_kernels import _attention_case, _paged_case, _paged_reference, _top_k_rows

require_kernels()
assert not bf16_pairs(), "a build without AVX512-BF16 must not offer the pair layout"
rng = np.random.default_rng(0)
for n, v, k, kind in [(3, 1000, 37, "ties"), (2, 333, 100, "special"), (64, 32000, 100, "normal"), (1, 5, 5, "constant")]:
    x = _top_k_rows(rng, n, v, kind)
    got, want = jax.jit(top_k, static_argnums=1)(x, k), jax.lax.top_k(x, k)
    assert np.array_equal(np.asarray(got[1]), np.asarray(want[1])), (n, v, k, kind)
for dtype in ("float32", "bfloat16"):
    case = _attention_case(rng, prompts=2, g=3, kvh=2, hg=5, dh=24, t=37, blk=20, sealed=2, slot=7, dtype=dtype)
    got = np.asarray(jax.jit(lambda c: decode_attention(**c))(case))
    want = np.asarray(jax.jit(lambda c: xla_decode_attention(**c, dtype=jnp.dtype(dtype)))(case))
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 if dtype == "bfloat16" else 1e-5)
for dtype in ("float32", "bfloat16"):
    case = _paged_case(rng, d=1, s=3, kvh=2, hg=2, dh=24, page=16, width=3, lengths=[0, 17, 40], dtype=dtype)
    out, pool = jax.jit(lambda c: kernel_paged_attention(**c))(case)
    want, want_pool = jax.jit(lambda c: _paged_reference(c, dtype))(case)
    assert np.array_equal(np.asarray(pool), np.asarray(want_pool))
    np.testing.assert_allclose(np.asarray(out)[0, 1:], np.asarray(want)[0, 1:], rtol=2e-2, atol=2e-2 if dtype == "bfloat16" else 1e-5)
print("fallbacks ok")
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86-64 targets")
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])  # AVX2 only; SSE2 only (the scalar top-k filter)
def test_kernels_built_for_older_cpus_match_xla(march):
    """The paths this CPU does not take: a build for an AVX2-only or a baseline x86-64 CPU
    (no AVX-512, no AVX512-BF16) still equals the XLA ops; the sampler then keeps XLA's matmuls."""
    # built at -O1 (half -O3's compile time; the same results: kernels/native.py compile_flags), into the
    # kernels' own cache (JAXRL4LLM_KERNEL_CACHE, else ~/.cache/jaxrl4llm/kernels), where the library's name
    # holds the target and the level: built once for these sources, as the native build is
    env = {**os.environ, "JAXRL4LLM_KERNEL_MARCH": march, "JAXRL4LLM_KERNEL_OPT": "1",
           "JAXRL4LLM_CPU_KERNELS": "1", "JAX_PLATFORMS": "cpu"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run([sys.executable, "-c", _FALLBACK_CHECK], env=env, cwd=root, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "fallbacks ok" in result.stdout

"""The decode KV-block write: one slot changes, bit for bit, whatever the cache dtype."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl4llm.models.decode import write_slot


@settings(max_examples=20, deadline=None)
@given(slot=st.integers(0, 7), dtype=st.sampled_from(["bfloat16", "float32", "float16"]))
def test_write_slot_equals_a_plain_dynamic_update_slice(slot, dtype):
    """16-bit floats go through their uint16 bits (XLA:CPU would widen a bf16 update to f32)."""
    cache = jax.random.normal(jax.random.key(1), (3, 2, 8, 4)).astype(dtype)
    new = jax.random.normal(jax.random.key(2), (3, 2, 1, 4), jnp.float32)
    got = jax.jit(write_slot)(cache, new, jnp.int32(slot))
    expected = np.array(cache)
    expected[:, :, slot] = np.asarray(new.astype(dtype))[:, :, 0]
    assert got.dtype == cache.dtype
    np.testing.assert_array_equal(np.asarray(got), expected)

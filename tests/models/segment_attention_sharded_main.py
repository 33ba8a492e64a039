"""Run by test_segment_attention.py in a subprocess with 8 simulated CPU devices.

Under jax.set_mesh(a (data=2, fsdp=2, tensor=2) mesh) the splash backend runs in a shard_map
(batch over data x fsdp, heads over tensor; with KVH = 1 the kv heads are repeated to H first)
in Pallas interpret mode (pallas_gpu shares the wrapper): its values and gradients must equal
the single-device "xla" ones. Prints "OK" on success.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm.models import make_mesh
from jaxrl4llm.models.layers.segment_attention import segment_causal_attention
from tests.models.test_segment_attention import attention_of, left_padded_row, packed_row, value_and_grads


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    b, t, h, dh = 4, 136, 4, 16
    ids = jnp.asarray(np.stack([packed_row([50, 60, 10], t), left_padded_row(40, t), packed_row([t], t),
                                np.zeros(t)]), jnp.int32)
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    for kvh in (2, 1):
        rng = np.random.default_rng(kvh)
        q, w = (jnp.asarray(rng.standard_normal((b, t, h, dh)), jnp.float32) for _ in range(2))
        k, v = (jnp.asarray(rng.standard_normal((b, t, kvh, dh)), jnp.float32) for _ in range(2))
        ref, ref_grads = value_and_grads(attention_of("xla", 128))(q, k, v, ids, w)
        for impl in ("splash",):
            with jax.set_mesh(mesh):
                out, grads = value_and_grads(attention_of(impl, 128))(q, k, v, ids, w)
                text = jax.jit(lambda q, k, v, ids: segment_causal_attention(
                    q, k, v, ids, dtype=jnp.float32, impl=impl, block=128)).lower(q, k, v, ids).as_text()
            assert "shard_map" in text or "sdy.manual_computation" in text, text[:2000]
            np.testing.assert_allclose(out, ref, atol=1e-5, rtol=1e-5, err_msg=f"{impl} KVH={kvh}")
            for g, r in zip(grads, ref_grads):
                np.testing.assert_allclose(g, r, atol=2e-5, rtol=1e-5, err_msg=f"{impl} KVH={kvh} gradient")
    print("OK")


if __name__ == "__main__":
    main()

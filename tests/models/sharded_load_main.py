"""Run by test_sharding.py in a subprocess with 8 simulated CPU devices.

Loads a tiny Qwen3 checkpoint onto a (data=2, fsdp=2, tensor=2) mesh and checks that logits,
token log-probs and their gradients equal the single-device ones, and that a sharded
save_pretrained round-trips. Prints "OK" on success.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxrl4llm.models import (
    batch_sharding,
    forward,
    load_pretrained,
    make_mesh,
    positions_from_mask,
    save_pretrained,
    token_logprobs,
)
from tests.models.hf_oracle import left_padded_batch, tiny_hf_model


def main(folder: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    tiny_hf_model("qwen3", tie_word_embeddings=False).save_pretrained(folder)
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    config, sharded = load_pretrained(folder, dtype="float32", mesh=mesh)
    _, single = load_pretrained(folder, dtype="float32")
    assert sharded["layers"]["q_proj"].sharding.spec == P(None, "fsdp", "tensor", None)
    assert sharded["embed_tokens"].sharding.spec == P("tensor", "fsdp")
    assert sharded["lm_head"].sharding.spec == P("fsdp", "tensor")
    assert len(single["embed_tokens"].devices()) == 1

    tokens, mask = left_padded_batch()
    tokens, mask = np.concatenate([tokens, tokens[:1]]), np.concatenate([mask, mask[:1]])  # 4 rows
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    positions = positions_from_mask(mask)
    targets = jnp.roll(tokens, -1, axis=1)
    place = lambda x: jax.device_put(x, batch_sharding(mesh, x.shape))
    assert place(tokens).sharding.spec == P(("data", "fsdp"), None)

    ref = forward(single, config, tokens, positions=positions, attention_mask=mask)
    out = forward(sharded, config, place(tokens), positions=place(positions), attention_mask=place(mask))
    np.testing.assert_allclose(out, ref, atol=1e-5)

    def loss(params, tokens, positions, mask):
        logp, _ = token_logprobs(params, config, tokens, targets, positions=positions, attention_mask=mask,
                                 chunk_size=4)
        return jnp.sum(logp * mask)

    ref_grads = jax.jit(jax.grad(loss))(single, tokens, positions, mask)
    grads = jax.jit(jax.grad(loss))(sharded, place(tokens), place(positions), place(mask))
    assert grads["layers"]["gate_proj"].sharding.spec == sharded["layers"]["gate_proj"].sharding.spec
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)

    save_pretrained(config, sharded, folder + "/resaved", max_shard_size="100KB")
    _, again = load_pretrained(folder + "/resaved", dtype="float32", mesh=mesh)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(single)):
        np.testing.assert_array_equal(a, b)
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])

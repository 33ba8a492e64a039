"""Run by test_sharding.py in a subprocess with 8 simulated CPU devices.

Loads a tiny Qwen3 checkpoint onto a (data=2, fsdp=2, tensor=2) mesh and checks that logits,
token log-probs and their gradients equal the single-device ones, and that a sharded
save_pretrained round-trips; then a tiny Qwen3-MoE checkpoint: its stacked experts sharded like
the MLP, logits and expert ids equal to one device's, the sharded save round-trips. Prints "OK"
on success.
"""

import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxrl4llm.models import (
    batch_sharding,
    forward,
    load_pretrained,
    make_mesh,
    positions_from_mask,
    save_pretrained,
    score_tokens,
)
from tests.models.hf_oracle import left_padded_batch, tiny_hf_model


def main(folder: str) -> None:
    assert jax.device_count() == 8, jax.devices()
    tiny_hf_model("qwen3", tie_word_embeddings=False).save_pretrained(folder)
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    graphdef, sharded = nnx.split(load_pretrained(folder, dtype="float32", mesh=mesh))
    single_graphdef, single = nnx.split(load_pretrained(folder, dtype="float32"))
    assert single_graphdef == graphdef  # placement lives in the state only
    assert sharded["layers"]["attn"]["q_proj"]["kernel"].get_value().sharding.spec == P(None, "fsdp", "tensor", None)
    assert sharded["embed_tokens"]["embedding"].get_value().sharding.spec == P("tensor", "fsdp")
    assert sharded["lm_head"]["kernel"].get_value().sharding.spec == P("fsdp", "tensor")
    assert len(single["embed_tokens"]["embedding"].get_value().devices()) == 1

    tokens, mask = left_padded_batch()
    tokens, mask = np.concatenate([tokens, tokens[:1]]), np.concatenate([mask, mask[:1]])  # 4 rows
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    positions = positions_from_mask(mask)
    targets = jnp.roll(tokens, -1, axis=1)
    place = lambda x: jax.device_put(x, batch_sharding(mesh, x.shape))
    assert place(tokens).sharding.spec == P(("data", "fsdp"), None)

    ref = forward(graphdef, single, tokens, positions=positions, attention_mask=mask)
    out = forward(graphdef, sharded, place(tokens), positions=place(positions), attention_mask=place(mask))
    np.testing.assert_allclose(out, ref, atol=1e-5)

    def loss(state, tokens, positions, mask):
        logp, _ = score_tokens(graphdef, state, tokens, targets, positions=positions, attention_mask=mask,
                               chunk_size=4)
        return jnp.sum(logp * mask)

    ref_grads = jax.jit(jax.grad(loss))(single, tokens, positions, mask)
    grads = jax.jit(jax.grad(loss))(sharded, place(tokens), place(positions), place(mask))
    gate = lambda s: s["layers"]["mlp"]["gate_proj"]["kernel"].get_value().sharding.spec
    assert gate(grads) == gate(sharded)
    assert len(jax.tree.leaves(grads)) == len(jax.tree.leaves(ref_grads)) == len(jax.tree.leaves(sharded))
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)

    save_pretrained((graphdef, sharded), folder + "/resaved", max_shard_size="100KB")
    _, again = nnx.split(load_pretrained(folder + "/resaved", dtype="float32", mesh=mesh))
    assert len(jax.tree.leaves(again)) == len(jax.tree.leaves(single))
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(single)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(sharded)):  # reloaded onto the same placement
        assert a.sharding == b.sharding
    check_moe(folder + "/moe", mesh, tokens, mask, place)
    print("OK")


def check_moe(folder: str, mesh, tokens, mask, place) -> None:
    tiny_hf_model("qwen3_moe").save_pretrained(folder)
    graphdef, sharded = nnx.split(load_pretrained(folder, dtype="float32", mesh=mesh))
    _, single = nnx.split(load_pretrained(folder, dtype="float32"))
    mlp = sharded["layers"]["mlp"]
    assert mlp["gate_proj"].get_value().sharding.spec == P(None, None, "fsdp", "tensor")  # [L, E, D, I]
    assert mlp["down_proj"].get_value().sharding.spec == P(None, None, "tensor", "fsdp")  # [L, E, I, D]
    assert mlp["router"].get_value().sharding.spec == P(None, "fsdp", None)  # [L, D, E]
    positions = positions_from_mask(mask)
    ref, ref_routes = forward(graphdef, single, tokens, positions=positions, attention_mask=mask, return_routes=True)
    out, routes = forward(graphdef, sharded, place(tokens), positions=place(positions), attention_mask=place(mask),
                          return_routes=True)
    np.testing.assert_allclose(out, ref, atol=1e-5)
    np.testing.assert_array_equal(routes, ref_routes)
    save_pretrained((graphdef, sharded), folder + "/resaved", max_shard_size="100KB")
    _, again = nnx.split(load_pretrained(folder + "/resaved", dtype="float32", mesh=mesh))
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(sharded)):
        np.testing.assert_array_equal(a, b)
        assert a.sharding == b.sharding


if __name__ == "__main__":
    main(sys.argv[1])

"""The NNX model: family classes, sharding axes read from parameter metadata, depth-flat
programs, the functional boundary, dtypes as JAX users write them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxrl4llm.models import (CausalLM, ModelConfig, Qwen3ForCausalLM, abstract_model, forward, init_model,
                              load_pretrained, logical_axes, make_mesh, param_shardings)

TINY = dict(architecture="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
            num_kv_heads=2, head_dim=8, dtype="float32")


def test_load_pretrained_gives_the_family_module_and_display_works(hf_checkpoint):
    family, _, folder = hf_checkpoint
    model = load_pretrained(folder, dtype=jnp.float32, param_dtype=jnp.float32)  # dtypes as JAX users write them
    assert isinstance(model, CausalLM) and type(model).__name__.lower().startswith(family.replace("_", ""))
    assert model.config.dtype == "float32" and model.layers.attn.q_proj.kernel.dtype == jnp.float32
    text = repr(model)  # what nnx.display prints without IPython
    assert "DecoderLayer" in text and "q_proj" in text and "out_sharding" in text


def test_sharding_axes_come_from_the_parameters_metadata():
    graphdef, state = abstract_model(ModelConfig(**TINY))
    axes = logical_axes(state)
    assert axes["layers"]["attn"]["q_proj"]["kernel"].get_value() == ("layers", "embed", "heads", "head_dim")
    assert axes["layers"]["mlp"]["down_proj"]["kernel"].get_value() == ("layers", "mlp", "embed")
    assert axes["embed_tokens"]["embedding"].get_value() == ("vocab", "embed")
    for (_, v), (_, a) in zip(nnx.to_flat_state(state), nnx.to_flat_state(axes)):
        assert len(a.get_value()) == len(v.shape)
    # change one parameter's metadata: its sharding follows (the metadata is the only source)
    v = state["layers"]["mlp"]["up_proj"]["kernel"]
    state["layers"]["mlp"]["up_proj"]["kernel"] = v.replace(v.get_value(), out_sharding=("layers", "mlp", "embed"))
    mesh = make_mesh(1, 1, 1)
    rules = (("mlp", "tensor"), ("embed", "fsdp"))
    shardings = param_shardings(state, mesh, rules)
    assert shardings["layers"]["mlp"]["up_proj"]["kernel"].get_value().spec == P(None, "tensor", "fsdp")
    assert shardings["layers"]["mlp"]["gate_proj"]["kernel"].get_value().spec == P(None, "fsdp", "tensor")


def test_program_size_is_flat_in_depth():
    def equations(layers):
        graphdef, state = abstract_model(ModelConfig(**{**TINY, "num_layers": layers}))
        tokens = jnp.zeros((1, 4), jnp.int32)
        jaxpr = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(tokens, tokens, tokens + 1))(state)
        return len(str(jaxpr).splitlines())

    assert equations(2) == equations(12)


def test_functional_boundary_and_eager_module_agree():
    config = ModelConfig(**TINY)
    graphdef, state = init_model(config, jax.random.key(0), std=0.2)
    model = nnx.merge(graphdef, state)
    assert isinstance(model, Qwen3ForCausalLM)
    tokens = jnp.asarray([[3, 4, 5, 6]])
    positions, mask = jnp.arange(4)[None], jnp.ones((1, 4), jnp.int32)
    np.testing.assert_allclose(model(tokens, positions, mask),
                               forward(graphdef, state, tokens, positions=positions, attention_mask=mask), atol=1e-6)
    # a new state of the same shapes reuses the compiled program; the module was never mutated
    state2 = jax.tree.map(lambda x: x * 1.5, state)
    before = forward._cache_size()
    forward(graphdef, state2, tokens, positions=positions, attention_mask=mask)
    assert forward._cache_size() == before


def test_bad_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig(**{**TINY, "dtype": "int8"})
    assert ModelConfig(**{**TINY, "dtype": jnp.bfloat16}).dtype == "bfloat16"

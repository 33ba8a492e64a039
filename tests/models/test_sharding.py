"""Sharded load / forward / grad on 8 simulated CPU devices (in a subprocess), and the rules."""

import os
import subprocess
import sys

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl4llm.models import (DEFAULT_RULES, ModelConfig, abstract_model, logical_axes, logical_to_spec, make_mesh,
                              param_shardings)
from tests.subprocess_xla_flags import xla_flags

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _flat(state) -> dict:
    return {"/".join(map(str, path)): v for path, v in nnx.to_flat_state(state)}


def test_every_param_has_logical_axes_of_its_rank():
    config = ModelConfig(architecture="qwen2", vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, attention_bias=True, qk_norm=False)
    _, shapes = abstract_model(config)
    axes = _flat(logical_axes(shapes))
    shapes = _flat(shapes)
    # Qwen2: q/k/v biases, no q/k norm, no o_proj bias, untied head.
    assert sorted(shapes) == sorted(
        ["embed_tokens/embedding", "final_norm/scale", "lm_head/kernel", "layers/input_norm/scale",
         "layers/post_attn_norm/scale", "layers/attn/o_proj/kernel", "layers/mlp/down_proj/kernel",
         "layers/mlp/gate_proj/kernel", "layers/mlp/up_proj/kernel"]
        + [f"layers/attn/{p}_proj/{w}" for p in "qkv" for w in ("kernel", "bias")])
    assert sorted(axes) == sorted(shapes)
    assert all(len(axes[k].get_value()) == len(shapes[k].shape) for k in shapes)
    names = {name for a in axes.values() for name in a.get_value()}
    assert names <= set(dict(DEFAULT_RULES))
    assert shapes["layers/attn/q_proj/kernel"].shape == (2, 64, 4, 16)
    assert axes["layers/attn/k_proj/bias"].get_value() == ("layers", "kv_heads", "head_dim")
    # param_shardings of the abstract state is the same structure, one NamedSharding per parameter
    shardings = _flat(param_shardings(abstract_model(config)[1], make_mesh(1, 1, 1)))
    assert sorted(shardings) == sorted(shapes)
    assert all(isinstance(s.get_value(), NamedSharding) for s in shardings.values())
    assert shardings["lm_head/kernel"].get_value().spec == P("fsdp", "tensor")


def test_logical_to_spec_drops_axes_that_do_not_divide():
    mesh = jax.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    assert logical_to_spec(("vocab", "embed"), DEFAULT_RULES) == P("tensor", "fsdp")
    assert logical_to_spec(("batch", None), DEFAULT_RULES) == P(("data", "fsdp"), None)
    assert logical_to_spec(("vocab", "embed"), DEFAULT_RULES, shape=(3, 4), mesh=mesh) == P("tensor", "fsdp")


def test_sharded_load_matches_single_device(tmp_path):
    env = dict(os.environ, XLA_FLAGS=xla_flags(8), JAX_PLATFORMS="cpu",  # 8 devices, fast compiles
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-m", "tests.models.sharded_load_main", str(tmp_path)], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stdout + result.stderr

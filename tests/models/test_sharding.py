"""Sharded load / forward / grad on 8 simulated CPU devices (in a subprocess), and the rules."""

import os
import subprocess
import sys

import jax
from jax.sharding import PartitionSpec as P

from jaxrl4llm.models import DEFAULT_RULES, ModelConfig, logical_to_spec, param_logical_axes, param_shapes

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_every_param_has_logical_axes_of_its_rank():
    config = ModelConfig(architecture="qwen2", vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, attention_bias=True, qk_norm=False)
    axes, shapes = param_logical_axes(config), param_shapes(config)
    assert jax.tree.structure(axes, is_leaf=lambda x: isinstance(x, tuple)) == jax.tree.structure(shapes)
    pairs = zip(jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple)), jax.tree.leaves(shapes))
    assert all(len(a) == len(s.shape) for a, s in pairs)
    names = {name for a in jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple)) for name in a}
    assert names <= set(dict(DEFAULT_RULES))


def test_logical_to_spec_drops_axes_that_do_not_divide():
    mesh = jax.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 3)
    assert logical_to_spec(("vocab", "embed"), DEFAULT_RULES) == P("tensor", "fsdp")
    assert logical_to_spec(("batch", None), DEFAULT_RULES) == P(("data", "fsdp"), None)
    assert logical_to_spec(("vocab", "embed"), DEFAULT_RULES, shape=(3, 4), mesh=mesh) == P("tensor", "fsdp")


def test_sharded_load_matches_single_device(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-m", "tests.models.sharded_load_main", str(tmp_path)], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stdout + result.stderr

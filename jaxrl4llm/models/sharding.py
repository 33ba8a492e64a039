"""Logical -> physical sharding: map logical axis names of params/activations to mesh axes.

The mesh has axes ("data", "fsdp", "tensor"). A rules table is a tuple of
(logical_name, mesh_axis | tuple of mesh axes | None) pairs (hashable, so it can be a jit
static argument). A mesh axis that does not divide a dimension, or is already used by an
earlier dimension of the same array, is dropped for that dimension (replicated instead).
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.models.kv_cache import CACHE_LOGICAL_AXES, KVCache
from jaxrl4llm.models.params import ParamSpec, param_specs

MESH_AXES = ("data", "fsdp", "tensor")

DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),  # activations / tokens: data-parallel over data x fsdp
    ("vocab", "tensor"),
    ("embed", "fsdp"),  # FSDP: weights sharded over fsdp along the model dim
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("head_dim", None),
    ("layers", None),
    ("norm", None),
    ("seq", None),
    ("cache_seq", None),
)


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, devices=None) -> Mesh:
    """A ("data", "fsdp", "tensor") mesh with Auto axis types (with_sharding_constraint-friendly)."""
    return jax.make_mesh((data, fsdp, tensor), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3,
                         devices=devices)


def logical_to_spec(axes: tuple[str | None, ...], rules=DEFAULT_RULES, *, shape: tuple[int, ...] | None = None,
                    mesh: Mesh | None = None) -> PartitionSpec:
    """PartitionSpec for an array whose dims carry logical names `axes`.

    With `shape` and `mesh`, mesh axes that do not divide the dim are dropped.
    """
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for dim, name in enumerate(axes):
        target = table.get(name) if name is not None else None
        targets = (target,) if isinstance(target, str) else tuple(target or ())
        kept = []
        size = 1
        for axis in targets:
            if axis in used:
                continue
            if mesh is not None and shape is not None:
                if shape[dim] % (size * mesh.shape[axis]):
                    continue
                size *= mesh.shape[axis]
            kept.append(axis)
            used.add(axis)
        spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    return PartitionSpec(*spec)


def param_shardings(config: ModelConfig, mesh: Mesh, rules=DEFAULT_RULES) -> dict:
    """Pytree (same structure as params) of NamedSharding."""
    return jax.tree.map(
        lambda s: NamedSharding(mesh, logical_to_spec(s.axes, rules, shape=s.shape, mesh=mesh)),
        param_specs(config),
        is_leaf=lambda x: isinstance(x, ParamSpec),
    )


def cache_shardings(config: ModelConfig, mesh: Mesh, batch: int, max_len: int, rules=DEFAULT_RULES) -> KVCache:
    """KVCache of NamedSharding for a cache of `batch` rows and `max_len` slots."""
    shape = (config.num_layers, batch, config.num_kv_heads, max_len, config.head_dim)
    sharding = NamedSharding(mesh, logical_to_spec(CACHE_LOGICAL_AXES, rules, shape=shape, mesh=mesh))
    return KVCache(sharding, sharding)


def batch_sharding(mesh: Mesh, shape: tuple[int, ...], rules=DEFAULT_RULES) -> NamedSharding:
    """NamedSharding of a [B, ...] token/activation array: batch over the "batch" rule's axes."""
    axes = ("batch",) + (None,) * (len(shape) - 1)
    return NamedSharding(mesh, logical_to_spec(axes, rules, shape=shape, mesh=mesh))

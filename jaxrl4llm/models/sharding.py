"""Logical -> physical sharding: map logical axis names of params/activations to mesh axes.

A parameter's logical axes are its own metadata (`out_sharding`, set where the module
creates it: `models/layers/`); `param_shardings` reads them from the state, so a module's
shapes, axes and HF names have one source each.

The mesh has axes ("data", "fsdp", "tensor"). A rules table is a tuple of
(logical_name, mesh_axis | tuple of mesh axes | None) pairs (hashable, so it can be a jit
static argument). A mesh axis that does not divide a dimension, or is already used by an
earlier dimension of the same array, is dropped for that dimension (replicated instead).
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),  # activations / tokens: data-parallel over data x fsdp
    ("vocab", "tensor"),
    ("embed", "fsdp"),  # FSDP: weights sharded over fsdp along the model dim
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("expert", None),  # experts [E, D, I]: whole on every chip along E, sharded like the MLP (FSDP on D)
    ("expert_mlp", "tensor"),
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


def constrain(x: jax.Array, axes: tuple[str | None, ...], rules=DEFAULT_RULES) -> jax.Array:
    """with_sharding_constraint(x, spec of logical `axes`) on the mesh of the current context
    (`jax.set_mesh(mesh)`); the identity when no mesh is set (one device, or callers that place
    everything themselves). Mesh axes that do not divide a dimension are dropped.

    Activations need it under FSDP: without a constraint GSPMD may keep a [B, T, D] activation
    whole on every chip (the batch not split over the fsdp axis), so each chip computes the
    whole batch.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(axes, rules, shape=x.shape, mesh=mesh))


ACTIVATION_AXES = ("batch", "seq", None)  # the residual stream [B, T, D]: rows split, hidden whole
LOGITS_AXES = ("batch", "seq", "vocab")  # logits [B, T, V]: rows split, vocabulary over tensor


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _names(v: nnx.Variable) -> tuple:
    """A parameter's logical axis names (`out_sharding` metadata; None per dim when absent)."""
    names = v.get_metadata().get("out_sharding")
    return tuple(names) if names is not None else (None,) * len(v.shape)


def flat_state(state) -> dict[str, nnx.Variable]:
    """{"layers/attn/q_proj/kernel": Variable, ...}: a model state by parameter path."""
    return {"/".join(str(k) for k in path): v for path, v in nnx.to_flat_state(state)}


def logical_axes(state) -> nnx.State:
    """The state with each parameter's value replaced by its logical axis names (a tuple, one
    name or None per dim), read from the variable's `out_sharding` metadata."""
    return jax.tree.map(lambda v: v.replace(_names(v)), state, is_leaf=_is_variable)


def param_shardings(state, mesh: Mesh, rules=DEFAULT_RULES) -> nnx.State:
    """NamedSharding of every parameter (same structure as the state), from its logical axes.

    state: a model state (arrays or ShapeDtypeStructs; for a config, `abstract_model(config)[1]`).
    Pass the result to `jax.device_put` or as a jit's in/out shardings.
    """
    def sharding(v: nnx.Variable):
        return v.replace(NamedSharding(mesh, logical_to_spec(_names(v), rules, shape=tuple(v.shape), mesh=mesh)))
    return jax.tree.map(sharding, state, is_leaf=_is_variable)


def batch_sharding(mesh: Mesh, shape: tuple[int, ...], rules=DEFAULT_RULES) -> NamedSharding:
    """NamedSharding of a [B, ...] token/activation array: batch over the "batch" rule's axes."""
    axes = ("batch",) + (None,) * (len(shape) - 1)
    return NamedSharding(mesh, logical_to_spec(axes, rules, shape=shape, mesh=mesh))

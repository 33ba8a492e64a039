"""The sampler's mesh: the training mesh's devices regrouped for decoding.

    train mesh (data, fsdp, tensor)  ->  decode mesh (data = n / tp, fsdp = 1, tensor = tp)

Training shards the weights over fsdp and all-gathers them layer by layer; a decode step
would all-gather every weight once per token. So the sampler replicates weights over its
data-parallel rows and splits them only over `tensor`: with the training mesh as it is
(tensor 1 in every shipped config), each chip holds the whole model (16.4 GB in bf16 for
Qwen3-8B, more than a v5e chip) and reads all of it every step. A decode mesh with
tp-way tensor parallelism (verl's and ROLL's rollout `tensor_model_parallel_size`) holds
1/tp of the weights per chip and reads 1/tp per step, at the cost of two all-reduces of
[rows, D] per layer and step. `weights_program` reshards the training state onto it once
per rollout (jit moves arrays between meshes over the same devices).
"""

from __future__ import annotations

import numpy as np
from jax.sharding import Mesh

from jaxrl4llm.models.decode import DECODE_RULES
from jaxrl4llm.sampling.filters import VocabShards


def decode_mesh(mesh: Mesh | None, tensor_parallel: int, *, num_kv_heads: int | None = None) -> Mesh | None:
    """The sampler's ("data", "fsdp", "tensor") mesh over `mesh`'s devices with `tensor_parallel` = tp.

    tp = 0: `mesh` itself (rows over data x fsdp, weights over its tensor axis). Else the
    devices in `mesh` order regrouped as (n / tp, 1, tp): consecutive devices form a
    tensor-parallel group. tp must divide the device count and the model's KV heads (each
    chip holds whole KV heads of its rows).
    """
    if not tensor_parallel:
        return mesh
    devices = np.asarray(mesh.devices).reshape(-1) if mesh is not None else None
    n = 1 if devices is None else devices.size
    if tensor_parallel < 0 or n % tensor_parallel:
        raise ValueError(f"rollout.tensor_parallel={tensor_parallel} must divide the {n} devices of the mesh "
                          f"(0 = decode on the training mesh as it is).")
    if num_kv_heads is not None and num_kv_heads % tensor_parallel:
        raise ValueError(f"rollout.tensor_parallel={tensor_parallel} must divide the model's {num_kv_heads} KV heads "
                          f"(each chip holds whole heads); use a divisor of {num_kv_heads}.")
    if devices is None:
        return None
    return Mesh(devices.reshape(n // tensor_parallel, 1, tensor_parallel), ("data", "fsdp", "tensor"),
                axis_types=mesh.axis_types)


def vocab_shards(mesh: Mesh | None, rules) -> VocabShards | None:
    """Where the decode step's logits [N, V] live on `mesh` under the logical `rules` (the
    backend's): the vocabulary over the "vocab" rule's axis, the rows over the "batch" rule's
    axes. None without a mesh or when the vocabulary is not split (the sampler's one-device path)."""
    if mesh is None:
        return None
    table = dict(rules)
    vocab = table.get("vocab")
    if not isinstance(vocab, str) or mesh.shape.get(vocab, 1) == 1:
        return None
    batch = table.get("batch")
    rows = tuple(a for a in ((batch,) if isinstance(batch, str) else tuple(batch or ())) if a in mesh.shape)
    return VocabShards(mesh, vocab, rows)


def data_parallel_size(mesh: Mesh | None) -> int:
    """Number of ways the sampler splits its rows on `mesh` (the product of the mesh axes of the
    decode layout's "batch" rule, `models.decode.DECODE_RULES`); 1 without a mesh. The prompts of
    a call are padded to a multiple of it, and the continuous engine runs that many shards."""
    if mesh is None:
        return 1
    axes = dict(DECODE_RULES)["batch"]
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    return int(np.prod([mesh.shape[a] for a in axes if a in mesh.shape]))

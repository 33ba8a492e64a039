"""Mixture-of-experts feed-forward (Qwen3-MoE): a softmax top-k router over E SwiGLU experts.

    p = softmax(x W_r)                      router, float32       (Shazeer et al. 2017, arXiv 1701.06538)
    (w, e) = top_k(p, k);  w = w / sum(w)   the renormalisation only when norm_topk_prob (Qwen3-MoE)
    y = sum_j w_j (silu(x G_{e_j}) * x U_{e_j}) D_{e_j}                   (SwiGLU experts, dropless)

Replay (rollout routing replay, R3: Ma et al. 2025, arXiv 2510.11370): the expert ids e are given
(e.g. the sampler's), and w is gathered from the full softmax p at those ids, so the router still
gets a gradient.

The experts run in one of three interchangeable forms (`expert_ffn`; which one where:
`kernels.choice.expert_form_for`), equal in values and gradients:
  ragged_dot      sort the N*k (token, expert) pairs by expert, three grouped matmuls
                  (`grouped_matmul`: `jax.lax.ragged_dot`), and undo the sort by a gather (never a
                  scatter-add): k FFNs per token where the platform has a grouped matmul.
  dense_capacity  every expert on every token, a batched einsum weighted by the [N, E] combine
                  matrix (zero off the chosen experts): E FFNs per token, each expert's weights
                  read once (decode). Dropless: no expert can receive more than N tokens.
  reference       a Python loop over the experts (tests).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.pallas.ops.tpu.megablox.gmm import tgmm
from jax.sharding import PartitionSpec

from jaxrl4llm.core.routing import RouterStats, router_stats
from jaxrl4llm.kernels.choice import (ExpertForm, ExpertWeightGrad, expert_form_for, expert_weight_grad_for,
                                      experts_model_dim_minor)
from jaxrl4llm.models.layers.linear import einsum, normal_init, param
from jaxrl4llm.models.layers.segment_attention import compile_platform
from jaxrl4llm.models.sharding import logical_to_spec


class Experts(NamedTuple):
    """The stacked SwiGLU experts: gate, up [E, D, I]; down [E, I, D]."""

    gate: jax.Array
    up: jax.Array
    down: jax.Array


# ---------------------------------------------------------------------------- router
def router_probs(x: jax.Array, router: jax.Array) -> jax.Array:
    """p = softmax(x W_r) over the experts, in float32 at full precision.

    Args: x [N, D]; router W_r [D, E]. Returns p [N, E] float32.
    """
    logits = jnp.einsum("nd,de->ne", x.astype(jnp.float32), router.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    return jax.nn.softmax(logits, axis=-1)


def replay_route(probs: jax.Array, expert_ids: jax.Array, norm_topk_prob: bool) -> jax.Array:
    """w[n, j] = p[n, e[n, j]] (/ sum_j p[n, e[n, j]] when norm_topk_prob), gathered from the FULL
    softmax (never a top-k-masked one): the router gets a gradient at any given ids.

    Args: probs [N, E] float32; expert_ids [N, k] int. Returns gate weights w [N, k] float32.
    """
    w = jnp.take_along_axis(probs, expert_ids.astype(jnp.int32), axis=-1)
    return w / jnp.sum(w, axis=-1, keepdims=True) if norm_topk_prob else w


def top_k_route(probs: jax.Array, k: int, norm_topk_prob: bool) -> tuple[jax.Array, jax.Array]:
    """(w, e): the k most probable experts e [N, k] int32 (descending; ties to the lower id) and
    their gate weights w [N, k] float32 = `replay_route(probs, e, norm_topk_prob)`."""
    _, ids = jax.lax.top_k(probs, k)
    return replay_route(probs, ids, norm_topk_prob), ids.astype(jnp.int32)


def route_dtype(num_experts: int):
    """The narrowest integer dtype that holds an expert id of `num_experts`: what recorded routes
    are stored in (uint8 up to 256 experts, uint16 up to 65536, else int32)."""
    return jnp.uint8 if num_experts <= 256 else jnp.uint16 if num_experts <= 65536 else jnp.int32


# ---------------------------------------------------------------------------- experts
def _reference(x, expert_ids, gate_weights, experts: Experts, dtype):
    """y = sum_e c[:, e] * FFN_e(x), one expert at a time; c [N, E] the combine weights."""
    combine = _combine(expert_ids, gate_weights, experts.gate.shape[0])
    y = jnp.zeros(x.shape, jnp.float32)
    for e in range(experts.gate.shape[0]):
        h = jax.nn.silu(einsum("nd,di->ni", x, experts.gate[e], dtype)) * einsum("nd,di->ni", x, experts.up[e], dtype)
        y = y + combine[:, e:e + 1] * einsum("ni,id->nd", h, experts.down[e], dtype)
    return y


def _combine(expert_ids, gate_weights, num_experts):
    """c[n, e] = sum_j w[n, j] [e[n, j] == e]: [N, E] float32, zero off the chosen experts."""
    one_hot = jax.nn.one_hot(expert_ids, num_experts, dtype=jnp.float32)  # [N, k, E]
    return jnp.einsum("nke,nk->ne", one_hot, gate_weights.astype(jnp.float32))


def _dense_capacity(x, expert_ids, gate_weights, experts: Experts, dtype):
    """Every expert on every token, weighted by the combine matrix: [E, N, I] or [N, E I] intermediates,
    in the order XLA lays the experts out (`kernels.choice.experts_model_dim_minor`): with the model
    dim minor, three plain matmuls over the experts' (expert, unit) rows (`expert_rows`); else
    einsums over [E, D, I]. Either reads the weights in place."""
    num_experts, _, width = experts.gate.shape
    combine = _combine(expert_ids, gate_weights, num_experts)
    if not experts_model_dim_minor(compile_platform(), width):
        h = jax.nn.silu(einsum("nd,edi->eni", x, experts.gate, dtype)) * einsum("nd,edi->eni", x, experts.up, dtype)
        return einsum("eni,eid->nd", h * combine.T[:, :, None], experts.down, dtype)  # weighted, summed over e and i
    gate, up, down = expert_rows(experts)
    h = jax.nn.silu(einsum("nd,fd->nf", x, gate, dtype)) * einsum("nd,fd->nf", x, up, dtype)  # [N, E I]
    h = (h.reshape(-1, num_experts, width) * combine[:, :, None]).reshape(-1, num_experts * width)
    return einsum("nf,fd->nd", h, down, dtype)  # weighted, summed over the experts and their units


def expert_rows(experts: Experts) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The experts as matrices over their (expert, unit) rows: gate, up [E, D, I] -> [E I, D] (row
    e I + i: W[e, :, i]), down [E, I, D] -> [E I, D]. A transpose and reshape of whole arrays: run it
    where each device holds its experts' own width (`moe_ffn`'s shard_map), since a width split over
    a mesh axis cannot stay split through the merge of (E, I)."""
    e, d, i = experts.gate.shape
    rows = lambda w: jnp.swapaxes(w, 1, 2).reshape(e * i, d)
    return rows(experts.gate), rows(experts.up), experts.down.reshape(e * i, d)


TGMM_TILE = 128  # megablox tgmm's (rows, k, n) tile: TPU's lane width; rows are padded to a multiple of it


def grouped_matmul(a: jax.Array, w: jax.Array, group_sizes: jax.Array, dtype, weight_grad: str = "auto") -> jax.Array:
    """out[r] = a[r] @ w[g(r)], rows sorted by group (rows of group 0 first): `jax.lax.ragged_dot`.

    Args: a [M, K]; w [G, K, N]; group_sizes [G] int32 (sum <= M; rows past the sum give 0); dtype:
      the matmuls' inputs (float32 accumulation, output float32 [M, N]); weight_grad: how the
      backward computes dW[g] = a_g^T dout_g, an `ExpertWeightGrad` or "auto"
      (`kernels.choice.expert_weight_grad_for` the compiling platform). "ragged_dot": JAX's own
      autodiff; "tgmm": a custom VJP whose input gradient is a ragged_dot (dout W_g^T) and weight
      gradient megablox's Pallas `tgmm` (Pallas' interpreter off TPU, for tests), in `dtype`.
    """
    dtype = jnp.dtype(dtype)
    if weight_grad == "auto":
        weight_grad = expert_weight_grad_for(compile_platform()).kernel
    if ExpertWeightGrad(weight_grad) == ExpertWeightGrad.RAGGED_DOT:
        return _ragged_matmul(a.astype(dtype), w.astype(dtype), group_sizes)
    return _tgmm_matmul(a.astype(dtype), w.astype(dtype), group_sizes)


def _ragged_matmul(a, w, group_sizes):
    precision = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None  # as `linear.einsum`
    return jax.lax.ragged_dot(a, w, group_sizes, precision=precision, preferred_element_type=jnp.float32)


@jax.custom_vjp
def _tgmm_matmul(a, w, group_sizes):
    return _ragged_matmul(a, w, group_sizes)


def _tgmm_matmul_fwd(a, w, group_sizes):
    return _ragged_matmul(a, w, group_sizes), (a, w, group_sizes)


def _tgmm_matmul_bwd(residuals, dout):
    """da = dout W_g^T (a ragged_dot: XLA:TPU's grouped kernel); dW[g] = a_g^T dout_g (tgmm)."""
    a, w, group_sizes = residuals
    dout = dout.astype(a.dtype)
    da = _ragged_matmul(dout, jnp.swapaxes(w, 1, 2), group_sizes).astype(a.dtype)
    rows = a.shape[0]
    pad = -rows % TGMM_TILE
    a_t = jnp.pad(a, ((0, pad), (0, 0))).T  # [K, M']: tgmm's lhs; padded rows belong to no group
    dout = jnp.pad(dout, ((0, pad), (0, 0)))
    tiling = (TGMM_TILE, min(TGMM_TILE, a.shape[1]), min(TGMM_TILE, w.shape[2]))
    dw = tgmm(a_t, dout, group_sizes, jnp.float32, tiling, interpret=compile_platform() != "tpu")
    return da, dw.astype(w.dtype), None


_tgmm_matmul.defvjp(_tgmm_matmul_fwd, _tgmm_matmul_bwd)


def _ragged_dot(x, expert_ids, gate_weights, experts: Experts, dtype):
    """Sort the N*k (token, expert) pairs by expert, grouped matmuls, unsort by a gather."""
    n, k = expert_ids.shape
    num_experts = experts.gate.shape[0]
    flat = expert_ids.reshape(-1)  # [N*k]: pair p = n*k + j
    order = jnp.argsort(flat, stable=True)  # pairs by expert
    group_sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # [E], zeros allowed
    xs = jnp.take(x, order // k, axis=0)  # [N*k, D], rows of expert 0 first
    mm = lambda a, w: grouped_matmul(a, w, group_sizes, dtype)
    h = jax.nn.silu(mm(xs, experts.gate)) * mm(xs, experts.up)  # [N*k, I]
    out = mm(h, experts.down)  # [N*k, D]
    unsorted = jnp.take(out, jnp.argsort(order), axis=0).reshape(n, k, -1)  # the inverse permutation
    return jnp.einsum("nkd,nk->nd", unsorted, gate_weights.astype(jnp.float32))


_FORMS = {ExpertForm.RAGGED_DOT: _ragged_dot, ExpertForm.DENSE_CAPACITY: _dense_capacity,
          ExpertForm.REFERENCE: _reference}


def expert_ffn(x: jax.Array, expert_ids: jax.Array, gate_weights: jax.Array, experts: Experts,
               form: str, dtype=jnp.float32) -> jax.Array:
    """y[n] = sum_j w[n, j] FFN_{e[n, j]}(x[n]), FFN_e(x) = (silu(x G_e) * x U_e) D_e; dropless.

    Args: x [N, D]; expert_ids e [N, k] int (distinct per row); gate_weights w [N, k];
      experts: `Experts` [E, D, I], [E, D, I], [E, I, D]; form: an `ExpertForm` name (module
      docstring); dtype: matmul inputs, float32 accumulation (`linear.einsum`'s precision: with
      bfloat16, dense_capacity and reference run bf16 backward matmuls too; ragged_dot's backward is
      JAX's autodiff of `ragged_dot`, or on TPU a custom one with the same matmuls in `dtype`:
      `grouped_matmul`).
    Returns: y [N, D] float32.
    """
    return _FORMS[ExpertForm(form)](x, expert_ids, gate_weights, experts, jnp.dtype(dtype))


def moe_ffn(h: jax.Array, router: jax.Array, experts: Experts, *, k: int, norm_topk_prob: bool, form: str,
            dtype, routes: jax.Array | None = None, phase: str = "train", mesh=None,
            token_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array, RouterStats | None]:
    """The layer's feed-forward: (y [B, T, D] float32, expert ids [B, T, k] int32, router stats) of
    h [B, T, D]: the router's top k, or `routes` [B, T, k] replayed (gate weights from the router's
    full softmax).

    router [D, E]; form: an `ExpertForm` name or "auto" (`kernels.choice.expert_form_for` for the
    compiling platform and `phase`: "train", "prefill" or "decode"). The training forward (`MoE`) and
    the sampler's decode layout (`models.decode.FusedLayer`) both run this. mesh: the mesh h's rows
    are split over (default: the current `jax.set_mesh` context's); each of its batch shards routes
    its own rows (`_per_batch_shard`), and the dense_capacity form (a decode step's) runs there
    even where the rows are not split, its experts' width split over the tensor axis. token_mask
    [B, T] (> 0: counted): the router's `core.routing.RouterStats` over those tokens (the
    load-balancing loss, the router entropy); None: none computed (stats None, the program as
    without)."""
    form = expert_form_for(compile_platform(), phase).kernel if form == "auto" else form

    def rows(h, routes, mask, router, experts):
        b, t, d = h.shape
        x = h.reshape(b * t, d)
        probs = router_probs(x, router)
        if routes is None:
            w, ids = top_k_route(probs, k, norm_topk_prob)
        else:
            ids = routes.reshape(b * t, k).astype(jnp.int32)
            w = replay_route(probs, ids, norm_topk_prob)
        y = expert_ffn(x, ids, w, experts, form, dtype)
        stats = None if mask is None else router_stats(probs, ids, mask.reshape(b * t))
        return y.reshape(b, t, d), ids.reshape(b, t, k), stats

    mesh = mesh if mesh is not None else jax.sharding.get_abstract_mesh()
    split = None if mesh.empty else _row_split(h, mesh)
    if split is None and form == ExpertForm.DENSE_CAPACITY and not mesh.empty and mesh.size > 1:
        split = PartitionSpec(None, None, None)  # rows whole; each device its experts' width (`expert_rows`)
    if split is None:  # one device, or rows not split (the ragged form under GSPMD)
        return rows(h, routes, token_mask, router, experts)
    # megablox's Pallas tgmm declares its output without the varying-axes type a checked shard_map's
    # values carry: where the backward runs it, the shard_map runs unchecked (its transpose then sums
    # the replicated weights' cotangents over the batch shards itself)
    pallas_grad = form == ExpertForm.RAGGED_DOT and \
        expert_weight_grad_for(compile_platform()).kernel == ExpertWeightGrad.TGMM
    return _per_batch_shard(rows, h, routes, token_mask, router, experts, mesh, split, check_vma=not pallas_grad)


def _per_batch_shard(rows, h, routes, token_mask, router, experts: Experts, mesh, split: PartitionSpec,
                     check_vma: bool = True):
    """`rows` run by each batch shard on its own rows (`jax.shard_map` over the batch axes): the sort
    by expert, the grouped matmuls and the unsort stay on the shard. Over rows split across chips,
    GSPMD gathers every chip's tokens for one global sort (Qwen3-30B-A3B's scoring pass on v5p:4x4x4
    asked 227 GiB a chip). The router enters whole; each expert enters with its width split over
    the tensor axis where the mesh has one (`expert_mlp`), the partial outputs summed by one psum;
    the model dim enters whole, as FSDP gathers a layer's weights for its matmuls. Router stats
    (sums) are summed over the batch shards by a psum. split P(None, None, None): the rows whole on
    every device (the dense_capacity form where no batch axis splits them). check_vma: `jax.shard_map`'s."""
    tensor = "tensor" if mesh.shape.get("tensor", 1) > 1 and experts.gate.shape[2] % mesh.shape["tensor"] == 0 \
        else None
    specs = Experts(PartitionSpec(None, None, tensor), PartitionSpec(None, None, tensor),
                    PartitionSpec(None, tensor, None))
    batch_axes = split[0]
    given = {"routes": (routes, split), "token_mask": (token_mask, PartitionSpec(batch_axes, None))}
    given = {name: arg for name, arg in given.items() if arg[0] is not None}

    def local(h, optional, router, experts):
        y, ids, stats = rows(h, optional.get("routes"), optional.get("token_mask"), router, experts)
        y = jax.lax.psum(y, tensor) if tensor else y
        return (y, ids) if stats is None else (y, ids, jax.lax.psum(stats, batch_axes) if batch_axes else stats)

    out_specs = (split, split) if token_mask is None else (split, split, PartitionSpec())
    out = jax.shard_map(local, mesh=mesh, in_specs=(split, {n: a[1] for n, a in given.items()}, PartitionSpec(), specs),
                        out_specs=out_specs, check_vma=check_vma)(h, {n: a[0] for n, a in given.items()}, router,
                                                                  experts)
    return out if token_mask is not None else (*out, None)


def _row_split(h: jax.Array, mesh) -> PartitionSpec | None:
    """The spec that splits h [B, T, D]'s rows over `mesh`'s batch axes (the sharding rules'
    "batch"), or None where no batch axis of size > 1 divides B."""
    spec = logical_to_spec(("batch", None, None), shape=h.shape, mesh=mesh)
    axes = (spec[0],) if isinstance(spec[0], str) else tuple(spec[0] or ())
    return spec if math.prod(mesh.shape[a] for a in axes) > 1 else None


# ---------------------------------------------------------------------------- the module
class MoE(nnx.Module):
    """router [D, E] ("embed", None); experts gate_proj, up_proj [E, D, I] ("expert", "embed",
    "expert_mlp"), down_proj [E, I, D] ("expert", "expert_mlp", "embed")."""

    def __init__(self, config, *, rngs: nnx.Rngs, std: float = 0.02):
        c = config
        d, e, i = c.hidden_size, c.num_experts, c.moe_intermediate_size
        self.k = c.num_experts_per_tok
        self.norm_topk_prob = c.norm_topk_prob
        self.dtype = jnp.dtype(c.dtype)
        self.form = c.expert_form
        self.router = param(normal_init(rngs, (d, e), c.param_dtype, std), ("embed", None))
        self.gate_proj = param(normal_init(rngs, (e, d, i), c.param_dtype, std), ("expert", "embed", "expert_mlp"))
        self.up_proj = param(normal_init(rngs, (e, d, i), c.param_dtype, std), ("expert", "embed", "expert_mlp"))
        self.down_proj = param(normal_init(rngs, (e, i, d), c.param_dtype, std), ("expert", "expert_mlp", "embed"))

    def __call__(self, h: jax.Array, routes: jax.Array | None = None, phase: str = "train",
                 token_mask: jax.Array | None = None) -> tuple[jax.Array, jax.Array, RouterStats | None]:
        """`moe_ffn` over this layer's weights."""
        experts = Experts(self.gate_proj[...], self.up_proj[...], self.down_proj[...])
        return moe_ffn(h, self.router[...], experts, k=self.k, norm_topk_prob=self.norm_topk_prob, form=self.form,
                       dtype=self.dtype, routes=routes, phase=phase, token_mask=token_mask)

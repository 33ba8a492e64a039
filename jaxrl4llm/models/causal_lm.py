"""The decoder-only causal LM (Qwen2/2.5, Qwen3, Llama 3, Qwen3-MoE) as a Flax NNX module, and the pure
functions of its `(graphdef, state)` that every jitted program calls.

    x_0 = embed(tokens)
    x_{l+1} = decoder_layer(x_l)                 (l < L: lax.scan over the stacked layer state)
    logits = norm(x_L) W_head                    (W_head = embed^T when tied)

The residual stream is float32; matmul inputs are `config.dtype` with float32 accumulation.
Qwen2 adds q/k/v biases, Qwen3 per-head q/k RMSNorm, Llama 3 "llama3" RoPE scaling, Qwen3-MoE
a router and experts in place of the MLP (`layers/moe.py`); all share this code (the module only
holds the weights a family has).

Routes: a mixture-of-experts model's forward can return the expert ids each layer chose,
[B, T, L, k], and take them back (`routes`) to force its experts (router replay); the scan over
layers carries them in and out. A dense model has none: routes None, the same programs.

The functional boundary: `graphdef, state = nnx.split(model)` once (or `init_model`,
`load_pretrained`); jitted programs take `state` (an `nnx.State` pytree: optax, orbax and the
sampler treat it as any pytree) with `graphdef` static, and rebuild the module inside with
`nnx.merge`. Nothing mutates a Python object under `jit`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from jaxrl4llm.core.logprobs import token_logprobs_from_head
from jaxrl4llm.core.routing import RouterStats
from jaxrl4llm.kernels import exact as exact_numerics
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.models.layers.attention import causal_padding_mask, dot_product_attention
from jaxrl4llm.models.layers.segment_attention import segment_causal_attention
from jaxrl4llm.models.layers.decoder import DecoderLayer
from jaxrl4llm.models.layers.linear import (Linear, LoraSettings, current_dropout_key, einsum, lora_dropout,
                                            normal_init, param)
from jaxrl4llm.models.layers.norm import RMSNorm
from jaxrl4llm.models.layers.rope import rope_tables
from jaxrl4llm.models.remat import checkpoint_policy
from jaxrl4llm.models.sharding import ACTIVATION_AXES, LOGITS_AXES, constrain


class _SharedAttention(NamedTuple):
    """`CausalLM.shared_prompt_outputs`' attention: prompt(q, k, v) -> (out, (k, v)); rows(kp, vp) -> the
    rows' attend function over their prompt's keys kp and values vp and their own."""

    prompt: Callable
    rows: Callable


def positions_from_mask(attention_mask: Int[Array, "B T"]) -> Int[Array, "B T"]:
    """pos[b, t] = max(cumsum(mask[b])[t] - 1, 0): RoPE positions of a left-padded batch.

    Args: attention_mask [B, T] (1 = real token). Returns [B, T] int32.
    """
    return jnp.maximum(jnp.cumsum(jnp.asarray(attention_mask).astype(jnp.int32), axis=-1) - 1, 0)


class Embed(nnx.Module):
    """embedding [V, D] ("vocab", "embed"): tokens -> rows, and the tied LM head h E^T."""

    def __init__(self, vocab: int, dim: int, *, dtype, param_dtype, rngs: nnx.Rngs, std: float = 0.02,
                 exact: bool = False):
        self.dtype = jnp.dtype(dtype)
        self.exact = exact
        self.embedding = param(normal_init(rngs, (vocab, dim), param_dtype, std), ("vocab", "embed"))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        # mode="clip": an out-of-range id (e.g. -1 padding) must not become NaN, which would leak
        # through masked attention (0 * NaN = NaN).
        return jnp.take(self.embedding[...], tokens, axis=0, mode="clip").astype(jnp.float32)

    def attend(self, h: jax.Array) -> jax.Array:
        """Tied LM head: h [B, T, D] -> h E^T [B, T, V] float32."""
        return einsum("btd,vd->btv", h, self.embedding[...], self.dtype, self.exact)


class CausalLM(nnx.Module):
    """A decoder-only transformer of one of the supported families (`config.architecture`).

    Attributes: embed_tokens (Embed), layers (one DecoderLayer whose parameters are stacked
    [L, ...] on a leading "layers" axis), final_norm (RMSNorm), lm_head (Linear [D, V], None
    when tied). Every parameter carries its logical sharding axes as `out_sharding` metadata.

    Args:
      config: ModelConfig. rngs: nnx.Rngs for the random init (N(0, std^2) matrices, ones for
        norm scales, zeros for biases). lora: LoraSettings to add LoRA adapters (nnx.LoRAParam).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, lora: LoraSettings | None = None,
                 std: float = 0.02):
        c = config
        self.config = c
        self.lora_settings = lora
        exact = c.numerics == "exact"
        self.embed_tokens = Embed(c.vocab_size, c.hidden_size, dtype=c.dtype, param_dtype=c.param_dtype, rngs=rngs,
                                  std=std, exact=exact)

        @nnx.split_rngs(splits=c.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stacked_layers(rngs):
            return DecoderLayer(c, rngs=rngs, lora=lora)

        self.layers = stacked_layers(rngs)
        self.final_norm = RMSNorm(c.hidden_size, ("norm",), eps=c.rms_norm_eps, param_dtype=c.param_dtype,
                                  exact=exact)
        head_lora = lora if lora is not None and "lm_head" in lora.targets else None
        self.lm_head = None if c.tie_word_embeddings else Linear(
            "btd,dv->btv", (c.hidden_size, c.vocab_size), ("embed", "vocab"), dtype=c.dtype,
            param_dtype=c.param_dtype, rngs=rngs, lora=head_lora, std=std, name="lm_head", exact=exact)

    def hidden_states(self, tokens: Int[Array, "B T"], positions: Int[Array, "B T"],
                      attention_mask: Int[Array, "B T"], segment_ids: Int[Array, "B T"] | None = None,
                      routes: Int[Array, "B T L K"] | None = None) -> Float[Array, "B T D"]:
        """`hidden_states_and_routes` without the routes."""
        return self.hidden_states_and_routes(tokens, positions, attention_mask, segment_ids, routes)[0]

    def hidden_states_and_routes(self, tokens: Int[Array, "B T"], positions: Int[Array, "B T"],
                                 attention_mask: Int[Array, "B T"], segment_ids: Int[Array, "B T"] | None = None,
                                 routes: Int[Array, "B T L K"] | None = None
                                 ) -> tuple[Float[Array, "B T D"], Int[Array, "B T L K"] | None]:
        """`layer_outputs` without the router stats."""
        return self.layer_outputs(tokens, positions, attention_mask, segment_ids, routes)[:2]

    def layer_outputs(self, tokens: Int[Array, "B T"], positions: Int[Array, "B T"],
                      attention_mask: Int[Array, "B T"], segment_ids: Int[Array, "B T"] | None = None,
                      routes: Int[Array, "B T L K"] | None = None, router_stats: bool = False
                      ) -> tuple[Float[Array, "B T D"], Int[Array, "B T L K"] | None, RouterStats | None]:
        """h = norm(x_L) [B, T, D] float32; causal + padding masked (attention_mask 1 = real), by
        `segment_causal_attention` (`config.attention_impl`; never a [T, T] mask).

        segment_ids: packed rows (train/packing.py): several sequences in a row, token t attends
        to s <= t of its own segment only (ids 1, 2, ...; 0 = padding); positions restart in
        each segment. Under a mesh context (`jax.set_mesh`), the residual stream is constrained
        at every layer boundary to rows split over (data, fsdp) (`sharding.constrain`).

        routes: a mixture-of-experts model's expert ids [B, T, L, k] to force (None: each router's
        top k). router_stats (static): also the routers' `core.routing.RouterStats` [L, ...] over the
        real tokens (attention_mask > 0, or segment_ids > 0 when packed). Returns (h, the ids the
        layers ran [B, T, L, k] int32, the stats; None for a dense model / when not asked)."""
        c = self.config
        self._check_routes(routes, tokens.shape)
        cos, sin = rope_tables(c, positions)
        # left-padded rows are segments too: 1 real, 0 padding (a pad token sees only pads)
        ids = (attention_mask > 0).astype(jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
        attend = lambda q, k, v: (segment_causal_attention(q, k, v, ids, dtype=jnp.dtype(c.dtype),
                                                           impl=c.attention_impl, numerics=c.numerics), None)
        token_mask = ids if router_stats and c.num_experts else None

        def layer_fn(layer, x, key, route):
            with lora_dropout(key):
                x, _, ran, stats = layer(x, cos, sin, attend, route, token_mask)
            return constrain(x, ACTIVATION_AXES), ran, stats

        x, routes, stats = self._scan_layers(layer_fn, constrain(self.embed_tokens(tokens), ACTIVATION_AXES), routes)
        return self.final_norm(x), routes, stats

    def _check_routes(self, routes, shape):
        """A ValueError naming the expected shape when routes [B, T, L, k] do not fit tokens' `shape`."""
        c = self.config
        if routes is not None and c.num_experts and \
                tuple(routes.shape) != tuple(shape) + (c.num_layers, c.num_experts_per_tok):
            raise ValueError(f"routes of shape {tuple(routes.shape)} for tokens {tuple(shape)}: this model's "
                             f"routes are [batch, positions, layers, k] = {tuple(shape) + (c.num_layers, c.num_experts_per_tok)} "
                             f"({c.num_layers} layers, num_experts_per_tok={c.num_experts_per_tok}); record them with "
                             f"the same model config (generate(record_routes=True)), one entry per input token")

    def hidden_states_shared_prompt(
        self, prompt_tokens: Int[Array, "N P"], prompt_positions: Int[Array, "N P"], prompt_mask: Int[Array, "N P"],
        tokens: Int[Array, "NG T"], positions: Int[Array, "NG T"], attention_mask: Int[Array, "NG T"], group: int,
        prompt_routes: Int[Array, "N P L K"] | None = None, routes: Int[Array, "NG T L K"] | None = None,
    ) -> tuple[Float[Array, "N P D"], Float[Array, "NG T D"]]:
        """`shared_prompt_outputs`' hidden states (h_prompt, h)."""
        return self.shared_prompt_outputs(prompt_tokens, prompt_positions, prompt_mask, tokens, positions,
                                          attention_mask, group, prompt_routes, routes)[:2]

    def shared_prompt_outputs(
        self, prompt_tokens: Int[Array, "N P"], prompt_positions: Int[Array, "N P"], prompt_mask: Int[Array, "N P"],
        tokens: Int[Array, "NG T"], positions: Int[Array, "NG T"], attention_mask: Int[Array, "NG T"], group: int,
        prompt_routes: Int[Array, "N P L K"] | None = None, routes: Int[Array, "NG T L K"] | None = None,
        router_stats: bool = False,
    ) -> tuple[Float[Array, "N P D"], Float[Array, "NG T D"], Any, RouterStats | None]:
        """`hidden_states` of rows [prompt_n ; tokens_r] (r = n*group + j), each prompt run once.

            h([prompt_n ; tokens_r]) = (h_prompt[n], h[r]),  keys of tokens_r = [k(prompt_n) ; k(tokens_r)]

        The `group` rows that answer one prompt share its forward pass (Prefix Grouper, arXiv
        2506.05433): a prompt's hidden states, keys and values depend only on the prompt, so they
        are computed for N prompts instead of N*group rows, and the response tokens attend to
        their prompt's keys. Same values (and gradients, the prompt's summed over its rows) as
        `hidden_states` of the concatenated rows, with group-fold fewer prompt positions.

        Args: prompt_* [N, P] (left-padded prompts, positions, 1 = real); tokens, positions,
          attention_mask [N*group, T] (what follows each row's prompt, its positions continuing
          the prompt's); a mixture-of-experts model's routes to force, both or neither:
          prompt_routes [N, P, L, k] (one prompt's, as its rows share its forward) and routes
          [N*group, T, L, k]; router_stats (static): the routers' `core.routing.RouterStats` [L, ...]
          of the concatenated rows (each prompt's counted `group` times, as `layer_outputs` of the
          rows would).
        Returns (h_prompt [N, P, D], h [N*group, T, D]) float32, final-normed; (the prompt's and the
          rows' expert ids [N, P, L, k], [N*group, T, L, k], or None for a dense model); the stats or
          None.
        """
        c = self.config
        n, p = prompt_tokens.shape
        rows, t = tokens.shape
        if rows != n * group:
            raise ValueError(f"{rows} rows do not answer {n} prompts x group {group}; pass group-major rows "
                             f"(row n*group + j answers prompt n).")
        if (prompt_routes is None) != (routes is None):
            raise ValueError("pass both prompt_routes and routes (the prompt's and the rows' expert ids) or neither")
        self._check_routes(prompt_routes, prompt_tokens.shape)
        self._check_routes(routes, tokens.shape)
        cos_p, sin_p = rope_tables(c, prompt_positions)
        cos_r, sin_r = rope_tables(c, positions)
        attention = self._shared_prompt_attention(prompt_mask, attention_mask, group)
        masks = (prompt_mask, attention_mask) if router_stats and c.num_experts else (None, None)

        def layer_fn(layer, xs, key, route):
            (xp, xr), (route_p, route_r) = xs, (None, None) if route is None else route
            with lora_dropout(key):
                xp, (kp, vp), ids_p, stats_p = layer(xp, cos_p, sin_p, attention.prompt, route_p, masks[0])
            with lora_dropout(None if key is None else jax.random.fold_in(key, 1)):
                xr, _, ids_r, stats_r = layer(xr, cos_r, sin_r, attention.rows(kp, vp), route_r, masks[1])
            stats = None if stats_p is None else jax.tree.map(lambda a, b: a * group + b, stats_p, stats_r)
            ids = None if ids_p is None else (ids_p, ids_r)
            return (constrain(xp, ACTIVATION_AXES), constrain(xr, ACTIVATION_AXES)), ids, stats

        embed = lambda x: constrain(self.embed_tokens(x), ACTIVATION_AXES)
        both = None if routes is None else (prompt_routes, routes)
        (xp, xr), ran, stats = self._scan_layers(layer_fn, (embed(prompt_tokens), embed(tokens)), both)
        return self.final_norm(xp), self.final_norm(xr), ran, stats

    def _shared_prompt_attention(self, prompt_mask, attention_mask, group: int) -> "_SharedAttention":
        """The attention of `shared_prompt_outputs`: the prompt's own (keeping its rotated keys and values), and
        its rows' over [the prompt's keys ; their own]."""
        c = self.config
        n, p = prompt_mask.shape
        rows, t = attention_mask.shape
        dtype = jnp.dtype(c.dtype)
        prompt_attn = causal_padding_mask(prompt_mask)  # [N, P, P]
        sees_prompt = jnp.broadcast_to(jnp.repeat(prompt_mask > 0, group, axis=0)[:, None, :], (rows, t, p))
        rows_attn = jnp.concatenate([sees_prompt, causal_padding_mask(attention_mask)], axis=-1)  # [NG, T, P + T]
        share = lambda a: jnp.repeat(a, group, axis=0)  # [N, ...] -> [N*group, ...]
        prompt_ranges = rows_ranges = None
        if c.numerics == "exact":  # the sampler's kernel: the prompt's real keys, then the row's own
            prompt_ranges = exact_numerics.segment_ranges((prompt_mask > 0).astype(jnp.int32))  # [N, P, 4]
            own = exact_numerics.segment_ranges((attention_mask > 0).astype(jnp.int32))  # [NG, T, 4]
            first_real = jnp.broadcast_to(share(p - jnp.sum(prompt_mask > 0, axis=1))[:, None], (rows, t))
            rows_ranges = jnp.stack([first_real, jnp.full((rows, t), p), own[..., 0] + p, own[..., 1] + p], axis=-1)

        def attention(q, k, v, mask, ranges):
            if ranges is not None:
                return exact_numerics.attention(q, k, v, ranges, dtype=dtype)
            return dot_product_attention(q, k, v, mask, dtype, query_chunk=c.attention_query_chunk)

        def attend_prompt(q, k, v):  # keeps the prompt's (rotated) keys and values for its rows
            return attention(q, k, v, prompt_attn, prompt_ranges), (k, v)

        def attend_rows(kp, vp):
            return lambda q, k, v: (attention(q, jnp.concatenate([share(kp), k], axis=1),
                                              jnp.concatenate([share(vp), v], axis=1), rows_attn, rows_ranges), None)

        return _SharedAttention(attend_prompt, attend_rows)

    def _scan_layers(self, layer_fn, x, routes=None):
        """(x after the L layers, routes out, stats out): lax.scan of layer_fn(layer, x, dropout key or
        None, route) -> (x, ids or None, stats or None) over the stacked layer state, rematerialised per
        `config.remat` / `remat_policy`; x is any pytree. routes: None or a pytree of [B, T, L, k]
        arrays, each layer's [B, T, k] slice passed as `route`; the ids out likewise ([B, T, L, k]
        each, None when layer_fn returns None); the stats stacked [L, ...]."""
        c = self.config
        if routes is not None and not c.num_experts:
            raise ValueError(f"routes (expert ids) given to a dense {c.architecture} model; only mixture-of-experts "
                             f"models take them")
        layer_def, layer_state = nnx.split(self.layers)
        dropout_key = current_dropout_key()  # LoRA dropout (training forwards only): one key per layer
        keys = None if dropout_key is None else jax.random.split(dropout_key, c.num_layers)
        per_layer = jax.tree.map(lambda r: jnp.moveaxis(r, 2, 0), routes)  # [L, B, T, k] each

        def body(x, xs):
            one_layer, key, route = xs
            x, ids, stats = layer_fn(nnx.merge(layer_def, one_layer), x, key, route)
            return x, (ids, stats)

        if c.remat:
            body = jax.checkpoint(body, prevent_cse=False, policy=checkpoint_policy(c.remat_policy))
        x, (ids, stats) = jax.lax.scan(body, x, (layer_state, keys, per_layer))
        return x, jax.tree.map(lambda r: jnp.moveaxis(r, 0, 2), ids), stats

    def logits(self, h: Float[Array, "B T D"]) -> Float[Array, "B T V"]:
        """LM head: h [B, T, D] -> logits [B, T, V] float32."""
        return self.embed_tokens.attend(h) if self.lm_head is None else self.lm_head(h)

    def __call__(self, tokens: Int[Array, "B T"], positions: Int[Array, "B T"],
                 attention_mask: Int[Array, "B T"], routes: Int[Array, "B T L K"] | None = None
                 ) -> Float[Array, "B T V"]:
        """logits [B, T, V] float32. Left-padded rows equal each row run alone (positions from
        `positions_from_mask`); rows at padding positions hold finite garbage. routes: expert
        ids to force (`hidden_states_and_routes`)."""
        return self.logits(self.hidden_states(tokens, positions, attention_mask, routes=routes))


class Qwen2ForCausalLM(CausalLM):
    """Qwen2 / Qwen2.5: q/k/v biases, untied or tied head."""


class Qwen3ForCausalLM(CausalLM):
    """Qwen3: per-head q/k RMSNorm, explicit head_dim."""


class LlamaForCausalLM(CausalLM):
    """Llama 3 / 3.1: "llama3" RoPE scaling."""


class Qwen3MoeForCausalLM(CausalLM):
    """Qwen3-MoE: Qwen3's attention; every layer's MLP a softmax top-k router over SwiGLU experts."""


FAMILY_CLASSES = {"qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM, "llama": LlamaForCausalLM,
                  "qwen3_moe": Qwen3MoeForCausalLM}


def model_class(config: ModelConfig) -> type[CausalLM]:
    """The module class of `config.architecture`."""
    return FAMILY_CLASSES[config.architecture]


# ---------------------------------------------------------------------------- the functional boundary
def merge(graphdef: nnx.GraphDef, state) -> nnx.Module:
    """nnx.merge(graphdef, *states): `state` is one nnx.State or a tuple of them (e.g. LoRA
    adapters and the frozen base, see `models.lora`)."""
    states = state if isinstance(state, tuple) else (state,)
    return nnx.merge(graphdef, *states)


def abstract_model(config: ModelConfig, *, lora: LoraSettings | None = None) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, state of ShapeDtypeStructs): shapes, dtypes and sharding metadata, nothing allocated."""
    model = nnx.eval_shape(lambda: model_class(config)(config, rngs=nnx.Rngs(0), lora=lora))
    return nnx.split(model)


@functools.partial(jax.jit, static_argnames=("config", "lora", "std"))
def _init_state(config: ModelConfig, rng: jax.Array, lora: LoraSettings | None, std: float):
    return nnx.split(model_class(config)(config, rngs=nnx.Rngs(params=rng), lora=lora, std=std))[1]


def init_model(config: ModelConfig, rng: jax.Array, *, lora: LoraSettings | None = None,
               std: float = 0.02) -> tuple[nnx.GraphDef, nnx.State]:
    """A random model as (graphdef, state), built in one jitted program.

    To create it sharded: `jax.device_put(state, param_shardings(state, mesh))`, or jit
    `_init_state` with those out_shardings for models too large for one device.
    """
    graphdef, _ = abstract_model(config, lora=lora)
    return graphdef, _init_state(config, rng, lora, std)


@functools.partial(jax.jit, static_argnames=("graphdef", "return_routes"))
def forward(graphdef: nnx.GraphDef, state, tokens: Int[Array, "B T"], *, positions: Int[Array, "B T"],
            attention_mask: Int[Array, "B T"], routes: Int[Array, "B T L K"] | None = None,
            return_routes: bool = False):
    """logits = merge(graphdef, state)(tokens, positions, attention_mask): [B, T, V] float32.

    A mixture-of-experts model: routes [B, T, L, k] forces its experts (router replay; None: each
    router's top k); return_routes (static) returns (logits, the expert ids the layers ran
    [B, T, L, k] int32)."""
    model = merge(graphdef, state)
    if not return_routes:  # a model of the user's (model.module) takes no routes
        return model(tokens, positions, attention_mask) if routes is None else \
            model(tokens, positions, attention_mask, routes)
    h, ran = model.hidden_states_and_routes(tokens, positions, attention_mask, routes=routes)
    return model.logits(h), ran


@functools.partial(jax.jit, static_argnames=("graphdef",))
def hidden_states(graphdef: nnx.GraphDef, state, tokens: Int[Array, "B T"], *, positions: Int[Array, "B T"],
                  attention_mask: Int[Array, "B T"]) -> Float[Array, "B T D"]:
    """Final-norm hidden states [B, T, D] float32 of a model with a `hidden_states` method."""
    return merge(graphdef, state).hidden_states(tokens, positions, attention_mask)


@functools.partial(jax.jit, static_argnames=("graphdef", "chunk_size", "first_scored", "prompt_group", "router_stats"))
def score_tokens(graphdef: nnx.GraphDef, state, tokens: Int[Array, "B T"], targets: Int[Array, "B T"], *,
                 positions: Int[Array, "B T"], attention_mask: Int[Array, "B T"], temperature: Any = 1.0,
                 chunk_size: int = 128, dropout_rng: jax.Array | None = None, first_scored: int = 0,
                 prompt_group: int = 1, segment_ids: Int[Array, "B T"] | None = None,
                 routes: Int[Array, "B T L K"] | None = None, router_stats: bool = False
                 ) -> tuple[Float[Array, "B T"], Float[Array, "B T"]]:
    """(log p(targets), entropy) [B, T] float32 under softmax(logits / temperature), differentiable.

    logp[b, t] = log_softmax(z)[targets[b, t]], entropy = logZ - E_p[z] (max-subtracted,
    `core.token_logprobs_from_head`), z = logits[b, t] / temperature. A model with
    `hidden_states` and `logits` methods (ours, and the bring-your-own protocol's optional
    pair) gets its LM head applied `chunk_size` positions at a time, so the [B, T, V] logits
    never exist at once; any other model's `__call__` logits are scored whole.
    Targets outside [0, V) (e.g. -100) are clipped, never NaN: mask those positions.
    dropout_rng: a key for LoRA adapter dropout (the trainer's update passes one; None = none).
    first_scored: static; positions before it are not scored (logp and entropy 0 there) and the
      LM head never runs on them: the trainer passes the prompt length - 1, so only response
      targets are scored.
    prompt_group: static; G > 1 says rows n*G .. n*G+G-1 share their first `first_scored + 1`
      tokens (one prompt, its G responses): each prompt then runs once
      (`CausalLM.hidden_states_shared_prompt`), same values. Needs first_scored > 0.
    segment_ids: packed rows (`CausalLM.hidden_states`); only for models with hidden_states.
    routes: a mixture-of-experts model's expert ids [B, T, L, k] to force (router replay;
      `CausalLM.layer_outputs`); with prompt_group > 1 each prompt runs with its group's first row's
      prompt routes (`CausalLM.shared_prompt_outputs`).
    router_stats: static; returns (logp, entropy, the routers' `core.routing.RouterStats` [L, ...]
      over the real tokens) for a mixture-of-experts CausalLM (the load-balancing loss's input).
    """
    with lora_dropout(dropout_rng):
        return _score(merge(graphdef, state), tokens, targets, positions, attention_mask, temperature, chunk_size,
                      first_scored, prompt_group, segment_ids, routes, router_stats)


def _score(model, tokens, targets, positions, attention_mask, temperature, chunk_size, first_scored=0,
           prompt_group=1, segment_ids=None, routes=None, router_stats=False):
    own = hasattr(model, "hidden_states") and hasattr(model, "logits")  # else: a module that returns logits
    if (routes is not None or router_stats) and not (own and hasattr(model, "layer_outputs")):
        raise ValueError("routes (expert ids) and router stats are scored on jaxrl4llm's CausalLM only")
    if router_stats and not model.config.num_experts:
        raise ValueError(f"router stats asked of a dense {model.config.architecture} model; only mixture-of-experts "
                         f"models have routers")
    stats = None
    if prompt_group > 1:
        if not first_scored or not hasattr(model, "hidden_states_shared_prompt"):
            raise ValueError("prompt_group > 1 needs first_scored > 0 (the prompt's length - 1) and a model with "
                             "hidden_states_shared_prompt (jaxrl4llm's CausalLM).")
        p, g = first_scored + 1, prompt_group
        if tokens.shape[0] % g:
            raise ValueError(f"{tokens.shape[0]} rows are not whole groups of prompt_group={g}.")
        args = (tokens[::g, :p], positions[::g, :p], attention_mask[::g, :p], tokens[:, p:], positions[:, p:],
                attention_mask[:, p:], g)
        if routes is None and not router_stats:
            h_prompt, h_rows = model.hidden_states_shared_prompt(*args)
        else:
            h_prompt, h_rows, _, stats = model.shared_prompt_outputs(
                *args, None if routes is None else routes[::g, :p], None if routes is None else routes[:, p:],
                router_stats=router_stats)
        # the first scored position is the prompt's last: its hidden state is the prompt's
        h = jnp.concatenate([jnp.repeat(h_prompt[:, -1:], g, axis=0), h_rows], axis=1)
    elif segment_ids is not None and not own:
        raise ValueError("segment_ids (packed rows) need a model with hidden_states (jaxrl4llm's CausalLM); "
                         "set trainer.packing=false for this model.")
    elif routes is not None or router_stats:
        h, _, stats = model.layer_outputs(tokens, positions, attention_mask, segment_ids, routes, router_stats)
        h = h[:, first_scored:]
    elif segment_ids is not None:
        h = model.hidden_states(tokens, positions, attention_mask, segment_ids)[:, first_scored:]
    else:
        h = (model.hidden_states if own else model)(tokens, positions, attention_mask)[:, first_scored:]
    logp, entropy = _score_head(model, h, targets, temperature, chunk_size, first_scored, own)
    return (logp, entropy, stats) if router_stats else (logp, entropy)


def _score_head(model, h, targets, temperature, chunk_size, first_scored=0, own=True):
    """(logp, entropy) [B, T] of hidden states h [B, T - first_scored, D] (logits: `model.logits`,
    or h itself for a module that returns logits), 0 before `first_scored`."""
    inv_temperature = 1.0 / jnp.asarray(temperature, jnp.float32)
    if own:
        head = lambda hc: constrain(model.logits(hc), LOGITS_AXES) * inv_temperature
    else:
        head = lambda zc: zc * inv_temperature
    exact = own and getattr(getattr(model, "config", None), "numerics", "default") == "exact"
    logp, entropy = token_logprobs_from_head(head, h, targets[:, first_scored:], chunk_size=chunk_size,
                                             return_entropy=True,
                                             logprob_fn=exact_numerics.token_logprobs if exact else None)
    if not first_scored:
        return logp, entropy
    pad = lambda x: jnp.pad(x, ((0, 0), (first_scored, 0)))
    return pad(logp), pad(entropy)


@functools.partial(jax.jit, static_argnames=("graphdef", "chunk_size", "first_scored"))
def score_tokens_with_routes(graphdef: nnx.GraphDef, state, tokens: Int[Array, "B T"], targets: Int[Array, "B T"],
                             *, positions: Int[Array, "B T"], attention_mask: Int[Array, "B T"], temperature: Any = 1.0,
                             chunk_size: int = 128, first_scored: int = 0
                             ) -> tuple[Float[Array, "B T"], Int[Array, "B T L K"], RouterStats]:
    """(log p(targets) [B, T], routes [B, T, L, k] int32, router stats [L, ...]) of a mixture-of-experts
    model routing natively: `score_tokens`' log-probs (no replay), the experts each layer's router
    chose for each position (top k of its softmax) and the routers' `core.routing.RouterStats` over
    the real tokens. What router replay's metrics compare with the sampler's routes and log-probs
    (`core.routing`)."""
    model = merge(graphdef, state)
    h, routes, stats = model.layer_outputs(tokens, positions, attention_mask, router_stats=True)
    logp, _ = _score_head(model, h[:, first_scored:], targets, temperature, chunk_size, first_scored)
    return logp, routes, stats

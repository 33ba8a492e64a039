"""What a rollout holds per chip, counted from the shapes (no compile), and the chunk that fits.

    decode bytes per chip = decode weights / tp + KV cache(chunk) / (dp * tp) + per-row tables(chunk) / dp

`jaxrl4llm plan` prints these beside XLA's figures for the same programs (docs/scaling.md:
within 15% on the shipped configs), and `rollout.prompts_per_chunk: auto` sizes the chunk of
prompts sampled at once from them: the largest chunk whose decode program fits the budget.

Shapes (N = prompts * G rows, T the prompt bucket, R = max_new_tokens, L layers, KVH kv
heads, Dh head dim, dp = the decode mesh's data x fsdp, tp its tensor axis):
    decode weights   L (D (H + 2 KVH) Dh + H Dh D + 3 D F) + V D (head) in the compute dtype, the
                     embedding table (V x D, kept in the state's dtype) and norms
    prompt KV        2 L P T KVH Dh                      (shared by the G samples of a prompt)
    generated KV     2 L N (blocks x blk) KVH Dh         (blocks of `block_size_for` slots)
    blocks in flight 2 x 2 L N blk KVH Dh                (XLA holds about two blocks beyond the cache:
                                                          the block the loop fills is copied into the
                                                          loop's carry, and sealed into another layout;
                                                          measured 1.8-1.9 blocks on v5p, Qwen3-8B shapes)
    per-row tables   N R (2 Dh (rotary cos, sin) + 4 (uniforms, tokens, 2 log-probs)) float32
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jaxrl4llm.kernels.choice import ExpertForm, expert_form_for, minor_dim_size, prefill_expert_copy_width
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.models.layers.moe import route_dtype
from jaxrl4llm.sampling.buckets import PROMPT_BUCKETS, bucket
from jaxrl4llm.sampling.continuous import PAGE_SIZE, shard_sizes
from jaxrl4llm.sampling.decode_loop import block_size_for

# The share of a device's memory limit (`memory_stats()["bytes_limit"]`: what JAX's allocator hands
# the process) that the sampler's automatic sizing fills (`rollout.slots: auto`,
# `rollout.prompts_per_chunk: auto`), by the loop on the device and by `plan` on a topology's chip.
SIZING_SHARE = 0.85


def decode_weight_bytes(config: ModelConfig, *, tensor_parallel: int = 1, embed_dtype="float32") -> int:
    """Bytes per chip of `models.decode.decode_weights`: matmul weights (and an untied or tied
    head copy) in the compute dtype, split tp ways; the lookup embedding in `embed_dtype`."""
    c = config
    table = c.vocab_size * c.hidden_size
    # the decoder layers and final norm: every parameter but the embedding and an untied head
    layers = c.num_params - table - (0 if c.tie_word_embeddings else table)
    compute = (layers + table) * jnp.dtype(c.dtype).itemsize  # + the head, always a copy of its own
    embed = table * jnp.dtype(embed_dtype).itemsize
    return (compute + embed) // tensor_parallel


def decode_sizing(config: ModelConfig, decode_mesh, *, samples: int, prompt_len: int, max_new_tokens: int) -> dict:
    """The shape keywords of decode_memory / prompts_per_chunk for sampling on `decode_mesh`
    (None: one device): samples, the prompt bucket of `prompt_len` (the longest prompt, in
    tokens), max_new_tokens, the KV block size, the mesh's data parallelism (data x fsdp) and
    tensor parallelism, and the embedding's dtype (the state's)."""
    dp = 1 if decode_mesh is None else decode_mesh.shape["data"] * decode_mesh.shape["fsdp"]
    tp = 1 if decode_mesh is None else decode_mesh.shape["tensor"]
    return dict(samples=samples, prompt_len=bucket(prompt_len, PROMPT_BUCKETS), max_new_tokens=max_new_tokens,
                block_size=block_size_for(max_new_tokens, config.num_kv_heads * config.head_dim),
                data_parallel=dp, tensor_parallel=tp, embed_dtype=config.param_dtype)


def decode_memory(config: ModelConfig, *, prompts: int, samples: int, prompt_len: int, max_new_tokens: int,
                  block_size: int, data_parallel: int, tensor_parallel: int = 1, embed_dtype="float32") -> dict:
    """Per-chip bytes of the sampler's decode program by category (see the module docstring).

    prompts: prompts sampled at once (one chunk, padded to a multiple of data_parallel).
    """
    c = config
    rows = prompts * samples
    width = 2 * c.num_layers * c.num_kv_heads * c.head_dim * jnp.dtype(c.dtype).itemsize  # K and V of one token
    blocks = -(-(max_new_tokens - 1) // block_size)
    split = data_parallel * tensor_parallel
    return {
        "decode weights": decode_weight_bytes(config, tensor_parallel=tensor_parallel, embed_dtype=embed_dtype),
        "KV cache": width * (prompts * prompt_len + rows * blocks * block_size) // split,
        "blocks in flight": 2 * width * rows * block_size // split,
        "per-row tables": rows * max_new_tokens * (2 * c.head_dim + 4) * 4 // data_parallel,
    }


def weights_program_memory(config: ModelConfig, *, param_bytes: int, tensor_parallel: int = 1,
                           embed_dtype="float32") -> dict:
    """Per-chip bytes of the program that builds the decode weights from the training state: the
    state's shard (its argument), the decode weights (its output) and, while XLA gathers the
    FSDP shards, the largest weight whole: the V x D embedding table in the state's dtype, and
    with tied embeddings also its transposed head copy in the compute dtype (measured on v5p:
    Qwen3-8B, tp 4, 2.43 GiB of temporaries against our 2.32; Qwen3-4B, tied, tp 2, 2.54 against
    2.17)."""
    table = config.vocab_size * config.hidden_size
    head_copy = table * jnp.dtype(config.dtype).itemsize if config.tie_word_embeddings else 0
    return {"parameters": param_bytes,
            "decode weights": decode_weight_bytes(config, tensor_parallel=tensor_parallel, embed_dtype=embed_dtype),
            "gathering the embedding": table * jnp.dtype(embed_dtype).itemsize + head_copy}


def prompts_per_chunk(config: ModelConfig, budget_bytes: float, *, prompts: int, samples: int, prompt_len: int,
                      max_new_tokens: int, block_size: int, data_parallel: int, tensor_parallel: int = 1,
                      embed_dtype="float32") -> int:
    """The largest chunk of prompts (all of them, or a multiple of data_parallel) whose decode
    memory fits `budget_bytes` per chip; data_parallel when even that does not fit (the plan
    then reports the program as not fitting)."""
    def fits(chunk: int) -> bool:
        used = decode_memory(config, prompts=chunk, samples=samples, prompt_len=prompt_len,
                             max_new_tokens=max_new_tokens, block_size=block_size, data_parallel=data_parallel,
                             tensor_parallel=tensor_parallel, embed_dtype=embed_dtype)
        return sum(used.values()) <= budget_bytes

    padded = math.ceil(prompts / data_parallel) * data_parallel
    if fits(padded):
        return prompts
    best = data_parallel
    lo, hi = 1, padded // data_parallel  # chunk = k * data_parallel; memory grows with k
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(mid * data_parallel):
            best, lo = mid * data_parallel, mid + 1
        else:
            hi = mid - 1
    return best


def continuous_memory(config: ModelConfig, *, prompts: int, slots: int, samples: int, prompt_len: int,
                      max_new_tokens: int, data_parallel: int, tensor_parallel: int = 1, embed_dtype="float32",
                      page_size: int | None = None, record_routes: bool = False, platform: str) -> dict:
    """Per-chip bytes of the continuous sampler (`sampling.continuous`) on `platform` ("tpu", "gpu",
    "cpu": the sampler mesh's devices) by category.

    page pool      2 L (1 + S_d ceil((page-1 + R-1)/page) + (S_d + 1) ceil(T/page)) page KVH Dh / tp
                   (`paged_cache.pool_pages`: a pool that never runs dry; S_d = slots / dp; the
                   engine's own sizes, `continuous.shard_sizes`, as `Engine.resolve` reads them)
    prefill        A T (2 (H/tp) T + 3 F/tp + 4 D) 4    (one layer's prefill of A = min(P_d, S_d / G)
                   prompts at once, float32: scores and probabilities, gate, up and their product, the
                   residual, its norm and the two outputs; while the pool is held)
    per-row tables N R (4 uniforms + 12 tokens and two log-probs) / dp             (every row's outputs)
    score row      S_d H (pages of a slot) page 4 / tp                              (one layer's, float32)
    routes         (N R + P T) [L k] b / dp  (`record_routes`: a mixture-of-experts model's expert ids of
                   every response and prompt token, b bytes an id (`models.layers.moe.route_dtype`),
                   L k one minor dim: [L k] rounds it up to whole 128-lane rows on TPU,
                   `kernels.choice.minor_dim_size`)
    page pool copy the page pool again      (a mixture of experts on TPU: `tpu_moe_pool_copies`)
    expert copies  2 L E D I' c             (a mixture of experts: every layer's gate and up copied for the
                   prefill's expert form, I' = I/tp padded to whole lanes, c the compute dtype's bytes;
                   `kernels.choice.prefill_expert_copy_width`, nonzero on TPU where I/tp is not a
                   multiple of 128: Qwen3-30B-A3B at tp 4)

A mixture-of-experts layer's prefill holds, with the ragged form (the prefill's on TPU,
`kernels.choice.expert_form_for`), k expert intermediates a token (3 k I for F: the sorted copies of
the token's k (token, expert) pairs) and 2 k D more: its [N k, D] float32 output and the gather that
unsorts it (Qwen3-30B-A3B on v5p: two f32[32768, 2048] for 4 prompts of 1024 tokens); with
dense_capacity (GPU, CPU) every expert's intermediates, 3 E I for F.

    XLA's TPU compile holds the pool once (Qwen3-8B's rollout shard on v5p, 64 slots, tp 4: 22.4
    GiB of temporaries for a 20.3 GiB pool, ours/XLA 0.97 in all; 39.4 GiB before). The extra came
    from every layer's prefill outputs, kept alive until `models.decode.prefill_kv` put a barrier
    after each layer, and, with fewer slots than rows, from pool copies in the refill's `lax.cond`
    between two prefill loops (now two loops in a row; docs/sampling.md).
    """
    c = config
    page = page_size or PAGE_SIZE
    per_shard = -(-slots // data_parallel)
    sizes = shard_sizes(prompts_per_shard=math.ceil(prompts / data_parallel), slots_per_shard=per_shard,
                        samples=samples, prompt_len=prompt_len, max_new_tokens=max_new_tokens, page_size=page)
    tp_pages, rp_pages, at_once = sizes.prompt_pages, sizes.response_pages, sizes.prefill_prompts  # the engine's
    width = 2 * c.num_layers * c.num_kv_heads * c.head_dim * jnp.dtype(c.dtype).itemsize  # K and V of one token
    rows = math.ceil(prompts / data_parallel) * samples
    pool = width * sizes.pool_pages * page // tensor_parallel
    ragged = c.num_experts and expert_form_for(platform, "prefill").kernel == ExpertForm.RAGGED_DOT
    ffn = ((c.num_experts_per_tok if ragged else c.num_experts) * c.moe_intermediate_size if c.num_experts
           else c.intermediate_size)
    per_token = 2 * c.num_heads * prompt_len // tensor_parallel + 3 * ffn // tensor_parallel + 4 * c.hidden_size
    if ragged:
        per_token += 2 * c.num_experts_per_tok * c.hidden_size  # the sorted pairs' output, unsorted
    memory = {
        "decode weights": decode_weight_bytes(config, tensor_parallel=tensor_parallel, embed_dtype=embed_dtype),
        "page pool": pool,
        "prefill": at_once * prompt_len * per_token * 4,
        "per-row tables": rows * max_new_tokens * 16,
        "score row": per_shard * c.num_heads * (tp_pages + rp_pages) * page * 4 // tensor_parallel,
    }
    if record_routes:
        prompts_here = math.ceil(prompts / data_parallel)
        ids = minor_dim_size(platform, c.num_layers * c.num_experts_per_tok)
        memory["routes"] = (rows * max_new_tokens + prompts_here * prompt_len) * ids * \
            jnp.dtype(route_dtype(c.num_experts)).itemsize
    if copies := tpu_moe_pool_copies(platform, c):
        memory["page pool copy"] = copies * pool
    if c.num_experts:
        width = c.moe_intermediate_size
        copy_width = prefill_expert_copy_width(platform, width // tensor_parallel if width % tensor_parallel == 0
                                               else width)  # the experts' width split where tp divides it
        memory["expert copies"] = 2 * c.num_layers * c.num_experts * c.hidden_size * copy_width * \
            jnp.dtype(c.dtype).itemsize
    return memory


def tpu_moe_pool_copies(platform: str, config: ModelConfig) -> int:
    """Page pools beyond the engine's own that a compiled mixture-of-experts decode program holds on
    `platform`: 1 on TPU, else 0. Measured, cause unnamed: XLA:TPU's `memory_analysis()` of a
    Qwen3-30B-A3B sampler (libtpu 0.0.42.1, 512 slots) exceeds its buffer assignment's allocations by
    the pool and the routes again at 1, 2, 3 and 48 layers (0.20, 0.33, 0.54 and 7.08 GiB;
    docs/results/scaling.md), and a dense model's program does not; no buffer of the assignment is
    that size. Counted so `rollout.slots: auto` does not over-fill an MoE sampler on TPU. H100s'
    programs (jax-cuda12-plugin 0.10.2) hold the pool once."""
    return int(platform == "tpu" and bool(config.num_experts))


def slots_that_fit(config: ModelConfig, budget_bytes: float, *, prompts: int, samples: int, prompt_len: int,
                   max_new_tokens: int, data_parallel: int, tensor_parallel: int = 1, embed_dtype="float32",
                   record_routes: bool = False, platform: str, **unused) -> int:
    """`rollout.slots: auto`: the most slots (all rows at most, a multiple of data_parallel, at least
    one per shard) whose `continuous_memory` on `platform` fits `budget_bytes` per chip."""
    def fits(per_shard: int) -> bool:
        used = continuous_memory(config, prompts=prompts, slots=per_shard * data_parallel, samples=samples,
                                 prompt_len=prompt_len, max_new_tokens=max_new_tokens, data_parallel=data_parallel,
                                 tensor_parallel=tensor_parallel, embed_dtype=embed_dtype, record_routes=record_routes,
                                 platform=platform)
        return sum(used.values()) <= budget_bytes

    lo, hi = 1, math.ceil(prompts / data_parallel) * samples
    best = 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(mid):
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best * data_parallel

"""generate(): the sampler's public entry point (host side: validate, bucket, pad, run, trim).

    rollout = generate(graphdef, state, prompts, num_samples=G, max_new_tokens=R, ...)

Takes the model as the train step holds it, `(graphdef, state)` of an NNX model (any dtype,
any sharding, LoRA adapters included: the device program merges adapters, casts to
`config.dtype` and reshards to the decode layout on device) and returns a `Rollout` of
N = len(prompts) * G rows whose arrays stay on device. Our `CausalLM` runs the KV-cache
decoder (`decode_loop.py`); any other NNX causal LM (docs/models.md, "Bring your own NNX
model") runs `generic_decode.py`. Two engines run our models: "continuous" (the default,
`continuous.py`: S slots over a paged KV cache, refilled as rows finish) and "static"
(`decode_loop.py`: all rows, or chunks of prompts, decoded to their longest row; the reference);
they give the same rows (row n's uniforms depend on n only).
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxrl4llm.kernels.choice import (DecodeAttention, require_engine_for_numerics)
from jaxrl4llm.kernels.native import load_kernels, require_kernels
from jaxrl4llm.models.causal_lm import CausalLM, merge
from jaxrl4llm.models.decode import DECODE_RULES
from jaxrl4llm.models.sharding import logical_to_spec
from jaxrl4llm.sampling.buckets import BATCH_BUCKETS, PROMPT_BUCKETS, bucket, left_pad_prompts
from jaxrl4llm.sampling.decode_loop import block_size_for, decode_backend, sample_program, weights_program
from jaxrl4llm.sampling.continuous import (BURST, PAGE_SIZE, continuous_program, engine_spec_for, tool_init,
                                           tool_result, tool_resume, tool_segment)
from jaxrl4llm.sampling.generic_decode import generic_sample_program
from jaxrl4llm.sampling.rollout import Rollout
from jaxrl4llm.sampling.decode_mesh import data_parallel_size
from jaxrl4llm.sampling.stops import apply_stop_strings, end_token_ids, stop_token_sequences, trigger_token_sequences
from jaxrl4llm.sampling.tool_rollout import SEGMENT_STEPS, ToolStats, run_tools
from jaxrl4llm.tools.protocol import ToolFormat, ToolsSpec, tool_format


def use_cpu_kernels(requested: bool | None, mesh: Mesh | None) -> bool:
    """Whether a sampler call runs the C++ CPU kernels (`jaxrl4llm.kernels`), from generate()'s
    `cpu_kernels` option (also `PartialRollouts`'): None = when the call runs on one CPU device and
    the kernels build; True = required (ValueError on another platform or a multi-device mesh, and
    `kernels.native.require_kernels` says what is missing); False = never."""
    if requested is False:
        return False
    devices = list(mesh.devices.flat) if mesh is not None else None
    on_cpu = {d.platform for d in devices} == {"cpu"} if devices is not None else jax.default_backend() == "cpu"
    single_device = mesh is None or mesh.size == 1
    if requested is None:
        return single_device and on_cpu and load_kernels()
    if not on_cpu:
        raise ValueError("cpu_kernels=True, but the sampler runs on "
                         f"{jax.default_backend() if devices is None else devices[0].platform}: the kernels are "
                         f"CPU-only; pass cpu_kernels=None or False")
    if not single_device:
        raise ValueError("cpu_kernels=True with a multi-device mesh: the kernels run unsharded; pass "
                         "cpu_kernels=None or False (the sharded sampler uses XLA ops)")
    require_kernels()
    return True


def generate(graphdef, state, prompts: Sequence[Sequence[int]], *, num_samples: int, max_new_tokens: int,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, eos_token_ids: Sequence[int],
             pad_token_id: int, rng: jax.Array, mesh: Mesh | None = None, greedy: bool = False,
             max_prompt_length: int | None = None, prompt_buckets: Sequence[int] = PROMPT_BUCKETS,
             batch_buckets: Sequence[int] = BATCH_BUCKETS, kv_block_size: int | None = None,
             cpu_kernels: bool | None = None, prompts_per_chunk: int | None = None, engine: str = "continuous",
             slots: int | None = None, kv_page_size: int = PAGE_SIZE, decode_burst: int = BURST,
             row_max_new_tokens: Sequence[int] | None = None,
             paged_attention: str | DecodeAttention | None = None, min_p: float = 0.0,
             stop_token_ids: Sequence[int] = (), stop_strings: Sequence[str] = (), tokenizer=None,
             record_routes: bool = False) -> Rollout:
    """Sample `num_samples` responses per prompt: y_t ~ softmax(min-p/top-k/top-p(logits / temperature)).

    Args:
      graphdef, state: the NNX model, `nnx.split(model)` (state: one nnx.State or a tuple of
        them, e.g. (LoRA adapters, frozen base)).
      prompts: P token-id lists (unpadded, any lengths >= 1).
      num_samples: G responses per prompt (rows p*G .. p*G+G-1 answer prompt p).
      max_new_tokens: R, the response budget (Rollout arrays are [N, R]).
      temperature (> 0), top_p (in (0, 1]), top_k (0 = off), min_p (in [0, 1], 0 = off; keep
        p >= min_p * p_max, `filters.min_p_keep`): the sampling distribution.
      greedy: argmax decoding (ignores temperature/top-k/top-p for the choice).
      eos_token_ids: tokens that end a response (kept in the response, masked after).
      stop_token_ids: more tokens that end a response, exactly as an EOS (`stops`; vLLM's stop_token_ids).
      stop_strings: a response ends with the token that completes the first of these strings in
        its text (`stops.apply_stop_strings`, on the host after decoding; needs `tokenizer`); a row
        whose last tokens spell one (`stops.stop_token_sequences`) also ends there inside the decode
        loop (the continuous engine frees its slot).
      tokenizer: what decodes the responses for `stop_strings` (`decode(ids, skip_special_tokens=True)`;
        with an `encode(text, add_special_tokens=False)` too, the in-loop stop).
      pad_token_id: fills the left of prompts and the right of finished responses.
      rng: PRNG key; same key + same inputs -> same rollout.
      mesh: optional ("data", "fsdp", "tensor") mesh: rows split over data x fsdp, weights and
        KV heads over tensor (`sampling.decode_mesh` regroups a training mesh for decoding).
      max_prompt_length: optional prompt budget; a longer prompt is an error (default: no
        budget, the longest prompt picks the bucket).
      prompt_buckets, batch_buckets: padded prompt lengths / prompt counts (one compile each).
      kv_block_size: generated-KV block size (default `block_size_for(max_new_tokens, KVH * Dh)`).
      cpu_kernels: matmuls, decode attention and top-k with the C++ CPU kernels (`jaxrl4llm.kernels`).
        None (default): when the program runs on one CPU device and the kernels build;
        True: require them (an error names what is missing); False: XLA ops only. Our models only.
      prompts_per_chunk: sample the prompts this many at a time (one compiled program, run
        ceil(P / chunk) times; the KV cache holds one chunk's rows). None: all at once. Row n
        draws the same uniforms either way (`filters.row_uniforms`), so the rows are the same.
        Static engine only (the continuous engine holds `slots` rows at a time instead).
      engine: "continuous" (S slots over a paged KV cache, refilled between bursts of decode steps)
        or "static" (every row of a call decoded until the longest finishes; the reference).
      slots: continuous engine: rows decoded at once (None: all rows), rounded up to a multiple of
        the data-parallel size.
      kv_page_size: continuous engine: tokens per KV page. decode_burst: decode steps between refills.
      paged_attention: continuous engine: "xla" (chunks of live pages in XLA ops) or "kernel" (TPU:
        the ragged paged attention kernel; GPU: the Pallas/Triton paged attention kernel,
        `gpu_paged_attention`; CPU: the C++ paged attention kernel, `kernels.paged_attention`);
        None or "auto": the kernel where it takes the model's shapes (on CPU when the CPU kernels are in
        use), else XLA; or a resolved `kernels.choice.DecodeAttention` (the trainer passes its run
        layout's, `RunLayout.decode_attention`), checked to run here. The rule:
        `kernels.choice.decode_attention_choice` (the trainer's `rollout.decode_attention`).
      row_max_new_tokens: optional N = P*G per-row budgets (each in [1, max_new_tokens]): row n
        stops after that many tokens (truncated unless it ends with an EOS).
      record_routes: a mixture-of-experts model, continuous engine: the Rollout carries the expert
        ids of every prompt and fed response token (`Rollout.routes`, `Rollout.prompt_routes`).
    Returns: Rollout (arrays on device) with N = P*G rows, R = max_new_tokens columns.
    """
    model = merge(graphdef, state)  # Python objects over the same arrays: no copy
    config = model.config if isinstance(model, CausalLM) else None
    vocab_size = _vocab_size(model, config)
    num_prompts = len(prompts)
    _check_sampling_options(num_prompts, num_samples=num_samples, max_new_tokens=max_new_tokens, greedy=greedy,
                            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, stop_strings=stop_strings,
                            tokenizer=tokenizer, pad_token_id=pad_token_id, eos_token_ids=eos_token_ids,
                            stop_token_ids=stop_token_ids, vocab_size=vocab_size)
    prompt_len = _prompt_bucket(prompts, model, config, vocab_size=vocab_size, max_new_tokens=max_new_tokens,
                                max_prompt_length=max_prompt_length, prompt_buckets=prompt_buckets)
    _check_engine_options(config, engine=engine, prompts_per_chunk=prompts_per_chunk, slots=slots,
                          record_routes=record_routes)
    budget = _row_budgets(row_max_new_tokens, config, num_rows=num_prompts * num_samples, max_new_tokens=max_new_tokens)
    continuous = engine == "continuous" and config is not None
    dp = data_parallel_size(mesh)
    chunk = num_prompts if continuous else min(prompts_per_chunk or num_prompts, num_prompts)
    num_rows = bucket(chunk, batch_buckets, multiple_of=dp)
    eos = end_token_ids(eos_token_ids, stop_token_ids)
    traced = _traced_options(config, min_p=min_p, greedy=greedy, tokenizer=tokenizer, stop_strings=stop_strings)
    run = _sampler_program(graphdef, state, config, mesh=mesh, continuous=continuous, num_rows=num_rows,
                           num_samples=num_samples, max_new_tokens=max_new_tokens, top_k=top_k, top_p=top_p,
                           greedy=greedy, cpu_kernels=cpu_kernels, kv_block_size=kv_block_size, slots=slots,
                           kv_page_size=kv_page_size, decode_burst=decode_burst, paged_attention=paged_attention,
                           record_routes=record_routes)
    out = _sample_in_chunks(run, prompts, budget, chunk=chunk, num_rows=num_rows, num_samples=num_samples,
                            prompt_len=prompt_len, pad_token_id=pad_token_id, mesh=mesh,
                            row_budgets=continuous or row_max_new_tokens is not None, rng=rng,
                            temperature=temperature, top_p=top_p, eos=eos, traced=traced)
    return apply_stop_strings(Rollout(*out), tokenizer, stop_strings, pad_token_id)


MAX_TRIGGER_TOKENS = 16  # the longest token spelling of a tool trigger the decode loop matches


def generate_with_tools(graphdef, state, prompts: Sequence[Sequence[int]], *, tools: ToolsSpec, executor, tokenizer,
                        num_samples: int, max_new_tokens: int, eos_token_ids: Sequence[int], pad_token_id: int,
                        rng: jax.Array, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                        min_p: float = 0.0, greedy: bool = False, mesh: Mesh | None = None,
                        max_prompt_length: int | None = None, prompt_buckets: Sequence[int] = PROMPT_BUCKETS,
                        batch_buckets: Sequence[int] = BATCH_BUCKETS, cpu_kernels: bool | None = None,
                        slots: int | None = None, kv_page_size: int = PAGE_SIZE, decode_burst: int = BURST,
                        segment_steps: int = SEGMENT_STEPS, row_max_new_tokens: Sequence[int] | None = None,
                        paged_attention: str | DecodeAttention | None = None, stop_token_ids: Sequence[int] = (),
                        stop_strings: Sequence[str] = (), fmt: ToolFormat | None = None) -> tuple[Rollout, ToolStats]:
    """`generate` on the continuous engine with tool calls (`sampling.tool_rollout`): a row whose
    own tokens end with the format's trigger parks (its slot keeps its pages while the others
    decode), the host runs its code on `executor` (`tools.PythonExecutor`, or anything with
    `run(codes) -> [ToolResult]`) while the engine decodes on in segments of about `segment_steps`
    steps, and the row resumes by decoding the observation's tokens as forced tokens.

    tools: the `tools.ToolsSpec` (format, max_turns, max_tool_tokens, max_output_chars).
    tokenizer: decodes a row's turn (special tokens kept) and encodes the observations and the
    trigger. An EOS id that is the format's one-token trigger (Llama 3.1's <|eom_id|>) does not end
    a row. fmt: the `tools.ToolFormat` (default: `tools.format`'s; another, e.g. a new chat template).
    The other arguments are `generate`'s (no prompts_per_chunk: one call holds every row).
    Returns (Rollout with `tool_mask` [N, R], ToolStats).
    """
    model = merge(graphdef, state)
    config = model.config if isinstance(model, CausalLM) else None
    if config is None:
        raise ValueError("generate_with_tools: tool calls run on the continuous engine of a jaxrl4llm CausalLM")
    num_prompts = len(prompts)
    _check_sampling_options(num_prompts, num_samples=num_samples, max_new_tokens=max_new_tokens, greedy=greedy,
                            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, stop_strings=stop_strings,
                            tokenizer=tokenizer, pad_token_id=pad_token_id, eos_token_ids=eos_token_ids,
                            stop_token_ids=stop_token_ids, vocab_size=config.vocab_size)
    _check_engine_options(config, engine="continuous", prompts_per_chunk=None, slots=slots)
    fmt = fmt or tool_format(tools.format)
    triggers = trigger_token_sequences(fmt, tokenizer, max_tokens=MAX_TRIGGER_TOKENS)
    if triggers is None:
        raise ValueError(f"tools.format={fmt.name!r}: the tokenizer spells its trigger {fmt.trigger!r} in more tokens "
                         f"than the decode loop matches; pick the format the model was trained on")
    eos = end_token_ids(eos_without_triggers(eos_token_ids, triggers), stop_token_ids)
    prompt_len = _prompt_bucket(prompts, model, config, vocab_size=config.vocab_size, max_new_tokens=max_new_tokens,
                                max_prompt_length=max_prompt_length, prompt_buckets=prompt_buckets)
    budget = _row_budgets(row_max_new_tokens, config, num_rows=num_prompts * num_samples, max_new_tokens=max_new_tokens)
    num_rows = bucket(num_prompts, batch_buckets, multiple_of=data_parallel_size(mesh))
    weights, spec = _continuous_engine(graphdef, state, config, mesh=mesh, num_rows=num_rows, num_samples=num_samples,
                                       max_new_tokens=max_new_tokens, top_k=top_k, top_p=top_p, greedy=greedy,
                                       cpu_kernels=cpu_kernels, slots=slots, kv_page_size=kv_page_size,
                                       decode_burst=decode_burst, paged_attention=paged_attention)
    padded = left_pad_prompts(prompts, pad_token_id=pad_token_id, length=prompt_len, num_rows=num_rows)
    row_budget = np.concatenate([budget, np.ones((num_rows * num_samples - len(budget),), np.int32)])
    arrays = (padded.tokens, padded.mask, padded.row_valid, row_budget)
    if mesh is not None:
        arrays = tuple(_on_rows(a, mesh) for a in arrays)
    tokens, mask, valid, row_budget = arrays
    engine = tool_init(tokens, mask, valid, rng, np.int32(0), np.int32(pad_token_id), row_budget, triggers,
                       np.int32(tools.max_turns), spec=spec)
    traced = _traced_options(config, min_p=min_p, greedy=greedy, tokenizer=tokenizer, stop_strings=stop_strings)
    segment = lambda engine, steps, park_wait: tool_segment(weights, engine, np.float32(temperature),
                                                            np.float32(top_p), eos, np.int32(pad_token_id), steps,
                                                            park_wait=park_wait, spec=spec, **traced)
    engine, stats = run_tools(engine, segment=segment, resume=tool_resume, fmt=fmt, spec=tools, executor=executor,
                              tokenizer=tokenizer, num_rows=num_rows * num_samples, segment_steps=segment_steps)
    out, tool_mask = tool_result(engine, spec=spec)
    n = num_prompts * num_samples
    if num_rows != num_prompts:  # padding rows cut off
        out, tool_mask = jax.tree.map(lambda a: a[:n], out), tool_mask[:n]
    stats.calls = stats.calls[:n]
    rollout = apply_stop_strings(Rollout(*out), tokenizer, stop_strings, pad_token_id)
    return rollout._replace(tool_mask=tool_mask * rollout.response_mask), stats


def eos_without_triggers(eos_token_ids: Sequence[int], triggers: np.ndarray) -> list[int]:
    """The EOS ids that end a row when tools are on: eos_token_ids less the one-token triggers
    (rows of triggers [K, L], `stops.trigger_token_sequences`, with a single id): Llama 3.1 lists
    <|eom_id|>, its tool call's end, among its EOS ids; the row hands its call over there instead."""
    one_token = {int(t[-1]) for t in np.asarray(triggers) if (t[:-1] < 0).all()}
    return [int(t) for t in eos_token_ids if int(t) not in one_token]


def _vocab_size(model, config) -> int:
    """The model's vocabulary size: its config's (our CausalLM) or its `vocab_size` attribute
    (another NNX model); a model with neither is a TypeError."""
    vocab_size = config.vocab_size if config is not None else getattr(model, "vocab_size", None)
    if vocab_size is None:
        raise TypeError(f"generate() needs a jaxrl4llm CausalLM or an NNX model with a `vocab_size` attribute "
                        f"(docs/models.md, bring your own model); got {type(model).__name__}")
    return vocab_size


def _check_sampling_options(num_prompts: int, *, num_samples: int, max_new_tokens: int, greedy: bool,
                            temperature: float, top_p: float, top_k: int, min_p: float, stop_strings: Sequence[str],
                            tokenizer, pad_token_id: int, eos_token_ids: Sequence[int],
                            stop_token_ids: Sequence[int], vocab_size: int) -> None:
    """generate()'s sizes, sampling distribution, stop strings and special token ids, checked
    (a ValueError names the first that is wrong)."""
    if num_prompts == 0:
        raise ValueError("generate() needs at least one prompt, got an empty list")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not greedy and not temperature > 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature} (use greedy=True for argmax)")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0.0 <= min_p <= 1.0:
        raise ValueError(f"min_p must be in [0, 1] (0 = off), got {min_p}")
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings are matched on decoded text: pass tokenizer=")
    if any(not isinstance(s, str) or not s for s in stop_strings):
        raise ValueError(f"stop_strings must be non-empty strings, got {list(stop_strings)!r}")
    for name, token in [("pad_token_id", pad_token_id)] + [("eos_token_ids", t) for t in eos_token_ids] + \
            [("stop_token_ids", t) for t in stop_token_ids]:
        if not 0 <= int(token) < vocab_size:
            raise ValueError(f"{name} contains {token}, outside the vocabulary [0, {vocab_size})")


def _prompt_bucket(prompts: Sequence[Sequence[int]], model, config, *, vocab_size: int, max_new_tokens: int,
                   max_prompt_length: int | None, prompt_buckets: Sequence[int]) -> int:
    """The padded prompt length T: the bucket of the longest prompt. Checked: the prompts
    against max_prompt_length and the vocabulary, T + max_new_tokens against the model's positions."""
    longest = max(len(p) for p in prompts)
    if max_prompt_length is not None and longest > max_prompt_length:
        index = next(i for i, p in enumerate(prompts) if len(p) == longest)
        raise ValueError(f"prompt {index} has {longest} tokens, more than max_prompt_length={max_prompt_length}; "
                         f"raise max_prompt_length or truncate the prompt")
    prompt_len = bucket(longest, prompt_buckets)
    max_positions = config.max_position_embeddings if config is not None else getattr(model, "max_length", None)
    if max_positions is not None and prompt_len + max_new_tokens > max_positions:
        raise ValueError(f"prompt bucket {prompt_len} + max_new_tokens {max_new_tokens} exceeds the model's "
                         f"max_position_embeddings={max_positions}; lower max_new_tokens or shorten the prompts")
    for i, p in enumerate(prompts):
        if min(p) < 0 or max(p) >= vocab_size:
            raise ValueError(f"prompt {i} holds token ids outside the vocabulary [0, {vocab_size})")
    return prompt_len


def _check_engine_options(config, *, engine: str, prompts_per_chunk: int | None, slots: int | None,
                          record_routes: bool = False) -> None:
    """generate()'s engine, chunking, slots and route recording, checked (and the model's numerics
    against the engine)."""
    if prompts_per_chunk is not None and prompts_per_chunk < 1:
        raise ValueError(f"prompts_per_chunk must be >= 1 (or None: all prompts at once), got {prompts_per_chunk}")
    if engine not in ("continuous", "static"):
        raise ValueError(f"engine must be 'continuous' or 'static' (rollout.engine), got {engine!r}")
    require_engine_for_numerics(config, engine)
    if slots is not None and slots < 1:
        raise ValueError(f"slots must be >= 1 (rollout.slots; or None: all rows), got {slots}")
    if record_routes and not (engine == "continuous" and config is not None and config.num_experts):
        raise ValueError("record_routes: routes are recorded for a mixture-of-experts model (model.num_experts > 0) "
                         "by the continuous engine (engine='continuous')")


def _row_budgets(row_max_new_tokens: Sequence[int] | None, config, *, num_rows: int,
                 max_new_tokens: int) -> np.ndarray:
    """Each row's response budget, [N] int32 (N = num_rows = P*G): row_max_new_tokens, checked
    (each in [1, max_new_tokens]; our CausalLM only), or max_new_tokens for every row."""
    budget = np.full((num_rows,), max_new_tokens, np.int32)
    if row_max_new_tokens is not None:
        budget = np.asarray(row_max_new_tokens, np.int32)
        if budget.shape != (num_rows,) or budget.min() < 1 or budget.max() > max_new_tokens:
            raise ValueError(f"row_max_new_tokens must hold {num_rows} values (one per row) in "
                             f"[1, max_new_tokens={max_new_tokens}]")
    if config is None and row_max_new_tokens is not None:
        raise ValueError("row_max_new_tokens: per-row budgets need a jaxrl4llm CausalLM (the generic decoder has none)")
    return budget


def _traced_options(config, *, min_p: float, greedy: bool, tokenizer, stop_strings: Sequence[str]) -> dict:
    """The sampler program's optional traced keyword arguments: "min_p" (a float32 scalar; absent
    when min-p is off, 0 or greedy: the program without it) and "stop_seqs" (the stop strings'
    token spellings [K, W] int32, `stops.stop_token_sequences`, matched in the decode loop for an
    early stop; the host cut in `apply_stop_strings` decides; our CausalLM only)."""
    traced = {} if min_p <= 0 or greedy else {"min_p": np.float32(min_p)}
    stop_seqs = stop_token_sequences(tokenizer, stop_strings) if config is not None else None
    if stop_seqs is not None:
        traced["stop_seqs"] = stop_seqs
    return traced


def _sampler_program(graphdef, state, config, *, mesh: Mesh | None, continuous: bool, num_rows: int,
                     num_samples: int, max_new_tokens: int, top_k: int, top_p: float, greedy: bool,
                     cpu_kernels: bool | None, kv_block_size: int | None, slots: int | None, kv_page_size: int,
                     decode_burst: int, paged_attention: str | DecodeAttention | None, record_routes: bool = False):
    """The compiled sampler that decodes one chunk: `run(tokens [n, T], mask [n, T], row_valid [n],
    rng, first_row, temperature, top_p, eos, pad[, budgets [n*G]], **traced)` -> the Rollout's
    arrays of n*G rows (n = num_rows prompts). The generic decoder for another NNX model
    (`generic_decode.py`); for our CausalLM the weights program runs here, once for all chunks,
    then the continuous engine (`continuous.py`) or the static one (`decode_loop.py`)."""
    sampling = dict(num_samples=num_samples, max_new_tokens=max_new_tokens, top_k=int(top_k),
                    use_top_p=bool(top_p < 1.0), greedy=bool(greedy))
    if config is None:
        if cpu_kernels:
            raise ValueError("cpu_kernels=True: the CPU kernels run jaxrl4llm models only; pass cpu_kernels=None")
        return lambda *args, **kw: generic_sample_program(graphdef, state, *args, mesh=mesh, **sampling, **kw)
    if continuous:
        weights, spec = _continuous_engine(graphdef, state, config, mesh=mesh, num_rows=num_rows,
                                           num_samples=num_samples, max_new_tokens=max_new_tokens, top_k=top_k,
                                           top_p=top_p, greedy=greedy, cpu_kernels=cpu_kernels, slots=slots,
                                           kv_page_size=kv_page_size, decode_burst=decode_burst,
                                           paged_attention=paged_attention, record_routes=record_routes,
                                           kv_block_size=kv_block_size)
        return lambda *args, **kw: continuous_program(weights, *args, spec=spec, **kw)
    use_kernels = use_cpu_kernels(cpu_kernels, mesh)
    block_size = int(kv_block_size or block_size_for(max_new_tokens, config.num_kv_heads * config.head_dim))
    backend = decode_backend(config, mesh=mesh, use_kernels=use_kernels, block_size=block_size)
    weights = weights_program(graphdef, state, config=config, backend=backend)  # once for all chunks
    return lambda *args, **kw: sample_program(weights, *args, config=config, block_size=block_size,
                                              backend=backend, use_kernels=use_kernels, **sampling, **kw)


def _continuous_engine(graphdef, state, config, *, mesh: Mesh | None, num_rows: int, num_samples: int,
                       max_new_tokens: int, top_k: int, top_p: float, greedy: bool, cpu_kernels: bool | None,
                       slots: int | None, kv_page_size: int, decode_burst: int,
                       paged_attention: str | DecodeAttention | None, record_routes: bool = False,
                       kv_block_size: int | None = None):
    """(weights, EngineSpec) of the continuous engine over `num_rows` prompts: the decode weights
    (`weights_program`, once for all calls) and the engine (`continuous.engine_spec_for`)."""
    use_kernels = use_cpu_kernels(cpu_kernels, mesh)
    block_size = int(kv_block_size or block_size_for(max_new_tokens, config.num_kv_heads * config.head_dim))
    backend = decode_backend(config, mesh=mesh, use_kernels=use_kernels, block_size=block_size)
    weights = weights_program(graphdef, state, config=config, backend=backend)
    spec = engine_spec_for(config, backend, mesh=mesh, num_prompts=num_rows, num_samples=num_samples,
                           max_new_tokens=max_new_tokens, top_k=top_k, top_p=top_p, greedy=greedy,
                           use_kernels=use_kernels, slots=slots, page_size=kv_page_size, burst=decode_burst,
                           requested_attention=paged_attention, record_routes=record_routes)
    return weights, spec


def _on_rows(a: np.ndarray, mesh: Mesh) -> jax.Array:
    """a [n, ...] on the mesh, its rows split as the decode rules' "batch" axis says."""
    return jax.device_put(a, NamedSharding(mesh, logical_to_spec(
        ("batch",) + (None,) * (a.ndim - 1), DECODE_RULES, shape=a.shape, mesh=mesh)))


def _sample_in_chunks(run, prompts: Sequence[Sequence[int]], budget: np.ndarray, *, chunk: int, num_rows: int,
                      num_samples: int, prompt_len: int, pad_token_id: int, mesh: Mesh | None, row_budgets: bool,
                      rng: jax.Array, temperature: float, top_p: float, eos: np.ndarray, traced: dict) -> tuple:
    """`run` on the prompts `chunk` at a time -> the Rollout's arrays of N = P*G rows.

    Each chunk's prompts are left-padded to [num_rows, prompt_len] (padding rows are invalid),
    its row budgets (`budget` [N] int32) cut and padded to [num_rows*G] (passed only with
    row_budgets), run, and its padding rows cut off; the chunks are concatenated on the rows.
    rng, temperature, top_p, eos (`stops.end_token_ids`), traced: what `run` takes besides the
    chunk's arrays (and its first row's index, which keys its rows' uniforms).
    """
    outs = []
    for start in range(0, len(prompts), chunk):
        part = prompts[start:start + chunk]
        padded = left_pad_prompts(part, pad_token_id=pad_token_id, length=prompt_len, num_rows=num_rows)
        arrays = (padded.tokens, padded.mask, padded.row_valid)
        if mesh is not None:
            arrays = tuple(_on_rows(a, mesh) for a in arrays)
        rows = budget[start * num_samples:(start + len(part)) * num_samples]
        rows = np.concatenate([rows, np.full((num_rows * num_samples - len(rows),), 1, np.int32)])
        if mesh is not None:
            rows = _on_rows(rows, mesh)
        extra = (rows,) if row_budgets else ()
        out = run(*arrays, rng, np.int32(start * num_samples), np.float32(temperature), np.float32(top_p), eos,
                  np.int32(pad_token_id), *extra, **traced)
        n = len(part) * num_samples
        if num_rows != len(part):  # padding rows cut off (prompt_routes: one per prompt)
            cut = None if out.prompt_routes is None else out.prompt_routes[:len(part)]
            out = jax.tree.map(lambda a: a[:n], out._replace(prompt_routes=None))._replace(prompt_routes=cut)
        outs.append(out)
    return outs[0] if len(outs) == 1 else jax.tree.map(lambda *parts: jnp.concatenate(parts, axis=0), *outs)

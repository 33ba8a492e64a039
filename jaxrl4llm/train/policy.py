"""The policy a run trains: the NNX model as (graphdef, state), tokenizer, mesh, and the three
things the loop asks of it (sample, score tokens, export). `params` is the train state's
trainable pytree (all parameters, or the LoRA adapters when `frozen` holds the base); the
sampler reads them as they are, with no host round trip or format conversion.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxrl4llm.kernels.choice import mesh_devices
from jaxrl4llm.models import (ModelConfig, add_lora, init_model, load_pretrained, load_tokenizer, merge,
                              param_shardings, save_pretrained, score_tokens, score_tokens_with_routes)
from jaxrl4llm.models.hub import HubFilesMissing, resolve_model
from jaxrl4llm.sampling import decode_responses, generate, generate_with_tools
from jaxrl4llm.sampling.buckets import PROMPT_BUCKETS, bucket
from jaxrl4llm.sampling.memory import SIZING_SHARE, decode_sizing, prompts_per_chunk, slots_that_fit
from jaxrl4llm.sampling.rollout import decode_token_lists
from jaxrl4llm.sampling.stops import apply_stop_strings, response_text
from jaxrl4llm.train import hosts
from jaxrl4llm.train.config import ConfigError, RunConfig
from jaxrl4llm.train.layout import model_config_from_fields, sampler_mesh_for
from jaxrl4llm.train.prompts import run_tokenizer
from jaxrl4llm.train.step import join_params
from jaxrl4llm.train.user_code import import_object
from jaxrl4llm.tools.python_executor import PythonExecutor


@dataclasses.dataclass(frozen=True)
class Policy:
    config: Any  # jaxrl4llm.models.ModelConfig, or None for a bring-your-own module
    graphdef: Any  # flax.nnx.GraphDef
    params: Any  # trainable nnx.State
    tokenizer: Any
    mesh: Mesh | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    temperature: float
    chunk_size: int
    cpu_kernels: bool | None = None  # generate(cpu_kernels=): None = auto
    frozen: Any = None  # frozen nnx.State (the LoRA base), or None
    decode_mesh: Mesh | None = None  # the sampler's mesh (`sampling.decode_mesh`); None: `mesh`
    prompts_per_chunk: int | str = 0  # rollout.prompts_per_chunk: 0 = all at once, or "auto"
    engine: str = "continuous"  # rollout.engine: "continuous" or "static"
    slots: int | str = "auto"  # rollout.slots (continuous engine): rows at once, or "auto"
    decode_burst: int = 16  # rollout.decode_burst (continuous engine): decode steps between refills
    # generate(paged_attention=): rollout.decode_attention (auto, kernel or xla), in a run the layout's resolved
    # kernels.choice.DecodeAttention (loop.setup_run)
    decode_attention: str = "auto"
    min_p: float = 0.0  # rollout.min_p: 0 = off
    stop_token_ids: tuple[int, ...] = ()  # rollout.stop_token_ids: end a row as an EOS does
    stop_strings: tuple[str, ...] = ()  # rollout.stop_strings: rows cut at the first one (`sampling.stops`)
    tools: Any = None  # rollout.tools: a tools.protocol.ToolsSpec, or None (off)
    tool_executor: Any = None  # rollout.tools: the tools.PythonExecutor that runs the rows' code
    segment_steps: int = 32  # rollout.tools.segment_steps

    def with_params(self, params) -> "Policy":
        return dataclasses.replace(self, params=params)

    def with_state(self, train_state) -> "Policy":
        """The policy at a TrainState: its params and its frozen part (the update donates the
        state's buffers, so the frozen base is read from the newest state, never kept aside)."""
        return dataclasses.replace(self, params=train_state.params, frozen=train_state.frozen)

    @property
    def state(self):
        """What `nnx.merge(graphdef, ...)` takes: params, or (adapters, frozen base)."""
        return join_params(self.params, self.frozen)

    @property
    def dropout(self) -> bool:
        """The model has LoRA adapters with dropout: updates pass a dropout key."""
        settings = getattr(merge(self.graphdef, self.state), "lora_settings", None)
        return settings is not None and settings.dropout > 0

    @property
    def logprob_fn(self):
        """(state, inputs, targets, positions, attention_mask, rng=None) -> (logp, entropy) [B, L], at
        the rollout temperature (the distribution the sampler drew from, before top-k/top-p);
        `rng` keys LoRA dropout (the update passes it, scoring passes none)."""
        return make_logprob_fn(self.graphdef, self.temperature, self.chunk_size)

    @property
    def routing_fn(self):
        """A mixture-of-experts model's native routing pass at the rollout temperature
        (`make_routing_fn`); None for a dense model or a model of the user's."""
        if self.config is None or not self.config.num_experts:
            return None
        return make_routing_fn(self.graphdef, self.temperature, self.chunk_size)

    def generate(self, prompts, *, num_samples, max_new_tokens, temperature, top_p, top_k, rng, greedy=False,
                 prompt_len: int | None = None, slots: int | None = None, record_routes: bool = False):
        """`sampling.generate` with this policy; `prompt_len`: pad the prompts to this length's bucket
        (at least the longest prompt's) whatever this call's longest is, so calls share one program;
        `slots`: the continuous engine's slots when `rollout.slots: auto` finds no memory budget
        (default: all rows); `record_routes`: the rollout carries a mixture-of-experts model's routes
        (`trainer.router_replay: rollout`). Rows are cut at their first stop string (`sampling.stops`)."""
        longest = max(max(map(len, prompts)), prompt_len or 0)
        rollout = generate(
            self.graphdef, self.state, prompts, num_samples=num_samples, max_new_tokens=max_new_tokens,
            temperature=temperature if temperature > 0 else 1.0, top_p=top_p, top_k=top_k,
            eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id, rng=rng, mesh=self.sampler_mesh,
            greedy=greedy or temperature <= 0, cpu_kernels=self.cpu_kernels,
            prompt_buckets=(bucket(longest, PROMPT_BUCKETS),),
            engine=self.engine,
            slots=self.slots_for(len(prompts), num_samples, longest, max_new_tokens, record_routes) or slots,
            prompts_per_chunk=self.chunk_for(len(prompts), num_samples, longest, max_new_tokens),
            decode_burst=self.decode_burst, paged_attention=self.decode_attention,
            min_p=self.min_p, stop_token_ids=self.stop_token_ids, record_routes=record_routes,
        )
        return self.cut_at_stop_strings(rollout)

    def sample(self, prompts, *, num_samples, max_new_tokens, temperature, top_p, top_k, rng, prompt_len=None,
               record_routes: bool = False):
        """(rollout, tools.ToolStats or None): `generate`, or with rollout.tools on
        `sampling.generate_with_tools` (rows park at their tool calls; `Rollout.tool_mask`)."""
        if self.tools is None:
            return self.generate(prompts, num_samples=num_samples, max_new_tokens=max_new_tokens,
                                 temperature=temperature, top_p=top_p, top_k=top_k, rng=rng, prompt_len=prompt_len,
                                 record_routes=record_routes), None
        longest = max(max(map(len, prompts)), prompt_len or 0)
        rollout, stats = generate_with_tools(
            self.graphdef, self.state, prompts, tools=self.tools, executor=self.tool_executor,
            tokenizer=self.tokenizer, num_samples=num_samples, max_new_tokens=max_new_tokens,
            temperature=temperature if temperature > 0 else 1.0, top_p=top_p, top_k=top_k,
            eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id, rng=rng, mesh=self.sampler_mesh,
            greedy=temperature <= 0, cpu_kernels=self.cpu_kernels, prompt_buckets=(bucket(longest, PROMPT_BUCKETS),),
            slots=self.slots_for(len(prompts), num_samples, longest, max_new_tokens, False),
            decode_burst=self.decode_burst, paged_attention=self.decode_attention, min_p=self.min_p,
            stop_token_ids=self.stop_token_ids, segment_steps=self.segment_steps)
        return self.cut_at_stop_strings(rollout), stats

    def cut_at_stop_strings(self, rollout):
        """The rollout with its rows cut at their first stop string (`sampling.stops.apply_stop_strings`,
        every process decoding every row: the cut rows must agree across processes)."""
        return apply_stop_strings(rollout, self.tokenizer, self.stop_strings, self.pad_token_id, fetch=hosts.fetch)

    @property
    def sampler_mesh(self) -> Mesh | None:
        return self.decode_mesh if self.decode_mesh is not None else self.mesh

    def _memory_budget(self) -> float | None:
        """`SIZING_SHARE` (85%) of a sampler device's memory limit minus what it holds, where the device reports it (TPU,
        GPU): this process's first sampler device (another host's cannot be asked), the smallest
        over the processes (every process must size the sampler alike)."""
        devices = list(self.sampler_mesh.devices.flat) if self.sampler_mesh is not None else jax.devices()
        local = next(d for d in devices if d.process_index == jax.process_index())
        stats = local.memory_stats()
        if not stats or "bytes_limit" not in stats or self.config is None:
            return None  # the same on every process: one platform
        return hosts.smallest(SIZING_SHARE * stats["bytes_limit"] - stats.get("bytes_in_use", 0))

    def slots_for(self, num_prompts: int, num_samples: int, prompt_len: int, max_new_tokens: int,
                  record_routes: bool = False) -> int | None:
        """Slots of the continuous sampler: `slots`, or with "auto" the most whose memory
        (`sampling.memory.continuous_memory`, with the recorded routes when `record_routes`) fits the
        budget; None (all rows) without one."""
        if self.engine != "continuous":
            return None
        if self.slots != "auto":
            return int(self.slots)
        budget = self._memory_budget()
        if budget is None:
            return None
        sizing = decode_sizing(self.config, self.sampler_mesh, samples=num_samples, prompt_len=prompt_len,
                               max_new_tokens=max_new_tokens)
        return slots_that_fit(self.config, budget, prompts=num_prompts, record_routes=record_routes,
                              platform=mesh_devices(self.sampler_mesh)[0].platform, **sizing)

    def chunk_for(self, num_prompts: int, num_samples: int, prompt_len: int, max_new_tokens: int) -> int | None:
        """Prompts per sampler call: `prompts_per_chunk`, or with "auto" the largest chunk whose
        decode memory (`sampling.memory`) fits the sampler's memory budget (`_memory_budget`: this
        process's sampler device, the smallest over the processes); None (all at once) without one."""
        if self.prompts_per_chunk != "auto":
            return self.prompts_per_chunk or None
        budget = self._memory_budget()  # the one budget rule, as `slots_for`'s
        if budget is None:
            return None
        sizing = decode_sizing(self.config, self.sampler_mesh, samples=num_samples, prompt_len=prompt_len,
                               max_new_tokens=max_new_tokens)
        return prompts_per_chunk(self.config, budget, prompts=num_prompts, **sizing)

    def decode(self, rollout) -> list[str]:
        return decode_responses(rollout, self.tokenizer)

    def decode_rows(self, token_lists) -> list[str]:
        """Response texts of token-id lists (special tokens skipped, as `decode`), as the reward reads
        them: a last stop token's text left out, the text ended before a stop string
        (`sampling.stops.response_text`)."""
        if not (self.stop_strings or self.stop_token_ids):
            return decode_token_lists(token_lists, self.tokenizer)
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)
        return [response_text(ids, decode, stop_strings=self.stop_strings, stop_token_ids=self.stop_token_ids)
                for ids in token_lists]

    def decode_ids(self, ids) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def export(self, path: str | Path) -> Path:
        """Writes an HF folder (config.json, safetensors, tokenizer) loadable by transformers/vLLM;
        LoRA adapters are merged into the weights."""
        if self.config is None:
            raise ConfigError("model.module models have no Hugging Face layout to export to; set trainer.export_hf=false "
                              "and save the orbax checkpoint's state instead.")
        path = Path(path)
        save_pretrained((self.graphdef, self.state), path)  # every process gathers, process 0 writes
        if hosts.is_main():
            self.tokenizer.save_pretrained(str(path))
        return path


def make_logprob_fn(graphdef, temperature: float, chunk_size: int):
    """The train step's logprob_fn for an NNX model: (state, inputs, targets, positions,
    attention_mask, rng=None, last=None, group=1, segment_ids=None, routes=None) -> (logp, entropy) at
    `temperature` (0 = greedy: scored at 1); `last` = n scores only the last n positions (the others
    are 0); `group` = G (with `last`): rows n*G .. n*G+G-1 share the prompt before those n positions,
    run once; `segment_ids`: packed rows (train/packing.py); `routes` [B, T, layers, k]: a
    mixture-of-experts model's experts forced to these ids (router replay); `router_stats=True`: (logp,
    entropy, the routers' `core.routing.RouterStats`) (the load-balancing loss's input)."""
    def logprob_fn(state, inputs, targets, positions, attention_mask, rng=None, last=None, group=1, segment_ids=None,
                   routes=None, router_stats=False):
        first = 0 if last is None else max(inputs.shape[1] - last, 0)
        return score_tokens(graphdef, state, inputs, targets, positions=positions, attention_mask=attention_mask,
                            temperature=temperature if temperature > 0 else 1.0, chunk_size=chunk_size,
                            dropout_rng=rng, first_scored=first, prompt_group=group if first else 1,
                            segment_ids=segment_ids, routes=routes, router_stats=router_stats)
    return logprob_fn


def make_routing_fn(graphdef, temperature: float, chunk_size: int):
    """A mixture-of-experts model's native routing pass for router replay's metrics
    (`train.step.make_routing_pass`): (state, inputs, targets, positions, attention_mask, last=None)
    -> (logp [B, T] with no routes replayed, the routes its routers chose [B, T, layers, k], their
    `core.routing.RouterStats`), at
    `temperature` as `make_logprob_fn`."""
    def routing_fn(state, inputs, targets, positions, attention_mask, last=None):
        first = 0 if last is None else max(inputs.shape[1] - last, 0)
        return score_tokens_with_routes(graphdef, state, inputs, targets, positions=positions,
                                        attention_mask=attention_mask, temperature=temperature if temperature > 0 else 1.0,
                                        chunk_size=chunk_size, first_scored=first)
    return routing_fn


def _eos_ids(tokenizer, model_config) -> tuple[int, ...]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    eos = getattr(model_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(e) for e in eos)
    for tok in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        tid = tokenizer.convert_tokens_to_ids(tok) if tok in tokenizer.get_vocab() else None
        if tid is not None:
            ids.add(int(tid))
    if not ids:
        raise ConfigError("The tokenizer defines no EOS token: set eos_token in its tokenizer_config.json.")
    return tuple(sorted(ids))


def _user_module(m, tokenizer, rng):
    """model.module = "package.module:factory" -> (graphdef, state) of the user's NNX model."""
    factory = import_object(m.module, "model.module")
    model = factory(vocab_size=random_model_vocab_size(m, tokenizer), rngs=nnx.Rngs(params=rng))
    if not isinstance(model, nnx.Module):
        raise ConfigError(f"model.module={m.module!r} returned {type(model).__name__}, not an nnx.Module.")
    if m.lora is not None:
        raise ConfigError("model.lora applies to jaxrl4llm's models; wrap your own module's linears instead.")
    return nnx.split(model)


def random_model_vocab_size(m, tokenizer) -> int:
    """The vocabulary of a model built without a checkpoint (random, or `model.module`'s): `model.vocab_size`
    when set (e.g. Qwen3's 151936 rows for a tokenizer of 151669 tokens), else the tokenizer's length.
    A vocabulary smaller than the tokenizer's would leave token ids without an embedding row: ConfigError."""
    if m.vocab_size is None:
        return len(tokenizer)
    if m.vocab_size < len(tokenizer):
        raise ConfigError(f"model.vocab_size={m.vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens "
                          f"(model.tokenizer={m.tokenizer!r}); set model.vocab_size >= {len(tokenizer)}, or unset it "
                          f"(null) to take the tokenizer's length.")
    return int(m.vocab_size)


def random_model_config(cfg: RunConfig, tokenizer) -> ModelConfig:
    """The ModelConfig of the random model a run without `model.path` builds from the `model` section's
    size fields (`layout.model_config_from_fields`, as `plan` does) with `tokenizer`'s vocabulary and
    special tokens."""
    return model_config_from_fields(cfg, vocab_size=random_model_vocab_size(cfg.model, tokenizer),
                                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


def load_policy(cfg: RunConfig, mesh: Mesh | None) -> Policy:
    """From `model.path` (an HF folder, local or gs://, or a Hub id), `model.module` (your NNX model)
    or a random model of the configured size + `model.tokenizer`; with `model.lora`, adapters on a
    frozen base."""
    m = cfg.model
    rng = jax.random.PRNGKey(cfg.trainer.seed)
    model_config = None
    if m.path:
        try:  # gs://: a local copy; a Hub id: huggingface_hub's cache
            path = resolve_model(m.path)
        except HubFilesMissing as e:
            raise ConfigError(f"model.path={m.path!r}: {e}") from None
        if not path.is_dir():
            raise ConfigError(f"model.path={m.path!r} is not a folder; point it at a Hugging Face checkpoint folder "
                              f"(config.json + *.safetensors), local or gs://, or a Hub id (org/name[@revision]).")
        model = load_pretrained(path, dtype=m.dtype, param_dtype=m.param_dtype, mesh=mesh, remat=m.remat,
                                remat_policy=m.remat_policy, attention_impl=m.attention_impl, numerics=m.numerics,
                                expert_form=m.expert_form)
        model_config = model.config
        graphdef, state = nnx.split(model)
        tokenizer = run_tokenizer(cfg) if m.tokenizer else load_tokenizer(path)
    else:
        tokenizer = run_tokenizer(cfg)  # model.tokenizer: neither key set is its ConfigError
        if m.module:
            graphdef, state = _user_module(m, tokenizer, rng)
        else:
            model_config = random_model_config(cfg, tokenizer)
            graphdef, state = init_model(model_config, rng)
        if mesh is not None:
            state = jax.device_put(state, param_shardings(state, mesh))
    frozen = None
    if m.lora is not None and model_config is not None:
        graphdef, adapters = add_lora(model_config, m.lora.settings(), jax.random.fold_in(rng, 1))
        if mesh is not None:
            adapters = jax.device_put(adapters, param_shardings(adapters, mesh))
        state, frozen = adapters, state
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return Policy(
        config=model_config, graphdef=graphdef, params=state, frozen=frozen, tokenizer=tokenizer, mesh=mesh,
        eos_token_ids=_eos_ids(tokenizer, model_config), pad_token_id=int(pad), temperature=cfg.rollout.temperature,
        chunk_size=m.logprob_chunk_size,
        cpu_kernels=None if cfg.rollout.cpu_kernels == "auto" else bool(cfg.rollout.cpu_kernels),
        decode_mesh=sampler_mesh_for(cfg, mesh, model_config), prompts_per_chunk=cfg.rollout.prompts_per_chunk,
        engine=cfg.rollout.engine, slots=cfg.rollout.slots, decode_burst=cfg.rollout.decode_burst,
        decode_attention=cfg.rollout.decode_attention, min_p=cfg.rollout.min_p,
        stop_token_ids=tuple(cfg.rollout.stop_token_ids), stop_strings=tuple(cfg.rollout.stop_strings),
        tools=cfg.rollout.tools.spec(), segment_steps=cfg.rollout.tools.segment_steps,
        tool_executor=PythonExecutor(cfg.rollout.tools.executor_config()) if cfg.rollout.tools.enabled else None,
    )

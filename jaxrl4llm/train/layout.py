"""The run's layout, resolved once from the config and the devices: what `train` runs and `plan` prices.

    layout = run_layout(cfg, mesh, model_config, prompt_width=..., sampler_mesh=...)

`train` resolves it on the run's devices (`loop.setup_run`), `plan` on a topology's chips
(`plan.programs.plan_run`); both read the same object, so a rule about a run's shape is written
here once and cannot drift between the two:
- the model a run trains when it is built from the `model` section's size fields
  (`model_config_from_fields`, with `model.lora`'s adapters: `RunLayout.lora`);
- the split of the devices into the trainer's and the sampler's own (`split_for_sampler`,
  `mesh.sampler_devices`) and the (data, fsdp, tensor) shape of each (`mesh_dims`);
- rows per micro-batch and the micro-batch count (`micro_batches`), the single-optimizer-step
  rule (`single_optimizer_step`), the packing layout (`packing_layout`), the shared-prompt group
  (`shared_prompt_group`): together the update's `UpdateSettings`;
- the sampler's decode mesh for `rollout.tensor_parallel` (`sampler_mesh_for`) and its settings
  (`SamplerLayout`);
- which attention kernel runs (`kernels.choice`, the one rule): the sampler's decode attention
  (`rollout.decode_attention` on the sampler's devices: `RunLayout.decode_attention`) and the training
  forward's (`model.attention_impl` on the trainer's: `RunLayout.train_attention`), each with its reason;
  the loop hands the decode choice to the sampler, `plan` compiles and prices both as resolved here.
`jaxrl4llm plan --show-layout` prints it; every run writes it beside its config.json (`layout.json`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from jax.sharding import Mesh

from jaxrl4llm.kernels import exact
from jaxrl4llm.kernels.choice import (KernelChoice, decode_attention_choice, expert_kernels, mesh_devices,
                                      train_attention_choice)
from jaxrl4llm.models import LoraSettings, ModelConfig
from jaxrl4llm.sampling.buckets import PROMPT_BUCKETS, bucket
from jaxrl4llm.sampling.continuous import PAGE_SIZE
from jaxrl4llm.sampling.decode_mesh import decode_mesh
from jaxrl4llm.sampling.memory import SIZING_SHARE
from jaxrl4llm.train.config import ConfigError, RunConfig
from jaxrl4llm.train.packing import PackLayout, expected_micro_batches, pack_layout
from jaxrl4llm.train.response_lengths import LengthDistribution, parse_lengths
from jaxrl4llm.train.rollout_pipeline import split_devices
from jaxrl4llm.train.step import UpdateSettings


@dataclasses.dataclass(frozen=True)
class SamplerLayout:
    """How the sampler runs: `engine` (continuous | static), `slots` (as configured: auto or a count;
    auto is sized on the device at run time, by `plan` on the chip), `decode_burst`,
    `prompts_per_chunk` (static), `partial` rollouts, and its decode mesh: `data_parallel` x
    `tensor_parallel` devices, `own_devices`
    of its own (asynchronous RL; 0: the trainer's)."""

    engine: str
    slots: Any
    decode_burst: int
    prompts_per_chunk: Any
    partial: bool
    data_parallel: int
    tensor_parallel: int
    own_devices: int


@dataclasses.dataclass(frozen=True)
class RunLayout:
    """A run's layout (module docstring): the `model` it trains (its shape: no special-token ids; None
    for a `model.module` model) and
    its `lora` adapters, the trainer's `mesh` (data, fsdp, tensor), the step's `rows` (prompts x
    samples), the update's `UpdateSettings` (micro-batches, packing, shared prompts, single step),
    the `sampler`'s layout, the share of a device's memory the sampler's automatic sizing fills, and
    the attention kernels (`kernels.choice.KernelChoice`: kernel and reason; None for a model.module
    model, which decodes with the generic decoder and attends its own way): `decode_attention` on
    the sampler's devices, `train_attention` on the trainer's; a mixture of experts' `experts`
    (`kernels.choice.expert_kernels`: the expert form of training, prefill and decode, and the ragged
    form's weight gradient; None for a dense model)."""

    model: ModelConfig | None
    lora: LoraSettings | None
    mesh: tuple[int, int, int]
    rows: int
    update: UpdateSettings
    sampler: SamplerLayout
    sizing_share: float = SIZING_SHARE
    row_form: str = ""  # padded | shared_prompt | packed: what the update runs on (`trainer.packing`)
    row_form_reason: str = ""  # trainer.packing=auto: why (`choose_row_form`)
    decode_attention: KernelChoice | None = None
    train_attention: KernelChoice | None = None
    experts: dict[str, KernelChoice] | None = None

    @property
    def data_parallel(self) -> int:
        return self.mesh[0] * self.mesh[1]

    def to_dict(self) -> dict:
        """The layout as JSON-ready values (`layout.json`, `plan --show-layout`)."""
        def plain(value):
            if dataclasses.is_dataclass(value):
                return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
            if isinstance(value, (tuple, list)):
                return [plain(v) for v in value]
            if isinstance(value, dict):
                return {k: plain(v) for k, v in value.items()}
            return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)
        return plain(self)


# ---------------------------------------------------------------------------- the model
def model_config_from_fields(cfg: RunConfig, *, vocab_size: int, eos_token_id=None, pad_token_id=None) -> ModelConfig:
    """The ModelConfig of a model built from the `model` section's size fields (a random model, or
    `plan` without a checkpoint): architecture, widths, `tie_word_embeddings`, `rope_theta`, and
    position embeddings for at least the run's prompt + response budget; a qwen3_moe model's experts
    (`num_experts`, `num_experts_per_tok`, `moe_intermediate_size`, `norm_topk_prob`)."""
    m = cfg.model
    return ModelConfig(
        architecture=m.architecture, vocab_size=vocab_size, hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size, num_layers=m.num_layers, num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, qk_norm=m.architecture in ("qwen3", "qwen3_moe"),
        attention_bias=m.architecture == "qwen2", tie_word_embeddings=m.tie_word_embeddings,
        max_position_embeddings=max(m.max_position_embeddings, cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens),
        rope_theta=m.rope_theta, dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat,
        remat_policy=m.remat_policy, attention_impl=m.attention_impl, numerics=m.numerics,
        expert_form=m.expert_form, eos_token_id=eos_token_id,
        pad_token_id=pad_token_id, num_experts=m.num_experts, num_experts_per_tok=m.num_experts_per_tok,
        moe_intermediate_size=m.moe_intermediate_size, norm_topk_prob=m.norm_topk_prob and m.num_experts > 0)


def lora_settings(cfg: RunConfig) -> LoraSettings | None:
    """`model.lora`'s adapters (None: a full fine-tune)."""
    return cfg.model.lora.settings() if cfg.model.lora is not None else None


# ---------------------------------------------------------------------------- the meshes
def mesh_dims(data: int, fsdp: int, tensor: int, n: int, where: str = "devices") -> tuple[int, int, int]:
    """(data, fsdp, tensor) of `mesh.*` over n devices; one of them may be -1 (the rest)."""
    dims = [data, fsdp, tensor]
    if dims.count(-1) > 1:
        raise ConfigError("At most one of mesh.data / mesh.fsdp / mesh.tensor may be -1.")
    fixed = int(np.prod([d for d in dims if d != -1]))
    if -1 in dims:
        if n % fixed:
            raise ConfigError(f"mesh {dims}: the {n} {where} are not divisible by {fixed}.")
        dims[dims.index(-1)] = n // fixed
    if int(np.prod(dims)) != n:
        raise ConfigError(f"mesh data*fsdp*tensor = {dims} = {int(np.prod(dims))}, but there are {n} {where}; "
                          f"set mesh.data/fsdp/tensor to multiply to {n} (one of them may be -1).")
    return tuple(dims)


def split_for_sampler(cfg: RunConfig, devices: list, where: str = "devices") -> tuple[list, list, tuple[int, int, int]]:
    """(trainer devices, the sampler's own devices, the trainer mesh's dims): `mesh.sampler_devices` of
    each process's devices go to the sampler (asynchronous RL, `trainer.max_staleness` >= 1;
    `rollout_pipeline.split_devices`), `mesh.data / fsdp / tensor` shape the rest."""
    if cfg.mesh.sampler_devices and not cfg.trainer.max_staleness:
        raise ConfigError(f"mesh.sampler_devices={cfg.mesh.sampler_devices} gives the sampler devices of its own, which "
                          f"idle while the update runs unless rollouts run ahead: set trainer.max_staleness >= 1 "
                          f"(asynchronous RL), or mesh.sampler_devices=0.")
    try:
        trainer, sampler = split_devices(devices, cfg.mesh.sampler_devices)
    except ValueError as e:
        raise ConfigError(f"{e} ({len(devices)} {where})") from None
    dims = mesh_dims(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, len(trainer),
                     f"{where} left to train on" if sampler else where)
    return trainer, sampler, dims


def sampler_mesh_for(cfg: RunConfig, mesh: Mesh | None, model_config) -> Mesh | None:
    """The sampler's mesh for `rollout.tensor_parallel` (sampling.decode_mesh of the training
    mesh), or None (sample on the training mesh); a bad tensor_parallel is a ConfigError."""
    tp = cfg.rollout.tensor_parallel
    if tp and model_config is None:
        raise ConfigError("rollout.tensor_parallel needs one of our models (model.path or a random model); a "
                          "model.module is sampled on the training mesh (set rollout.tensor_parallel=0).")
    if mesh is None:
        if tp > 1:
            raise ConfigError(f"rollout.tensor_parallel={tp} needs a device mesh; this run has one device.")
        return None
    try:
        return decode_mesh(mesh, tp, num_kv_heads=model_config.num_kv_heads if model_config else None)
    except ValueError as e:
        raise ConfigError(str(e)) from None


# ---------------------------------------------------------------------------- the update
def micro_batches(cfg: RunConfig, rows: int, data_parallel: int = 1) -> int:
    """Micro-batches per mini-batch; each micro-batch's rows must split evenly over the
    `data_parallel` = mesh.data * mesh.fsdp devices (else chips would sit idle or hold copies)."""
    minis = cfg.trainer.mini_batches
    if rows % minis:
        raise ConfigError(f"{rows} rollout rows are not divisible by trainer.mini_batches={minis}.")
    per_mini = rows // minis
    mbs = cfg.trainer.micro_batch_size or per_mini
    if per_mini % mbs:
        raise ConfigError(f"a mini-batch of {per_mini} rows is not divisible by trainer.micro_batch_size={mbs}.")
    if mbs % data_parallel:
        raise ConfigError(
            f"trainer.micro_batch_size={mbs} rows do not split over the {data_parallel} data-parallel devices "
            f"(mesh.data x mesh.fsdp): use a multiple of {data_parallel}, or fewer data/fsdp devices "
            f"(more mesh.tensor).")
    return per_mini // mbs


def lora_dropout(cfg: RunConfig) -> bool:
    """`model.lora` drops adapter inputs out: the update's forward passes take a dropout key."""
    return cfg.model.lora is not None and cfg.model.lora.dropout > 0


def single_optimizer_step(cfg: RunConfig) -> bool:
    """One optimizer step per rollout and no LoRA dropout: pi_old is the policy the update itself
    scores, so old_logp is its own forward pass (detached) and the recompute pass is skipped."""
    return cfg.trainer.ppo_epochs == 1 and cfg.trainer.mini_batches == 1 and not lora_dropout(cfg)


def replays_routes(cfg: RunConfig, model_config=None) -> bool:
    """Whether the run replays the sampler's routes (`trainer.router_replay: rollout`), checked: a
    mixture-of-experts model (when `model_config` is known), the continuous engine (the one that
    records them, whole or partial rollouts); a ConfigError names the setting to change. Every row form
    carries the routes (padded, packed, shared-prompt). The loop's sampler and `plan` read it here."""
    t = cfg.trainer
    if t.router_replay != "rollout":
        return False
    if model_config is not None and not getattr(model_config, "num_experts", 0):
        raise ConfigError("trainer.router_replay=rollout replays a mixture-of-experts model's routes; this model is "
                          "dense: set trainer.router_replay=off")
    if cfg.rollout.engine != "continuous":
        raise ConfigError(f"trainer.router_replay=rollout replays the routes the continuous sampler records; "
                          f"rollout.engine={cfg.rollout.engine} records none: set rollout.engine=continuous")
    return True


def shared_prompt_group(cfg: RunConfig, own_model: bool, micro_batches: int, data_parallel: int = 1) -> int | None:
    """UpdateSettings.prompt_group of `trainer.share_prompt`: G = rollout.samples_per_prompt when
    each prompt's forward can run once for its G rows, else None (every row whole); with
    share_prompt=true, a ConfigError that says why it cannot.

    It applies when every data-parallel device (mesh.data x mesh.fsdp) holds whole groups of a
    micro-batch: a group split over devices would have each of them run the whole prompt."""
    share, G = cfg.trainer.share_prompt, cfg.rollout.samples_per_prompt
    if share is False:
        return None
    rows = cfg.rollout.prompts_per_step * G // (cfg.trainer.mini_batches * micro_batches)
    if not own_model:
        why = "a model.module model scores whole rows (the shared forward is jaxrl4llm's CausalLM)"
    elif G < 2:
        why = "rollout.samples_per_prompt=1: no two rows share a prompt"
    elif cfg.rollout.max_new_tokens < 2:
        why = "rollout.max_new_tokens=1 leaves no response tokens to run after the prompt"
    elif rows % (G * data_parallel):
        over = f" over {data_parallel} data-parallel devices" if data_parallel > 1 else ""
        why = (f"a micro-batch of {rows} rows{over} does not give each device whole groups of "
               f"rollout.samples_per_prompt={G}; set trainer.micro_batch_size to a multiple of {G * data_parallel}")
    else:
        return G
    if share is True:
        raise ConfigError(f"trainer.share_prompt=true, but {why} (or set trainer.share_prompt=auto).")
    return None


def packing_layout(cfg: RunConfig, own_model: bool, data_parallel: int, longest_prompt: int, log) -> PackLayout | None:
    """The PackLayout of `trainer.packing` (its micro-batch count and prompt width are per step:
    see `loop.pack_step`), or None: padded rows (packing off, a model.module, share_prompt=true).
    trainer.packing=auto gives the layout packed rows would take (`run_layout` then weighs it
    against padded rows in `choose_row_form`)."""
    t = cfg.trainer
    if not t.packing:
        return None
    if not own_model:
        if t.packing is True:
            log("trainer.packing: a model.module model scores padded rows (packed rows need jaxrl4llm's models); "
                "set trainer.packing=false to silence this.")
        return None
    if t.share_prompt is True:
        return None  # the user asked for the shared-prompt forward of padded rows
    rows = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    return packing_layout_for(cfg, rows, data_parallel, longest_prompt)


def packing_layout_for(cfg: RunConfig, rows: int, data_parallel: int, prompt_width: int) -> PackLayout:
    """pack_layout of this run for prompts padded to `prompt_width`; the token budget is
    trainer.tokens_per_micro_batch, or micro_batch_size's padded rows per device when set."""
    t = cfg.trainer
    width = bucket(prompt_width, PROMPT_BUCKETS)
    budget = t.tokens_per_micro_batch
    if budget is None and t.micro_batch_size:
        budget = max(t.micro_batch_size // data_parallel, 1) * (width + cfg.rollout.max_new_tokens - 1)
    return pack_layout(rows=rows, mini_batches=t.mini_batches, shards=data_parallel, prompt_width=width,
                       response_width=cfg.rollout.max_new_tokens, tokens_per_micro_batch=budget)


# ---------------------------------------------------------------------------- the row form
ROW_FORMS = ("padded", "shared_prompt", "packed")
# Time per position of each row form relative to a padded row's, measured by benchmarks/row_form.py
# on the CPU's block-causal XLA attention (docs/training.md, "Which row form"): shared-prompt
# 1.04-1.08, packed 0.96-1.11 (segment ids, the per-sequence loss view, the LM head on every packed
# position, the pack program). Rounded up, so a form must save positions to win over padded rows.
# The splash (TPU) and Pallas (GPU) kernels skip masked blocks and are not measured yet: the same.
ROW_FORM_COST = {"padded": 1.0, "shared_prompt": 1.05, "packed": 1.1}


@dataclasses.dataclass(frozen=True)
class RowFormChoice:
    """`choose_row_form`'s answer: the `form` (one of ROW_FORMS), the `reason` (one line, logged and
    in layout.json), and each candidate's expected positions per step (`positions`) and weighted
    cost (`costs`, positions x ROW_FORM_COST)."""

    form: str
    reason: str
    positions: dict
    costs: dict


def choose_row_form(*, rows: int, prompt_width: int, prompt_tokens: float, max_new_tokens: int,
                    prompt_group: int | None, packing: PackLayout | None,
                    lengths: LengthDistribution | None = None) -> RowFormChoice:
    """trainer.packing=auto: the row form with the least expected work per step, where work =
    the positions the form runs x its per-position cost (ROW_FORM_COST). Pure; chosen once per run.

    Positions per step of `rows` sequences, prompts padded to P = `prompt_width` (mean real tokens
    `prompt_tokens`), R = `max_new_tokens`:
      padded         rows x (P + R - 1)
      shared_prompt  rows / G x P + rows x (R - 1)            (G = `prompt_group`; None: not a candidate)
      packed         E[micro-batches] x mini-batches x RR x S  (`packing`; None: not a candidate)
    E[micro-batches] is `pack_plan`'s count (`micro_batch_counts`) on response lengths drawn from
    `lengths` (None: `plan`'s prior, lognormal with mean R / 4: the lengths are not known before the
    run), so packing wins when the expected padding it removes outweighs its per-position overhead.
    """
    L = prompt_width + max_new_tokens - 1
    positions = {"padded": float(rows * L)}
    if prompt_group:
        positions["shared_prompt"] = float(rows // prompt_group * prompt_width + rows * (max_new_tokens - 1))
    if packing is not None:
        dist = lengths or parse_lengths(None, max_new_tokens)
        micro = expected_micro_batches(packing, dist, prompt_tokens)
        positions["packed"] = micro * packing.mini_batches * packing.positions
    costs = {form: p * ROW_FORM_COST[form] for form, p in positions.items()}
    form = min(costs, key=lambda f: (costs[f], ROW_FORMS.index(f)))
    dist_text = (lengths or parse_lengths(None, max_new_tokens)).describe(max_new_tokens)
    parts = ", ".join(f"{f.replace('_', '-')} {positions[f]:.0f}" + (f" x {ROW_FORM_COST[f]:g}" if ROW_FORM_COST[f] != 1 else "")
                      for f in positions)
    reason = (f"least expected work per step (positions x per-position cost: {parts}; responses "
              f"{dist_text}, prompts {prompt_tokens:.0f} of {prompt_width})")
    return RowFormChoice(form=form, reason=reason, positions=positions, costs=costs)


# ---------------------------------------------------------------------------- the layout
def attention_kernels(cfg: RunConfig, model_config: ModelConfig, trainer_devices: list, sampler_devices: list,
                      cpu_kernels: bool, sampler_tensor: int = 1) -> tuple[KernelChoice, KernelChoice]:
    """(decode attention, training attention) of `cfg` (`rollout.decode_attention`, `model.attention_impl`)
    for the model on the sampler's and the trainer's devices (`kernels.choice`; the sampler splitting
    the kv heads over `sampler_tensor` devices); a request that cannot run there is a ConfigError
    that says why."""
    try:
        decode = decode_attention_choice(model_config, sampler_devices, cpu_kernels=cpu_kernels,
                                         requested=cfg.rollout.decode_attention, page_size=PAGE_SIZE,
                                         engine=cfg.rollout.engine, tensor_parallel=sampler_tensor)
        train = train_attention_choice(model_config.attention_impl, trainer_devices[0].platform,
                                       model_config.numerics)
        if model_config.numerics == "exact":
            exact.require(trainer_devices)
            exact.require(sampler_devices)
            if cfg.model.lora is not None:
                raise ValueError("model.numerics=exact trains the full model: the sampler decodes with the adapters "
                                 "merged into W (x (W + s A B)), the trainer computes x W + s (x A) B, and those round "
                                 "differently; drop model.lora or use model.numerics=default")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return decode, train


def run_layout(cfg: RunConfig, mesh: Mesh, model_config: ModelConfig | None, *, prompt_width: int,
               prompt_tokens: float | None = None, sampler_mesh: Mesh | None = None, cpu_kernels: bool = False,
               log=lambda line: None) -> RunLayout:
    """The layout of `cfg` on the trainer's `mesh` (and the sampler's own `sampler_mesh`, if any) for
    the model `model_config` (None: a `model.module` model), prompts padded to `prompt_width`
    (the run: its data's longest prompt; `plan`: `data.max_prompt_tokens`'s bucket) holding
    `prompt_tokens` real tokens on average (None: the whole width; trainer.packing=auto weighs it).
    `cpu_kernels`: the sampler runs the C++ CPU kernels (the run: `generate.use_cpu_kernels`; `plan`
    prices XLA's programs: False). `log` gets a line when the decode attention falls back from a
    kernel, saying why."""
    own_model = model_config is not None
    replays_routes(cfg, model_config)  # trainer.router_replay's requirements, before the row form is chosen
    if cfg.model.freeze_router and model_config is not None and not model_config.num_experts:
        raise ConfigError("model.freeze_router freezes a mixture-of-experts model's routers; this model is dense: "
                          "set model.freeze_router=false")
    if cfg.trainer.router_aux_loss_coef > 0 and (model_config is None or not model_config.num_experts):
        raise ConfigError("trainer.router_aux_loss_coef balances a mixture-of-experts model's routers; this model "
                          f"({'a model.module' if model_config is None else 'dense'}) has none: set "
                          "trainer.router_aux_loss_coef=0")
    rows = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    micro = micro_batches(cfg, rows, dp)
    packing = packing_layout(cfg, own_model, dp, prompt_width, log)
    group = None if packing and cfg.trainer.packing is True else shared_prompt_group(cfg, own_model, micro, dp)
    form = "packed" if packing else "shared_prompt" if group else "padded"
    reason = ""
    if cfg.trainer.packing == "auto" and own_model:
        width = bucket(prompt_width, PROMPT_BUCKETS)
        choice = choose_row_form(rows=rows, prompt_width=width, prompt_tokens=prompt_tokens or width,
                                 max_new_tokens=cfg.rollout.max_new_tokens, prompt_group=group, packing=packing)
        form, reason = choice.form, choice.reason
        packing, group = (packing if form == "packed" else None), (group if form == "shared_prompt" else None)
        log(f"row form: {form.replace('_', '-')} (trainer.packing=auto: {reason})")
    update = UpdateSettings(
        ppo_epochs=cfg.trainer.ppo_epochs, mini_batches=cfg.trainer.mini_batches, micro_batches=micro,
        # with a teacher, pi_old comes from the log-prob pass, the teacher's own code path: d_t = old - teacher
        # reads 0 exactly for a teacher that is the student (train/step.py `distill_batch`)
        old_logp_from_update=single_optimizer_step(cfg) and cfg.trainer.old_logp_source == "recompute"
        and not cfg.teacher.model,
        scored_tokens=cfg.rollout.max_new_tokens if own_model else None,
        prompt_group=group, packing=packing, router_aux_loss_coef=float(cfg.trainer.router_aux_loss_coef))
    dmesh = sampler_mesh_for(cfg, sampler_mesh or mesh, model_config) or sampler_mesh or mesh
    r = cfg.rollout
    sampler = SamplerLayout(
        engine=r.engine, slots=r.slots, decode_burst=r.decode_burst, prompts_per_chunk=r.prompts_per_chunk,
        partial=bool(r.partial),
        data_parallel=dmesh.shape["data"] * dmesh.shape["fsdp"], tensor_parallel=dmesh.shape["tensor"],
        own_devices=0 if sampler_mesh is None else math.prod(sampler_mesh.shape.values()))
    shape = None if model_config is None else dataclasses.replace(  # the model's shape: no tokenizer's ids
        model_config, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    decode = train = experts = None
    if own_model:
        decode, train = attention_kernels(cfg, model_config, mesh_devices(mesh), mesh_devices(dmesh), cpu_kernels,
                                          sampler_tensor=dmesh.shape["tensor"])
        if decode.fallback:
            log(f"decode attention (rollout.decode_attention): {decode.reason}")
        if model_config.num_experts:
            experts = expert_kernels(model_config.expert_form, mesh_devices(mesh)[0].platform,
                                     mesh_devices(dmesh)[0].platform)
    return RunLayout(model=shape, lora=lora_settings(cfg) if own_model else None,
                     mesh=(mesh.shape["data"], mesh.shape["fsdp"], mesh.shape["tensor"]), rows=rows,
                     update=update, sampler=sampler, row_form=form, row_form_reason=reason,
                     decode_attention=decode, train_attention=train, experts=experts)

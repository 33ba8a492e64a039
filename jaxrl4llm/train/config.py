"""Run configuration: typed dataclasses loaded from YAML, with `section.key=value` overrides.

A YAML file may start with `include: other.yaml` (or a list), resolved relative to the file;
later files and then command-line overrides win. Unknown or mistyped keys are errors that
list the valid keys, so a typo never silently falls back to a default.

    cfg = load_config("configs/lite_ppo.yaml", ["rollout.samples_per_prompt=16", "optim.lr=2e-6"])
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from jaxrl4llm.core.recipes import PRESETS, Recipe
from jaxrl4llm.tools.protocol import ToolsSpec
from jaxrl4llm.tools.python_executor import ExecutorConfig


class ConfigError(ValueError):
    """A configuration problem, with a message naming the key and the fix."""


@dataclasses.dataclass
class LoraConfig:
    """`model.lora`: LoRA adapters on the named linears, the base frozen (models.LoraSettings)."""

    rank: int = 8
    alpha: float = 16.0
    targets: list[str] = dataclasses.field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    dropout: float = 0.0

    def settings(self):
        from jaxrl4llm.models import LoraSettings

        try:
            return LoraSettings(rank=self.rank, alpha=self.alpha, targets=tuple(self.targets), dropout=self.dropout)
        except ValueError as e:
            raise ConfigError(str(e)) from None


@dataclasses.dataclass
class ModelConfigSection:
    """Which model to train. `path` is a local HF folder (config.json + safetensors + tokenizer);
    without it, a random model of the given size is built (tests, demo) with `tokenizer`.
    `lora`: train LoRA adapters only (LoraConfig). `module`: "package.module:factory", your own
    NNX causal LM, factory(vocab_size=..., rngs=nnx.Rngs) -> nnx.Module (docs/models.md).
    `vocab_size`, `tie_word_embeddings`, `max_position_embeddings`, `rope_theta` and the size fields
    describe the model for `jaxrl4llm plan` when there is no checkpoint (`train.layout.model_config_from_fields`:
    the same model a run builds from them); a random model (and a `module`'s
    factory) takes `vocab_size` (at least the tokenizer's length; unset: the tokenizer's length);
    a checkpoint's config.json overrides them all."""

    path: str | None = None
    tokenizer: str | None = None
    architecture: str = "qwen3"
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    param_dtype: Literal["bfloat16", "float32"] = "float32"
    remat: bool = False
    # what a rematerialised layer keeps for the backward (models/remat.py): "full" keeps nothing
    # (least memory), "save_dots" every matmul output (least recompute), "save_attention" between
    remat_policy: Literal["full", "save_attention", "save_dots"] = "full"
    # the training forward's attention (models/layers/segment_attention.py): auto = by platform
    # (TPU splash kernel, GPU Pallas flash attention, CPU block-causal XLA), or force one
    attention_impl: Literal["auto", "xla", "splash", "pallas_gpu"] = "auto"
    # a mixture of experts' expert form (models/layers/moe.py): auto = by platform and phase
    # (kernels.choice.expert_form_for: ragged_dot to train and prefill on TPU, dense_capacity to
    # decode and on GPU and CPU), or force one everywhere
    expert_form: Literal["auto", "ragged_dot", "dense_capacity", "reference"] = "auto"
    # exact: batch-invariant kernels, so the sampler's log-probs equal the trainer's bit for bit
    # (kernels/exact.py; one device: C++ kernels on a CPU, Pallas on a GPU or TPU; no LoRA;
    # docs/objectives.md, "Sampler-trainer agreement")
    numerics: Literal["default", "exact"] = "default"
    # positions per LM-head chunk when scoring: a chunk's logits hold rows x chunk x vocab floats
    # (64 rows x 64 x 32k vocab = 0.5 GiB); measured on a 48M model, 64 rows x 255 tokens, remat:
    # update temporaries 1.95 GiB at 64 against 2.57 GiB at 256
    logprob_chunk_size: int = 64
    lora: LoraConfig | None = None
    module: str | None = None
    vocab_size: int | None = None
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    # a random mixture-of-experts model (architecture: qwen3_moe): experts a layer, experts a token,
    # an expert's width, and whether a token's k gate weights are renormalised (Qwen3-MoE's true)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    # a mixture-of-experts model's routers stay as loaded: no update, no weight decay (NeMo-RL's GRPO
    # default); the experts and everything else train
    freeze_router: bool = False


@dataclasses.dataclass
class DataConfig:
    """Prompt data: JSONL/JSON/parquet files (local or gs://) or Hub datasets (hf://org/name[:config][@split])
    with problem and answer fields (docs/data.md); `problem_key` / `answer_key` may be dotted
    (`reward_model.ground_truth`, verl's layout)."""

    train_files: list[str] = dataclasses.field(default_factory=list)
    eval_files: list[str] = dataclasses.field(default_factory=list)
    problem_key: str | None = None
    answer_key: str | None = None
    template: str = "base"
    # the sentence after the problem in the base/chat templates (null: the study's "Please reason
    # step by step, and put your final answer within \boxed{}.")
    instruction: str | None = None
    # a system message before every prompt (null: none): first in a row's chat messages (a row's own
    # system message is kept instead), or before the user message of the chat templates; a
    # plain-text template (base, demo, a format string) has none, so it is an error there
    system_prompt: str | None = None
    max_prompt_tokens: int = 512
    # the prompts' padded width: dataset = the bucket of the training set's longest prompt, fixed
    # for the run (no step compiles a new program); step = each step's longest (less padding, a
    # compile of the sampler and the trainer programs per new bucket)
    prompt_bucket: Literal["dataset", "step"] = "dataset"
    on_overlong_prompt: Literal["error", "drop"] = "error"
    shuffle: bool = True
    eval_limit: int | None = None


@dataclasses.dataclass
class ToolsConfig:
    """`rollout.tools`: tool-integrated rollouts (docs/sampling.md "Tools"): a row that writes its
    format's trigger parks, its code runs in the Python executor while the other rows decode, and
    the output comes back as forced tokens (`Rollout.tool_mask`). `format`: null = off, or one of
    `tools.protocol.TOOL_FORMATS` (fence: ```python blocks then ```output, for base models;
    qwen3_chat / llama3_chat: the chat templates' tool calls). max_turns, max_tool_tokens,
    max_output_chars, timeout: `tools.protocol.ToolsSpec`. segment_steps: decode steps between two
    host looks at parked rows. workers, memory_bytes, cpu_seconds: the executor's pool and limits
    (`tools.python_executor.ExecutorConfig`). The continuous engine only (not rollout.partial)."""

    format: Literal["fence", "qwen3_chat", "llama3_chat"] | None = None
    max_turns: int = 4
    max_tool_tokens: int = 128
    max_output_chars: int = 256
    timeout: float = 5.0
    segment_steps: int = 32
    workers: int = 4
    memory_bytes: int = 1 << 30
    cpu_seconds: float = 5.0

    @property
    def enabled(self) -> bool:
        return self.format is not None

    def spec(self):
        """The `tools.protocol.ToolsSpec` of this section (None when off)."""
        if not self.enabled:
            return None
        try:
            return ToolsSpec(format=self.format, max_turns=self.max_turns, max_tool_tokens=self.max_tool_tokens,
                             max_output_chars=self.max_output_chars, timeout=self.timeout)
        except ValueError as e:
            raise ConfigError(f"rollout.tools: {e}") from None

    def executor_config(self):
        """The `tools.python_executor.ExecutorConfig` of this section."""
        try:
            return ExecutorConfig(timeout=self.timeout, workers=self.workers, memory_bytes=self.memory_bytes,
                                  cpu_seconds=self.cpu_seconds, max_output_chars=max(self.max_output_chars, 1))
        except ValueError as e:
            raise ConfigError(f"rollout.tools: {e}") from None


@dataclasses.dataclass
class RolloutConfig:
    """Sampling: P prompts x G responses per step (the study: 128 x 8, T=0.99, top_p=0.99, top_k=100)."""

    prompts_per_step: int = 8
    samples_per_prompt: int = 8
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # min-p sampling (Nguyen et al. 2024; docs/sampling.md): keep the tokens with p >= min_p * max p,
    # after temperature and before top-k / top-p (vLLM's order); 0 = off
    min_p: float = 0.0
    # tokens that end a response besides EOS, exactly as EOS does: kept in the response and its loss
    # mask, the row not truncated (vLLM's stop_token_ids); its text is left out of the scored text
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    # a response ends with the token that completes the first of these strings in its decoded text:
    # later tokens leave the loss mask and the length, the row is not truncated, and the scored text
    # ends before the string (vLLM's `stop`). Matched on the host after sampling; the tokenizer's
    # spellings of each string also end a row inside the decode loop (its slot freed; docs/sampling.md)
    stop_strings: list[str] = dataclasses.field(default_factory=list)
    dynamic_sampling_max_draws: int = 4
    # the sampler's C++ CPU kernels (docs/sampling.md): auto = on one CPU device when they build;
    # true = required (an error says why they are unavailable); false = XLA ops only
    cpu_kernels: Literal["auto"] | bool = "auto"
    # The sampler's tensor parallelism (docs/scaling.md): the mesh's devices regrouped as
    # (n / tp, 1, tp) for decoding, weights and KV heads split tp ways; 0 = the training mesh
    # as it is (weights replicated over data x fsdp). tp must divide the model's KV heads.
    tensor_parallel: int = 0
    # The sampler (docs/sampling.md): continuous (the default) = `slots` rows at a time over a
    # paged KV cache, a finished row's slot refilled with a waiting one; static = every row of a
    # chunk decoded until the chunk's longest row ends (the reference the tests compare to; the
    # same rows, exactly). Its TPU kernel has not run on a TPU yet: static is the fallback there.
    engine: Literal["continuous", "static"] = "continuous"
    # continuous: rows decoded at once; auto = the most whose memory (sampling.memory) fits 85%
    # of a device's memory where the device reports it (TPU, GPU), else all rows.
    slots: Literal["auto"] | int = "auto"
    # continuous: decode steps between two refills of finished slots.
    decode_burst: int = 16
    # continuous: the decode attention over the paged KV cache (docs/sampling.md): auto = the
    # platform's kernel where it takes the model's shapes (TPU ragged paged attention, GPU Triton
    # paged attention, the CPU kernels), else XLA; kernel = required (an error says why it cannot
    # run); xla = XLA's chunks of live pages (the fallback, any platform)
    decode_attention: Literal["auto", "kernel", "xla"] = "auto"
    # Partial rollouts (docs/training.md "Partial rollouts"; trainer.max_staleness >= 1, continuous
    # engine): one engine runs across steps; a segment decodes until step t's rollout is complete
    # and admits step t+1's rows into the slots its rows free; those still decoding then continue
    # under the next policy version. Step t's segment is sampled by version t - k + 1, so no token is
    # more than k versions old.
    partial: bool = False
    # static: prompts sampled per chunk (the KV cache holds one chunk's rows): 0 = all at once;
    # auto = the largest chunk whose decode memory (sampling.memory) fits 85% of a device's memory.
    prompts_per_chunk: Literal["auto"] | int = 0
    # No-Positive-Resampling (ScaleRL, arXiv 2510.13786): a prompt whose pass rate (share of its
    # samples with reward > train.reward_fn.CORRECT_REWARD_THRESHOLD, 0.5) reaches this value leaves
    # the prompt stream for good (saved in checkpoints); null = off. ScaleRL uses 0.9.
    retire_pass_rate: float | None = None
    # Tool calls in the rollout (ToolsConfig; docs/sampling.md "Tools"): format null = off
    tools: ToolsConfig = dataclasses.field(default_factory=ToolsConfig)


@dataclasses.dataclass
class AlgorithmConfig:
    """The recipe: a preset name plus any Recipe field overridden by key, or a custom loss by
    import path (`custom_loss: my_pkg.losses:my_policy_loss`, same signature as
    jaxrl4llm.core.policy_loss)."""

    preset: str = "lite_ppo"
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    custom_loss: str | None = None


@dataclasses.dataclass
class RewardTerm:
    """One entry of `reward.fns`: a reward function (as `reward.fn`), its weight in the sum and the
    name of its metric `reward/<name>` (default: the function's name)."""

    fn: str = ""
    weight: float = 1.0
    name: str | None = None
    batched: Literal["auto"] | bool = "auto"


@dataclasses.dataclass
class RewardConfig:
    """Reward function by import path ('package.module:function'; docs/own_data_and_reward.md).
    A per-sample fn(response, gold) -> float or a batched fn(responses, golds) -> list of floats;
    batched=auto tells them apart by the signature (train/reward_fn.py). The function also gets
    `problem=` / `metadata=` (batched: `problems=` / `metadata=`, lists) and `timeout=` when its
    signature names them."""

    fn: str = "jaxrl4llm.rewards:batch_math_reward"
    batched: Literal["auto"] | bool = "auto"
    # seconds per response: a per-sample function without a `timeout` argument runs in worker
    # processes (reward.sandbox) and a call still running after this scores 0 (counted as an error);
    # a function with a `timeout` argument gets it (the built-in verifier applies it to each comparison)
    timeout: float = 5.0
    # a reward that raises (or times out, or returns no finite number): zero = that response scores
    # 0, counted in the step's `reward_errors` metric and warned once per step; raise = the run stops
    on_error: Literal["zero", "raise"] = "zero"
    # a per-sample function without a `timeout` argument runs in worker processes, one per core, each
    # call stopped at reward.timeout; false = in the trainer's process, no time limit (for a function
    # that needs the trainer's process, or a debugger)
    sandbox: bool = True
    # The training reward is scale * fn + offset (before DAPO's overlong penalty, which keeps its
    # own units): scale=2, offset=-1 turns the verifier's {0, 1} into the study's {-1, 1} reward
    # setting (Tricks or Traps, Sec. 4.1). Accuracy, pass rates and evaluation read fn's own value.
    scale: float = 1.0
    offset: float = 0.0
    # A weighted sum of rewards instead of `fn` (train/reward_fn.py, docs/rewards.md): a list of
    # {fn: module:function, weight: 1.0, name: ..., batched: auto}, each logged as `reward/<name>`;
    # null = `fn` alone (its batched/timeout/on_error/sandbox settings apply to every entry).
    fns: list[RewardTerm] | None = None

    def terms(self) -> list[RewardTerm]:
        """The rewards summed, each with its weight and metric name: `fns` (checked: an fn each,
        finite weights, unique names) or `fn` alone as one term of weight 1. A ConfigError names
        the entry and the fix."""
        if self.fns is None:
            return [RewardTerm(fn=self.fn, weight=1.0, name=_function_name(self.fn), batched=self.batched)]
        if self.fn != RewardConfig.fn:
            raise ConfigError(f"reward.fn={self.fn!r} and reward.fns are both set: list the function in reward.fns "
                              f"(- {{fn: {self.fn}, weight: 1.0}}) and leave reward.fn unset.")
        if not self.fns:
            raise ConfigError("reward.fns is empty: list at least one {fn: module:function, weight: 1.0}, or drop "
                              "reward.fns to use reward.fn.")
        terms, seen = [], set()
        for i, term in enumerate(self.fns):
            if not term.fn:
                raise ConfigError(f"reward.fns[{i}] has no fn: give it fn: package.module:function.")
            if not math.isfinite(term.weight):
                raise ConfigError(f"reward.fns[{i}].weight={term.weight} is not a finite number.")
            name = term.name if term.name is not None else _function_name(term.fn)
            if not name or "/" in name:
                raise ConfigError(f"reward.fns[{i}].name={name!r}: a name is a non-empty word without '/' "
                                  f"(the metric is reward/<name>).")
            if name in seen:
                raise ConfigError(f"reward.fns: two entries are named {name!r} (the metric reward/{name} would mix "
                                  f"them): give one of them its own `name:`.")
            seen.add(name)
            terms.append(dataclasses.replace(term, name=name))
        return terms


def _function_name(path: str) -> str:
    """'package.module:function' (or 'package.module.function') -> 'function'."""
    return path.partition(":")[2] if ":" in path else path.rpartition(".")[2]


@dataclasses.dataclass
class EvalConfig:
    """Evaluation's sampling, apart from the rollout's (docs/training.md "Evaluation"). Each key left
    null takes its older source: samples = trainer.eval_samples, temperature =
    trainer.eval_temperature (aliases kept working), top_p = rollout.top_p, top_k = rollout.top_k.
    `RunConfig.eval_sampling()` resolves them; temperature 0 = greedy, one sample."""

    samples: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None


@dataclasses.dataclass(frozen=True)
class EvalSampling:
    """Evaluation's resolved sampling: n samples per problem at (temperature, top_p, top_k)."""

    samples: int
    temperature: float
    top_p: float
    top_k: int

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


@dataclasses.dataclass
class OptimConfig:
    """AdamW with warm-up and constant or cosine decay, global-norm clipping."""

    lr: float = 1e-6
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float = 1.0


# trainer.loggers' choices (train/metrics.py: LOGGER_PACKAGES says what each imports)
LOGGERS = ("tensorboard", "wandb", "mlflow")


@dataclasses.dataclass
class TrainerConfig:
    """Loop, update and bookkeeping knobs."""

    steps: int = 10
    ppo_epochs: int = 1
    mini_batches: int = 1
    micro_batch_size: int | None = None
    # Each prompt's forward pass runs once for its samples_per_prompt rows in the update and the
    # log-prob passes (Prefix Grouper, arXiv 2506.05433; same values and gradients, fewer
    # FLOPs: docs/training.md). auto = when the run allows it (jaxrl4llm's models, micro-batches
    # of whole groups); true = required (an error says why it cannot); false = every row whole.
    share_prompt: Literal["auto"] | bool = "auto"
    # Whole sequences packed side by side into rows of the padded width, each a segment that
    # attends only to itself (train/packing.py, docs/training.md): the update and the log-prob
    # passes run on about as many positions as the step's sequences hold, not rows x (prompt +
    # max_new_tokens). Same losses, metrics and gradients as padded rows. jaxrl4llm's models
    # only (a model.module scores padded rows); share_prompt=true keeps padded rows instead.
    # auto (the default) = packed, padded or shared-prompt rows, whichever the run's shape makes
    # least work (train/layout.py `choose_row_form`: expected positions x each form's measured
    # cost; logged); true = packed rows always; false = padded rows.
    packing: Literal["auto"] | bool = "auto"
    # Positions of one packed micro-batch on each data-parallel device (verl's
    # ppo_max_token_len_per_gpu): its memory bound. null = micro_batch_size's padded rows when
    # set, else min(16384, the padded mini-batch's share of a device).
    tokens_per_micro_batch: int | None = None
    old_logp_source: Literal["sampler", "recompute"] = "recompute"
    # Router replay (R3, docs/training.md "Router replay"): rollout = a mixture-of-experts model's
    # sampler records the experts each token ran (`generate(record_routes=True)`) and the
    # old-log-prob and update passes force them (`score_tokens(routes=)`); the reference pass routes
    # natively. Every row form (padded, packed, shared-prompt) and rollout.partial carry the routes.
    router_replay: Literal["off", "rollout"] = "off"
    # With router replay, every this many steps a forward pass with the trainer's own routes measures
    # what replay closes (`train.step.make_routing_pass`): route_disagreement (the share of (token,
    # layer) pairs whose experts differ from the sampler's), expert_load_max_over_mean and
    # sampler_trainer_logp_gap_native. 0: never (no extra pass).
    router_metrics_every: int = 1
    # A mixture-of-experts model's load-balancing loss (the switch transformer's, Fedus et al. 2021;
    # transformers' Qwen3-MoE `router_aux_loss_coef`): c > 0 adds c * E * sum_e f_e P_e (f: the share
    # of choices routed to expert e, P: its mean router probability, the layers pooled) to the loss.
    # 0 (NeMo-RL's and MaxText's RL default): off, no router statistics computed.
    router_aux_loss_coef: float = 0.0
    reference_model: bool = False
    seed: int = 0
    out_dir: str = "runs/default"
    eval_every: int = 0
    # evaluation's samples per problem and temperature: the older names of eval.samples and
    # eval.temperature (EvalConfig), which win where set
    eval_samples: int = 1
    eval_temperature: float = 0.0
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    clipped_tokens_every: int = 10
    export_hf: bool = True
    progress_bar: bool = True
    # Where the metrics go besides the console and OUT/metrics.jsonl (always on; train/metrics.py,
    # docs/training.md "Metrics"): tensorboard (OUT/tb), wandb (pip install 'jaxrl4llm[wandb]'),
    # mlflow (pip install 'jaxrl4llm[mlflow]'; MLFLOW_TRACKING_URI). On process 0 only; a --resume
    # continues the W&B / MLflow run whose id OUT/loggers.json holds.
    loggers: list[Literal[LOGGERS]] = dataclasses.field(default_factory=lambda: ["tensorboard"])
    # The W&B project and the MLflow experiment (verl's trainer.project_name).
    project_name: str = "jaxrl4llm"
    # The W&B / MLflow run name (verl's trainer.experiment_name, TRL's run_name); null = the
    # name of trainer.out_dir's folder.
    experiment_name: str | None = None
    # Rollouts logged a step (train/samples.py): the first N rows of the step's batch (the first
    # prompts' groups, in order) with prompt, response, rewards, advantage, extracted answer,
    # truncation and policy version, to OUT/samples.jsonl and each logger as a table. 0 = off.
    log_samples: int = 4
    # A fresh run (no --resume) into an out_dir that already holds a run is an error unless
    # this is true; then that run's checkpoints, metrics, TensorBoard events and export go.
    overwrite: bool = False
    # XLA's persistent compilation cache (train/compile_cache.py): auto (or true) = ~/.cache/jaxrl4llm/xla
    # (or $JAXRL4LLM_COMPILE_CACHE), off (or false), or a folder (a shared one on a pod); a resume
    # loads its programs instead of compiling them.
    compile_cache: bool | str = "auto"
    # Asynchronous RL (train/rollout_pipeline.py, docs/training.md "Asynchronous RL"): the rollout
    # of step t is sampled by the policy of step t - k (k policy versions old) while the updates in
    # between run; 0 = the synchronous loop (every rollout from the current policy). The sampler
    # runs on its own devices with mesh.sampler_devices, else on the training devices.
    max_staleness: int = 0


@dataclasses.dataclass
class TeacherConfig:
    """On-policy distillation's teacher (docs/objectives.md "On-policy distillation"): a frozen
    model that scores the student's sampled tokens in the trainer's log-prob pass
    (`TrainBatch.teacher_logp`). `model`: an HF folder (local or gs://) or a Hub id, of any size,
    whose tokenizer gives every token the student's id (compared id by id); null = no teacher.
    `dtype`: its weights' and compute's dtype (frozen: no float32 master copy, no optimizer
    state); its parameters are sharded on the trainer's mesh as the student's. `temperature`:
    log softmax(z / temperature) of the teacher's logits; 1.0 is the teacher's own distribution,
    another value distills a sharpened (< 1) or flattened (> 1) teacher: a bias of the target,
    not of the estimator. The distillation's weight and form are algorithm keys
    (`algorithm.overrides.distill_coef`, `distill_discount`, `distill_clip`, `task_reward`;
    presets `opd`, `lite_ppo_opd`)."""

    model: str | None = None
    dtype: Literal["bfloat16", "float32"] = "bfloat16"
    temperature: float = 1.0
    logprob_chunk_size: int = 64  # positions per LM-head chunk of the teacher's pass (model.logprob_chunk_size)


@dataclasses.dataclass
class MeshConfig:
    """Device mesh shape; -1 on one axis takes the remaining devices."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    topology: str | None = None  # the TPU slice the mesh is sized for (`jaxrl4llm plan`'s default)
    # Devices of each process given to the sampler alone (trainer.max_staleness >= 1: rollouts and
    # updates run at the same time): a count, or a fraction (0.5 = half) of the devices; the
    # data/fsdp/tensor axes then shape the remaining ones. 0 = the sampler uses the training devices.
    sampler_devices: float = 0


@dataclasses.dataclass
class RunConfig:
    """A whole run; each field is a YAML section."""

    model: ModelConfigSection = dataclasses.field(default_factory=ModelConfigSection)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = dataclasses.field(default_factory=AlgorithmConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    teacher: TeacherConfig = dataclasses.field(default_factory=TeacherConfig)

    def eval_sampling(self) -> EvalSampling:
        """Evaluation's sampling (EvalConfig): `eval.*` where set, else trainer.eval_samples /
        trainer.eval_temperature and rollout.top_p / top_k; greedy (temperature 0) means one
        sample at top_p 1, top_k 0, whatever `samples` says."""
        ev = self.eval
        temperature = ev.temperature if ev.temperature is not None else self.trainer.eval_temperature
        if temperature <= 0:
            return EvalSampling(samples=1, temperature=temperature, top_p=1.0, top_k=0)
        return EvalSampling(samples=max(ev.samples if ev.samples is not None else self.trainer.eval_samples, 1),
                            temperature=temperature, top_p=ev.top_p if ev.top_p is not None else self.rollout.top_p,
                            top_k=ev.top_k if ev.top_k is not None else self.rollout.top_k)

    def recipe(self) -> Recipe:
        """The core Recipe: the preset with `algorithm.overrides` applied (validated)."""
        preset = self.algorithm.preset
        if preset not in PRESETS:
            raise ConfigError(f"algorithm.preset={preset!r} is not a recipe; valid presets: {', '.join(PRESETS)}.")
        base = PRESETS[preset]
        valid = [f.name for f in dataclasses.fields(Recipe)]
        unknown = [k for k in self.algorithm.overrides if k not in valid]
        if unknown:
            raise ConfigError(f"algorithm.overrides has unknown key(s) {unknown}; valid keys: {', '.join(valid)}.")
        changes = {k: _coerce(v, _hints(Recipe)[k], f"algorithm.overrides.{k}") for k, v in self.algorithm.overrides.items()}
        try:
            return dataclasses.replace(base, **changes)
        except ValueError as e:
            raise ConfigError(str(e)) from None


# ----------------------------------------------------------------------------- loading


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _type_name(tp) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Checks/converts a YAML value to the annotated type; raises ConfigError naming the key."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, key)
            except ConfigError as e:
                errors.append(str(e))
        if len(errors) > 1:  # say every accepted form, e.g. "'auto'" or "true/false"
            forms = [", ".join(map(repr, typing.get_args(a))) if typing.get_origin(a) is Literal else _type_name(a)
                     for a in args if a is not type(None)]
            raise ConfigError(f"{key}={value!r} is not allowed; use {' or '.join(forms)}.")
        raise ConfigError(errors[0] if errors else f"{key}: bad value {value!r}.")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}={value!r} is not allowed; choose one of {', '.join(map(repr, args))}.")
        return value
    if origin in (list, tuple):
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}.")
        inner = args[0] if args else Any
        return [_coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}.")
        return dict(value)
    if tp is Any:
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}.")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key} must be an integer, got {value!r}.")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-6" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}.")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}.")
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key)
    raise ConfigError(f"{key}: unsupported type {_type_name(tp)}.")


def _build(cls, values: Any, prefix: str):
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping of keys, got {values!r}.")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in values if k not in names]
    if unknown:
        where = f"section '{prefix}'" if prefix else "the top level"
        raise ConfigError(f"Unknown config key(s) {', '.join(repr(f'{prefix}.{k}' if prefix else k) for k in unknown)} in {where}; valid keys: {', '.join(names)}.")
    kwargs = {k: _coerce(v, hints[k], f"{prefix}.{k}" if prefix else k) for k, v in values.items()}
    return cls(**kwargs)


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "overrides":
            out[k] = _deep_merge(out[k], v)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = {**out[k], **v}
        else:
            out[k] = v
    return out


# libyaml's safe loader where PyYAML was built with it (the wheels are): the same documents as
# yaml.safe_load, parsed ~10x faster (`plan` and the layout tests read the config files thousands of times)
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def read_yaml(path: str | Path, _seen: tuple = ()) -> dict:
    """Reads a YAML config, resolving `include:` (relative to the file) recursively."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"Config file {str(path)!r} does not exist (looked in {Path.cwd()}); pass a path to a YAML file such as configs/lite_ppo.yaml.")
    if path.resolve() in _seen:
        raise ConfigError(f"Config include cycle through {path}.")
    try:
        raw = yaml.load(path.read_text(), Loader=YAML_LOADER) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"Config file {path} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"Config file {path} must hold a mapping of sections, got {type(raw).__name__}.")
    includes = raw.pop("include", None) or []
    if isinstance(includes, str):
        includes = [includes]
    merged: dict = {}
    for inc in includes:
        merged = _deep_merge(merged, read_yaml(path.parent / inc, _seen + (path.resolve(),)))
    return _deep_merge(merged, raw)


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Applies `a.b=value` strings (value parsed as YAML: 1e-6, true, [a, b], null)."""
    out = dict(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"Override {item!r} must look like section.key=value (e.g. optim.lr=2e-6).")
        key, text = item.split("=", 1)
        try:
            value = yaml.safe_load(text) if text != "" else ""
        except yaml.YAMLError:
            value = text
        parts = key.strip().split(".")
        node = out
        for p in parts[:-1]:
            child = node.get(p)
            child = dict(child) if isinstance(child, dict) else {}
            node[p] = child
            node = child
        node[parts[-1]] = value
    return out


# Allowed ranges of the values that would otherwise crash (or silently misbehave) later in the
# run: key -> (test, the range in words). `None` (an optional key left unset) always passes.
_POSITIVE = (lambda v: v >= 1, ">= 1")
_NON_NEGATIVE = (lambda v: v >= 0, ">= 0")
RANGES: dict[str, tuple[Any, str]] = {
    "model.hidden_size": _POSITIVE, "model.intermediate_size": _POSITIVE, "model.num_layers": _POSITIVE,
    "model.num_heads": _POSITIVE, "model.num_kv_heads": _POSITIVE, "model.head_dim": _POSITIVE,
    "model.logprob_chunk_size": _POSITIVE, "model.vocab_size": _POSITIVE, "model.max_position_embeddings": _POSITIVE, "model.rope_theta": _POSITIVE,
    "model.lora.rank": _POSITIVE, "model.lora.dropout": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "data.max_prompt_tokens": _POSITIVE, "data.eval_limit": _NON_NEGATIVE,
    "rollout.prompts_per_step": _POSITIVE, "rollout.samples_per_prompt": _POSITIVE,
    "rollout.max_new_tokens": _POSITIVE, "rollout.temperature": (lambda v: v >= 0, ">= 0 (0 = greedy)"),
    "rollout.top_p": (lambda v: 0 < v <= 1, "in (0, 1]"), "rollout.top_k": (lambda v: v >= 0, ">= 0 (0 = off)"),
    "rollout.min_p": (lambda v: 0 <= v <= 1, "in [0, 1] (0 = off)"),
    "rollout.stop_token_ids": (lambda v: all(t >= 0 for t in v), "a list of token ids >= 0"),
    "rollout.stop_strings": (lambda v: all(v), "a list of non-empty strings"),
    "rollout.dynamic_sampling_max_draws": _POSITIVE, "rollout.tensor_parallel": (lambda v: v >= 0, ">= 0 (0 = the training mesh)"),
    "rollout.prompts_per_chunk": (lambda v: v == "auto" or v >= 0, ">= 0 (0 = all at once) or 'auto'"),
    "rollout.slots": (lambda v: v == "auto" or v >= 1, ">= 1 or 'auto'"), "rollout.decode_burst": _POSITIVE,
    "rollout.retire_pass_rate": (lambda v: 0 < v <= 1, "in (0, 1] or null (off)"),
    "rollout.tools.max_turns": _POSITIVE, "rollout.tools.max_tool_tokens": _POSITIVE,
    "rollout.tools.max_output_chars": _POSITIVE, "rollout.tools.timeout": (lambda v: v > 0, "> 0 (seconds)"),
    "rollout.tools.segment_steps": _POSITIVE, "rollout.tools.workers": _POSITIVE,
    "rollout.tools.memory_bytes": _POSITIVE, "rollout.tools.cpu_seconds": (lambda v: v > 0, "> 0 (seconds)"),
    "reward.timeout": (lambda v: v > 0, "> 0 (seconds)"),
    "optim.lr": (lambda v: v > 0, "> 0"), "optim.warmup_steps": _NON_NEGATIVE,
    "optim.min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"), "optim.weight_decay": _NON_NEGATIVE,
    "optim.b1": (lambda v: 0 <= v < 1, "in [0, 1)"), "optim.b2": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "optim.eps": (lambda v: v > 0, "> 0"), "optim.max_grad_norm": (lambda v: v >= 0, ">= 0 (0 = no clipping)"),
    "trainer.steps": _NON_NEGATIVE, "trainer.ppo_epochs": _POSITIVE, "trainer.mini_batches": _POSITIVE,
    "trainer.micro_batch_size": _POSITIVE, "trainer.tokens_per_micro_batch": _POSITIVE, "trainer.eval_every": (lambda v: v >= -1, ">= -1 (0 = before and after training only, -1 = never)"),
    "trainer.eval_samples": _POSITIVE, "trainer.eval_temperature": (lambda v: v >= 0, ">= 0 (0 = greedy)"),
    "trainer.checkpoint_every": (lambda v: v >= 0, ">= 0 (0 = off)"), "trainer.keep_checkpoints": _POSITIVE,
    "trainer.clipped_tokens_every": (lambda v: v >= 0, ">= 0 (0 = off)"),
    "trainer.log_samples": (lambda v: v >= 0, ">= 0 (0 = off)"),
    "trainer.max_staleness": (lambda v: v >= 0, ">= 0 (0 = synchronous)"),
    "eval.samples": _POSITIVE, "eval.temperature": (lambda v: v >= 0, ">= 0 (0 = greedy)"),
    "eval.top_p": (lambda v: 0 < v <= 1, "in (0, 1]"), "eval.top_k": (lambda v: v >= 0, ">= 0 (0 = off)"),
    "trainer.router_metrics_every": (lambda v: v >= 0, ">= 0 (0: no routing metrics pass)"),
    "trainer.router_aux_loss_coef": (lambda v: v >= 0, ">= 0 (0: no load-balancing loss)"),
    "mesh.sampler_devices": (lambda v: v >= 0, ">= 0 (a count, a fraction in (0, 1), or 0 = share the training devices)"),
    "teacher.temperature": (lambda v: v > 0, "> 0 (1.0 = the teacher's own distribution)"),
    "teacher.logprob_chunk_size": _POSITIVE,
    "mesh.data": (lambda v: v == -1 or v >= 1, ">= 1 or -1 (the remaining devices)"),
    "mesh.fsdp": (lambda v: v == -1 or v >= 1, ">= 1 or -1 (the remaining devices)"),
    "mesh.tensor": (lambda v: v == -1 or v >= 1, ">= 1 or -1 (the remaining devices)"),
}


def check_ranges(cfg: RunConfig) -> None:
    """Raises ConfigError naming the key, its value and the allowed range for a value out of
    range (RANGES), e.g. `rollout.samples_per_prompt=0 is out of range; it must be >= 1.`"""
    for key, (ok, allowed) in RANGES.items():
        node: Any = cfg
        for part in key.split("."):
            node = getattr(node, part, None)
            if node is None:
                break
        if node is not None and not ok(node):
            raise ConfigError(f"{key}={node!r} is out of range; it must be {allowed}.")


def config_from_dict(raw: dict) -> RunConfig:
    """Builds and validates a RunConfig from a nested dict."""
    cfg = _build(RunConfig, raw, "")
    check_ranges(cfg)
    cfg.recipe()  # validates preset and overrides early
    cfg.reward.terms()  # reward.fns: an fn each, finite weights, unique names
    return cfg


def load_config(paths: str | Path | list | None, overrides: list[str] | None = None) -> RunConfig:
    """YAML file(s) merged in order (or defaults when None) + overrides -> validated RunConfig."""
    if paths is None:
        paths = []
    elif isinstance(paths, (str, Path)):
        paths = [paths]
    raw: dict = {}
    for path in paths:
        raw = _deep_merge(raw, read_yaml(path))
    raw = apply_overrides(raw, overrides or [])
    return config_from_dict(raw)


def config_to_dict(cfg: RunConfig) -> dict:
    """Plain nested dict of a RunConfig (for saving next to a run)."""
    return dataclasses.asdict(cfg)

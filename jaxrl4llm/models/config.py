"""ModelConfig: the static description of a decoder-only LLM (Qwen2/2.5, Qwen3, Llama 3, Qwen3-MoE).

A frozen, hashable dataclass: pass it as a `jax.jit` static argument. It converts to and
from the Hugging Face `config.json` dictionary of the supported families.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
import numpy as np

from jaxrl4llm.kernels.choice import ATTENTION_IMPLS, EXPERT_FORMS, NUMERICS
from jaxrl4llm.models.remat import REMAT_POLICIES

SUPPORTED_ARCHITECTURES = ("qwen2", "qwen3", "llama", "qwen3_moe")
MOE_ARCHITECTURES = ("qwen3_moe",)  # every layer's feed-forward is a router + experts (layers/moe.py)

_HF_CLASS_NAMES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_DTYPES = ("bfloat16", "float32", "float16")


class ConfigError(ValueError):
    """A config.json that jaxrl4llm cannot turn into a ModelConfig."""


def _freeze(value: Any) -> Any:
    """dict/list -> sorted tuple of items / tuple, recursively (hashable)."""
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    """Inverse of `_freeze` for the rope_scaling tuple of (key, value) pairs."""
    if isinstance(value, tuple) and all(isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) for x in value):
        return {k: _thaw(v) for k, v in value}
    if isinstance(value, tuple):
        return [_thaw(v) for v in value]
    return value


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static hyper-parameters of a decoder-only transformer.

    Attributes:
      architecture: "qwen2" | "qwen3" | "llama" (Hugging Face `model_type`).
      vocab_size, hidden_size (D), intermediate_size (F), num_layers (L), num_heads (H),
      num_kv_heads (KVH, grouped-query attention when < H), head_dim (Dh).
      rope_theta: RoPE base. rope_scaling: None or a sorted tuple of (key, value) items of the
        HF rope-scaling dict (rope_type "linear" or "llama3").
      rms_norm_eps: RMSNorm epsilon. tie_word_embeddings: LM head = embedding matrix.
      attention_bias: bias on q/k/v projections. o_proj_bias: bias on the output projection.
      qk_norm: per-head RMSNorm of q and k before RoPE (Qwen3).
      dtype: compute dtype of matmul inputs ("bfloat16" -> bf16 x bf16 -> f32 accumulation); a
        dtype object (jnp.bfloat16) is accepted and stored by name.
      param_dtype: storage dtype of parameters. remat: rematerialise each layer in backward.
      remat_policy: what a rematerialised layer keeps ("full": nothing, "save_attention",
        "save_dots"; models/remat.py).
    attention_query_chunk: sequences longer than this attend in blocks of this many queries
      (bounds the [B, H, T, T] score memory of training/scoring; None = never).
    attention_impl: the backend of segment-id attention (models/layers/segment_attention.py):
      "auto" (by platform: TPU splash, GPU pallas_gpu, CPU xla) or one forced: "xla", "splash",
      "pallas_gpu", "cudnn".
    numerics: "default" (each platform's fastest kernels) or "exact": batch-invariant kernels that
      give the sampler's log-probs and the trainer's the same bits (`kernels.exact`; one CPU
      device, no LoRA; docs/objectives.md, "Sampler-trainer agreement").
    Mixture of experts (Qwen3-MoE; 0 / defaults for dense models; `models/layers/moe.py`):
      num_experts (E, 0 = dense), num_experts_per_tok (k), moe_intermediate_size (I, each
      expert's SwiGLU width), norm_topk_prob (renormalise the k gate weights to sum 1),
      decoder_sparse_step and mlp_only_layers (HF's dense/MoE layer mix: only all-MoE stacks,
      step 1 and no mlp-only layers, are supported), router_aux_loss_coef (HF's load-balancing
      loss weight, kept for the checkpoint; nothing here adds that loss).
      expert_form: "auto" (`kernels.choice.expert_form_for`) or one of EXPERT_FORMS, forced.
    """

    architecture: str = "qwen3"
    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_layers: int = 28
    num_heads: int = 16
    num_kv_heads: int = 8
    head_dim: int = 128
    rope_theta: float = 1_000_000.0
    rope_scaling: tuple | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    o_proj_bias: bool = False
    qk_norm: bool = True
    max_position_embeddings: int = 40960
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    dtype: str = "bfloat16"
    param_dtype: str = "float32"
    remat: bool = False
    remat_policy: str = "full"
    attention_query_chunk: int | None = 1024
    attention_impl: str = "auto"
    numerics: str = "default"
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0
    expert_form: str = "auto"

    def __post_init__(self):
        for name in ("dtype", "param_dtype"):  # jnp.bfloat16 / np.dtype / "bfloat16" all name the same dtype
            value = getattr(self, name)
            if not isinstance(value, str):
                try:
                    object.__setattr__(self, name, np.dtype(value).name)
                except TypeError:
                    raise ConfigError(f"{name}={value!r} is not a dtype; supported: {', '.join(_DTYPES)}") from None
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unknown architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.remat_policy not in REMAT_POLICIES:
            raise ConfigError(f"remat_policy={self.remat_policy!r}; choose one of {', '.join(REMAT_POLICIES)} "
                              f"(models/remat.py)")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ConfigError(f"attention_impl={self.attention_impl!r}; choose one of {', '.join(ATTENTION_IMPLS)} "
                              f"(models/layers/segment_attention.py)")
        if self.numerics not in NUMERICS:
            raise ConfigError(f"numerics={self.numerics!r}; choose one of {', '.join(NUMERICS)} (kernels/exact.py)")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ConfigError(f"{name}={getattr(self, name)!r}; supported: {', '.join(_DTYPES)}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling_dict().get("rope_type", "default")
            if rope_type not in _SUPPORTED_ROPE_TYPES:
                raise ConfigError(f"rope_type {rope_type!r} is not supported; supported: {', '.join(_SUPPORTED_ROPE_TYPES)}")
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        self._check_experts()

    def _check_experts(self):
        """The mixture-of-experts fields: set for the MoE architectures, every layer MoE."""
        moe = self.architecture in MOE_ARCHITECTURES
        if not moe:
            if self.num_experts:
                raise ConfigError(f"num_experts={self.num_experts} on a dense {self.architecture} model; "
                                  f"mixture-of-experts architectures: {', '.join(MOE_ARCHITECTURES)}")
            return
        e, k = self.num_experts, self.num_experts_per_tok
        if e < 1 or k < 1 or self.moe_intermediate_size < 1:
            raise ConfigError(f"{self.architecture} needs num_experts, num_experts_per_tok and moe_intermediate_size "
                              f">= 1 (got {e}, {k}, {self.moe_intermediate_size})")
        if k > e:
            raise ConfigError(f"num_experts_per_tok={k} > num_experts={e}: set num_experts_per_tok <= num_experts")
        if self.decoder_sparse_step != 1 or self.mlp_only_layers:
            raise ConfigError(f"a stack that mixes dense and MoE layers (decoder_sparse_step="
                              f"{self.decoder_sparse_step}, mlp_only_layers={list(self.mlp_only_layers)}) is not "
                              f"supported; supported: every layer MoE (decoder_sparse_step=1, mlp_only_layers=[])")
        if self.numerics == "exact":
            raise ConfigError("model.numerics=exact has no mixture-of-experts kernels; use numerics=default")
        if self.expert_form not in ("auto",) + EXPERT_FORMS:
            raise ConfigError(f"expert_form={self.expert_form!r}; choose one of auto, {', '.join(EXPERT_FORMS)} "
                              f"(kernels/choice.py)")

    def rope_scaling_dict(self) -> dict:
        """rope_scaling as a plain dict ({} when there is no scaling)."""
        return {} if self.rope_scaling is None else _thaw(self.rope_scaling)

    def replace(self, **changes) -> "ModelConfig":
        """A copy with some fields changed (e.g. `config.replace(dtype="float32")`)."""
        return dataclasses.replace(self, **changes)

    @property
    def num_params(self) -> int:
        """Total number of parameters (embedding counted once when tied; every expert and the
        router of an MoE model)."""
        return self._count_params(self.num_experts)

    @property
    def num_active_params(self) -> int:
        """Parameters one token runs through: `num_params` with k of the E experts per layer
        (the router counted whole); = num_params for a dense model."""
        return self._count_params(self.num_experts_per_tok)

    def _count_params(self, experts: int) -> int:
        d, f, h, kvh, dh = self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim
        per_layer = d * h * dh * 2 + d * kvh * dh * 2 + 2 * d
        if self.num_experts:  # router [D, E] + `experts` SwiGLU experts of width I
            per_layer += d * self.num_experts + experts * 3 * d * self.moe_intermediate_size
        else:
            per_layer += 3 * d * f
        per_layer += (h + 2 * kvh) * dh if self.attention_bias else 0
        per_layer += d if self.o_proj_bias else 0
        per_layer += 2 * dh if self.qk_norm else 0
        head = 0 if self.tie_word_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.num_layers * per_layer + d + head

    # ------------------------------------------------------------------ HF conversion
    @classmethod
    def from_hf_dict(cls, d: dict, **overrides) -> "ModelConfig":
        """Build from a Hugging Face config.json dict (legacy rope_theta/rope_scaling or
        transformers-5 `rope_parameters`). `overrides` set dtype, param_dtype, remat, ..."""
        arch = d.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unknown architecture (model_type) {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if d.get("use_sliding_window", False):
            raise ConfigError("use_sliding_window=True is not supported (full attention only)")
        if d.get("mlp_bias", False):
            raise ConfigError("mlp_bias=True is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act={d.get('hidden_act')!r} is not supported (silu only)")
        try:
            hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
            rope_params = dict(d.get("rope_parameters") or {})
            rope_theta = float(rope_params.pop("rope_theta", None) or d.get("rope_theta") or 10000.0)
            rope_scaling = d.get("rope_scaling") or rope_params or None
            if rope_scaling is not None:
                rope_scaling = dict(rope_scaling)
                rope_scaling.pop("rope_theta", None)
                if "type" in rope_scaling and "rope_type" not in rope_scaling:
                    rope_scaling["rope_type"] = rope_scaling.pop("type")
                if rope_scaling.get("rope_type", "default") == "default" and set(rope_scaling) <= {"rope_type"}:
                    rope_scaling = None
            attention_bias = bool(d.get("attention_bias", False))
            eos = d.get("eos_token_id")
            fields = dict(
                architecture=arch,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(d.get("intermediate_size") or 0) if arch in MOE_ARCHITECTURES
                else int(d["intermediate_size"]),
                num_layers=int(d["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(d.get("num_key_value_heads") or heads),
                head_dim=int(d.get("head_dim") or hidden // heads),
                rope_theta=rope_theta,
                rope_scaling=_freeze(rope_scaling),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=True if arch == "qwen2" else attention_bias,
                o_proj_bias=False if arch == "qwen2" else attention_bias,
                qk_norm=arch in ("qwen3", "qwen3_moe"),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
                pad_token_id=d.get("pad_token_id"),
            )
            if arch in MOE_ARCHITECTURES:
                fields.update(_moe_fields(d))
        except KeyError as e:
            raise ConfigError(f"config.json lacks required key {e.args[0]!r}") from None
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def from_pretrained_dir(cls, path: str | os.PathLike, **overrides) -> "ModelConfig":
        """Read `<path>/config.json` (a local Hugging Face checkpoint folder)."""
        file = os.path.join(os.fspath(path), "config.json")
        if not os.path.isdir(os.fspath(path)):
            raise FileNotFoundError(f"checkpoint folder {os.fspath(path)!r} does not exist")
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no config.json in checkpoint folder {os.fspath(path)!r}")
        try:
            with open(file) as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{file}: invalid JSON ({e})") from None
        try:
            return cls.from_hf_dict(d, **overrides)
        except ConfigError as e:
            raise ConfigError(f"{file}: {e}") from None

    def to_hf_dict(self, torch_dtype: str | None = None) -> dict:
        """The Hugging Face config.json dict (legacy rope_theta/rope_scaling keys, which both
        transformers 4/5 and vLLM read)."""
        d = {
            "architectures": [_HF_CLASS_NAMES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling_dict() or None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_cache": True,
            "torch_dtype": torch_dtype or self.param_dtype,
        }
        if self.architecture != "qwen2":
            d["attention_bias"] = self.attention_bias
        if self.architecture == "llama":
            d["mlp_bias"] = False
        if self.num_experts:
            d.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                     decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers),
                     router_aux_loss_coef=self.router_aux_loss_coef, output_router_logits=False)
        if self.architecture in ("qwen2", "qwen3", "qwen3_moe"):
            d["use_sliding_window"] = False
            d["sliding_window"] = None
            d["max_window_layers"] = self.num_layers
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, key)
            if value is not None:
                d[key] = list(value) if isinstance(value, tuple) else value
        return d


def _moe_fields(d: dict) -> dict:
    """The Qwen3-MoE fields of a config.json dict (`num_local_experts` is accepted for `num_experts`)."""
    experts = d.get("num_experts", d.get("num_local_experts"))
    if experts is None:
        raise KeyError("num_experts")
    return {"num_experts": int(experts), "num_experts_per_tok": int(d["num_experts_per_tok"]),
            "moe_intermediate_size": int(d["moe_intermediate_size"]),
            "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
            "decoder_sparse_step": int(d.get("decoder_sparse_step", 1)),
            "mlp_only_layers": tuple(int(i) for i in d.get("mlp_only_layers") or ()),
            "router_aux_loss_coef": float(d.get("router_aux_loss_coef", 0.001))}  # transformers' default

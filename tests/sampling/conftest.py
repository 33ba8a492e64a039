"""Fixtures of tests/sampling: tiny random Hugging Face checkpoints (transformers + torch oracles)."""

from typing import NamedTuple

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxrl4llm.models import abstract_model, load_pretrained

VOCAB = 96
PAD = 0
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
FAMILIES = {
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),  # q/k/v bias, tied head
    "qwen3": (transformers.Qwen3Config, dict(head_dim=24, tie_word_embeddings=False)),  # q/k norm
    "llama": (transformers.LlamaConfig, dict(rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False)),
    # Qwen3-MoE: Qwen3's attention, 8 experts, 2 per token, renormalised gate weights
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(head_dim=24, num_experts=8, num_experts_per_tok=2,
                                                    moe_intermediate_size=32, norm_topk_prob=True,
                                                    tie_word_embeddings=False)),
}
PROMPT_LENGTHS = (9, 4, 1, 6)


def tiny_hf_model(family: str, seed: int = 0):
    """A random float32 HF causal LM (2 layers, hidden 64, 4 heads, 2 KV heads), weights scaled so logits are peaked."""
    cls, kwargs = FAMILIES[family]
    config = cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, rope_theta=10000.0, max_position_embeddings=256, rms_norm_eps=1e-6,
                 bos_token_id=None, eos_token_id=None, pad_token_id=PAD, **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    if family == "qwen3_moe":  # transformers' per-expert loop (its oracle), not grouped_mm
        model.set_experts_implementation("eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.05 if "norm" in name else 0.15) + (1.0 if "norm" in name else 0.0))
    return model


def random_prompts(seed: int = 0, lengths=PROMPT_LENGTHS) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, VOCAB, n).tolist() for n in lengths]


class Family(NamedTuple):
    """A tiny checkpoint: the transformers model and ours as `nnx.split(load_pretrained(...))`."""

    torch_model: object
    config: object  # ModelConfig (float32 compute)
    graphdef: nnx.GraphDef
    state: nnx.State


def with_dtype(config, dtype: str) -> nnx.GraphDef:
    """The graphdef of the same model computing in `dtype` (the compute dtype is part of the
    module, not of its state: the float32 state is reused as it is)."""
    graphdef, _ = abstract_model(config.replace(dtype=dtype))
    return graphdef


_CACHE = {}


def load_family(family: str, tmp_path_factory) -> Family:
    """Family (torch model, ModelConfig, graphdef, state) of a tiny checkpoint saved by transformers."""
    if family not in _CACHE:
        model = tiny_hf_model(family)
        folder = tmp_path_factory.mktemp(f"hf_{family}")
        model.save_pretrained(folder)
        ours = load_pretrained(folder, dtype="float32", param_dtype="float32")
        graphdef, state = nnx.split(ours)
        _CACHE[family] = Family(model, ours.config, graphdef, state)
    return _CACHE[family]


@pytest.fixture(scope="session")
def qwen3(tmp_path_factory) -> Family:
    """Family (torch model, config, graphdef, state) of the tiny qwen3 checkpoint."""
    return load_family("qwen3", tmp_path_factory)


@pytest.fixture
def key():
    return jax.random.key(0)

"""Tiny random Hugging Face checkpoints (built with transformers + torch, no downloads)."""

import numpy as np
import torch
import transformers

VOCAB = 300
LENGTHS = (8, 5, 1)  # a left-padded batch of three rows of different lengths
T = max(LENGTHS)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}

FAMILIES = {
    # Qwen2.5: q/k/v bias, untied head.
    "qwen2": (transformers.Qwen2Config, dict(tie_word_embeddings=False)),
    # Qwen3: q/k norm, explicit head_dim != hidden / heads, tied head (as Qwen3-4B).
    "qwen3": (transformers.Qwen3Config, dict(head_dim=24, tie_word_embeddings=True)),
    # Llama 3.1: llama3 RoPE scaling, untied head.
    "llama": (transformers.LlamaConfig, dict(rope_scaling=LLAMA3_ROPE, tie_word_embeddings=False)),
    # Qwen3-MoE: Qwen3's attention, 8 experts, 2 per token, renormalised gate weights, untied head.
    "qwen3_moe": (transformers.Qwen3MoeConfig, dict(head_dim=24, num_experts=8, num_experts_per_tok=2,
                                                    moe_intermediate_size=32, norm_topk_prob=True,
                                                    tie_word_embeddings=False)),
}


def tiny_hf_model(family: str, seed: int = 0, **overrides):
    """A random tiny HF causal LM of `family` in float32, weights scaled so logits vary."""
    cls, kwargs = FAMILIES[family]
    kwargs = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, max_position_embeddings=64,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, **kwargs)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cls(**kwargs)).float().eval()
    pin_eager_experts(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    return model


def pin_eager_experts(model):
    """A mixture-of-experts model runs transformers' per-expert loop (its oracle), not grouped_mm."""
    if getattr(model.config, "num_experts", 0) and hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    return model


def left_padded_batch(seed: int = 0):
    """tokens, attention_mask [3, T] int32, rows left-padded to lengths LENGTHS."""
    rng = np.random.default_rng(seed)
    tokens = np.zeros((len(LENGTHS), T), np.int32)
    mask = np.zeros((len(LENGTHS), T), np.int32)
    for b, n in enumerate(LENGTHS):
        tokens[b, T - n:] = rng.integers(3, VOCAB, n)
        mask[b, T - n:] = 1
    return tokens, mask


def hf_logits_per_row(model, tokens, mask) -> list[np.ndarray]:
    """Each row of a left-padded batch run alone through `model` (no padding): [n_b, V] each."""
    out = []
    with torch.no_grad():
        for b in range(tokens.shape[0]):
            row = torch.tensor(tokens[b][mask[b] > 0], dtype=torch.long)[None]
            out.append(model(row).logits[0].float().numpy())
    return out


def max_diff_vs_rows(logits: np.ndarray, refs: list[np.ndarray], mask) -> float:
    """max |ours - reference| over the real tokens of every row."""
    return max(float(np.abs(np.asarray(logits)[b][mask[b] > 0] - ref).max()) for b, ref in enumerate(refs))



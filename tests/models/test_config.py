"""ModelConfig <-> Hugging Face config.json dicts."""

import jax
import pytest

from jaxrl4llm.models import ConfigError, ModelConfig

QWEN3_4B = {  # the fields of Qwen/Qwen3-4B's config.json that matter
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2560,
    "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "rope_theta": 1000000, "rope_scaling": None, "rms_norm_eps": 1e-06,
    "tie_word_embeddings": True, "attention_bias": False, "max_position_embeddings": 40960,
    "bos_token_id": 151643, "eos_token_id": 151645, "use_sliding_window": False, "sliding_window": None,
    "hidden_act": "silu", "torch_dtype": "bfloat16",
}
LLAMA31_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}


def test_qwen3_4b_config():
    c = ModelConfig.from_hf_dict(QWEN3_4B)
    assert (c.architecture, c.num_layers, c.head_dim, c.num_kv_heads) == ("qwen3", 36, 128, 8)
    assert c.qk_norm and c.tie_word_embeddings and not c.attention_bias and c.rope_scaling is None
    assert c.dtype == "bfloat16" and c.param_dtype == "float32"
    assert 4.0e9 < c.num_params < 4.1e9  # Qwen3-4B: 4.02B parameters
    hash(c)
    jax.jit(lambda x, config: x * config.num_layers, static_argnames="config")(1.0, config=c)


def test_round_trip_through_hf_dict():
    for d in (QWEN3_4B,
              dict(QWEN3_4B, model_type="llama", rope_scaling=LLAMA31_ROPE, eos_token_id=[128001, 128009]),
              dict(QWEN3_4B, model_type="qwen2", head_dim=None)):
        c = ModelConfig.from_hf_dict(d)
        assert ModelConfig.from_hf_dict(c.to_hf_dict()) == c


def test_transformers5_rope_parameters_and_family_rules():
    d = dict(QWEN3_4B, model_type="llama", rope_theta=None, rope_scaling=None,
             rope_parameters=dict(LLAMA31_ROPE, rope_theta=500000.0), eos_token_id=[1, 2], attention_bias=True)
    c = ModelConfig.from_hf_dict(d)
    assert c.rope_theta == 500000.0 and c.rope_scaling_dict() == LLAMA31_ROPE and c.eos_token_id == (1, 2)
    assert c.attention_bias and c.o_proj_bias and not c.qk_norm  # Llama's attention_bias covers o_proj
    q2 = ModelConfig.from_hf_dict(dict(QWEN3_4B, model_type="qwen2"))
    assert q2.attention_bias and not q2.o_proj_bias and not q2.qk_norm  # Qwen2: q/k/v bias only


@pytest.mark.parametrize("change, message", [
    ({"model_type": "mistral"}, "supported: qwen2, qwen3, llama"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn' is not supported"),
    ({"use_sliding_window": True}, "sliding"),
    ({"num_key_value_heads": 5}, "not a multiple"),
])
def test_unsupported_configs_raise_clearly(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(dict(QWEN3_4B, **change))

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


QWEN3_30B_A3B = {  # the fields of Qwen/Qwen3-30B-A3B-Base's config.json that matter
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
    "attention_bias": False, "max_position_embeddings": 40960, "hidden_act": "silu", "num_experts": 128,
    "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "router_aux_loss_coef": 0.001, "output_router_logits": False,
    "use_sliding_window": False, "torch_dtype": "bfloat16",
}


def test_qwen3_30b_a3b_config_counts_total_and_active_parameters():
    c = ModelConfig.from_hf_dict(QWEN3_30B_A3B)
    assert (c.architecture, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == ("qwen3_moe", 128, 8,
                                                                                                768)
    assert c.qk_norm and c.norm_topk_prob and c.router_aux_loss_coef == 0.001 and c.mlp_only_layers == ()
    assert c.num_params == 30_532_122_624  # 128 experts + router per layer
    assert c.num_active_params == 3_353_032_704  # 8 of the 128 experts
    dense = ModelConfig.from_hf_dict(QWEN3_4B)
    assert dense.num_active_params == dense.num_params
    hash(c)


def test_qwen3_moe_round_trips_and_transformers_reads_it():
    import transformers

    c = ModelConfig.from_hf_dict(QWEN3_30B_A3B)
    d = c.to_hf_dict()
    assert ModelConfig.from_hf_dict(d) == c
    assert d["architectures"] == ["Qwen3MoeForCausalLM"]
    hf = transformers.Qwen3MoeConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    assert (hf.num_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, hf.norm_topk_prob) == (128, 8, 768, True)
    alias = {k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"}
    assert ModelConfig.from_hf_dict(dict(alias, num_local_experts=128)) == c  # transformers 5 writes this name


@pytest.mark.parametrize("change, message", [
    ({"decoder_sparse_step": 2}, (r"mixes dense and MoE layers \(decoder_sparse_step=2, mlp_only_layers=\[\]\) is "
                                  r"not supported; supported: every layer MoE")),
    ({"mlp_only_layers": [0, 47]}, r"mlp_only_layers=\[0, 47\]\) is not supported"),
    ({"num_experts_per_tok": 129}, (r"^num_experts_per_tok=129 > num_experts=128: set num_experts_per_tok <= "
                                    r"num_experts$")),
    ({"num_experts": 0}, "needs num_experts"),
])
def test_unsupported_moe_configs_raise_clearly(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_hf_dict(dict(QWEN3_30B_A3B, **change))


def test_moe_fields_refused_where_they_do_not_apply():
    with pytest.raises(ConfigError, match="num_experts=8 on a dense qwen3 model"):
        ModelConfig(num_experts=8)
    moe = ModelConfig.from_hf_dict(QWEN3_30B_A3B)
    with pytest.raises(ConfigError, match="numerics=exact has no mixture-of-experts kernels"):
        moe.replace(numerics="exact")
    with pytest.raises(ConfigError, match="expert_form='grouped'; choose one of auto, ragged_dot"):
        moe.replace(expert_form="grouped")

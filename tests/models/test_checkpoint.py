"""HF checkpoints in and out: logit parity with transformers, round trip, clear errors."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from tests.models.hf_oracle import hf_logits_per_row, left_padded_batch, max_diff_vs_rows, tiny_hf_model
from jaxrl4llm.models import (
    CausalLM,
    abstract_model,
    CheckpointError,
    ConfigError,
    forward,
    load_pretrained,
    positions_from_mask,
    save_pretrained,
)
from jaxrl4llm.models.layers.decoder import attention_block
from jaxrl4llm.models.layers.rope import rope_tables
from jaxrl4llm.models.layers.segment_attention import segment_causal_attention


def _forward(model, tokens, mask):
    graphdef, state = nnx.split(model)
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    return np.asarray(forward(graphdef, state, tokens, positions=positions_from_mask(mask), attention_mask=mask))


def _flat(model) -> dict[str, np.ndarray]:
    """{"layers/attn/q_proj/kernel": array, ...} of a model's parameters."""
    return {"/".join(map(str, path)): np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model))}


def _assert_same_params(a, b):
    flat_a, flat_b = _flat(a), _flat(b)
    assert sorted(flat_a) == sorted(flat_b)
    for key, value in flat_a.items():
        assert value.dtype == flat_b[key].dtype, key
        np.testing.assert_array_equal(value, flat_b[key], err_msg=key)


def test_float32_logits_match_transformers(hf_checkpoint):
    family, model, folder = hf_checkpoint
    ours = load_pretrained(folder, dtype="float32")
    assert isinstance(ours, CausalLM) and ours.config.architecture == family
    tokens, mask = left_padded_batch()
    logits = _forward(ours, tokens, mask)
    assert max_diff_vs_rows(logits, hf_logits_per_row(model, tokens, mask), mask) <= 1e-4


def test_bfloat16_compute_stays_close_to_transformers(hf_checkpoint):
    _, model, folder = hf_checkpoint
    ours = load_pretrained(folder)  # default: bf16 compute, f32 params
    assert ours.config.dtype == "bfloat16" and ours.config.param_dtype == "float32"
    assert all(v.dtype == jnp.float32 for v in _flat(ours).values())
    tokens, mask = left_padded_batch()
    refs = hf_logits_per_row(model, tokens, mask)
    scale = max(np.abs(r).max() for r in refs)
    assert max_diff_vs_rows(_forward(ours, tokens, mask), refs, mask) <= 0.05 * scale


def test_save_pretrained_round_trips_through_transformers(hf_checkpoint, tmp_path):
    family, model, folder = hf_checkpoint
    ours = load_pretrained(folder, dtype="float32")
    # A tiny max_shard_size forces several files plus model.safetensors.index.json.
    save_pretrained(ours, tmp_path, max_shard_size="100KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert reloaded.config.model_type == family
    # float32 weights are saved exactly: every tensor of the reloaded model equals the original.
    original = model.state_dict()
    for name, tensor in reloaded.state_dict().items():
        np.testing.assert_array_equal(tensor.numpy(), original[name].numpy(), err_msg=name)
    # Logits of two torch instances with equal weights may differ in the last bit (sdpa kernel
    # choice), so they are compared to float32 round-off, not bitwise.
    tokens, mask = left_padded_batch()
    ours_rows = hf_logits_per_row(reloaded, tokens, mask)
    for a, b in zip(ours_rows, hf_logits_per_row(model, tokens, mask)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    again = load_pretrained(tmp_path, dtype="float32")
    assert type(again) is type(ours) and again.config == ours.config
    _assert_same_params(ours, again)


def test_loads_bfloat16_safetensors(tmp_path):
    model = tiny_hf_model("qwen3", seed=1).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path, dtype="float32", param_dtype="float32")
    tokens, mask = left_padded_batch()
    # Reload in float32 (not model.float(): .to(bf16) also rounded the RoPE inv_freq buffer).
    oracle = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    refs = hf_logits_per_row(oracle, tokens, mask)
    assert max_diff_vs_rows(_forward(ours, tokens, mask), refs, mask) <= 1e-4
    save_pretrained(nnx.split(ours), tmp_path / "out", dtype="bfloat16")  # the (graphdef, state) form
    header = json.load(open(tmp_path / "out" / "config.json"))
    assert header["torch_dtype"] == "bfloat16"
    # The weights were bf16 values: saving them as bf16 loses nothing.
    _assert_same_params(ours, load_pretrained(tmp_path / "out", dtype="float32"))


# ---------------------------------------------------------------------------- errors
@pytest.fixture
def broken(qwen3_folder, tmp_path):
    """A copy of the qwen3 checkpoint folder that a test may break."""
    dst = tmp_path / "ckpt"
    shutil.copytree(qwen3_folder, dst)
    return dst


def test_missing_folder_and_config(broken, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_pretrained(tmp_path / "nope")
    os.remove(broken / "config.json")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_pretrained(broken)


def test_missing_safetensors(broken):
    os.remove(broken / "model.safetensors")
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        load_pretrained(broken)


def test_unknown_architecture_lists_supported(broken):
    cfg = json.load(open(broken / "config.json"))
    cfg["model_type"] = "gpt2"
    json.dump(cfg, open(broken / "config.json", "w"))
    with pytest.raises(ConfigError, match="'gpt2'.*qwen2, qwen3, llama"):
        load_pretrained(broken)


def test_shape_mismatch_names_file_tensor_and_shapes(broken):
    cfg = json.load(open(broken / "config.json"))
    cfg["intermediate_size"] = 96
    json.dump(cfg, open(broken / "config.json", "w"))
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight' "
                                              r"has shape \(128, 64\), expected \(96, 64\)"):
        load_pretrained(broken)


def test_missing_tensor_is_named(broken):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="'model.layers.1.self_attn.k_norm.weight' is missing"):
        load_pretrained(broken)


# ---------------------------------------------------------------------------- mixture of experts
def _our_router_logits(model, tokens, mask) -> list[np.ndarray]:
    """Each layer's router logits [B, T, E] of our model, its layers run one at a time."""
    c = model.config
    layer_def, layer_state = nnx.split(model.layers)
    tokens, mask = jnp.asarray(tokens), jnp.asarray(mask)
    cos, sin = rope_tables(c, positions_from_mask(mask))
    segments = (mask > 0).astype(jnp.int32)
    attend = lambda q, k, v: (segment_causal_attention(q, k, v, segments, dtype=jnp.float32, impl="xla"), None)
    x, out = model.embed_tokens(tokens), []
    for i in range(c.num_layers):
        layer = nnx.merge(layer_def, jax.tree.map(lambda a, i=i: a[i], layer_state))
        h = layer.post_attn_norm(attention_block(layer, x, cos, sin, attend)[0])
        out.append(np.asarray(jnp.einsum("btd,de->bte", h, layer.mlp.router[...], precision="highest")))
        x = layer(x, cos, sin, attend)[0]
    return out


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_router_logits_and_experts_match_transformers(norm_topk_prob, tmp_path):
    model = tiny_hf_model("qwen3_moe", seed=2, norm_topk_prob=norm_topk_prob)
    model.save_pretrained(tmp_path)
    ours = load_pretrained(tmp_path, dtype="float32")
    assert ours.config.norm_topk_prob == norm_topk_prob and ours.config.num_experts == 8
    tokens, mask = left_padded_batch()
    graphdef, state = nnx.split(ours)
    run = lambda g: forward(g, state, jnp.asarray(tokens), positions=positions_from_mask(jnp.asarray(mask)),
                            attention_mask=jnp.asarray(mask), return_routes=True)
    logits, routes = run(graphdef)
    ragged_logits, ragged_routes = run(abstract_model(ours.config.replace(expert_form="ragged_dot"))[0])
    refs = hf_logits_per_row(model, tokens, mask)
    assert max_diff_vs_rows(logits, refs, mask) <= 1e-4
    assert max_diff_vs_rows(ragged_logits, refs, mask) <= 1e-4
    np.testing.assert_array_equal(ragged_routes, routes)
    ours_router = _our_router_logits(ours, tokens, mask)
    for b, n in enumerate(mask.sum(axis=1)):
        with torch.no_grad():
            out = model(torch.tensor(tokens[b, -n:], dtype=torch.long)[None], output_router_logits=True)
        for layer, hf_logits in enumerate(out.router_logits):  # [n, E] each
            np.testing.assert_allclose(ours_router[layer][b, -n:], hf_logits.numpy(), rtol=0, atol=1e-5)
            hf_ids = torch.topk(torch.softmax(hf_logits, -1), 2, dim=-1).indices.numpy()
            np.testing.assert_array_equal(np.asarray(routes)[b, -n:, layer], hf_ids, err_msg=f"row {b} layer {layer}")


def test_moe_loads_transformers5_fused_expert_tensors(qwen3_moe_checkpoint, tmp_path):
    from safetensors.numpy import load_file, save_file

    _, _, folder = qwen3_moe_checkpoint
    tensors = load_file(folder / "model.safetensors")
    for i in range(2):
        pre = f"model.layers.{i}.mlp.experts."
        take = lambda name, pre=pre: [tensors.pop(f"{pre}{e}.{name}_proj.weight") for e in range(8)]
        gate, up, down = take("gate"), take("up"), take("down")
        tensors[pre + "gate_up_proj"] = np.stack([np.concatenate([g, u]) for g, u in zip(gate, up)])  # [E, 2I, D]
        tensors[pre + "down_proj"] = np.stack(down)  # [E, D, I]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    _assert_same_params(load_pretrained(tmp_path, dtype="float32"), load_pretrained(folder, dtype="float32"))


def test_moe_missing_expert_tensor_names_it_and_the_fix(qwen3_moe_checkpoint, tmp_path):
    from safetensors.numpy import load_file, save_file

    _, _, folder = qwen3_moe_checkpoint
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.1.mlp.experts.3.upproj.weight"] = tensors.pop("model.layers.1.mlp.experts.3.up_proj.weight")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match=r"^tensor 'model.layers.1.mlp.experts.3.up_proj.weight' is missing .*"
                                              r"one tensor per expert .* re-save it with transformers' save_pretrained$"):
        load_pretrained(tmp_path)


def test_moe_load_balancing_loss_and_router_entropy_match_transformers(qwen3_moe_checkpoint):
    """score_tokens(router_stats=True) on a left-padded batch: `core.routing.load_balancing_loss` of the stats
    equals transformers' aux_loss (`load_balancing_loss_func` with the attention mask), and
    `router_entropy` the masked mean entropy of transformers' router softmax over tokens and layers."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from jaxrl4llm.core.routing import load_balancing_loss, router_entropy
    from jaxrl4llm.models import score_tokens

    _, model, folder = qwen3_moe_checkpoint
    tokens, mask = left_padded_batch()
    positions = np.asarray(positions_from_mask(jnp.asarray(mask)))
    with torch.no_grad():
        out = model(torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask),
                    position_ids=torch.tensor(positions, dtype=torch.long), output_router_logits=True)
    hf_aux = float(out.aux_loss)
    np.testing.assert_allclose(hf_aux, float(load_balancing_loss_func(out.router_logits, 8, 2, torch.tensor(mask))))
    probs = torch.softmax(torch.stack(out.router_logits).double(), -1).numpy()  # [L, B*T, E]
    entropy = -(probs * np.log(probs)).sum(-1) * mask.reshape(1, -1)
    hf_entropy = entropy.sum() / (mask.sum() * len(out.router_logits))
    graphdef, state = nnx.split(load_pretrained(folder, dtype="float32"))
    tokens_j = jnp.asarray(tokens)
    _, _, stats = score_tokens(graphdef, state, tokens_j, jnp.roll(tokens_j, -1, axis=1), positions=jnp.asarray(positions),
                               attention_mask=jnp.asarray(mask), router_stats=True)
    assert stats.load.shape == (2, 8) and float(stats.tokens[0]) == mask.sum()
    np.testing.assert_allclose(float(load_balancing_loss(stats)), hf_aux, rtol=1e-5)
    np.testing.assert_allclose(float(router_entropy(stats)), hf_entropy, rtol=1e-5)

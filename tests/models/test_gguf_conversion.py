"""scripts/materialize_smollm2.py: a GGUF checkpoint -> an HF folder that jaxrl4llm loads.

A tiny random Llama (tied embeddings, grouped-query attention, like SmolLM2) is written as a
GGUF file the way llama.cpp's converter writes one (its tensor names, q/k rows permuted for
its RoPE layout, a byte-level BPE tokenizer in the metadata); the script's `materialize`
turns it back into a folder whose tensors must equal the originals and whose logits under
jaxrl4llm must equal transformers'. Needs the `gguf` package (test and bench extras).
"""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (it is in the test and bench extras)")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "materialize_smollm2.py"
HEADS, KV_HEADS, HIDDEN, LAYERS, FFN = 4, 2, 64, 2, 96


def _script():
    spec = importlib.util.spec_from_file_location("materialize_smollm2", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (HF's rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _byte_vocab() -> tuple[list[str], list[str]]:
    """Byte-level BPE tokens (the 256 byte symbols, a few merges) and the merges."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = list(bytes_to_unicode().values())
    merges = ["Ġ t", "h e", "Ġt he", "Ġ a"]
    return symbols + ["Ġt", "he", "Ġthe", "Ġa", "<|im_start|>", "<|im_end|>"], merges


def _write_gguf(path: Path):
    tokens, merges = _byte_vocab()
    vocab = len(tokens)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS,
        tie_word_embeddings=True, rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # logits far from uniform, norms away from 1: mistakes show
            p.normal_(1.0, 0.3) if "norm" in name else p.normal_(0.0, 0.3)
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t.startswith("<|") else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|im_end|>"))
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    for i in range(LAYERS):
        hf = f"model.layers.{i}."
        for ours, theirs in [("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                             ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                             ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")]:
            w.add_tensor(f"blk.{i}.{ours}.weight", sd[hf + theirs + ".weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _llama_cpp_permute(sd[hf + "self_attn.q_proj.weight"], HEADS))
        w.add_tensor(f"blk.{i}.attn_k.weight", _llama_cpp_permute(sd[hf + "self_attn.k_proj.weight"], KV_HEADS))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def test_gguf_folder_has_the_original_tensors_and_jaxrl4llm_matches_transformers(tmp_path):
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl4llm.models import forward, load_pretrained, load_tokenizer

    original = _write_gguf(tmp_path / "tiny.gguf")
    out = _script().materialize(str(tmp_path / "hf"), "float32", gguf_file=str(tmp_path / "tiny.gguf"))

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert reloaded.config.tie_word_embeddings and "quantization_config" not in reloaded.config.to_dict()
    for name, value in original.state_dict().items():  # q/k un-permuted, names mapped back
        np.testing.assert_array_equal(reloaded.state_dict()[name].numpy(), value.numpy(), err_msg=name)

    tokenizer = load_tokenizer(out)
    ids = tokenizer("the cat at the hat", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == "the cat at the hat"
    model = load_pretrained(out, dtype="float32", param_dtype="float32")
    assert model.config.architecture == "llama" and model.config.tie_word_embeddings
    graphdef, state = nnx.split(model)
    tokens = jnp.asarray([ids], jnp.int32)
    ours = np.asarray(forward(graphdef, state, tokens, positions=jnp.arange(len(ids))[None],
                              attention_mask=jnp.ones_like(tokens)))[0]
    with torch.no_grad():
        theirs = reloaded(torch.tensor([ids])).logits[0].numpy()
    assert np.abs(theirs).max() > 1.0
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)

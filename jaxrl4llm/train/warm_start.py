"""Warm starts: a small Qwen3-shaped model with a character-level tokenizer, fine-tuned (SFT) on a
teacher's completions and saved as a Hugging Face folder, the starting checkpoint of the demo and
of the miniature study (train/demo.py, study/miniature.py).

    build_warm_start(path, prompts, completions, model=DEMO_MODEL, sft=SFT_DEFAULTS, seed=0)
    ensure_warm_start(path, recipe, build)   # reuses a folder built from the same recipe

A completion is ``(text, stops)``: the tokens of ``" " + text``, then EOS when ``stops`` (a teacher
that loops without end is learned as one that never stops).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable, Sequence

import jax
from flax import nnx

from jaxrl4llm.data.demo_task import build_char_tokenizer
from jaxrl4llm.models import ModelConfig, init_model, load_pretrained, load_tokenizer, save_pretrained, score_tokens
from jaxrl4llm.train.sft import pack_sft_examples, sft_train

# the demo's 0.41M-parameter model (2 layers of hidden 128)
DEMO_MODEL = dict(architecture="qwen3", hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=32)
SFT_DEFAULTS = dict(steps=300, batch_size=64, lr=3e-3, length=96)
RECIPE_FILE = "warmstart.json"  # what a warm-start folder was built from; reused only on a match


def build_warm_start(path: str | Path, prompts: Sequence[str], completions: Sequence[tuple[str, bool]], *,
                     model: dict = DEMO_MODEL, sft: dict = SFT_DEFAULTS, seed: int = 0, init: str | Path | None = None,
                     log=print) -> Path:
    """SFT a random model of shape `model` on (prompt, completion) texts; save an HF folder at `path`.

    sft: steps, batch_size, lr and length (tokens of prompt + completion + EOS; a longer example is
    a ValueError naming it). init: a warm-start folder to fine-tune instead of a random model (its
    shape, not `model`'s; float32).
    """
    path = Path(path)
    tokenizer = load_tokenizer(build_char_tokenizer(path))
    if init is None:
        config = ModelConfig(vocab_size=len(tokenizer), tie_word_embeddings=True, qk_norm=True, rope_theta=10000.0,
                             max_position_embeddings=512, dtype="float32", param_dtype="float32",
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                             bos_token_id=tokenizer.bos_token_id, **model)
        graphdef, params = init_model(config, jax.random.PRNGKey(seed))
    else:
        start = load_pretrained(init, dtype="float32", param_dtype="float32")
        config, (graphdef, params) = start.config, nnx.split(start)
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    completion_ids = [tokenizer(" " + text)["input_ids"] + ([tokenizer.eos_token_id] if stops else [])
                      for text, stops in completions]
    data = pack_sft_examples(prompt_ids, completion_ids, length=sft["length"], pad_id=tokenizer.pad_token_id)
    logprob_fn = lambda p, x, y, pos, m: score_tokens(graphdef, p, x, y, positions=pos, attention_mask=m,
                                                      chunk_size=sft["length"])
    log(f"warm start: SFT of a {config.num_params / 1e6:.2f}M-parameter Qwen3-shaped model for {sft['steps']} steps "
        f"on {len(prompts)} examples")
    params = sft_train(params, logprob_fn, data, steps=sft["steps"], batch_size=sft["batch_size"], lr=sft["lr"],
                       seed=seed, log_every=100, log=log)
    save_pretrained((graphdef, params), path)
    return path


def warm_start_matches(path: str | Path, recipe: dict) -> bool:
    """True when `path` holds a complete warm start built from exactly `recipe` (its RECIPE_FILE)."""
    path = Path(path)
    try:
        return (path / "config.json").is_file() and json.loads((path / RECIPE_FILE).read_text()) == json.loads(
            json.dumps(recipe))
    except (OSError, ValueError):
        return False


def ensure_warm_start(path: str | Path, recipe: dict, build: Callable[[Path], object], *, rebuild: bool = False,
                      log=print) -> Path:
    """The warm start at `path`: reused when it was built from `recipe`, else built by `build(path)` into
    a fresh folder and stamped with the recipe (a folder cut short by an interruption has no stamp)."""
    path = Path(path)
    if not rebuild and warm_start_matches(path, recipe):
        log(f"warm start: reusing {path} (same recipe)")
        return path
    if path.exists():
        shutil.rmtree(path)
    build(path)
    (path / RECIPE_FILE).write_text(json.dumps(recipe, indent=1, sort_keys=True))
    return path

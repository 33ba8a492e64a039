import shutil
from pathlib import Path

import jax
import pytest

from jaxrl4llm.data import build_char_tokenizer, write_demo_task


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory):
    """A char tokenizer and a small demo task (train 64 / test 8) on disk."""
    root = tmp_path_factory.mktemp("demo_assets")
    paths = write_demo_task(root / "data", num_train=64, num_test=8, seed=0, digits=1, ops="+", steps=1)
    tok = build_char_tokenizer(root / "tokenizer")
    return {"train": paths["train"], "test": paths["test"], "tokenizer": tok, "root": root}


def tiny_overrides(assets, out_dir, **extra):
    """Overrides for a random 2-layer model, 2 prompts x 4 samples, 8 new tokens."""
    base = {
        "model.tokenizer": assets["tokenizer"], "model.hidden_size": 32, "model.intermediate_size": 64,
        "model.num_layers": 1, "model.num_heads": 2, "model.num_kv_heads": 1, "model.head_dim": 16,
        "model.dtype": "float32", "model.logprob_chunk_size": 32,
        "data.train_files": f"[{assets['train']}]", "data.eval_files": f"[{assets['test']}]", "data.template": "demo",
        "data.max_prompt_tokens": 64,
        "rollout.prompts_per_step": 2, "rollout.samples_per_prompt": 4, "rollout.max_new_tokens": 8,
        "optim.lr": 1e-3, "trainer.steps": 2, "trainer.out_dir": str(out_dir), "trainer.progress_bar": False,
        "trainer.eval_every": -1, "trainer.export_hf": False, "trainer.clipped_tokens_every": 1,
        "reward.fn": "tests.train.custom_parts:contains_one_reward", "reward.batched": False,
        "trainer.compile_cache": "off",  # tests/train/test_compile_cache.py covers it; keep the suite hermetic
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture(scope="session")
def finished_run(demo_assets, tmp_path_factory):
    """One tiny finished run that several tests read (copy it before changing it): 2 steps, a
    checkpoint at each, held-out accuracy before and after, an HF export, and a reward of the
    user's that asks for the problem and the row's metadata and raises on some responses
    (tests.train.custom_parts:checks_problem_and_metadata). Returns {"out", "overrides",
    "summary", "log"}: the folder, its train overrides, train's summary and its log lines."""
    from jaxrl4llm.train.config import load_config
    from jaxrl4llm.train.loop import train

    out = tmp_path_factory.mktemp("finished") / "run"
    overrides = tiny_overrides(demo_assets, out, **{
        "reward.fn": "tests.train.custom_parts:checks_problem_and_metadata", "reward.batched": "auto",
        "trainer.checkpoint_every": 1, "trainer.eval_every": 0, "trainer.export_hf": True,
        "trainer.clipped_tokens_every": 0, "data.eval_limit": 4})
    lines = []
    summary = train(load_config(None, overrides), log=lines.append)
    return {"out": out, "overrides": overrides, "summary": summary, "log": lines}


def teacher_folder(path, tokenizer_dir, *, layers=2, hidden=48, seed=3):
    """A random teacher of another shape than the tiny student (more layers, wider), with the tiny
    run's tokenizer, as an HF folder."""
    from jaxrl4llm.models import ModelConfig, init_model, load_tokenizer, save_pretrained

    tok = load_tokenizer(tokenizer_dir)
    config = ModelConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers,
                         num_heads=2, num_kv_heads=1, head_dim=24, qk_norm=True, tie_word_embeddings=True,
                         max_position_embeddings=512, dtype="float32", param_dtype="float32",
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    save_pretrained(init_model(config, jax.random.PRNGKey(seed)), path)
    for f in Path(tokenizer_dir).iterdir():
        shutil.copy(f, path / f.name)
    return path

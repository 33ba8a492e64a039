"""The demo: Lite PPO on the built-in arithmetic task, on the CPU, in a few minutes.

    jaxrl4llm demo [--out-dir runs/demo] [key=value ...]

1. writes the demo task (train/test JSONL) and a character-level HF tokenizer under OUT;
2. warm-starts a small Qwen3-shaped model by SFT on short worked solutions (OUT/warmstart, an
   HF folder; reused when present — delete it to rebuild). It is deliberately under-trained,
   so RL has room to improve it;
3. runs `jaxrl4llm train -c configs/demo.yaml` from that checkpoint, with the same templates,
   verifier, loaders, sampler and train step as a real run;
4. prints the step table, `held-out accuracy: X% -> Y%` and the path of the curves PNG.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax

DEMO_MODEL = dict(architecture="qwen3", hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=32)
DEMO_TASK = dict(num_train=4000, num_test=200, seed=0, digits=1, ops="+-", steps=2)
SFT = dict(steps=300, batch_size=64, lr=3e-3, length=96)


def config_path() -> Path:
    path = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run the demo from a jaxrl4llm checkout (configs/ ships with the repository).")
    return path


def build_warm_start(out: Path, tokenizer_dir: str, train_file: str, *, seed: int = 0, sft_steps: int | None = None,
                     log=print) -> Path:
    """SFT a random demo-size model on the train split's worked solutions; save an HF folder."""
    from jaxrl4llm.data import demo_solution, load_problems
    from jaxrl4llm.models import ModelConfig, init_params, load_tokenizer, save_pretrained, token_logprobs
    from jaxrl4llm.train.sft import pack_sft_examples, sft_train

    tokenizer = load_tokenizer(tokenizer_dir)
    config = ModelConfig(vocab_size=len(tokenizer), tie_word_embeddings=True, qk_norm=True, rope_theta=10000.0,
                         max_position_embeddings=512, dtype="float32", param_dtype="float32",
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, **DEMO_MODEL)
    params = init_params(config, jax.random.PRNGKey(seed))
    from jaxrl4llm.data import format_prompt

    problems = load_problems(train_file)
    prompts = [tokenizer(format_prompt(p, "demo"))["input_ids"] for p in problems]
    completions = [tokenizer(" " + demo_solution(p))["input_ids"] + [tokenizer.eos_token_id] for p in problems]
    data = pack_sft_examples(prompts, completions, length=SFT["length"], pad_id=tokenizer.pad_token_id)
    logprob_fn = lambda p, x, y, pos, m: token_logprobs(p, config, x, y, positions=pos, attention_mask=m, chunk_size=SFT["length"])
    steps = sft_steps or SFT["steps"]
    log(f"warm start: SFT of a {config.num_params / 1e6:.2f}M-parameter Qwen3-shaped model for {steps} steps")
    params = sft_train(params, logprob_fn, data, steps=steps, batch_size=SFT["batch_size"], lr=SFT["lr"], seed=seed,
                       log_every=100, log=log)
    path = out / "warmstart"
    save_pretrained(config, params, path)
    tokenizer.save_pretrained(str(path))
    return path


def run_demo(out_dir: str = "runs/demo", overrides: list[str] | None = None, quick: bool = False,
             sft_steps: int | None = None, log=print) -> dict:
    from jaxrl4llm.data import build_char_tokenizer, write_demo_task
    from jaxrl4llm.train.config import load_config
    from jaxrl4llm.train.loop import train
    from jaxrl4llm.train.plot import plot_runs
    from jaxrl4llm.train.report import print_run_report

    t0 = time.perf_counter()
    out = Path(out_dir)
    paths = write_demo_task(out / "data", **DEMO_TASK)
    tokenizer_dir = build_char_tokenizer(out / "tokenizer")
    warm = out / "warmstart"
    if not (warm / "config.json").is_file():
        warm = build_warm_start(out, tokenizer_dir, paths["train"], sft_steps=30 if quick else sft_steps, log=log)
    else:
        log(f"warm start: reusing {warm} (delete it to rebuild)")
    t_warm = time.perf_counter() - t0
    run_dir = out / "rl"
    base = [f"model.path={warm}", f"data.train_files=[{paths['train']}]", f"data.eval_files=[{paths['test']}]",
            f"trainer.out_dir={run_dir}"]
    if quick:
        base += ["trainer.steps=3", "data.eval_limit=32", "trainer.checkpoint_every=0", "trainer.eval_samples=2"]
    cfg = load_config(config_path(), base + list(overrides or []))
    summary = train(cfg, log=log)
    png = plot_runs([run_dir], run_dir / "curves.png")
    print_run_report(summary)
    total = time.perf_counter() - t0
    log(f"time: {total:.0f}s in total ({t_warm:.0f}s task + warm start, {total - t_warm:.0f}s RL with evaluation)")
    log(f"curves: {png}")
    summary["curves"] = str(png)
    summary["total_seconds"] = total
    return summary

"""`jaxrl4llm convert`: a run's orbax checkpoint -> a Hugging Face folder (transformers / vLLM)."""

from __future__ import annotations

import json
from pathlib import Path

import jax

from jaxrl4llm.train.checkpointing import RunCheckpointer
from jaxrl4llm.train.config import ConfigError, config_from_dict


def export_checkpoint(run_dir: str | Path, out: str | Path, *, step: int | None = None) -> Path:
    """Restores the policy parameters of RUN_DIR's checkpoint (latest or `step`) and writes them,
    with the run's tokenizer, as config.json + safetensors to `out`."""
    from jaxrl4llm.train.policy import load_policy
    from jaxrl4llm.train.step import init_train_state, make_optimizer

    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"{cfg_path} not found: is {run_dir} a jaxrl4llm run directory (trainer.out_dir)?")
    cfg = config_from_dict(json.loads(cfg_path.read_text()))
    policy = load_policy(cfg, None)
    optimizer, _ = make_optimizer(lr=cfg.optim.lr, max_grad_norm=cfg.optim.max_grad_norm)
    abstract = jax.eval_shape(lambda p: init_train_state(p, optimizer), policy.params)  # no frozen part: not saved
    state, _, restored_step = RunCheckpointer(run_dir, keep=cfg.trainer.keep_checkpoints).restore(abstract, step)
    path = policy.with_params(state.params).export(out)
    (Path(path) / "jaxrl4llm_source.json").write_text(json.dumps({"run_dir": str(run_dir), "step": restored_step}))
    return Path(path)

"""`jaxrl4llm convert`: a run's orbax checkpoint -> a Hugging Face folder (transformers / vLLM)."""

from __future__ import annotations

import json
from pathlib import Path

from jaxrl4llm.train.checkpointing import RunCheckpointer
from jaxrl4llm.train.config import ConfigError, config_from_dict


def export_checkpoint(run_dir: str | Path, out: str | Path, *, step: int | None = None) -> Path:
    """Restores the policy parameters of RUN_DIR's checkpoint (latest or `step`) and writes them,
    with the run's tokenizer, as config.json + safetensors to `out`."""
    from jaxrl4llm.train.policy import load_policy

    run_dir = Path(run_dir)
    cfg_path = run_dir / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"{cfg_path} not found: is {run_dir} a jaxrl4llm run directory (trainer.out_dir)?")
    cfg = config_from_dict(json.loads(cfg_path.read_text()))
    policy = load_policy(cfg, None)
    # the parameters only (the optimizer state is twice their size and not needed to export)
    params, restored_step = RunCheckpointer(run_dir, keep=cfg.trainer.keep_checkpoints).restore_params(
        policy.params, step)
    path = policy.with_params(params).export(out)
    (Path(path) / "jaxrl4llm_source.json").write_text(json.dumps({"run_dir": str(run_dir), "step": restored_step}))
    return Path(path)

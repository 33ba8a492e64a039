"""`jaxrl4llm convert`: a run's orbax checkpoint -> a Hugging Face folder (transformers / vLLM)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from jaxrl4llm.storage import is_remote, run_path, upload_folder
from jaxrl4llm.train.checkpointing import RunCheckpointer
from jaxrl4llm.train.config import ConfigError, config_from_dict


def export_checkpoint(run_dir: str | Path, out: str | Path, *, step: int | None = None):
    """Restores the policy parameters of RUN_DIR's checkpoint (latest or `step`) and writes them,
    with the run's tokenizer, as config.json + safetensors to `out`. Either may be gs://."""
    from jaxrl4llm.train.policy import load_policy

    run_dir = run_path(run_dir)  # local or gs:// (jaxrl4llm.storage)
    cfg_path = run_dir / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"{cfg_path} not found: is {run_dir} a jaxrl4llm run directory (trainer.out_dir)?")
    cfg = config_from_dict(json.loads(cfg_path.read_text()))
    policy = load_policy(cfg, None)
    # the parameters only (the optimizer state is twice their size and not needed to export)
    params, restored_step = RunCheckpointer(run_dir, keep=cfg.trainer.keep_checkpoints).restore_params(
        policy.params, step)
    with tempfile.TemporaryDirectory() as staging:  # gs://: written here, then uploaded
        path = policy.with_params(params).export(Path(staging) if is_remote(out) else out)
        (Path(path) / "jaxrl4llm_source.json").write_text(json.dumps({"run_dir": str(run_dir), "step": restored_step}))
        if is_remote(out):
            return upload_folder(path, out)
    return Path(path)

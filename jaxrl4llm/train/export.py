"""`jaxrl4llm convert`: a run's orbax checkpoint -> a Hugging Face folder (transformers / vLLM);
`export_policy`: a policy -> a Hugging Face folder, local or gs:// (the run's trainer.export_hf)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from jaxrl4llm.storage import is_remote, run_path, upload_folder
from jaxrl4llm.train import hosts
from jaxrl4llm.train.checkpointing import RunCheckpointer
from jaxrl4llm.train.config import ConfigError, config_from_dict
from jaxrl4llm.train.policy import load_policy


def export_policy(policy, out: str | Path, source: dict | None = None):
    """Writes `policy` as a Hugging Face folder to `out` (every process calls it; process 0
    writes), with `source` as jaxrl4llm_source.json when given; a gs:// `out` is written to a
    local temporary folder and uploaded. Returns the folder's path."""
    with tempfile.TemporaryDirectory() as staging:  # gs://: written here, then uploaded
        path = policy.export(Path(staging) if is_remote(out) else out)
        if not hosts.is_main():
            return run_path(out) if is_remote(out) else Path(path)
        if source is not None:
            (Path(path) / "jaxrl4llm_source.json").write_text(json.dumps(source))
        if is_remote(out):
            return upload_folder(path, str(out))
    return Path(path)


def export_checkpoint(run_dir: str | Path, out: str | Path, *, step: int | None = None):
    """Restores the policy parameters of RUN_DIR's checkpoint (latest or `step`) and writes them,
    with the run's tokenizer, as config.json + safetensors to `out`. Either may be gs://."""
    run_dir = run_path(run_dir)  # local or gs:// (jaxrl4llm.storage)
    cfg_path = run_dir / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"{cfg_path} not found: is {run_dir} a jaxrl4llm run directory (trainer.out_dir)?")
    cfg = config_from_dict(json.loads(cfg_path.read_text()))
    policy = load_policy(cfg, None)
    # the parameters only (the optimizer state is twice their size and not needed to export)
    with RunCheckpointer(run_dir, keep=cfg.trainer.keep_checkpoints) as ckpt:
        params, restored_step = ckpt.restore_params(policy.params, step)
    return export_policy(policy.with_params(params), out, {"run_dir": str(run_dir), "step": restored_step})

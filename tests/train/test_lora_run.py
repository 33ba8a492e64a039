"""A LoRA run end to end: `model.lora` trains adapters only, checkpoints hold adapters only,
resume is exact, and the HF export is the merged plain model."""

import json

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxrl4llm.models import load_pretrained
from jaxrl4llm.train.config import ConfigError, load_config
from jaxrl4llm.train.loop import train

from tests.train.conftest import tiny_overrides

LORA = "{rank: 4, alpha: 8, targets: [q_proj, v_proj, gate_proj], dropout: 0.1}"


def _array_paths(tree, prefix=""):
    """Paths of the non-scalar arrays of a raw restored checkpoint (nested dicts and lists)."""
    if isinstance(tree, dict):
        return [p for k, v in tree.items() for p in _array_paths(v, f"{prefix}/{k}")]
    if isinstance(tree, (list, tuple)):
        return [p for i, v in enumerate(tree) for p in _array_paths(v, f"{prefix}/{i}")]
    return [prefix] if np.ndim(tree) >= 1 else []


def test_lora_run_checkpoints_adapters_only_and_resumes_exactly(demo_assets, tmp_path):
    run = lambda out, steps, **kw: train(load_config(None, tiny_overrides(demo_assets, out, **{
        "model.lora": LORA, "algorithm.preset": "grpo", "trainer.steps": steps, "trainer.checkpoint_every": 1,
        **kw})), log=lambda s: None)  # grpo: a KL term against the reference, which is the adapters at init
    straight = run(tmp_path / "a", 2, **{"trainer.export_hf": True})
    params = straight["state"].params
    assert all("lora_" in "/".join(map(str, p)) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0])

    saved = ocp.PyTreeCheckpointer().restore(tmp_path / "a" / "checkpoints" / "2" / "state")
    paths = _array_paths(saved)
    assert len(paths) == 3 * 6 and all("lora_" in p for p in paths), paths  # params, mu, nu of 6 adapter matrices
    assert saved.get("frozen") is None

    run(tmp_path / "b", 1)
    resumed = train(load_config(None, tiny_overrides(demo_assets, tmp_path / "b", **{
        "model.lora": LORA, "algorithm.preset": "grpo", "trainer.steps": 2, "trainer.checkpoint_every": 1})),
        resume=True, log=lambda s: None)
    for a, b in zip(jax.tree.leaves(straight["state"].params), jax.tree.leaves(resumed["state"].params)):
        np.testing.assert_allclose(a, b, atol=1e-6)
    a = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert a[-1]["loss"] == pytest.approx(b[-1]["loss"], abs=1e-6)
    assert np.isfinite(a[-1]["kl"]) and a[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # step 1: policy = reference

    exported = load_pretrained(straight["export_dir"], dtype="float32")
    assert exported.lora_settings is None  # a plain HF folder: adapters merged


def test_lora_config_errors_name_the_key(demo_assets, tmp_path):
    with pytest.raises(ConfigError, match=r"lora.targets.*valid"):
        train(load_config(None, tiny_overrides(demo_assets, tmp_path, **{"model.lora": "{targets: [qkv]}"})),
              log=lambda s: None)
    with pytest.raises(ConfigError, match=r"model.lora.*valid keys: rank, alpha, targets, dropout"):
        load_config(None, tiny_overrides(demo_assets, tmp_path, **{"model.lora": "{rnak: 4}"}))

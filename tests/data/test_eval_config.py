"""configs/eval/study_benchmarks.yaml: the study's benchmarks, loadable by `jaxrl4llm eval`."""

import os
from pathlib import Path

import pytest

from jaxrl4llm.data import load_problems
from jaxrl4llm.train.config import load_config

from .conftest import REPO_ROOT, SHARED_DATA, require_shared_data

CONFIG = REPO_ROOT / "configs" / "eval" / "study_benchmarks.yaml"
EXPECTED = {"math500_test.jsonl": 500, "aime24_test.jsonl": 30, "amc23_test.jsonl": 40,
            "olympiadbench_test.jsonl": 675, "minerva_math_test.jsonl": 272, "gsm8k_test.jsonl": 1319}


def _local_path(entry: str) -> Path:
    """Where an eval file entry points when `jaxrl4llm eval` runs from the repository root."""
    if "JAXRL4LLM_SHARED_DATA" in os.environ:  # the shared folder lives elsewhere on this machine
        return SHARED_DATA / Path(entry).name
    return (REPO_ROOT / entry).resolve()


def test_config_lists_the_study_benchmarks():
    cfg = load_config(CONFIG)
    assert [Path(f).name for f in cfg.data.eval_files] == list(EXPECTED)
    assert all(f.startswith("../shared/data/") for f in cfg.data.eval_files)  # outside the repository
    sampling = cfg.eval_sampling()
    assert sampling.samples > 1 and sampling.temperature > 0  # mean@n, pass@k and maj@k with n > 1
    assert cfg.data.on_overlong_prompt == "error" and cfg.data.eval_limit is None
    text = CONFIG.read_text()
    assert "AIME 2025" in text and "not available offline" in text.lower()


@pytest.mark.parametrize("preset", sorted((REPO_ROOT / "configs" / "models").glob("*.yaml")), ids=lambda p: p.stem)
def test_config_merges_after_every_model_preset(preset):
    cfg = load_config([preset, CONFIG])
    assert len(cfg.data.eval_files) == 6 and cfg.data.on_overlong_prompt == "error"
    assert cfg.eval_sampling().samples == load_config(CONFIG).eval_sampling().samples == 16  # over the preset's


def test_every_eval_file_exists_and_loads():
    require_shared_data()
    cfg = load_config(CONFIG)
    for entry in cfg.data.eval_files:
        path = _local_path(entry)
        assert path.is_file(), f"{entry} -> {path} does not exist"
        problems = load_problems(path, problem_key=cfg.data.problem_key, answer_key=cfg.data.answer_key)
        assert len(problems) == EXPECTED[path.name]
        assert all(p.problem.strip() and p.answer.strip() for p in problems)

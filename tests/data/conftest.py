"""Fixtures of the data tests: shared benchmark data and a local character tokenizer."""

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


SHARED_DATA = Path(os.environ.get("JAXRL4LLM_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
BENCHMARK_FILES = (
    "math500_test.jsonl", "aime24_test.jsonl", "amc23_test.jsonl", "olympiadbench_test.jsonl",
    "minerva_math_test.jsonl", "gsm8k_test.jsonl", "gsm8k_train.jsonl",
)


def _on_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require_shared_data() -> Path:
    """The shared benchmark folder; skips (fails under ``CI=1``) when the folder is missing.

    A folder that exists but lacks one of the benchmark files is always a failure.
    """
    if not SHARED_DATA.is_dir():
        message = (f"shared benchmark data folder {SHARED_DATA} is missing (expected {', '.join(BENCHMARK_FILES)}); "
                   "set JAXRL4LLM_SHARED_DATA=/path/to/shared/data")
        if _on_ci():
            pytest.fail(message + " [CI=1: missing data is a failure]", pytrace=False)
        pytest.skip(message)
    missing = [name for name in BENCHMARK_FILES if not (SHARED_DATA / name).is_file()]
    if missing:
        pytest.fail(f"shared benchmark data at {SHARED_DATA} lacks {missing}", pytrace=False)
    return SHARED_DATA


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``$JAXRL4LLM_SHARED_DATA`` or ``<repo>/../shared/data``; skipped when missing (failed under CI=1)."""
    return require_shared_data()


@pytest.fixture(scope="session")
def char_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from jaxrl4llm.data import build_char_tokenizer

    path = build_char_tokenizer(tmp_path_factory.mktemp("char_tokenizer"))
    return AutoTokenizer.from_pretrained(path)

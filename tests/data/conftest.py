"""Fixtures of the data tests: shared benchmark data and a local character tokenizer."""

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``$JAXRL4LLM_SHARED_DATA`` or ``<repo>/../shared/data``; fails clearly when missing."""
    path = Path(os.environ.get("JAXRL4LLM_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
    if not (path / "math500_test.jsonl").is_file():
        pytest.fail(
            f"shared benchmark data not found at {path} (expected math500_test.jsonl, gsm8k_test.jsonl, "
            "amc23_test.jsonl, aime24_test.jsonl). Set JAXRL4LLM_SHARED_DATA=/path/to/shared/data.",
            pytrace=False,
        )
    return path


@pytest.fixture(scope="session")
def char_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from jaxrl4llm.data import build_char_tokenizer

    path = build_char_tokenizer(tmp_path_factory.mktemp("char_tokenizer"))
    return AutoTokenizer.from_pretrained(path)

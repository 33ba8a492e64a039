"""Fixtures of the reward tests: where the shared (read-only) benchmark data lives."""

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def shared_data_dir() -> Path:
    """``$JAXRL4LLM_SHARED_DATA`` or ``<repo>/../shared/data``; fails clearly when missing."""
    path = Path(os.environ.get("JAXRL4LLM_SHARED_DATA", REPO_ROOT.parent / "shared" / "data"))
    if not (path / "verifier_cases_public.jsonl").is_file():
        pytest.fail(
            f"shared benchmark data not found at {path} (expected verifier_cases_public.jsonl and "
            "math500_test.jsonl there). Set JAXRL4LLM_SHARED_DATA=/path/to/shared/data.",
            pytrace=False,
        )
    return path


@pytest.fixture(scope="session")
def shared_data() -> Path:
    return shared_data_dir()

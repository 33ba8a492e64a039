"""Fixtures of tests/models: tiny HF checkpoints saved by transformers."""

import pytest

from tests.models.hf_oracle import FAMILIES, tiny_hf_model

_SAVED = {}


def _saved(family, tmp_path_factory):
    if family not in _SAVED:
        model = tiny_hf_model(family)
        folder = tmp_path_factory.mktemp(f"hf_{family}")
        model.save_pretrained(folder)
        _SAVED[family] = (family, model, folder)
    return _SAVED[family]


@pytest.fixture(scope="session", params=sorted(FAMILIES))
def hf_checkpoint(request, tmp_path_factory):
    """(family, torch model, folder) of a tiny float32 checkpoint saved by transformers."""
    return _saved(request.param, tmp_path_factory)


@pytest.fixture(scope="session")
def qwen3_folder(tmp_path_factory):
    """Folder of the tiny qwen3 checkpoint."""
    return _saved("qwen3", tmp_path_factory)[2]


@pytest.fixture(scope="session")
def qwen3_moe_checkpoint(tmp_path_factory):
    """(family, torch model, folder) of the tiny qwen3_moe checkpoint (norm_topk_prob=True)."""
    return _saved("qwen3_moe", tmp_path_factory)

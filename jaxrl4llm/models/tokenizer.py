"""Tokenizer loading from a local Hugging Face folder (no network)."""

from __future__ import annotations

import json
import os

GENERIC = ("TokenizersBackend", "PreTrainedTokenizerFast")  # transformers' class for a plain tokenizer.json


def load_tokenizer(path: str | os.PathLike):
    """transformers.AutoTokenizer from a local folder (tokenizer.json / tokenizer_config.json).

    A folder of a plain tokenizer.json whose config names the generic class, with no model config
    (config.json) to pick another by: that class directly, the one AutoTokenizer ends at, without
    AutoTokenizer's model-config machinery (which imports torch: seconds at every process start).
    Raises FileNotFoundError if the folder does not exist or holds no tokenizer files.
    Never downloads (local_files_only=True).
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer folder {path!r} does not exist")
    known = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not any(os.path.isfile(os.path.join(path, f)) for f in known):
        raise FileNotFoundError(f"no tokenizer files in {path!r} (expected one of {', '.join(known)})")
    if _generic(path):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    from transformers import AutoTokenizer  # the one runtime use of transformers (tokenizers only)

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _generic(path: str) -> bool:
    """tokenizer.json + a tokenizer_config.json naming the generic class (no custom code), and no config.json."""
    config = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")) or not os.path.isfile(config) or \
            os.path.exists(os.path.join(path, "config.json")):
        return False
    with open(config) as f:
        settings = json.load(f)
    return settings.get("tokenizer_class") in GENERIC and "auto_map" not in settings

"""Tokenizer loading from a local Hugging Face folder (no network)."""

from __future__ import annotations

import os


def load_tokenizer(path: str | os.PathLike):
    """transformers.AutoTokenizer from a local folder (tokenizer.json / tokenizer_config.json).

    Raises FileNotFoundError if the folder does not exist or holds no tokenizer files.
    Never downloads (local_files_only=True).
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer folder {path!r} does not exist")
    known = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
    if not any(os.path.isfile(os.path.join(path, f)) for f in known):
        raise FileNotFoundError(f"no tokenizer files in {path!r} (expected one of {', '.join(known)})")
    from transformers import AutoTokenizer  # the one runtime use of transformers (tokenizers only)

    return AutoTokenizer.from_pretrained(path, local_files_only=True)

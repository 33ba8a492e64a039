"""The runnable snippets of the docs run as written."""

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _python_blocks(name: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / name).read_text(), flags=re.S)


def test_bring_your_own_model_snippet_runs():
    blocks = [b for b in _python_blocks("models.md") if "class Bigram" in b]
    assert len(blocks) == 1
    exec(compile(blocks[0], "docs/models.md", "exec"), {})

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


def _blocks(name: str) -> list[tuple[str, str, str]]:
    """(language, file name of a `file=NAME` block or "", text) of every fenced block, in order."""
    return [(lang, file, text) for lang, file, text in
            re.findall(r"```(\w+)(?: file=(\S+))?\n(.*?)```", (DOCS / name).read_text(), flags=re.S)]


def test_own_data_and_reward_page_runs_as_written(tmp_path, monkeypatch):
    """docs/own_data_and_reward.md: its files written to a folder, its Python blocks run there in
    order (their asserts are the page's claims: field errors, auto batching, problem/metadata,
    on_error, the time limit)."""
    import sys

    blocks = _blocks("own_data_and_reward.md")
    files = {file: text for _, file, text in blocks if file}
    assert set(files) == {"my_problems.jsonl", "my_run.yaml", "my_rewards.py"}
    for file, text in files.items():
        (tmp_path / file).write_text(text)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    scope: dict = {}
    code = [text for lang, file, text in blocks if lang == "python" and not file]
    assert len(code) == 5
    for text in code:
        exec(compile(text, "docs/own_data_and_reward.md", "exec"), scope)
    sys.modules.pop("my_rewards", None)


def test_surrogate_table_snippet_runs():
    """docs/objectives.md: a surrogate registered from a notebook, validated and run by policy_loss."""
    blocks = [b for b in _python_blocks("objectives.md") if "register_surrogate" in b]
    assert len(blocks) == 1
    exec(compile(blocks[0], "docs/objectives.md", "exec"), {})

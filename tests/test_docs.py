"""The runnable snippets of the docs run as written."""

import re
from pathlib import Path

from tests.hub_cache import offline_hub  # noqa: F401 (a fixture)

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


def test_coming_from_trl_verl_recipe_trains_from_the_hub_and_logs_to_wandb(offline_hub, tmp_path, monkeypatch):
    """docs/coming_from_trl_verl.md: its `jaxrl4llm train` and `eval` lines, on its recipe file, against a
    Hugging Face cache written here (a tiny Qwen3 stored as Qwen/Qwen3-0.6B-Base; TRL's
    DeepMath-103K columns and MATH-500's, as the Hub stores them), offline, with W&B offline and
    the sizes shrunk to the CPU. The run names the model and datasets as the page does, scores
    both reward entries, logs samples and writes an offline W&B run."""
    import contextlib
    import io
    import json
    import shlex

    import pyarrow as pa
    import pyarrow.parquet as pq

    from jaxrl4llm.cli import main as cli_main
    from tests.hub_cache import write_hub_repo, write_tiny_model

    home = offline_hub
    write_hub_repo(home, "Qwen/Qwen3-0.6B-Base", write_tiny_model(tmp_path / "tiny"))
    deepmath = [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "solution": str(i + 1)} for i in range(4)]
    table = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(deepmath), table)
    write_hub_repo(home, "trl-lib/DeepMath-103K", {"data/train-00000-of-00001.parquet": table.getvalue()},
                   repo_type="dataset")
    math500 = "".join(json.dumps({"problem": f"What is {i} + 2?", "solution": "", "answer": str(i + 2)}) + "\n"
                      for i in range(2))
    write_hub_repo(home, "HuggingFaceH4/MATH-500", {"test.jsonl": math500.encode()}, repo_type="dataset")

    blocks = _blocks("coming_from_trl_verl.md")
    (recipe,) = [text for _, file, text in blocks if file == "qwen3_hub.yaml"]
    (tmp_path / "qwen3_hub.yaml").write_text(recipe)
    train_line, eval_line = [line for _, _, text in blocks for line in text.splitlines() if line.startswith("jaxrl4llm ")]
    to_here = {"qwen3_hub.yaml": str(tmp_path / "qwen3_hub.yaml"),
               "model.path=runs/qwen3_hub/hf_export": f"model.path={tmp_path / 'run' / 'hf_export'}"}
    argv = [to_here.get(a, a) for a in shlex.split(train_line)[1:]]
    shrink = ["model.dtype=float32", "model.logprob_chunk_size=32", "model.remat=false", "data.max_prompt_tokens=400",
              "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2", "rollout.max_new_tokens=8",
              "eval.samples=2", "trainer.steps=1", "trainer.mini_batches=1", "trainer.eval_every=0",
              "trainer.checkpoint_every=0", "trainer.progress_bar=false",
              "trainer.compile_cache=off", f"trainer.out_dir={tmp_path / 'run'}"]
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.chdir(DOCS.parent)  # the page's command runs from the repository's folder
    assert cli_main(argv + shrink) == 0
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = [r for r in records if "reward/correct" in r]
    assert len(step) == 1 and "reward/format" in step[0]
    assert {"eval/MATH-500-test/pass@2", "eval/MATH-500-test/maj@2"} <= set(records[0]), sorted(records[0])
    assert len((tmp_path / "run" / "samples.jsonl").read_text().splitlines()) == 4
    assert "wandb" in json.loads((tmp_path / "run" / "loggers.json").read_text())
    assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # the table goes to stderr, the JSON to stdout
        assert cli_main([to_here.get(a, a) for a in shlex.split(eval_line)[1:]] + shrink) == 0
    table = json.loads(printed.getvalue())
    assert {"MATH-500-test/mean@2", "MATH-500-test/pass@2", "MATH-500-test/maj@2"} <= set(table), sorted(table)
    assert (tmp_path / "run" / "eval.json").is_file()  # a run's export: its eval.json beside it

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


# ---------------------------------------------------------------------------- links

REPO = DOCS.parent
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
DOC_MENTION = re.compile(r"(?<![\w/.-])(docs/[\w/.-]+\.md)(?:#([\w-]+))?")
# a section named in prose or a message after its page: docs/<page>.md, "Section" or docs/<page>.md "Section"
SECTION_MENTION = re.compile(r"(?<![\w/.-])(docs/[\w/.-]+\.md)(?:,|'s)? \(?\"([A-Z][^\"\n]{1,80})\"")


def _markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]


def _code_files() -> list[Path]:
    """The package, the tests, the benchmarks (their README included) and the examples."""
    return sorted(p for top in ("jaxrl4llm", "tests", "benchmarks", "examples") for p in (REPO / top).rglob("*.py")) + [
        REPO / "benchmarks" / "README.md"]


def _shown(path: Path, root: Path) -> str:
    return str(path.relative_to(root)) if path.is_relative_to(root) else str(path)


def _prose_lines(text: str):
    """(line number, line) of a markdown text outside fenced code blocks, inline code spans blanked."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip()
        if fence is None and stripped[:3] in ("```", "~~~"):
            fence = stripped[:3]
            continue
        if fence is not None:
            if stripped.startswith(fence):
                fence = None
            continue
        yield number, re.sub(r"`[^`]*`", lambda m: " " * len(m.group()), line)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading's text: inline markup dropped (code spans keep their text,
    links their text), lower case, punctuation removed except '-' and '_', each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = re.sub(r"<[^>]+>", "", text.replace("`", ""))
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def _headings(path: Path) -> list[str]:
    """The text of every heading of a markdown file, in order (not the `#` lines of code blocks)."""
    found = []
    fence = None
    for line in path.read_text().splitlines():
        stripped = line.lstrip()
        if stripped[:3] in ("```", "~~~") and (fence is None or stripped.startswith(fence)):
            fence = stripped[:3] if fence is None else None
            continue
        m = re.match(r" {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$", line) if fence is None else None
        if m:
            found.append(m.group(1))
    return found


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file: its headings' (a repeated one gets -1, -2, ...) and HTML ids."""
    seen: dict[str, int] = {}
    found = set()
    for heading in _headings(path):
        slug = github_anchor(heading)
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    found |= set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", path.read_text()))
    return found


def broken_links(files, code_files=(), root: Path = REPO) -> list[str]:
    """'FILE:LINE: LINK: what is missing' for every relative markdown link of `files` ([text](path),
    [text](path#anchor), [text](#anchor), images; http(s) and mailto links are not checked) and every
    docs/<page>.md[#anchor] named in `files` or `code_files` (from the repository's root, `root`) whose
    file, or anchor among the file's headings, does not exist."""
    problems = []

    def check(source: Path, number: int, link: str, target: Path, anchor: str) -> None:
        if not target.exists():
            missing = f"no file {_shown(target, root)}"
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            missing = f"no heading with anchor #{anchor} in {_shown(target, root)}"
        else:
            return
        problems.append(f"{_shown(source, root)}:{number}: {link}: {missing}")

    for source in files:
        for number, line in _prose_lines(source.read_text()):
            for link in LINK.findall(line):
                if not re.match(r"[a-z][a-z0-9+.-]*:", link, flags=re.I):  # http:, https:, mailto: are not ours
                    path, _, anchor = link.partition("#")
                    check(source, number, link, (source.parent / path).resolve() if path else source, anchor)
            for path, anchor in DOC_MENTION.findall(line):
                check(source, number, path + "#" * bool(anchor) + anchor, root / path, anchor)
    for source in code_files:
        for number, line in enumerate(source.read_text().splitlines(), 1):
            for path, anchor in DOC_MENTION.findall(line):
                check(source, number, path + "#" * bool(anchor) + anchor, root / path, anchor)
    return problems


def broken_section_names(files, root: Path = REPO) -> list[str]:
    """'FILE:LINE: docs/<page>.md "Name": ...' for every section named in quotes after a docs page
    (as docs/<page>.md, "Section") that is neither the start of one of the page's headings
    nor of a bold lead (**Name**) in it."""
    problems = []
    for source in files:
        for number, line in enumerate(source.read_text().splitlines(), 1):
            for path, name in SECTION_MENTION.findall(line):
                page = root / path
                if not page.is_file():
                    problems.append(f"{_shown(source, root)}:{number}: {path} \"{name}\": no file {path}")
                    continue
                plain = [re.sub(r"[`*]", "", h) for h in _headings(page)]
                bold = re.findall(r"\*\*([^*\n]+)\*\*", page.read_text())
                if not any(h.startswith(name) for h in plain + bold):
                    problems.append(f"{_shown(source, root)}:{number}: {path} \"{name}\": no heading or bold lead "
                                    f"starting with it in {path}")
    return problems


def test_github_anchors_of_headings():
    assert github_anchor("The demo") == "the-demo"
    assert github_anchor("The check: `scripts/gpu_check`") == "the-check-scriptsgpu_check"
    assert github_anchor("A program per slot (built 2026-11-28)") == "a-program-per-slot-built-2026-11-28"
    assert github_anchor("jaxrl4llm.models — Qwen2/2.5") == "jaxrl4llmmodels--qwen225"
    assert github_anchor("See [the guide](gpu.md) **now**") == "see-the-guide-now"


def test_every_doc_link_resolves():
    """Every relative link of README.md and docs/**/*.md and every docs/<page>.md[#anchor] named in
    them or in the package, the tests, the benchmarks and the examples points at a file that exists and, for an
    anchor, at one of its headings (GitHub's anchors)."""
    problems = broken_links(_markdown_files(), _code_files())
    assert not problems, "broken doc links:\n" + "\n".join(problems)


def test_every_section_named_after_a_doc_page_exists():
    """A section named in quotes after a docs page (docs/<page>.md, "Section") in the docs, the code,
    the tests, the configs and the scripts is a heading (or a bold lead) of that page."""
    files = _markdown_files() + _code_files() + sorted(
        p for top in ("configs", "scripts", "tpu_scripts") for p in (REPO / top).rglob("*")
        if p.is_file() and p.suffix in ("", ".py", ".yaml", ".md", ".sh")) + [REPO / "pyproject.toml"]
    problems = broken_section_names(files)
    assert not problems, "sections named after a doc page that it lacks:\n" + "\n".join(problems)


def test_the_link_check_finds_broken_links(tmp_path):
    """The checks themselves, on a repository of two files: a missing file, a missing anchor (a
    repeated heading's -1 exists, its -2 does not), a code file's docs page that does not exist and
    a section a page lacks are each reported with the file, the link and what is missing; http
    links, inline code and fenced code are not checked."""
    docs = "docs"  # spelled apart, so that this file names no docs page itself
    (tmp_path / docs).mkdir()
    (tmp_path / docs / "guide.md").write_text(
        "# Top\n\n## Twice\n\n## Twice\n\n## The check: `scripts/gpu_check`\n\n"
        "[ok](#twice-1) [ok](#top) [web](https://example.com/x.md#y) `[code](nowhere.md)`\n"
        "```\n[fenced](nowhere.md)\n# not a heading\n```\n"
        "[gone](#twice-2) [file](nowhere.md) [ok](guide.md#the-check-scriptsgpu_check) [gone](#not-a-heading)\n")
    page = f"{docs}/guide.md"
    (tmp_path / "mod.py").write_text(f'"""See {page}#twice, {page}, "Twice", {page}, "Thrice" and '
                                     f'{docs}/missing.md."""\n')
    problems = broken_links([tmp_path / page], [tmp_path / "mod.py"], root=tmp_path)
    assert problems == [f"{page}:14: #twice-2: no heading with anchor #twice-2 in {page}",
                        f"{page}:14: nowhere.md: no file {docs}/nowhere.md",
                        f"{page}:14: #not-a-heading: no heading with anchor #not-a-heading in {page}",
                        f"mod.py:1: {docs}/missing.md: no file {docs}/missing.md"], problems
    assert broken_section_names([tmp_path / "mod.py"], root=tmp_path) == [
        f'mod.py:1: {page} "Thrice": no heading or bold lead starting with it in {page}']

"""Prompt sets of a run: problems from data files (local or gs://) or Hub datasets (hf://), formatted
with the configured template (or a row's chat messages rendered with the chat template) and
tokenized once, with the prompt-length budget enforced (error or drop, as configured).

They load before the model (`run_tokenizer` reads the tokenizer alone, not the weights): a bad
path, an empty file or a missing field fails in seconds, with an error that names the config key
(`data.train_files[0]`, `data.problem_key`, ...) and the fix."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from jaxrl4llm.data import encode_prompts, format_prompt
from jaxrl4llm.data.problems import BadRowError, MissingFieldError, is_hub_dataset, load_problems, source_name
from jaxrl4llm.models import load_tokenizer
from jaxrl4llm.models.hub import TOKENIZER_FILES, HubFilesMissing, resolve_model
from jaxrl4llm.storage import is_remote
from jaxrl4llm.train.config import ConfigError, RunConfig
from jaxrl4llm.train.reward_fn import reward_needs_gold


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """Prompts of one file: token ids, gold answers, the formatted prompt texts, and each row's
    problem text and metadata (its other fields; what a reward asks for with `problem=` /
    `metadata=`, docs/own_data_and_reward.md)."""

    name: str
    token_ids: list[list[int]]
    answers: list[str]
    texts: list[str]
    dropped: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)
    metadata: list[dict] = dataclasses.field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    @functools.cached_property
    def longest(self) -> int:
        """Tokens of the set's longest prompt (0 when empty)."""
        return max(map(len, self.token_ids), default=0)

    @functools.cached_property
    def mean_length(self) -> float:
        """Mean tokens of the set's prompts (0 when empty)."""
        return sum(map(len, self.token_ids)) / len(self.token_ids) if self.token_ids else 0.0


def run_tokenizer(cfg: RunConfig):
    """The tokenizer of `model.tokenizer` (or `model.path`): a folder, local or gs://, or a Hub id
    (`org/name[@revision]`, its tokenizer files only: `models.hub.TOKENIZER_FILES`), without the
    model's weights; a ConfigError that names the key when it is missing or holds no tokenizer."""
    key, path = ("model.tokenizer", cfg.model.tokenizer) if cfg.model.tokenizer else ("model.path", cfg.model.path)
    if not path:
        raise ConfigError("Set model.path (an HF checkpoint folder or Hub id) or, for a random model, model.tokenizer "
                          "(a tokenizer folder or Hub id).")
    try:
        return load_tokenizer(resolve_model(path, files=TOKENIZER_FILES))
    except HubFilesMissing as e:
        raise ConfigError(f"{key}={path!r}: {e}") from None
    except FileNotFoundError as e:
        raise ConfigError(f"{key}={path!r}: {e}; point {key} at a local folder with tokenizer.json or "
                          f"tokenizer_config.json (or a gs:// one), or a Hugging Face Hub id (org/name[@revision]).") \
            from None


def build_prompt_set(name: str, problems, tokenizer, cfg: RunConfig) -> PromptSet:
    try:
        ids, kept, dropped = encode_prompts(
            problems, tokenizer, cfg.data.template, max_prompt_tokens=cfg.data.max_prompt_tokens,
            on_overlong=cfg.data.on_overlong_prompt, instruction=cfg.data.instruction,
            system_prompt=cfg.data.system_prompt,
        )
    except ValueError as e:
        raise ConfigError(f"{name}: {e}") from None
    if dropped and not kept:
        raise ConfigError(f"{name}: all {dropped} prompts are longer than data.max_prompt_tokens="
                          f"{cfg.data.max_prompt_tokens} tokens (with the template and any system prompt), and "
                          f"data.on_overlong_prompt=drop dropped every one: raise data.max_prompt_tokens "
                          f"(`jaxrl4llm plan` prices the longer prompts) or shorten data.system_prompt.")
    texts = [format_prompt(problems[i], cfg.data.template, tokenizer=tokenizer, instruction=cfg.data.instruction,
                           system_prompt=cfg.data.system_prompt) for i in kept]
    return PromptSet(name=name, token_ids=[list(x) for x in ids], answers=[str(problems[i].answer) for i in kept],
                     texts=texts, dropped=dropped, problems=[problems[i].problem for i in kept],
                     metadata=[dict(problems[i].metadata) for i in kept])


_FIELD_WHAT = {"problem_key": "the problem text", "answer_key": "the gold answer"}
_NO_GOLD = {"problem_key": "", "answer_key": "; or, with a reward.fn that needs no gold answer, give its second "
                                              "parameter a default (fn(response, gold=\"\"))"}


def _load_file(path: str, cfg: RunConfig, key: str = "data.train_files / data.eval_files",
               require_answer: bool = True):
    """The problems of one data file (or Hub dataset); `key` (e.g. "data.train_files[0]") names the
    setting in errors; `require_answer=False` (a reward that needs no gold) keeps rows without one."""
    where = f"{key}={path!r}"
    # gs:// and hf://: load_problems names a missing object or repository
    if not is_remote(path) and not is_hub_dataset(path) and not Path(path).is_file():
        raise ConfigError(f"Data file {path!r} does not exist ({key}; paths are relative to {Path.cwd()}): point it "
                          f"at a local .jsonl, .json or .parquet file of problems, or name a Hugging Face Hub dataset "
                          f"as hf://org/name[:config][@split].")
    try:
        problems = load_problems(path, problem_key=cfg.data.problem_key, answer_key=cfg.data.answer_key,
                                 require_answer=require_answer)
    except MissingFieldError as e:
        setting = f"data.{e.kwarg}"
        what = _FIELD_WHAT[e.kwarg]
        if e.explicit is not None:
            found = f"{setting}={e.explicit!r}, but the file has no field {e.explicit!r}"
        else:
            found = f"{setting} is unset and none of the usual names ({', '.join(e.tried)}) is a field of the file"
        others = [c for c in e.columns if c not in (cfg.data.problem_key, cfg.data.answer_key)] or ["FIELD"]
        raise ConfigError(f"{where}: {found}; its fields are {e.columns}. Set {setting} to the field that holds "
                          f"{what}, e.g. {setting}={others[0]} (a dotted key reads a nested field: "
                          f"reward_model.ground_truth){_NO_GOLD[e.kwarg]} (docs/own_data_and_reward.md).") from None
    except BadRowError as e:
        raise ConfigError(f"{where}: {e}. Fix or remove row {e.row}, or set data.{e.kwarg} to the field that holds "
                          f"{_FIELD_WHAT[e.kwarg]}{_NO_GOLD[e.kwarg]} (docs/own_data_and_reward.md).") from None
    except (ValueError, FileNotFoundError) as e:
        raise ConfigError(f"{where}: {e}.") from None
    if not problems:
        raise ConfigError(f"{where} holds no problems: give it at least one row with a problem and an answer field "
                          f"(docs/own_data_and_reward.md).")
    return problems


def _require_answer(cfg: RunConfig) -> bool:
    """Whether every row needs a gold answer: unless `reward.fn` declares it needs none (train/reward_fn.py)."""
    return reward_needs_gold(cfg)


def _read_eval_files(cfg: RunConfig, require_answer: bool | None = None) -> list[tuple[str, list]]:
    require = _require_answer(cfg) if require_answer is None else require_answer
    out = []
    for i, f in enumerate(cfg.data.eval_files):
        problems = _load_file(f, cfg, f"data.eval_files[{i}]", require)
        out.append((source_name(f), problems[: cfg.data.eval_limit] if cfg.data.eval_limit else problems))
    return out


def load_eval_sets(cfg: RunConfig, tokenizer=None) -> list[PromptSet]:
    """[eval sets] from data.eval_files (the first data.eval_limit problems of each); the files
    are read and checked before the tokenizer (default: `run_tokenizer(cfg)`) loads."""
    files = _read_eval_files(cfg)
    tokenizer = tokenizer if tokenizer is not None else run_tokenizer(cfg)
    return [build_prompt_set(name, problems, tokenizer, cfg) for name, problems in files]


def load_prompt_sets(cfg: RunConfig, tokenizer=None) -> tuple[PromptSet, list[PromptSet]]:
    """(train set, [eval sets]) from data.train_files / data.eval_files; every file is read and
    checked before the tokenizer (default: `run_tokenizer(cfg)`) loads."""
    if not cfg.data.train_files:
        raise ConfigError("data.train_files is empty: list at least one JSONL/JSON/parquet file of problems or a Hub "
                          "dataset (hf://org/name[:config][@split]).")
    require = _require_answer(cfg)
    train_problems = []
    for i, f in enumerate(cfg.data.train_files):
        train_problems.extend(_load_file(f, cfg, f"data.train_files[{i}]", require))
    evals = _read_eval_files(cfg, require)
    tokenizer = tokenizer if tokenizer is not None else run_tokenizer(cfg)
    train = build_prompt_set("train", train_problems, tokenizer, cfg)
    return train, [build_prompt_set(name, problems, tokenizer, cfg) for name, problems in evals]

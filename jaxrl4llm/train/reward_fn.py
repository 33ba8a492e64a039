"""The run's reward: the function `reward.fn` names, checked before the model loads, called per
sample or batched as its signature says, given the problem and the row's metadata when it asks
for them, time-limited, and fenced: a response whose reward fails scores 0 and is counted.

    reward_fn = make_reward_fn(cfg)                      # imports and checks `reward.fn` (seconds)
    scores = reward_fn(responses, golds, problems, metadata)   # Scores(rewards [N], errors [N])

Which calls it makes (docs/own_data_and_reward.md):

    per sample   fn(response, gold[, problem=str][, metadata=dict][, timeout=float]) -> float
    batched      fn(responses, golds[, problems=list][, metadata=list of dict][, timeout=float]) -> floats

A reward that needs no gold answer says so by giving its second parameter a default
(`fn(response, gold="")`, `fn(responses, golds=None)`): data rows without one are then kept, with
gold "" (`reward_needs_gold`, read by train/prompts.py); the built-in verifier needs one, so such
a row is an error that names `data.answer_key`.

`reward.batched: auto` reads the signature: the first two parameters' annotations (`str` against
`list[str]` / `Sequence[str]`), else their names (`response, gold` against `responses, golds`,
also completion(s), text(s), answer(s), label(s), ...), else a `problem` / `problems` keyword.

Failures (`reward.on_error`): an exception, a call past `reward.timeout`, a value that is no finite
number, a batch of the wrong length. `zero` scores the response 0 and counts it (the step's
`reward_errors` metric, one warning a step with the first message); `raise` stops the run with a
RewardError. Time limit: a per-sample function without a `timeout` parameter runs in worker
processes (rewards/sandbox.py, one per core, as the built-in verifier's sympy comparisons do)
and a call still running after `reward.timeout` seconds is stopped; a function with a `timeout`
parameter gets `reward.timeout` and keeps it itself (the built-in verifier does); a batched
function runs in the trainer's process (it may hold a model or a client), like
`reward.sandbox=false`.

A weighted list (`reward.fns: [{fn, weight, name, batched}]`, docs/rewards.md) gives a
WeightedRewardFn: each entry is a RewardFn as above (the same timeout / on_error / sandbox), and

    reward [N] = sum_i weight_i * reward_i [N]       Scores.components = {name_i: reward_i [N]}

a failed entry scores 0 in its own term only (the row's error names the entry).
"""

from __future__ import annotations

import atexit
import inspect
import math
import sys
import typing
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np

from jaxrl4llm.rewards.sandbox import SandboxPool, call_by_path
from jaxrl4llm.train.config import ConfigError, RunConfig
from jaxrl4llm.train.user_code import import_object

# A row counts as correct when its reward exceeds this: accuracy and pass@k (train/evaluation.py),
# the step's accuracy and a prompt's pass rate (rollout.retire_pass_rate) in train/loop.py. The
# built-in verifier scores 0 or 1; a reward of one's own is read the same way.
CORRECT_REWARD_THRESHOLD = 0.5

# names of the first two parameters that say "one response" or "a list of them"
_ONE_RESPONSE = {"response", "completion", "text", "output", "generation", "prediction", "pred", "sample",
                 "solution", "string", "model_output", "response_str", "solution_str"}
_ONE_GOLD = {"gold", "answer", "ground_truth", "label", "target", "reference", "gold_answer", "truth", "gt"}
_MANY_RESPONSES = {n + "s" for n in _ONE_RESPONSE} | {"batch"}
_MANY_GOLDS = {n + "s" for n in _ONE_GOLD}


class RewardError(RuntimeError):
    """`reward.fn` failed on a response and `reward.on_error=raise`."""


class Scores(NamedTuple):
    """A batch's rewards [N] (0.0 where the reward failed), why each failed (None: it did not) and,
    from a WeightedRewardFn, each entry's own (unweighted) rewards {name: [N]} (empty otherwise)."""

    rewards: np.ndarray
    errors: list
    components: dict = {}


@dataclass(frozen=True)
class RewardSignature:
    """How to call the function: batched or per sample, and the keywords its signature names."""

    batched: bool
    problem: str | None = None  # "problem" / "problems" when the function takes it
    metadata: bool = False
    timeout: bool = False
    gold: bool = True  # needs a gold answer: its second parameter has no default


def _kind_of_annotation(annotation: Any) -> bool | None:
    """True: a list of responses, False: one response (str), None: cannot tell."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return None
    if isinstance(annotation, str):  # a string annotation that could not be evaluated
        text = annotation.replace(" ", "")
        if text in ("str", "Optional[str]", "str|None"):
            return False
        return True if text.split("[")[0].split(".")[-1] in ("list", "List", "Sequence", "tuple", "Tuple", "Iterable") else None
    if annotation is str:
        return False
    origin = typing.get_origin(annotation) or annotation
    if origin in (list, tuple) or (isinstance(origin, type) and issubclass(origin, (Sequence, Iterable))
                                   and origin is not str):
        return True
    return None


def reward_signature(fn: Callable, batched: bool | str = "auto", key: str = "reward.fn") -> RewardSignature:
    """How `fn` is called (module docstring); a ConfigError naming `key` (and `reward.batched`)
    when it cannot take a response and a gold answer, needs an argument we do not pass, or
    `batched=auto` cannot tell per-sample from batched."""
    batched_key = key.rsplit(".", 1)[0] + ".batched" if key.startswith("reward.fns[") else "reward.batched"
    try:
        try:
            params = list(inspect.signature(fn, eval_str=True).parameters.values())
        except Exception:  # noqa: BLE001 - an annotation that does not evaluate: read it as text
            params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        if batched == "auto":
            raise ConfigError(f"{key}: its signature cannot be read (a builtin?), so {batched_key}=auto cannot tell "
                              f"how to call it: set {batched_key}=false (fn(response, gold) -> float) or true "
                              f"(fn(responses, golds) -> list of floats).") from None
        return RewardSignature(batched=bool(batched))
    P = inspect.Parameter
    positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    keywords = {p.name for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
    shown = f"{getattr(fn, '__name__', type(fn).__name__)}({', '.join(str(p).split(':')[0] for p in params)})"
    if len(positional) < 2 and not any(p.kind == P.VAR_POSITIONAL for p in params):
        raise ConfigError(f"{key}: {shown} must take a response and its gold answer as its first two arguments: "
                          f"fn(response, gold) -> float, or fn(responses, golds) -> list of floats.")
    problem = "problem" if "problem" in keywords else "problems" if "problems" in keywords else None
    given = {problem, "metadata", "timeout"}
    needed = [p.name for p in positional[2:] if p.default is P.empty and p.name not in given]
    needed += [p.name for p in params if p.kind == P.KEYWORD_ONLY and p.default is P.empty and p.name not in given]
    if needed:
        raise ConfigError(f"{key}: {shown} needs {', '.join(map(repr, needed))}, which a reward is not given; it gets "
                          f"(response, gold) or (responses, golds), and problem=/problems=, metadata=, timeout= when "
                          f"it names them: give the others defaults.")
    if batched == "auto":
        votes = set()
        for p, one, many in zip(positional[:2], (_ONE_RESPONSE, _ONE_GOLD), (_MANY_RESPONSES, _MANY_GOLDS)):
            by_type = _kind_of_annotation(p.annotation)
            if by_type is not None:
                votes.add(by_type)
            elif p.name.lower() in one:
                votes.add(False)
            elif p.name.lower() in many:
                votes.add(True)
        if problem is not None:
            votes.add(problem == "problems")
        if len(votes) != 1:
            why = "its parameters say both" if votes else "neither its parameters' names nor their types say which"
            raise ConfigError(
                f"{key}: {batched_key}=auto cannot tell whether {shown} scores one response or a list ({why}). "
                f"Name or annotate its first two parameters (response: str, gold: str) for one response, "
                f"(responses: list[str], golds: list[str]) for a batch, or set {batched_key}=false / true.")
        batched = votes.pop()
    needs_gold = len(positional) < 2 or positional[1].default is P.empty
    return RewardSignature(batched=bool(batched), problem=problem, metadata="metadata" in keywords,
                           timeout="timeout" in keywords, gold=needs_gold)


def _number(value: Any) -> float:
    """A reward value as a finite float; a ValueError that says what came back otherwise."""
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"returned {str(value)[:80]!r} ({type(value).__name__}), not a number") from None
    if not math.isfinite(out):
        raise ValueError(f"returned {out}, not a finite number")
    return out


_USER_POOL: dict[tuple, Any] = {}  # {paths: pool}: one at a time (a run's functions share one)


def _user_pool(paths: tuple[str, ...]):
    """Worker processes for the user's functions at `paths` (one per core, no memory cap, the
    caller's sys.path, the functions imported at start, before any call's time limit), started on
    first use and kept for the process (closed at exit, or when other functions need them). The
    entries of `reward.fns` that run sandboxed share one pool (each call names its function)."""
    pool = _USER_POOL.get(paths)
    if pool is None or pool._closed:
        for other in _USER_POOL.values():
            other.close()
        _USER_POOL.clear()
        pool = _USER_POOL[paths] = SandboxPool(memory_bytes=None, pythonpath=[p for p in sys.path if p],
                                               preload=list(paths))
        atexit.register(pool.close)
    return pool


def runs_sandboxed(path: str, signature: RewardSignature, sandbox: bool) -> bool:
    """Whether the function runs in worker processes (module docstring): per sample, no `timeout`
    parameter, reward.sandbox, and importable by its path (not one defined in __main__, a script)."""
    return sandbox and not signature.batched and not signature.timeout and not path.startswith("__main__")


class CountedReward:
    """Counts a reward's failures over the batches scored (`count`, gathered over processes by
    train/scoring.py) until `drain` reports them for the step's metrics; `label` names it in the
    warning."""

    def __init__(self, label: str, log: Callable[[str], None] = print):
        self.label, self.log = label, log
        self._errors = self._scored = 0
        self._first: str | None = None

    def count(self, errors: int, scored: int, first: str | None) -> None:
        """Adds a batch's failures (gathered over processes) to the counts `drain` reports."""
        self._errors += errors
        self._scored += scored
        if self._first is None:
            self._first = first

    def drain(self, where: str) -> int:
        """The failures counted since the last drain; one warning line when there were any."""
        errors, scored, first = self._errors, self._scored, self._first
        self._errors = self._scored = 0
        self._first = None
        if errors:
            self.log(f"warning: {where}: {self.label} failed on {errors} of {scored} responses, scored 0 "
                     f"(reward.on_error=zero); first: {first or 'on another process'}")
        return errors


class RewardFn(CountedReward):
    """reward(responses, golds, problems=None, metadata=None) -> Scores, as `reward.*` says
    (module docstring). Failures are counted (`count`, `drain`) for the step's metrics.
    pool_paths: the functions the worker pool preloads (a weighted list's sandboxed entries
    share one pool); default this function's path."""

    def __init__(self, fn: Callable, path: str, signature: RewardSignature, *, timeout: float, on_error: str = "zero",
                 sandbox: bool = True, log: Callable[[str], None] = print, pool_paths: tuple[str, ...] | None = None):
        super().__init__(f"reward.fn={path!r}", log)
        self.fn, self.path, self.signature = fn, path, signature
        self.timeout, self.on_error = timeout, on_error
        self.sandboxed = runs_sandboxed(path, signature, sandbox)
        self.pool_paths = pool_paths or (path,)
        if self.sandboxed:
            _user_pool(self.pool_paths)  # the workers start (and import the function) while the model loads

    def _kwargs(self, problems, metadata, i: int | None) -> dict:
        """The keywords the function names; i = the row (per sample) or None (batched)."""
        sig, kw = self.signature, {}
        if sig.problem is not None:
            kw[sig.problem] = (problems[i] if i is not None else list(problems)) if problems is not None else None
        if sig.metadata:
            kw["metadata"] = (metadata[i] if i is not None else list(metadata)) if metadata is not None else None
        if sig.timeout:
            kw["timeout"] = self.timeout
        return kw

    def __call__(self, responses: list[str], golds: list[str], problems: list[str] | None = None,
                 metadata: list[dict] | None = None) -> Scores:
        n = len(responses)
        rewards, errors = np.zeros(n, np.float32), [None] * n
        if self.signature.batched:
            try:
                out = list(self.fn(list(responses), list(golds), **self._kwargs(problems, metadata, None)))
                if len(out) != n:
                    raise ValueError(f"returned {len(out)} rewards for {n} responses")
            except Exception as e:  # noqa: BLE001 - the user's code: any failure scores 0 (reward.on_error)
                self._fail(e)
                return Scores(rewards, [f"{type(e).__name__}: {e}"] * n)
            values = [(None, v) for v in out]
        elif self.sandboxed:
            why: list = []
            calls = [(self.path, (r, g), self._kwargs(problems, metadata, i)) for i, (r, g) in enumerate(zip(responses, golds))]
            out = _user_pool(self.pool_paths).run(call_by_path, calls, timeout=self.timeout, default=None, errors=why)
            values = list(zip(why, out))
        else:
            values = []
            for i, (r, g) in enumerate(zip(responses, golds)):
                try:
                    values.append((None, self.fn(r, g, **self._kwargs(problems, metadata, i))))
                except Exception as e:  # noqa: BLE001
                    self._fail(e)
                    values.append((f"{type(e).__name__}: {e}", None))
        for i, (error, value) in enumerate(values):
            if error is None:
                try:
                    rewards[i] = _number(value)
                    continue
                except ValueError as e:
                    error = str(e)
            errors[i] = error
            self._fail(error)
        return Scores(rewards, errors)

    def _fail(self, error) -> None:
        """on_error=raise: a RewardError that names the key and the way around it."""
        if self.on_error == "raise":
            message = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
            raise RewardError(f"reward.fn={self.path!r} failed on a response: {message}. (reward.on_error=raise; "
                              f"reward.on_error=zero scores such a response 0 and goes on.)") from (
                None if isinstance(error, str) else error)


class WeightedRewardFn(CountedReward):
    """`reward.fns`: reward [N] = sum_i weight_i * reward_i [N] over its entries (RewardFns), with
    each entry's own rewards in Scores.components under its name; a row's error names the entry
    that failed (the others keep their values). Failures are counted as one reward's."""

    def __init__(self, terms: list[tuple[str, float, RewardFn]], log: Callable[[str], None] = print):
        super().__init__("reward.fns (" + ", ".join(name for name, _, _ in terms) + ")", log)
        self.terms = terms

    def __call__(self, responses: list[str], golds: list[str], problems: list[str] | None = None,
                 metadata: list[dict] | None = None) -> Scores:
        total = np.zeros(len(responses), np.float64)
        errors: list = [None] * len(responses)
        components = {}
        for name, weight, reward in self.terms:
            scores = reward(responses, golds, problems, metadata)
            components[name] = scores.rewards
            total += weight * scores.rewards.astype(np.float64)
            errors = [e if e is not None or s is None else f"{name}: {s}" for e, s in zip(errors, scores.errors)]
        return Scores(total.astype(np.float32), errors, components)


def reward_needs_gold(cfg: RunConfig) -> bool:
    """Whether the run's reward needs a gold answer for every row: False when the second parameter of
    `reward.fn` (or of every `reward.fns` entry) has a default (module docstring); True for the
    built-in verifier and a signature that cannot be read."""
    for i, term in enumerate(cfg.reward.terms()):
        key = "reward.fn" if cfg.reward.fns is None else f"reward.fns[{i}].fn"
        fn = import_object(term.fn, key)
        if not callable(fn) or reward_signature(fn, term.batched, key=key).gold:
            return True
    return False


def make_reward_fn(cfg: RunConfig, log: Callable[[str], None] = print) -> RewardFn | WeightedRewardFn:
    """`reward.fn` (a RewardFn) or `reward.fns` (a WeightedRewardFn) imported and each signature
    checked (a ConfigError naming the key), ready to score; runs before the model loads."""
    r = cfg.reward
    if r.fns is None:
        fn = import_object(r.fn, "reward.fn")
        if not callable(fn):
            raise ConfigError(f"reward.fn={r.fn!r} is a {type(fn).__name__}, not a function.")
        return RewardFn(fn, r.fn, reward_signature(fn, r.batched), timeout=r.timeout,
                        on_error=r.on_error, sandbox=r.sandbox, log=log)
    found = []
    for i, term in enumerate(r.terms()):
        key = f"reward.fns[{i}].fn"
        fn = import_object(term.fn, key)
        if not callable(fn):
            raise ConfigError(f"{key}={term.fn!r} is a {type(fn).__name__}, not a function.")
        found.append((term, fn, reward_signature(fn, term.batched, key=key)))
    pool = tuple(t.fn for t, _, sig in found if runs_sandboxed(t.fn, sig, r.sandbox))
    return WeightedRewardFn([(t.name, t.weight, RewardFn(fn, t.fn, sig, timeout=r.timeout, on_error=r.on_error,
                                                         sandbox=r.sandbox, log=log, pool_paths=pool))
                             for t, fn, sig in found], log=log)

"""Your own data and reward (train/reward_fn.py, train/prompts.py): checked before the model, in
seconds, with errors naming the key; auto batching; problem/metadata; on_error; the time limit."""

import json
import re

import numpy as np
import pytest

import jaxrl4llm.train.loop as loop
from jaxrl4llm.cli import main as cli_main
from jaxrl4llm.train.config import ConfigError
from jaxrl4llm.train.reward_fn import RewardError, RewardFn, reward_signature

from tests.train.conftest import tiny_overrides
from tests.train.user_rewards import not_a_number, raises_on_b, short_batch, sleeps


def per_sample(response, gold): return 1.0
def per_sample_typed(x: str, y: str, *, metadata=None): return 1.0
def batched(completions, answers, timeout=1.0): return [1.0] * len(completions)
def batched_typed(a: list[str], b: list[str]): return [1.0] * len(a)
def with_problems(x, y, problems=None): return [1.0] * len(x)
def unknown(x, y): return 1.0
def mixed(response, golds): return 1.0
def needs_more(response, gold, rubric): return 1.0
def one_argument(response): return 1.0


@pytest.mark.parametrize("fn, batched_, problem, metadata, timeout", [
    (per_sample, False, None, False, False), (per_sample_typed, False, None, True, False),
    (batched, True, None, False, True), (batched_typed, True, None, False, False),
    (with_problems, True, "problems", False, False)])
def test_auto_reads_per_sample_or_batched_and_the_keywords_from_the_signature(fn, batched_, problem, metadata, timeout):
    sig = reward_signature(fn)
    assert (sig.batched, sig.problem, sig.metadata, sig.timeout) == (batched_, problem, metadata, timeout)


@pytest.mark.parametrize("fn, message", [
    (unknown, r"reward.batched=auto cannot tell whether unknown\(x, y\).*neither.*reward.batched=false / true"),
    (mixed, r"cannot tell whether mixed\(response, golds\).*say both"),
    (needs_more, r"needs 'rubric'.*give the others defaults"),
    (one_argument, r"must take a response and its gold answer")])
def test_a_signature_auto_cannot_read_is_refused_with_the_fix(fn, message):
    with pytest.raises(ConfigError, match=message):
        reward_signature(fn)
    if fn is unknown:  # an explicit setting decides
        assert reward_signature(fn, False).batched is False


def _reward(fn, **kw):
    return RewardFn(fn, f"tests.train.user_rewards:{fn.__name__}", reward_signature(fn, kw.pop("batched", "auto")),
                    timeout=kw.pop("timeout", 5.0), **kw)


def test_failures_score_zero_are_counted_and_warned_once_or_raise():
    lines = []
    for sandbox in (True, False):
        reward = _reward(raises_on_b, sandbox=sandbox, log=lines.append)
        assert reward.sandboxed is sandbox
        scores = reward(["a", "b", "c", "b"], ["a", "a", "a", "a"])
        assert scores.rewards.tolist() == [1.0, 0.0, 0.0, 0.0]
        assert scores.errors == [None, "KeyError: 'b'", None, "KeyError: 'b'"]
    assert _reward(not_a_number, sandbox=False)(["a", "b"], ["a", "a"]).errors == [
        "returned 'yes' (str), not a number", "returned nan, not a finite number"]
    assert _reward(short_batch)(["a", "b"], ["a", "a"]).errors == ["ValueError: returned 1 rewards for 2 responses"] * 2
    reward = _reward(raises_on_b, log=lines.append)
    reward.count(2, 8, "KeyError: 'b'")
    reward.count(1, 8, "KeyError: 'x'")
    assert reward.drain("sampling") == 3 and reward.drain("sampling") == 0  # one warning for the two batches
    assert lines == ["warning: sampling: reward.fn='tests.train.user_rewards:raises_on_b' failed on 3 of 16 "
                     "responses, scored 0 (reward.on_error=zero); first: KeyError: 'b'"]
    for sandbox in (True, False):
        with pytest.raises(RewardError, match=r"raises_on_b' failed on a response: KeyError: 'b'.*on_error=zero"):
            _reward(raises_on_b, sandbox=sandbox, on_error="raise")(["a", "b"], ["a", "a"])


def test_a_per_sample_reward_past_the_timeout_is_stopped_and_scores_zero():
    import time

    reward = _reward(sleeps, timeout=1.0)
    assert reward(["fast"], ["x"]).errors == [None]  # the workers are up
    start = time.perf_counter()
    scores = reward(["slow", "fast", "slow"], ["x", "x", "x"])
    assert scores.rewards.tolist() == [0.0, 1.0, 0.0]
    assert scores.errors == ["timed out after 1 s", None, "timed out after 1 s"]
    assert time.perf_counter() - start < 5  # two rounds of 1 s on the two workers, and a margin


def _fails_before_the_model(monkeypatch, capsys, overrides) -> str:
    """The CLI's error for a bad run, asserting no model was loaded first; returns stderr."""
    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the data and reward were checked")

    monkeypatch.setattr(loop, "load_policy", no_model)
    assert cli_main(["train", *overrides]) == 2
    return capsys.readouterr().err


def test_bad_data_or_reward_fails_before_the_model_naming_the_key(demo_assets, tmp_path, monkeypatch, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"q": "What is 1+1?", "a": "2", "src": "x"}\n{"q": "", "a": "3"}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    bad_module = tmp_path / "broken_reward.py"
    bad_module.write_text("def fn(response, gold):\n    return 1.0 +\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = [
        ({"data.train_files": f"[{rows}]"},
         r"data.train_files\[0\]='.*rows.jsonl': data.problem_key is unset and none of the usual names \(problem, "
         r"question, prompt, query, input\) is a field of the file; its fields are \['q', 'a', 'src'\]. Set "
         r"data.problem_key to the field that holds the problem text, e.g. data.problem_key=q"),
        ({"data.train_files": f"[{rows}]", "data.problem_key": "question"},
         r"data.problem_key='question', but the file has no field 'question'; its fields are \['q', 'a', 'src'\]"),
        ({"data.train_files": f"[{rows}]", "data.problem_key": "q", "data.answer_key": "ans"},
         r"data.answer_key='ans', but the file has no field 'ans'.*Set data.answer_key to the field that holds the "
         r"gold answer"),
        ({"data.train_files": f"[{rows}]", "data.problem_key": "q"},
         r"data.answer_key is unset and none of the usual names .* e.g. data.answer_key=a "),
        ({"data.train_files": f"[{rows}]", "data.problem_key": "q", "data.answer_key": "a"},
         r"data.train_files\[0\]=.*row 1 has an empty 'q' field. Fix or remove row 1, or set data.problem_key"),
        ({"data.eval_files": f"[{empty}]"}, r"data.eval_files\[0\]='.*empty.jsonl'.* is empty: it holds no problems"),
        ({"data.train_files": "[nope.jsonl]"}, r"Data file 'nope.jsonl' does not exist \(data.train_files\[0\]"),
        ({"model.tokenizer": str(tmp_path / "no_tokenizer")},
         r"model.tokenizer='.*no_tokenizer': tokenizer folder .* does not exist; point model.tokenizer at a local"),
        ({"reward.fn": "no_such_module:fn"}, r"reward.fn='no_such_module:fn': cannot import module 'no_such_module'"),
        ({"reward.fn": "broken_reward:fn"}, r"reward.fn='broken_reward:fn': importing module 'broken_reward' failed: "
                                            r"SyntaxError"),
        ({"reward.fn": "tests.train.test_reward_fn:unknown"}, r"reward.batched=auto cannot tell"),
    ]
    for extra, message in cases:
        err = _fails_before_the_model(monkeypatch, capsys, tiny_overrides(demo_assets, tmp_path / "run", **{
            "reward.batched": "auto", **extra}))
        assert err.startswith("jaxrl4llm train: error: ") and err.count("\n") == 1, err
        assert re.search(message, err), (message, err)


def test_a_run_gives_the_reward_problem_and_metadata_and_counts_its_failures(finished_run):
    """A tiny run (tests/train/conftest.py) with auto batching of a per-sample reward that asks
    for the problem and the row's metadata and raises on some responses: scored 0, counted,
    warned once per step."""
    records = [json.loads(line) for line in (finished_run["out"] / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "reward" in r]
    errors = [r["reward_errors"] for r in steps]
    assert len(steps) == 2 and sum(errors) > 0  # the seed's responses hold some '1's
    for r, h in zip(steps, finished_run["summary"]["history"]):
        assert r["reward_errors"] == h["reward_errors"]
        # every response without a '1' got its own problem and metadata (1.0), the others failed (0.0)
        np.testing.assert_allclose(r["reward"], 1 - r["reward_errors"] / 8)
    warnings = [line for line in finished_run["log"] if line.startswith("warning: sampling: reward.fn=")]
    assert len(warnings) == sum(e > 0 for e in errors)
    assert all("ValueError: a '1' in the response" in w for w in warnings)
    assert all("eval/reward_errors" in r for r in records if r["step"] in (0, 2) and "eval/accuracy" in r)


def test_a_weighted_list_sums_its_entries_and_returns_each_one(monkeypatch):
    """reward.fns: reward = sum_i weight_i * reward_i, each entry's own rewards as components; a
    failed entry scores 0 in its term only and the row's error names it."""
    from jaxrl4llm.train.config import load_config
    from jaxrl4llm.train.reward_fn import WeightedRewardFn, make_reward_fn

    cfg = load_config(None, ["reward.sandbox=false", "reward.fns=[{fn: tests.train.user_rewards:raises_on_b, "
                             "weight: 2.0, name: exact}, {fn: jaxrl4llm.rewards:boxed_format_reward, weight: 0.5}]"])
    reward = make_reward_fn(cfg, log=lambda line: None)
    assert isinstance(reward, WeightedRewardFn)
    scores = reward(["a", "b", r"\boxed{a}"], ["a", "a", "a"])
    assert scores.rewards.tolist() == [2.0, 0.0, 0.5]
    assert {k: v.tolist() for k, v in scores.components.items()} == {"exact": [1.0, 0.0, 0.0],
                                                                     "boxed_format_reward": [0.0, 0.0, 1.0]}
    assert scores.errors == [None, "exact: KeyError: 'b'", None]
    assert _reward(per_sample, sandbox=False)(["a"], ["a"]).components == {}  # a single reward.fn: none
    # two per-sample entries in worker processes: one pool that preloads both
    sandboxed = make_reward_fn(load_config(None, ["reward.fns=[{fn: tests.train.user_rewards:raises_on_b}, "
                                                  "{fn: tests.train.user_rewards:sleeps, weight: 0.5}]"]))
    assert all(r.sandboxed and r.pool_paths == ("tests.train.user_rewards:raises_on_b", "tests.train.user_rewards:sleeps")
               for _, _, r in sandboxed.terms)
    assert sandboxed(["a", "b"], ["a", "a"]).rewards.tolist() == [1.5, 0.5]


def test_a_weighted_list_needs_gold_answers_when_any_entry_does():
    from jaxrl4llm.train.config import load_config
    from jaxrl4llm.train.reward_fn import reward_needs_gold

    fmt = "{fn: jaxrl4llm.rewards:boxed_format_reward}"
    assert not reward_needs_gold(load_config(None, [f"reward.fns=[{fmt}]"]))  # the format reward reads no gold
    assert reward_needs_gold(load_config(None, [f"reward.fns=[{fmt}, {{fn: jaxrl4llm.rewards:batch_math_reward}}]"]))


def test_a_weighted_lists_bad_entry_is_refused_before_the_model(monkeypatch):
    import sys

    from jaxrl4llm.train.config import load_config
    from jaxrl4llm.train.reward_fn import make_reward_fn

    with pytest.raises(ConfigError, match=r"reward.fns\[1\].fn='no_such_module:fn': cannot import module"):
        make_reward_fn(load_config(None, ["reward.fns=[{fn: tests.train.user_rewards:raises_on_b}, "
                                          "{fn: no_such_module:fn}]"]))
    with pytest.raises(ConfigError, match=r"reward.fns\[0\].batched=auto cannot tell whether unknown"):
        make_reward_fn(load_config(None, ["reward.fns=[{fn: tests.train.test_reward_fn:unknown}]"]))
    monkeypatch.setitem(sys.modules, "math_verify", None)  # the math-verify extra not installed
    monkeypatch.delitem(sys.modules, "jaxrl4llm.rewards.hf_math_verify", raising=False)
    with pytest.raises(ConfigError, match=r"pip install 'jaxrl4llm\[math-verify\]'"):
        make_reward_fn(load_config(None, ["reward.fns=[{fn: jaxrl4llm.rewards.hf_math_verify:math_verify_reward}]"]))

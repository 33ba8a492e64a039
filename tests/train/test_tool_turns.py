"""train/tool_turns.py: a tool-integrated row split into turns, the void-turn flags, the step's tool
metrics and a logged row's turns (host side, no model)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl4llm.tools.protocol import FENCE
from jaxrl4llm.train.tool_turns import Turn, check_void_turn_filter, row_turns, tool_metrics, turn_records, void_rows


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.booleans()), max_size=24), st.integers(0, 4))
def test_turns_give_the_response_back_and_alternate_model_and_tool(cells, pad):
    tokens = np.array([t for t, _ in cells] + [99] * pad, np.int32)
    tool = np.array([f for _, f in cells] + [True] * pad, np.float32)  # padding past the length is ignored
    turns = row_turns(tokens, len(cells), tool)
    assert [t for turn in turns for t in turn.model + turn.tool] == [t for t, _ in cells]
    assert turns and all(turn.tool for turn in turns[:-1])  # every turn but the last is followed by an observation
    assert all(turn.model for turn in turns[1:])  # after an observation the model writes again
    runs = sum(1 for i, (_, f) in enumerate(cells) if f and (i == 0 or not cells[i - 1][1]))
    assert sum(1 for turn in turns if turn.tool) == runs


def test_turns_of_hand_built_rows():
    tool = np.array([0, 0, 1, 1, 0, 1, 0, 0], np.float32)
    assert row_turns(np.arange(8), 8, tool) == [Turn([0, 1], [2, 3]), Turn([4], [5]), Turn([6, 7], [])]
    assert row_turns(np.arange(8), 6, tool) == [Turn([0, 1], [2, 3]), Turn([4], [5])]  # cut inside an observation
    assert row_turns(np.arange(8), 0, tool) == [Turn([], [])]


CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 \n`{}\\()*"
enc = lambda text: [CHARS.index(c) for c in text]
dec = lambda ids: "".join(CHARS[i] for i in ids)


def _rows(*pieces_per_row):
    """Rows of (text, is_tool) pieces -> turns (`row_turns`) of their character ids."""
    out = []
    for pieces in pieces_per_row:
        ids = [i for text, _ in pieces for i in enc(text)]
        tool = [float(f) for text, f in pieces for _ in text]
        out.append(row_turns(np.array(ids), len(ids), np.array(tool)))
    return out


def test_void_rows_read_the_last_turn_of_the_model():
    code = "```python\nprint(3*4)\n```\n```output"
    turns = _rows([(code, False), ("\n12\n```\n", True), ("so \\boxed{12}", False)],  # answered after the call
                  [(code, False), ("\n12\n```\n", True), ("so 12", False)],  # void: no code, no box
                  [(code, False), ("\n12\n", True)],  # cut inside the observation: judged by the call
                  [("i guess 12", False)])  # no call, no answer
    np.testing.assert_array_equal(void_rows(turns, dec, FENCE), [False, True, False, True])


def test_tool_metrics_count_tool_tokens_rows_and_void_rows():
    tool = np.array([[0, 1, 1, 0, 1, 0], [0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]], np.float32)
    response = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 1, 0, 0, 0, 0]], np.float32)
    out = tool_metrics(tool, response, void=np.array([True, False, False]))
    assert out == {"tools/token_share": pytest.approx(4 / 11), "tools/rows_share": pytest.approx(2 / 3),
                   "tools/void_turn_share": pytest.approx(1 / 3)}
    assert "tools/void_turn_share" not in tool_metrics(tool, response)


def test_turn_records_show_each_turn_with_its_tool_output():
    turns = _rows([("```python\nprint(1)\n```\n```output", False), ("\n1\n```\n", True), ("\\boxed{1}", False)])[0]
    assert turn_records(turns, dec) == [{"model": "```python\nprint(1)\n```\n```output", "tool": "\n1\n```\n"},
                                        {"model": "\\boxed{1}", "tool": ""}]


def test_the_void_turn_filter_needs_a_run_with_tools():
    import dataclasses
    from types import SimpleNamespace

    from jaxrl4llm.core import LITE_PPO
    from jaxrl4llm.train.config import ConfigError

    recipe = dataclasses.replace(LITE_PPO, void_turn_filter=True)
    with pytest.raises(ConfigError, match="void_turn_filter=true needs a run with tools"):
        check_void_turn_filter(SimpleNamespace(rollout=SimpleNamespace()), recipe)
    check_void_turn_filter(SimpleNamespace(rollout=SimpleNamespace(tools=SimpleNamespace(format="fence"))), recipe)
    check_void_turn_filter(SimpleNamespace(rollout=SimpleNamespace()), LITE_PPO)


def test_the_loop_reads_void_flags_only_when_the_recipe_filters():
    import dataclasses
    from types import SimpleNamespace

    from jaxrl4llm.core import LITE_PPO
    from jaxrl4llm.sampling import Rollout
    from jaxrl4llm.train.loop import void_turn_flags

    turns = ["```python\nprint(1)\n```\n```output", "\n1\n```\n", "so 1"]
    ids = [i for t in turns for i in enc(t)]
    tool = [float(k == 1) for k, t in enumerate(turns) for _ in t]
    rows = [(ids, tool), (enc("so \\boxed{1}"), [0.0] * 12)]
    width = max(len(r[0]) for r in rows)
    tokens = np.array([r[0] + [0] * (width - len(r[0])) for r in rows], np.int32)
    mask = np.array([r[1] + [0.0] * (width - len(r[1])) for r in rows], np.float32)
    lengths = np.array([len(r[0]) for r in rows], np.int32)
    zeros = np.zeros((2, width), np.float32)
    rollout = Rollout(np.ones((2, 1), np.int32), np.ones((2, 1), np.float32), tokens, zeros, zeros, zeros, lengths,
                      np.array([False, False]), tool_mask=mask)
    cfg = SimpleNamespace(rollout=SimpleNamespace(tools=SimpleNamespace(format="fence")))
    run = SimpleNamespace(recipe=dataclasses.replace(LITE_PPO, void_turn_filter=True), cfg=cfg,
                          policy=SimpleNamespace(decode_ids=dec))
    np.testing.assert_array_equal(void_turn_flags(run, rollout), [True, False])  # "so 1" after the call: void
    assert void_turn_flags(SimpleNamespace(**{**vars(run), "recipe": LITE_PPO}), rollout) is None

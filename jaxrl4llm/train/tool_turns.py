"""A tool-integrated rollout's turns on the host: each row's response split where the tool's forced
tokens sit (`Rollout.tool_mask`), and what the trainer reads from them: SimpleTIR's void-turn flags
(`algorithm.overrides.void_turn_filter`), the step's tool metrics and the turns of a logged sample.

    turns = rollout_turns(rollout)                   # per row [Turn(model ids, tool ids), ...] (`row_turns`)
    void = void_rows(turns, decode_ids, fmt)         # [N] bool: the last turn wrote no code and no answer
    tool_metrics(tool_mask, response_mask, void=void)  # tools/token_share, tools/rows_share, tools/void_turn_share
    turn_records(turns[n], decode_ids)               # samples.jsonl: [{"model": text, "tool": text}, ...]

A row alternates the model's turns and the tool's observations: turn k is the model's tokens up to
its k-th call, then the observation the tool fed back (its tool ids); the last turn's tool ids are
empty unless the row ran out of budget inside an observation. Nothing here changes what the run
computes but the void flags, which the filter turns into row weights (`core.compute_advantages`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import numpy as np

from jaxrl4llm.tools.protocol import ToolFormat, is_void_turn, tool_format
from jaxrl4llm.train.config import ConfigError


def run_tool_format(cfg) -> ToolFormat | None:
    """The tool format of a run's `rollout.tools` section (its `format`), None for a run without tools
    (no section, or one that is off)."""
    tools = getattr(cfg.rollout, "tools", None)
    if tools is None or not getattr(tools, "enabled", True):
        return None
    return tool_format(tools.format)


def check_void_turn_filter(cfg, recipe) -> None:
    """A ConfigError when the recipe filters void turns (`algorithm.overrides.void_turn_filter`) in a
    run without tools: a turn is void by the tool format's calls."""
    if recipe.void_turn_filter and run_tool_format(cfg) is None:
        raise ConfigError("algorithm.overrides.void_turn_filter=true needs a run with tools (rollout.tools, "
                          "whose format says what a call is); turn tools on or drop the filter.")


class Turn(NamedTuple):
    """One turn of a row: `model`, the ids the model sampled; `tool`, the ids of the observation the
    tool fed back after them ([] when none followed)."""

    model: list[int]
    tool: list[int]


def row_turns(tokens, length: int, tool_mask) -> list[Turn]:
    """A row's response tokens[:length] ([R] ids, tool_mask [R] 1 on forced tool tokens) as its turns,
    in order: each maximal run of model tokens with the run of tool tokens after it. Concatenating
    the turns' model + tool ids gives tokens[:length] back; a row without tool tokens is one turn."""
    ids = np.asarray(tokens)[: int(length)]
    tool = np.asarray(tool_mask)[: int(length)] > 0
    bounds = [0, *(np.flatnonzero(np.diff(tool.astype(np.int8))) + 1).tolist(), len(ids)]
    turns: list[Turn] = []
    model: list[int] = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        if b == a:
            continue
        if tool[a]:
            turns.append(Turn(model, ids[a:b].tolist()))
            model = []
        else:
            model = ids[a:b].tolist()
    if model or not turns:  # the model wrote after the last observation, or the row has no tool tokens
        turns.append(Turn(model, []))
    return turns


def rollout_turns(rollout, rows: int | None = None) -> list[list[Turn]]:
    """`row_turns` of the first `rows` rows (default all) of a Rollout with a tool_mask (its arrays
    fetched to the host)."""
    rows = rollout.num_rows if rows is None else min(rows, rollout.num_rows)
    tokens, lengths = np.asarray(rollout.response_tokens)[:rows], np.asarray(rollout.lengths)[:rows]
    tool = np.asarray(rollout.tool_mask)[:rows]
    return [row_turns(tokens[n], lengths[n], tool[n]) for n in range(rows)]


def void_rows(turns: Sequence[Sequence[Turn]], decode_ids: Callable[[list[int]], str], fmt: ToolFormat) -> np.ndarray:
    """[N] bool: row n's last turn is void (`tools.protocol.is_void_turn` on the text of its model
    ids, decoded with special tokens kept: `Policy.decode_ids`), SimpleTIR's rows to drop. A row cut
    inside an observation (its last turn has tool ids) is judged by the turn that made the call."""
    return np.array([is_void_turn(fmt, decode_ids(row[-1].model)) for row in turns], bool)


def tool_metrics(tool_mask, response_mask, *, void: np.ndarray | None = None) -> dict[str, float]:
    """The trained batch's tool figures (host numpy; tool_mask, response_mask [N, R]), beside the
    rollout's own (`tools/calls_per_row`, `tools/error_rate`, ... from the engine's host loop):

        tools/token_share      tool tokens / response tokens (model + tool) of the batch
        tools/rows_share       share of rows with at least one observation fed back
        tools/void_turn_share  share of rows whose last turn is void (with `void` [N], the filter's flags)
    """
    tool = np.asarray(tool_mask) > 0
    rows = tool.any(axis=1)
    total = float(np.asarray(response_mask).sum())
    out = {"tools/token_share": float(tool.sum()) / total if total else 0.0,
           "tools/rows_share": float(rows.mean()) if rows.size else 0.0}
    if void is not None:
        out["tools/void_turn_share"] = float(np.mean(void)) if len(void) else 0.0
    return out


def turn_records(turns: Sequence[Turn], decode_ids: Callable[[list[int]], str]) -> list[dict]:
    """A logged row's turns for samples.jsonl: [{"model": the model's text of the turn, "tool": the
    observation the tool fed back after it ("" after the last turn)}], special tokens kept."""
    return [{"model": decode_ids(t.model), "tool": decode_ids(t.tool) if t.tool else ""} for t in turns]

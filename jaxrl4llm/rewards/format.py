r"""Format reward: does the response end with exactly one boxed answer?

    boxed_format_reward(responses, golds=None) -> [N] floats: 1.0 where `ends_with_one_box`, else 0.0

`ends_with_one_box(response)` is True when, and only when:
  1. `\boxed` occurs exactly once in the whole response (thinking included),
  2. it is followed (after optional spaces) by `{`, and that brace closes (braces balanced;
     `\{` and `\}` are escaped characters, not braces: the verifier's own
     `extraction.matching_brace`), and
  3. after the closing brace come only whitespace, at most one closing math delimiter
     (`$`, `$$`, `\]`, `\)`) and at most one final period: `$\boxed{5}$.` passes, `\boxed{5} so 5` fails.
The gold answer is not read: the reward scores the shape, not the answer (pair it with the math
verifier in `reward.fns`, docs/rewards.md "Several rewards").
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from jaxrl4llm.rewards.extraction import matching_brace

BOX = "\\boxed"
# what may follow the box's closing brace: whitespace, one math closer, one period
_TAIL = re.compile(r"\s*(?:\$\$|\$|\\\]|\\\))?\s*\.?\s*")


def ends_with_one_box(response: str) -> bool:
    """True when `response` holds exactly one `\\boxed{...}` and only whitespace, a math closer and
    a period after it (module docstring)."""
    if not isinstance(response, str) or response.count(BOX) != 1:
        return False
    start = response.index(BOX) + len(BOX)
    brace = start + len(response[start:]) - len(response[start:].lstrip(" "))
    if brace >= len(response) or response[brace] != "{":
        return False
    close = matching_brace(response, brace)
    return close is not None and _TAIL.fullmatch(response, close + 1) is not None


def boxed_format_reward(responses: Sequence[str], golds: Sequence | None = None) -> list[float]:
    """1.0 for each response that `ends_with_one_box`, else 0.0 (batched: `reward.fns` calls it
    in the trainer's process). The golds are not read: their default says that rows without a gold
    answer may be kept (train/reward_fn.reward_needs_gold)."""
    return [1.0 if ends_with_one_box(r) else 0.0 for r in responses]

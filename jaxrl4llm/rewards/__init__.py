"""jaxrl4llm.rewards: the binary math-answer reward (extraction, normalisation, equivalence), a
format reward (`boxed_format_reward`) and, with the `math-verify` extra, Math-Verify as a reward
(`jaxrl4llm.rewards.hf_math_verify:math_verify_reward`, not imported here).

Model output is untrusted: nothing here evaluates it as code, inputs are size-limited, and
every symbolic comparison runs in a worker process under a hard wall-clock limit.
"""

from jaxrl4llm.rewards.extraction import extract_answer
from jaxrl4llm.rewards.extraction import gold_answer
from jaxrl4llm.rewards.format import boxed_format_reward
from jaxrl4llm.rewards.math import batch_math_reward
from jaxrl4llm.rewards.math import math_equal
from jaxrl4llm.rewards.math import math_reward
from jaxrl4llm.rewards.math import strict_box_reward
from jaxrl4llm.rewards.normalization import normalize_answer
from jaxrl4llm.rewards.sandbox import SandboxPool
from jaxrl4llm.rewards.sandbox import shared_pool

__all__ = [
    "SandboxPool",
    "batch_math_reward",
    "boxed_format_reward",
    "extract_answer",
    "gold_answer",
    "math_equal",
    "math_reward",
    "normalize_answer",
    "shared_pool",
    "strict_box_reward",
]

"""The rows' response lengths, as a distribution: the meter's input (`plan`: a run's work depends on
them, not on the budget) and the row-form choice's (`train.layout.choose_row_form`).

    fixed                         every response runs to rollout.max_new_tokens (the old, full-length view)
    fixed:LEN                     every response has LEN tokens
    lognormal:mean=M,sigma=S      log-normal lengths of mean M tokens (log-space sigma S), capped at the budget
    <run folder>                  the lengths a run logged (`response_lengths.jsonl`, written by `train`)

A length above the budget is a truncated response of exactly `max_new_tokens` tokens. The study's
responses average 1-3k tokens at an 8k budget (arXiv 2508.08221), so `plan`'s default is
lognormal with mean a quarter of the budget and sigma 0.8 (p50 ~0.7 x mean, p95 ~2.5 x mean).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from jaxrl4llm.train.config import ConfigError
from jaxrl4llm.train.metrics import LENGTHS_FILE

DEFAULT_SIGMA = 0.8


@dataclasses.dataclass(frozen=True)
class LengthDistribution:
    """Response lengths in tokens: `kind` fixed | lognormal | empirical, with its parameters."""

    kind: str
    mean: float = 0.0
    sigma: float = 0.0
    values: tuple[int, ...] = ()  # empirical: the logged lengths
    source: str = ""

    def describe(self, budget: int) -> str:
        if self.kind == "fixed":
            return f"fixed at {int(self.mean) if self.mean else budget} tokens"
        if self.kind == "lognormal":
            return f"lognormal, mean {self.mean:.0f} tokens, sigma {self.sigma:g} (capped at {budget})"
        return f"{len(self.values)} lengths logged in {self.source} (mean {np.mean(self.values):.0f})"

    def sample(self, n: int, budget: int, rng: np.random.Generator) -> np.ndarray:
        """n response lengths [n] int in [1, budget]."""
        if self.kind == "fixed":
            out = np.full(n, self.mean or budget)
        elif self.kind == "lognormal":
            mu = math.log(self.mean) - self.sigma**2 / 2  # E[exp(N(mu, s^2))] = exp(mu + s^2 / 2) = mean
            out = rng.lognormal(mu, self.sigma, n)
        else:
            out = rng.choice(np.asarray(self.values), n, replace=True)
        return np.clip(np.round(out), 1, budget).astype(np.int64)


def parse_lengths(spec: str | None, max_new_tokens: int) -> LengthDistribution:
    """`--response-lengths` (see the module docstring); None = the default lognormal."""
    if spec is None or spec == "default":
        return LengthDistribution("lognormal", mean=max_new_tokens / 4, sigma=DEFAULT_SIGMA)
    if spec == "fixed":
        return LengthDistribution("fixed")
    if spec.startswith("fixed:"):
        return LengthDistribution("fixed", mean=float(_number(spec, spec[6:])))
    if spec.startswith("lognormal"):
        fields = dict(mean=max_new_tokens / 4, sigma=DEFAULT_SIGMA)
        for part in filter(None, spec.partition(":")[2].split(",")):
            key, _, value = part.partition("=")
            if key not in fields:
                raise ConfigError(f"--response-lengths {spec!r}: unknown field {key!r}; lognormal takes mean=TOKENS "
                                  f"and sigma=S, e.g. lognormal:mean=2048,sigma=0.8")
            fields[key] = _number(spec, value)
        if fields["mean"] <= 0 or fields["sigma"] < 0:
            raise ConfigError(f"--response-lengths {spec!r}: mean must be > 0 and sigma >= 0")
        return LengthDistribution("lognormal", **fields)
    path = Path(spec)
    if path.is_dir() or path.is_file():
        return logged_lengths(path)
    raise ConfigError(f"--response-lengths {spec!r}: not a distribution nor a run folder. Use fixed, fixed:LEN, "
                      f"lognormal:mean=TOKENS,sigma=S, or a run folder holding {LENGTHS_FILE}.")


def _number(spec: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"--response-lengths {spec!r}: {text!r} is not a number") from None


def logged_lengths(path: Path) -> LengthDistribution:
    """The response lengths a run logged (its folder or the file itself)."""
    file = path / LENGTHS_FILE if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"--response-lengths {str(path)!r}: no {LENGTHS_FILE} there (runs write it since the meter "
                          f"issue; a rollout's lengths can also be written as JSON lines "
                          f'{{"step": 1, "response_lengths": [...]}})')
    steps = {}  # a resumed run may log a step twice: its last line counts
    for line in file.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            steps[record.get("step", len(steps))] = [int(v) for v in record["response_lengths"]]
    values = [v for lengths in steps.values() for v in lengths]
    if not values:
        raise ConfigError(f"--response-lengths {str(file)!r} holds no lengths")
    return LengthDistribution("empirical", values=tuple(values), source=str(file))

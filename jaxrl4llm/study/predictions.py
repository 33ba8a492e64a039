"""Pre-registered predictions: written in a grid file before its sweep runs, judged by the report
(`jaxrl4llm report RUNS --predictions GRID.yaml`; issue #40, docs/sweeps.md "Predictions").

    predictions:
      - name: token-level aggregation, base-like start
        takeaway: token- beats sequence-level aggregation on base models
        baseline: {recipe: baseline, data: long, model: base_like}    # arm labels (cell.json)
        arm: {recipe: token_agg, data: long, model: base_like}
        readout: {metric: response_length, direction: up}             # the mechanism
        accuracy: up                                                  # up | down | none
        accuracy_metric: eval/accuracy                                 # default
        primary: true                                                  # in the Holm family

Each prediction compares two arms over their seeds with Welch's t-test (study/stats.py):
- the mechanism readout: each run's mean of `readout.metric` over its training steps (step 0
  left out). **Engaged** when the difference arm - baseline has the predicted sign and its 95%
  interval excludes 0; else "not engaged" (no detectable change) or "reversed";
- accuracy: each run's last `accuracy_metric` after step 0. The p-values of the primary
  predictions are Holm-adjusted together (p_(i) * (m - i + 1), running maximum). **held**: the
  predicted sign at adjusted p < 0.05; **reversed**: the other sign at adjusted p < 0.05;
  **inconclusive** otherwise. `accuracy: none` predicts no difference: "no difference detected"
  when adjusted p >= 0.05 (absence of evidence, said so), "not held" otherwise.
A prediction whose arms have no runs yet (a sweep in progress) says so and is left out of Holm's m.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Sequence

import yaml

from jaxrl4llm.study.stats import Comparison, welch_test
from jaxrl4llm.train.config import ConfigError

PREDICTION_KEYS = ("name", "takeaway", "baseline", "arm", "readout", "accuracy", "accuracy_metric", "primary")
READOUT_KEYS = ("metric", "direction")
DIRECTIONS = ("up", "down")
ALPHA = 0.05


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One pre-registered comparison (module docstring)."""

    name: str
    takeaway: str
    baseline: dict
    arm: dict
    readout_metric: str
    readout_direction: str
    accuracy: str
    accuracy_metric: str = "eval/accuracy"
    primary: bool = True


def _labels(value: Any, where: str) -> dict:
    if not isinstance(value, dict) or not value or not all(isinstance(k, str) for k in value):
        raise ConfigError(f"{where} must be a mapping of arm labels, e.g. {{recipe: baseline, model: base_like}}; "
                          f"got {value!r}.")
    return {k: str(v) for k, v in value.items()}


def parse_predictions(raw: Any, where: str = "predictions") -> list[Prediction]:
    """A grid file's `predictions:` list -> [Prediction]; a ConfigError names any wrong entry."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ConfigError(f"{where} must be a list of predictions (keys {', '.join(PREDICTION_KEYS)}).")
    out = []
    for i, entry in enumerate(raw):
        here = f"{where}[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{here} must be a mapping with keys {', '.join(PREDICTION_KEYS)}; got {entry!r}.")
        unknown = [k for k in entry if k not in PREDICTION_KEYS]
        missing = [k for k in ("name", "baseline", "arm", "readout", "accuracy") if k not in entry]
        if unknown or missing:
            raise ConfigError(f"{here}: " + "; ".join(
                ([f"unknown key(s) {', '.join(map(repr, unknown))}"] if unknown else [])
                + ([f"missing {', '.join(missing)}"] if missing else [])) + f" (valid keys: {', '.join(PREDICTION_KEYS)}).")
        readout = entry["readout"]
        if not isinstance(readout, dict) or set(readout) != set(READOUT_KEYS) or readout["direction"] not in DIRECTIONS:
            raise ConfigError(f"{here}.readout must be {{metric: <metrics.jsonl key>, direction: up|down}}; got {readout!r}.")
        if entry["accuracy"] not in (*DIRECTIONS, "none"):
            raise ConfigError(f"{here}.accuracy must be up, down or none; got {entry['accuracy']!r}.")
        out.append(Prediction(
            name=str(entry["name"]), takeaway=str(entry.get("takeaway", "")),
            baseline=_labels(entry["baseline"], f"{here}.baseline"), arm=_labels(entry["arm"], f"{here}.arm"),
            readout_metric=str(readout["metric"]), readout_direction=readout["direction"], accuracy=entry["accuracy"],
            accuracy_metric=str(entry.get("accuracy_metric", "eval/accuracy")), primary=bool(entry.get("primary", True))))
    return out


def read_predictions(grid_paths: Sequence[str | Path]) -> list[Prediction]:
    """The predictions of each grid file, in order (a grid without any adds none)."""
    out = []
    for path in grid_paths:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"--predictions {path}: cannot read the grid file: {e}") from None
        out += parse_predictions(raw.get("predictions"), f"{path}: predictions")
    return out


def holm_adjust(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjustment: p_(i) -> max_{j <= i} min(1, (m - j + 1) p_(j)); nan stays nan
    and is left out of m."""
    finite = sorted((p, i) for i, p in enumerate(p_values) if not math.isnan(p))
    adjusted = [math.nan] * len(p_values)
    running, m = 0.0, len(finite)
    for rank, (p, i) in enumerate(finite):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = running
    return adjusted


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A prediction judged: the two comparisons (arm minus baseline) and the words."""

    prediction: Prediction
    readout: Comparison
    accuracy: Comparison
    accuracy_p_adjusted: float
    engaged: str
    verdict: str


def run_readout(run, metric: str) -> float | None:
    """A run's mean of `metric` over its training steps (step 0 left out); None when never logged."""
    series = {s: v for s, v in run.series(metric).items() if s > 0}
    return sum(series.values()) / len(series) if series else None


def run_final(run, metric: str) -> float | None:
    """A run's last value of `metric` after step 0 (the final evaluation)."""
    series = {s: v for s, v in run.series(metric).items() if s > 0}
    return series[max(series)] if series else None


def _matching(runs, labels: dict) -> list:
    return [r for r in runs if all(str(r.labels.get(k)) == v for k, v in labels.items())]


def _engaged(c: Comparison, direction: str) -> str:
    if math.isnan(c.low):
        return "n/a (needs >= 2 seeds per arm)"
    if c.low > 0 or c.high < 0:
        return "engaged" if (c.diff > 0) == (direction == "up") else "reversed"
    return "not engaged"


def _verdict(c: Comparison, p_adjusted: float, expected: str) -> str:
    if math.isnan(p_adjusted):
        return "n/a (needs >= 2 seeds per arm)"
    if expected == "none":
        return "no difference detected (as predicted)" if p_adjusted >= ALPHA else "not held"
    if p_adjusted >= ALPHA:
        return "inconclusive"
    return "held" if (c.diff > 0) == (expected == "up") else "reversed"


def judge(predictions: Sequence[Prediction], runs) -> list[Outcome]:
    """Each prediction judged on `runs` (study_report.RunData with sweep labels). A prediction whose
    baseline or arm has no run yet is reported so ("no run yet with {...}", the labels it looked
    for) and left out of the Holm family."""
    comparisons, missing = [], {}
    for i, pred in enumerate(predictions):
        base, arm = _matching(runs, pred.baseline), _matching(runs, pred.arm)
        absent = [labels for labels, found in ((pred.baseline, base), (pred.arm, arm)) if not found]
        if absent:  # a sweep still running, or a label that names no arm: said in the verdict
            missing[i] = "no run yet with " + " nor ".join(
                "{" + ", ".join(f"{k}: {v}" for k, v in labels.items()) + "}" for labels in absent)
        values = lambda rs, fn, metric: [v for v in (fn(r, metric) for r in rs) if v is not None]
        comparisons.append((welch_test(values(base, run_readout, pred.readout_metric),
                                       values(arm, run_readout, pred.readout_metric)),
                            welch_test(values(base, run_final, pred.accuracy_metric),
                                       values(arm, run_final, pred.accuracy_metric))))
    primary = [i for i, p in enumerate(predictions) if p.primary and i not in missing]
    adjusted = dict(zip(primary, holm_adjust([comparisons[i][1].p_value for i in primary])))
    outcomes = []
    for i, (pred, (readout, accuracy)) in enumerate(zip(predictions, comparisons)):
        p_adj = adjusted.get(i, accuracy.p_value)
        if i in missing:
            outcomes.append(Outcome(pred, readout, accuracy, math.nan, missing[i], missing[i]))
            continue
        outcomes.append(Outcome(pred, readout, accuracy, p_adj, _engaged(readout, pred.readout_direction),
                                _verdict(accuracy, p_adj, pred.accuracy)))
    return outcomes


def _signed(x: float, scale: float = 1.0, digits: int = 3) -> str:
    return "n/a" if math.isnan(x) else f"{x * scale:+.{digits}g}"


def predictions_section(outcomes: Sequence[Outcome]) -> list[str]:
    """The report's markdown section: each prediction beside its outcome."""
    if not outcomes:
        return []
    m = sum(o.prediction.primary and not o.verdict.startswith("no run yet") for o in outcomes)
    lines = ["## Predictions and outcomes", "",
             f"Predictions written in the grid files before the runs (study/predictions.py). Mechanism: each run's mean "
             f"of the readout over its training steps; engaged = the predicted sign with a 95% interval that excludes "
             f"0. Accuracy: final held-out accuracy, Welch t-test, Holm-adjusted over the {m} primary predictions.", ""]
    rows = []
    for o in outcomes:
        p = o.prediction
        readout = (f"{p.readout_metric} {p.readout_direction}: {_signed(o.readout.diff)} "
                   f"[{_signed(o.readout.low)}, {_signed(o.readout.high)}]")
        accuracy = (f"{p.accuracy}: {_signed(o.accuracy.diff, 100)} pp [{_signed(o.accuracy.low, 100)}, "
                    f"{_signed(o.accuracy.high, 100)}], p = {o.accuracy.p_value:.3g}, adj. {o.accuracy_p_adjusted:.3g}"
                    + ("" if p.primary else " (secondary)"))
        rows.append([p.name, p.takeaway, f"{o.readout.n_b} vs {o.readout.n_a}", readout, o.engaged, accuracy, o.verdict])
    header = ["prediction", "takeaway", "seeds (arm vs baseline)", "mechanism: predicted, arm - baseline [95% CI]",
              "engaged?", "accuracy: predicted, arm - baseline", "verdict"]
    lines += ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return lines + [""]

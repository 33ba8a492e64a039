"""Study report: runs grouped into arms and compared over seeds (`jaxrl4llm report RUN_DIR... -o OUT`).

An arm is the set of runs that differ only by seed: a sweep cell's recipe/data/model labels
(CELL/cell.json, written by `jaxrl4llm sweep`), or, for runs without one, an equal config.json
but trainer.seed (and out_dir). Writes OUT/report.md with
- learning curves (PNG): mean over seeds and its 95% t-interval per step;
- final held-out accuracy per benchmark and arm: mean, 95% t-interval, per-seed values;
- every arm against the baseline arm (the first, or `baseline=`): difference of means, its 95%
  interval and the Welch t-test p-value (jaxrl4llm.study.stats), in plain words;
- the training metrics of the last 10% of steps, and the list of runs.
This is the comparison of many runs; jaxrl4llm.train.report is the one run's terminal table.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from pathlib import Path
from typing import Sequence

from jaxrl4llm.train.config import ConfigError
from jaxrl4llm.train.metrics import read_metrics
from jaxrl4llm.study.predictions import Prediction, judge, predictions_section, read_predictions
from jaxrl4llm.study.stats import Interval, mean_interval, welch_test

# (metric key in metrics.jsonl, plot title); a curve is drawn when some run logged the metric
CURVES = (
    ("reward", "training reward"),
    ("eval/accuracy", "held-out accuracy (mean over eval sets)"),
    ("entropy", "policy entropy (nats per token)"),
    ("response_length", "response length (tokens)"),
    ("clip_frac_high", "clipped tokens with A > 0 (ratio > 1 + eps_high)"),
    ("clip_frac_low", "clipped tokens with A < 0 (ratio < 1 - eps_low)"),
    ("truncation_rate", "truncated responses"),
    ("truncated_repeat_ratio", "repetitive share of truncated responses"),
    ("truncated_unfinished_ratio", "unfinished share of truncated responses (no boxed answer, no loop)"),
    ("response_length_cv", "response length CV (std / mean)"),
    ("all_same_groups", "groups whose rewards are all equal"),
    ("all_same_advantage_share", "share of sum |A| on all-same groups"),
)
# training metrics averaged over the last 10% of steps in the final-metrics table
FINAL_METRICS = ("reward", "entropy", "response_length", "clip_frac_high", "clip_frac_low")
# config keys that do not make two runs different arms
SEED_LIKE_KEYS = ("trainer.seed", "trainer.out_dir", "trainer.overwrite", "trainer.progress_bar", "trainer.loggers",
                  "trainer.project_name", "trainer.experiment_name", "trainer.log_samples")
ALPHA = 0.05


@dataclasses.dataclass
class RunData:
    """One run folder: its metrics records, config, sweep labels (without the seed) and seed."""

    path: Path
    records: list
    config: dict
    labels: dict
    seed: int | None
    index: int | None = None  # the cell's position in its grid (arm order)

    def series(self, key: str) -> dict:
        """{step: value} of a numeric metric (later records of a step win)."""
        return {int(r.get("step", 0)): float(r[key]) for r in self.records
                if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) and math.isfinite(r[key])}

    @property
    def last_step(self) -> int:
        return max((int(r.get("step", 0)) for r in self.records), default=0)

    @property
    def configured_steps(self) -> int | None:
        return self.config.get("trainer", {}).get("steps")


@dataclasses.dataclass
class Arm:
    label: str
    runs: list


def find_run_dirs(paths: Sequence[str | Path]) -> list[Path]:
    """Run folders (holding metrics.jsonl) among `paths`, searching inside folders that are not
    runs (a sweep's out_root); raises FileNotFoundError naming a path with no run."""
    found: list[Path] = []
    for p in map(Path, paths):
        if (p / "metrics.jsonl").is_file():
            runs = [p]
        elif p.is_dir():
            runs = sorted(m.parent for m in p.rglob("metrics.jsonl"))
        else:
            runs = []
        if not runs:
            raise FileNotFoundError(f"{p} is not a run folder (no metrics.jsonl) and holds none: pass trainer.out_dir "
                                    f"folders or a sweep's out_root.")
        found += [r for r in runs if r not in found]
    return found


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:
        return {}


def load_run(path: str | Path) -> RunData:
    """Reads a run folder: metrics.jsonl, config.json and (from a sweep) cell.json."""
    path = Path(path)
    config = _read_json(path / "config.json")
    cell = _read_json(path / "cell.json")
    labels = {k: v for k, v in cell.get("labels", {}).items() if k != "seed"}
    seed = cell.get("labels", {}).get("seed", config.get("trainer", {}).get("seed"))
    return RunData(path=path, records=read_metrics(path), config=config, labels=labels, seed=seed,
                   index=cell.get("index") if cell else None)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict) and v and k != "overrides":
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


def _plain(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def group_arms(runs: Sequence[RunData]) -> list[Arm]:
    """Runs -> arms: by sweep labels when the run has a cell.json, else by config minus the
    seed-like keys. Sweep arms come in grid order, then the others in input order. A plain
    arm is labelled by the config keys in which the plain arms differ (or its folder's name)."""
    groups: dict = {}
    for run in runs:
        if run.labels or run.index is not None:
            key = ("cell", tuple(run.labels.items()))
        else:
            flat = {k: v for k, v in _flatten(run.config).items() if k not in SEED_LIKE_KEYS}
            key = ("config", json.dumps(flat, sort_keys=True, default=str))
        groups.setdefault(key, []).append(run)
    keys = list(groups)
    plain = [k for k in keys if k[0] == "config"]
    flats = {k: json.loads(k[1]) for k in plain}
    varying = sorted({name for k in plain for name in flats[k] if any(flats[j].get(name) != flats[k].get(name) for j in plain)})
    arms = []
    for key in keys:
        members = groups[key]
        if key[0] == "cell":
            label = "/".join(str(v) for v in dict(key[1]).values()) or members[0].path.parent.name
        elif varying:
            label = ", ".join(f"{n}={_plain(flats[key].get(n))}" for n in varying)
        else:
            label = members[0].path.parent.name if members[0].path.name.startswith("seed") else members[0].path.name
        arms.append(Arm(label=label, runs=sorted(members, key=lambda r: (r.seed is None, r.seed or 0, str(r.path)))))
    order = {id(a): (0, min(r.index for r in a.runs if r.index is not None)) if any(r.index is not None for r in a.runs)
             else (1, i) for i, a in enumerate(arms)}
    arms.sort(key=lambda a: order[id(a)])
    seen: dict = {}
    for arm in arms:  # two arms with one label (e.g. two grids): keep both, told apart
        seen[arm.label] = seen.get(arm.label, 0) + 1
        if seen[arm.label] > 1:
            arm.label = f"{arm.label} ({seen[arm.label]})"
    return arms


def curve(arm: Arm, key: str) -> tuple[list, list]:
    """(steps, [Interval over the arm's runs at each step]) of a metric; steps where any run logged it."""
    per_run = [r.series(key) for r in arm.runs]
    steps = sorted({s for series in per_run for s in series})
    return steps, [mean_interval([series[s] for series in per_run if s in series]) for s in steps]


def final_values(arm: Arm, key: str) -> tuple[list, list, list]:
    """Each run's last logged value of `key` after step 0 (the evaluation before training is
    no final result): (values, steps, seeds), runs without one left out."""
    values, steps, seeds = [], [], []
    for run in arm.runs:
        series = {s: v for s, v in run.series(key).items() if s > 0}
        if series:
            last = max(series)
            values.append(series[last])
            steps.append(last)
            seeds.append(run.seed)
    return values, steps, seeds


def tail_mean(run: RunData, key: str, fraction: float = 0.1) -> float | None:
    """Mean of a training metric over the run's last `fraction` of logged steps (>= 1 step, step 0 excluded)."""
    series = {s: v for s, v in run.series(key).items() if s > 0}
    if not series:
        return None
    steps = sorted(series)
    window = steps[-max(1, round(len(steps) * fraction)):]
    return sum(series[s] for s in window) / len(window)


def most_clipped(arm: Arm, k: int = 10) -> list[tuple[str, int]]:
    """The k tokens most clipped over the arm's runs: `most_clipped_tokens` counts summed over runs and steps."""
    counts: dict = {}
    for run in arm.runs:
        for record in run.records:
            for token, count in record.get("most_clipped_tokens") or []:
                counts[token] = counts.get(token, 0) + int(count)
    return sorted(counts.items(), key=lambda tc: (-tc[1], tc[0]))[:k]


def benchmarks(runs: Sequence[RunData]) -> list[str]:
    """The held-out accuracy keys logged by any run: eval/<set>/accuracy for each set, then the
    mean eval/accuracy when there are several sets (with one set it is that set's)."""
    keys = sorted({k for r in runs for rec in r.records for k in rec if re.fullmatch(r"eval/.+/accuracy", k)})
    has_mean = any("eval/accuracy" in rec for r in runs for rec in r.records)
    return keys + (["eval/accuracy"] if has_mean and len(keys) != 1 else [])


# ----------------------------------------------------------------------------- formatting


def _pct(x: float) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{100 * x:.1f}%"


def _pp(x: float, sign: bool = True) -> str:
    return "n/a" if math.isnan(x) else f"{100 * x:+.1f}" if sign else f"{100 * x:.1f}"


def _num(x: float | None) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:.4g}"


def _interval(iv: Interval, fmt, bounds: tuple[float, float] | None = None) -> str:
    """`mean [low, high]`, the interval clipped to `bounds` (an accuracy's [0, 1]) if given."""
    if iv.n == 0:
        return "n/a"
    if iv.n < 2:
        return f"{fmt(iv.mean)} (n=1, no interval)"
    low, high = (max(iv.low, bounds[0]), min(iv.high, bounds[1])) if bounds else (iv.low, iv.high)
    return f"{fmt(iv.mean)} [{fmt(low)}, {fmt(high)}]"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|",
            *["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]]


def significance_words(n_arm: int, n_base: int, p: float) -> str:
    """The plain-words verdict of a comparison at the seeds given (p < ALPHA)."""
    if min(n_arm, n_base) < 2:
        return f"n too small to test (n={n_arm} vs {n_base}; needs >= 2 seeds per arm)"
    if math.isnan(p):
        return "n/a"
    few = f" (only {min(n_arm, n_base)} seeds: low power)" if min(n_arm, n_base) < 3 else ""
    return (f"yes, p < {ALPHA}" if p < ALPHA else "no: not detectable at these seeds") + few


def _slug(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", key).strip("_")


# ----------------------------------------------------------------------------- plots and report


def plot_curve(arms: Sequence[Arm], key: str, title: str, path: Path) -> bool:
    """One PNG of `key` over steps: per arm the mean over seeds and a shaded 95% t-interval
    (where >= 2 runs logged the step); returns False (and draws nothing) when no run has `key`."""
    curves = [(arm, *curve(arm, key)) for arm in arms]
    if not any(steps for _, steps, _ in curves):
        return False
    from matplotlib.figure import Figure  # no pyplot: the caller's backend (a notebook's) is left alone

    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    for arm, steps, ivs in curves:
        if not steps:
            continue
        means = [iv.mean for iv in ivs]
        line, = ax.plot(steps, means, marker="o" if len(steps) < 12 else None, markersize=3,
                        label=f"{arm.label} (n={len(arm.runs)})")
        band = [(s, iv.low, iv.high) for s, iv in zip(steps, ivs) if iv.n >= 2]
        if band:
            xs, lo, hi = zip(*band)
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_title(f"{title}\nmean over seeds, shaded: 95% t-interval", fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    return True


def _accuracy_section(arms: Sequence[Arm], bench: str, baseline: Arm) -> list[str]:
    name = "all eval sets (mean)" if bench == "eval/accuracy" else bench[len("eval/"):-len("/accuracy")]
    lines = [f"### {name}", ""]
    rows, notes = [], []
    for arm in arms:
        values, steps, seeds = final_values(arm, bench)
        if not values:
            rows.append([arm.label, "0", "n/a", "", "", ""])
            continue
        start = [r.series(bench).get(0) for r in arm.runs]
        start = [v for v in start if v is not None]
        step_text = str(steps[0]) if len(set(steps)) == 1 else f"{min(steps)}-{max(steps)}"
        if len(set(steps)) > 1:
            notes.append(f"{arm.label}: its runs' last evaluations are at different steps ({step_text}): some runs are unfinished.")
        rows.append([arm.label, str(len(values)), _interval(mean_interval(values), _pct, (0.0, 1.0)),
                     _interval(mean_interval(start), _pct, (0.0, 1.0)) if start else "n/a", step_text,
                     ", ".join(f"{_pct(v)} (seed {s})" for v, s in zip(values, seeds))])
    lines += _table(["arm", "n", "final accuracy, mean [95% CI]", "at step 0", "final step", "per seed"], rows)
    lines += [""] + [f"- {n}" for n in notes] + ([""] if notes else [])
    base_values = final_values(baseline, bench)[0]
    rows = []
    for arm in arms:
        if arm is baseline:
            continue
        values = final_values(arm, bench)[0]
        c = welch_test(base_values, values)
        rows.append([arm.label, f"{c.n_b} vs {c.n_a}", _pp(c.diff),
                     "n/a" if math.isnan(c.low) else f"[{_pp(c.low)}, {_pp(c.high)}]",
                     "n/a" if math.isnan(c.p_value) else f"{c.p_value:.3g}", significance_words(c.n_b, c.n_a, c.p_value)])
    if rows:
        lines += [f"Against the baseline **{baseline.label}** (difference of final accuracy, arm minus baseline, in "
                  f"percentage points):", ""]
        lines += _table(["arm", "seeds (arm vs baseline)", "difference (pp)", "95% CI (pp)", "p (Welch t-test)",
                         "significant at the seeds given?"], rows)
        lines.append("")
    return lines


def build_report(arms: Sequence[Arm], baseline: Arm, plots: Sequence[tuple[str, str]],
                 predictions: Sequence[Prediction] = ()) -> str:
    """The markdown text of the report (plots: (title, PNG file name) pairs, next to report.md;
    predictions: pre-registered comparisons, judged in their own section)."""
    runs = [r for a in arms for r in a.runs]
    lines = ["# Study report", "",
             f"{len(runs)} runs in {len(arms)} arms, generated {time.strftime('%Y-%m-%d %H:%M')} by `jaxrl4llm report`. "
             f"An arm is a set of runs that differ only by seed; intervals are 95% Student t intervals over its seeds "
             f"(none with n=1; an accuracy's interval is clipped to [0%, 100%]). Baseline arm: **{baseline.label}**.", ""]
    lines += _table(["arm", "n (seeds)", "preset", "steps"], [
        [a.label, f"{len(a.runs)} ({', '.join(str(r.seed) for r in a.runs)})",
         ", ".join(sorted({str(r.config.get("algorithm", {}).get("preset", "?")) for r in a.runs})),
         ", ".join(sorted({str(r.configured_steps) for r in a.runs}))] for a in arms])
    lines.append("")
    for a in arms:
        seeds = [r.seed for r in a.runs]
        if len(set(seeds)) < len(seeds):
            lines.append(f"- Warning: arm {a.label} holds several runs with the same seed ({seeds}): repeats are not "
                         f"independent seeds.")
    unfinished = [r for r in runs if r.configured_steps and r.last_step < r.configured_steps]
    if unfinished:
        lines += [f"- Warning: {len(unfinished)} run(s) stopped before their last step; their last logged values are "
                  f"used: {', '.join(str(r.path) for r in unfinished)}", ""]

    lines += predictions_section(judge(predictions, runs))
    lines += ["## Held-out accuracy", ""]
    benches = benchmarks(runs)
    if not benches:
        lines += ["No held-out evaluation was logged (data.eval_files empty or trainer.eval_every=-1).", ""]
    for bench in benches:
        lines += _accuracy_section(arms, bench, baseline)
    if benches and len(arms) > 1:
        lines += [f"Reading the comparisons: p is the Welch t-test's two-sided p-value; \"yes\" means p < {ALPHA}. "
                  f"\"no\" means the difference is not detectable with these seeds, not that the arms are equal: "
                  f"with 3 seeds only differences several times the seed-to-seed spread are detected. "
                  f"p-values are not corrected for multiple comparisons ({(len(arms) - 1) * len(benches)} here).", ""]

    lines += ["## Training metrics at the end", "",
              "Each run's mean over its last 10% of steps, then mean [95% CI] over the arm's seeds.", ""]
    present = [k for k in FINAL_METRICS if any(r.series(k) for r in runs)]
    rows = []
    for a in arms:
        cells = []
        for k in present:
            vals = [v for v in (tail_mean(r, k) for r in a.runs) if v is not None]
            cells.append(_interval(mean_interval(vals), _num))
        rows.append([a.label, str(len(a.runs)), *cells])
    lines += _table(["arm", "n", *present], rows) + [""]

    clipped = [(a.label, most_clipped(a)) for a in arms]
    if any(top for _, top in clipped):
        lines += ["## Most clipped tokens", "",
                  "The decoded tokens most often clipped in the updates (`most_clipped_tokens`, logged every "
                  "`trainer.clipped_tokens_every` steps), counts summed over the arm's runs and logged steps.", ""]
        lines += _table(["arm", "tokens (count)"], [[label, ", ".join(f"{json.dumps(t)} ({c})" for t, c in top) or "none"]
                                                     for label, top in clipped]) + [""]

    if plots:
        lines += ["## Curves", ""]
        for title, name in plots:
            lines += [f"### {title}", "", f"![{title}]({name})", ""]

    lines += ["## Runs", ""]
    lines += _table(["run", "arm", "seed", "steps logged / configured"], [
        [str(r.path), a.label, str(r.seed), f"{r.last_step} / {r.configured_steps if r.configured_steps else '?'}"]
        for a in arms for r in a.runs])
    return "\n".join(lines) + "\n"


def write_report(run_dirs: Sequence[str | Path], out: str | Path = "report", *, baseline: str | None = None,
                 plots: bool = True, prediction_grids: Sequence[str | Path] = ()) -> Path:
    """Reads the runs, groups them into arms, draws the curves (unless plots=False) and writes
    OUT/report.md; returns its path. baseline: the label of the arm the others are compared
    with (default: the first arm). prediction_grids: grid files whose `predictions:` the report
    judges (study/predictions.py)."""
    predictions = read_predictions(prediction_grids)
    arms = group_arms([load_run(p) for p in find_run_dirs(run_dirs)])
    if baseline is None:
        base = arms[0]
    else:
        matches = [a for a in arms if a.label == baseline]
        if not matches:
            raise ConfigError(f"--baseline {baseline!r} is not an arm; the arms are: {', '.join(a.label for a in arms)}.")
        base = matches[0]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [r for a in arms for r in a.runs]
    curve_keys = list(CURVES)
    if len([b for b in benchmarks(runs) if b != "eval/accuracy"]) > 1:  # several eval sets: one curve each too
        curve_keys[2:2] = [(b, f"held-out accuracy: {b[5:-9]}") for b in benchmarks(runs) if b != "eval/accuracy"]
    plots = [(title, f"{_slug(key)}.png") for key, title in curve_keys
             if plots and plot_curve(arms, key, title, out / f"{_slug(key)}.png")]
    path = out / "report.md"
    path.write_text(build_report(arms, base, plots, predictions))
    return path

"""Training curves of one or more runs, overlaid, to one PNG (`jaxrl4llm plot RUN_DIR ...`)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from jaxrl4llm.train.metrics import read_metrics

# The study's panel: what learns, what it costs, and what goes wrong.
DEFAULT_METRICS = (
    "reward", "eval/accuracy", "response_length", "entropy",
    "clip_frac", "truncation_rate", "grad_norm", "approx_kl",
)


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path | None = None, *, metrics: Sequence[str] | None = None) -> Path:
    """Draws each metric (one panel) for every run (one line each); returns the PNG path."""
    # a Figure of its own (no pyplot): the caller's backend (a notebook's inline one) is left alone
    from matplotlib.figure import Figure

    metrics = list(metrics or DEFAULT_METRICS)
    runs = [(Path(d).name or str(d), read_metrics(d)) for d in run_dirs]
    cols = 4
    rows = -(-len(metrics) // cols)
    fig = Figure(figsize=(4 * cols, 3 * rows))
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, metric in zip(axes.flat, metrics):
        for name, records in runs:
            pts = [(r["step"], r[metric]) for r in records if isinstance(r.get(metric), (int, float))]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o" if len(xs) < 20 else None, markersize=3, label=name)
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(metrics):]:
        ax.axis("off")
    if len(runs) > 1:
        axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    out = Path(out) if out else Path(run_dirs[0]) / "curves.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    return out

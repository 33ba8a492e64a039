"""The end-of-run table printed on the terminal: steps, time, reward, response length, and the
held-out accuracy before -> after on one line."""

from __future__ import annotations


def format_run_table(history: list[dict], *, every: int = 1, start_step: int = 0) -> str:
    """One line every `every` steps (and the last); a record's step is its "step" (records read
    from metrics.jsonl) or start_step + its place (a resumed run's history starts after it)."""
    lines = [f"{'step':>5} {'time(s)':>8} {'reward':>7} {'resp_len':>8} {'clip':>6} {'entropy':>8}"]
    elapsed = 0.0
    for i, r in enumerate(history):
        elapsed += r.get("time_step", 0.0)
        if (i + 1) % every and i != len(history) - 1:
            continue
        lines.append(f"{r.get('step', start_step + i + 1):>5} {elapsed:>8.1f} {r.get('reward', float('nan')):>7.3f} {r.get('response_length', float('nan')):>8.1f} "
                     f"{r.get('clip_frac', float('nan')):>6.3f} {r.get('entropy', float('nan')):>8.3f}")
    return "\n".join(lines)


def accuracy_line(before: dict | None, after: dict | None) -> str | None:
    if not before or not after or "accuracy" not in before or "accuracy" not in after:
        return None
    return f"held-out accuracy: {100 * before['accuracy']:.1f}% -> {100 * after['accuracy']:.1f}%"


def print_run_report(summary: dict, *, every: int | None = None) -> None:
    history = summary.get("history", [])
    if history:
        print(format_run_table(history, every=every or max(1, len(history) // 15), start_step=summary.get("start_step", 0)))
    line = accuracy_line(summary.get("eval_before"), summary.get("eval_after"))
    if line:
        print(line)
    print(f"run directory: {summary.get('out_dir')}")
    if summary.get("export_dir"):
        print(f"exported policy (Hugging Face format): {summary['export_dir']}")

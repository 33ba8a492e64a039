"""Run metrics: JSON lines + TensorBoard event files + a terminal progress bar, and the study's
diagnostics (repetition of truncated responses, most-clipped tokens).
"""

from __future__ import annotations

import collections
import json
import math
import time
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np


LENGTHS_FILE = "response_lengths.jsonl"  # per-row lengths of every step; `jaxrl4llm plan --response-lengths RUN`


def write_lengths(out_dir: str | Path, step: int, response_lengths, prompt_lengths=None) -> None:
    """Appends one step's per-row token counts to `<run>/response_lengths.jsonl`:
    {"step": s, "response_lengths": [...], "prompt_lengths": [...]} (a resumed step's line is rewritten
    by appending; readers keep each step's last line)."""
    record = {"step": int(step), "response_lengths": [int(x) for x in response_lengths]}
    if prompt_lengths is not None:
        record["prompt_lengths"] = [int(x) for x in prompt_lengths]
    with open(Path(out_dir) / LENGTHS_FILE, "a") as f:
        f.write(json.dumps(record) + "\n")


def repetition_score(tokens: Sequence[int], n: int = 4) -> float:
    """1 - (distinct n-grams / n-grams) of a token sequence: 0 for no repeats, -> 1 for a loop."""
    if len(tokens) < n + 1:
        return 0.0
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams)


def truncated_repeat_ratio(responses: Iterable[Sequence[int]], truncated: Sequence[bool], *, n: int = 4,
                           threshold: float = 0.5) -> float:
    """Fraction of truncated responses whose repetition_score exceeds `threshold` (the study's
    diagnostic: most overlong responses are degenerate repetition, not long reasoning).
    Returns 0.0 when no response was truncated."""
    flags = [repetition_score(list(r), n) > threshold for r, t in zip(responses, truncated) if t]
    return float(np.mean(flags)) if flags else 0.0


def most_clipped_tokens(tokens: np.ndarray, clipped: np.ndarray, decode, k: int = 10) -> list[tuple[str, int]]:
    """The k token strings most often clipped in an update ([B, L] ids and flags), with counts."""
    ids = tokens[np.asarray(clipped, bool)]
    counts = collections.Counter(ids.tolist()).most_common(k)
    return [(decode([i]), c) for i, c in counts]


class MetricsWriter:
    """Appends one JSON object per step to OUT/metrics.jsonl and scalars to TensorBoard (OUT/tb).

    enabled=False (every process but the first of a multi-host run): writes nothing."""

    def __init__(self, out_dir: str | Path, *, total_steps: int, progress_bar: bool = True, start_step: int = 0,
                 enabled: bool = True):
        self.enabled = enabled
        self._tb = self._bar = None
        if not enabled:
            return
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        self._tb = None
        try:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.out_dir / "tb"))
        except Exception:  # TensorBoard is optional at run time; JSON lines always work.
            self._tb = None
        self._bar = None
        if progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True, leave=True)

    def truncate_after(self, step: int) -> None:
        """On resume, drop lines of steps > step written after the last checkpoint."""
        if not self.enabled or not self.path.exists():
            return
        keep = [line for line in self.path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= step]
        self.path.write_text("".join(line + "\n" for line in keep))

    def write(self, step: int, metrics: dict, *, advance: bool = True) -> None:
        if not self.enabled:
            return
        clean = {k: _plain(v) for k, v in metrics.items()}
        clean["step"] = step
        clean["time"] = time.time()
        with self.path.open("a") as f:
            f.write(json.dumps(clean, sort_keys=True) + "\n")
        if self._tb is not None:
            for k, v in clean.items():
                if isinstance(v, (int, float)) and k not in ("step", "time") and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._bar is not None and advance:
            self._bar.update(1)
            shown = {k: clean[k] for k in ("reward", "response_length", "loss", "entropy") if k in clean}
            self._bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()})

    def close(self) -> None:
        """Closes the progress bar and TensorBoard's writer (once; later calls do nothing). Call it
        before the program ends: an open TensorBoard writer closes at exit by starting a thread,
        which Python 3.12 refuses there ("can't create new thread at interpreter shutdown")."""
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        self._tb = self._bar = None


def _plain(v):
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (str, bool, int)) or v is None:
        return v
    try:
        return float(np.asarray(v))
    except (TypeError, ValueError):
        return str(v)


def read_metrics(run_dir: str | Path) -> list[dict]:
    """All JSON-lines records of a run directory."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a jaxrl4llm run directory (trainer.out_dir)?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

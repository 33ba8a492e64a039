"""Run metrics: JSON lines, the loggers of `trainer.loggers` (TensorBoard, Weights & Biases, MLflow),
a terminal progress bar and logged rollouts (samples.jsonl), and the study's diagnostics
(repetition of truncated responses, most-clipped tokens).

    check_loggers(cfg.trainer.loggers)             # before any work: a missing package names its extra
    loggers = open_loggers(cfg, files.dir, resume=True)   # W&B / MLflow continue the run of loggers.json
    writer = MetricsWriter(files.dir, total_steps=..., loggers=loggers)
    writer.write(step, record); writer.write_samples(step, rows); writer.close()

Console and metrics.jsonl are always on. A logger that fails during the run warns once and the
run goes on (metrics.jsonl stays the record).
"""

from __future__ import annotations

import collections
import importlib.util
import json
import math
import re
import time
import warnings
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from tqdm import tqdm

from jaxrl4llm.rewards.extraction import has_complete_box
from jaxrl4llm.train.config import ConfigError, RunConfig, config_to_dict


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


def is_loop(tokens: Sequence[int], n: int = 4, threshold: float = 0.5) -> bool:
    """A degenerate repetition: repetition_score(tokens, n) > threshold."""
    return repetition_score(list(tokens), n) > threshold


def truncated_repeat_ratio(responses: Iterable[Sequence[int]], truncated: Sequence[bool], *, n: int = 4,
                           threshold: float = 0.5) -> float:
    """Fraction of truncated responses that are loops (`is_loop`; the study's diagnostic: most
    overlong responses are degenerate repetition, not long reasoning). Returns 0.0 when no response
    was truncated."""
    flags = [is_loop(r, n, threshold) for r, t in zip(responses, truncated) if t]
    return float(np.mean(flags)) if flags else 0.0


def truncated_kinds(responses: Sequence[Sequence[int]], texts: Sequence[str], truncated: Sequence[bool], *,
                    n: int = 4, threshold: float = 0.5) -> dict[str, float]:
    """What the truncated responses are, as shares of them (0.0 each when none was truncated), each
    row scored once: `truncated_repeat_ratio` loops (`is_loop`), `truncated_boxed_ratio` cut after a
    complete boxed answer (a run-on into more text), `truncated_unfinished_ratio` neither: unfinished
    work."""
    kinds = [(is_loop(r, n, threshold), has_complete_box(t))
             for r, t, cut in zip(responses, texts, truncated) if cut]
    loop, boxed = (np.array([k[i] for k in kinds], bool) for i in (0, 1))
    share = lambda flags: float(flags.mean()) if kinds else 0.0
    return {"truncated_repeat_ratio": share(loop), "truncated_boxed_ratio": share(boxed),
            "truncated_unfinished_ratio": share(~loop & ~boxed)}


def length_cv(lengths: Sequence[int]) -> float:
    """Coefficient of variation of response lengths [N]: std / mean (0.0 for an empty or all-zero
    batch). Token- and sequence-level aggregation weight tokens alike when it is near 0."""
    lengths = np.asarray(lengths, np.float64)
    mean = lengths.mean() if lengths.size else 0.0
    return float(lengths.std() / mean) if mean > 0 else 0.0


def all_same_groups(rewards: Sequence[float], advantages: Sequence[float], group_size: int) -> tuple[float, float]:
    """(share of groups whose `group_size` rewards are all equal, share of sum |A| on their rows).

    rewards, advantages: [N], N = groups * group_size, a group's rows adjacent (the rollout's order).
    Group-mean advantages give such groups A = 0; batch-level normalisation does not (Tricks or
    Traps, Sec. 4.1): the second figure is the advantage mass spent where the group says nothing.
    Returns (0.0, 0.0) when N is not a multiple of group_size (a filtered batch).
    """
    rewards = np.asarray(rewards, np.float64)
    advantages = np.abs(np.asarray(advantages, np.float64))
    if group_size < 1 or rewards.size == 0 or rewards.size % group_size or advantages.shape != rewards.shape:
        return 0.0, 0.0
    grouped = rewards.reshape(-1, group_size)
    same = grouped.max(axis=1) == grouped.min(axis=1)
    total = advantages.sum()
    on_same = advantages.reshape(-1, group_size)[same].sum()
    return float(same.mean()), float(on_same / total) if total > 0 else 0.0


def most_clipped_tokens(tokens: np.ndarray, clipped: np.ndarray, decode, k: int = 10) -> list[tuple[str, int]]:
    """The k token strings most often clipped in an update ([B, L] ids and flags), with counts."""
    ids = tokens[np.asarray(clipped, bool)]
    counts = collections.Counter(ids.tolist()).most_common(k)
    return [(decode([i]), c) for i, c in counts]


LOGGERS_FILE = "loggers.json"  # the W&B / MLflow run ids of the run folder: a --resume continues those runs
SAMPLES_FILE = "samples.jsonl"  # trainer.log_samples rollouts a step (train/samples.py)
# config.LOGGERS (trainer.loggers' choices): name -> (the module it imports, how to install it)
LOGGER_PACKAGES = {
    "tensorboard": ("tensorboardX", "pip install tensorboardX (a dependency of jaxrl4llm: reinstall it)"),
    "wandb": ("wandb", "pip install 'jaxrl4llm[wandb]'"),
    "mlflow": ("mlflow", "pip install 'jaxrl4llm[mlflow]'"),
}


def teacher_curve(record: dict) -> dict:
    """A step record with on-policy distillation's position curve finished: the update's
    `teacher_kl_by_position/k` and `teacher_tokens_by_position/k` (each bin's sum of d_t and its
    tokens, both over the step's counted tokens: `train.step.distill_batch`) become
    `teacher_kl_by_position/k`, the mean d_t of bin k (0 for an empty bin), and
    `teacher_tokens_by_position/k`, the bin's share of the tokens. A record without them is returned as it is."""
    out = dict(record)
    for key in [k for k in record if k.startswith("teacher_kl_by_position/")]:
        share = record[key.replace("teacher_kl_", "teacher_tokens_", 1)]
        out[key] = record[key] / share if share > 0 else 0.0
    return out


def check_loggers(names: Sequence[str]) -> None:
    """A ConfigError for a logger of `trainer.loggers` that is not one of LOGGER_PACKAGES or whose
    package is not installed (looked up, not imported: milliseconds), naming the install command."""
    for name in names:
        if name not in LOGGER_PACKAGES:
            raise ConfigError(f"trainer.loggers: {name!r} is not a logger; choose from {', '.join(LOGGER_PACKAGES)} "
                              f"(console and metrics.jsonl are always on).")
        module, install = LOGGER_PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"trainer.loggers includes {name}, but the {module} package is not installed: {install}, "
                              f"or remove {name} from trainer.loggers.")


def run_name(cfg: RunConfig) -> str:
    """The W&B / MLflow run name: trainer.experiment_name, else the run folder's name."""
    return cfg.trainer.experiment_name or Path(str(cfg.trainer.out_dir).rstrip("/")).name


class TensorBoardLogger:
    """Scalars and a markdown table of the samples as TensorBoard events in OUT/tb (tensorboardX)."""

    name = "tensorboard"

    def __init__(self, out_dir: Path):
        from tensorboardX import SummaryWriter

        self.writer = SummaryWriter(str(out_dir / "tb"))

    def ids(self) -> dict:
        return {}

    def log_metrics(self, step: int, scalars: dict) -> None:
        for k, v in scalars.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def log_samples(self, step: int, rows: list[dict]) -> None:
        columns = list(rows[0])
        cell = lambda v: str(v).replace("|", "\\|").replace("\n", "<br>")
        table = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
        table += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]
        self.writer.add_text("samples", "\n".join(table), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    """A Weights & Biases run (project trainer.project_name, name `run_name`): the config, the scalars
    at their step, the samples as a `wandb.Table` ("samples"). run_id: the run to continue (resume)."""

    name = "wandb"

    def __init__(self, *, project: str, name: str, config: dict, run_id: str | None):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=project, name=name, id=run_id, resume="allow" if run_id else None)
        self.run.config.update(config, allow_val_change=True)  # a resume's config may differ (config_changes.jsonl)

    def ids(self) -> dict:
        return {"run_id": self.run.id, "project": self.run.project}

    def log_metrics(self, step: int, scalars: dict) -> None:
        self.run.log(scalars, step=step)

    def log_samples(self, step: int, rows: list[dict]) -> None:
        columns = list(rows[0])
        data = [[row.get(c) if isinstance(row.get(c), (str, int, float, bool, type(None))) else json.dumps(row.get(c))
                 for c in columns] for row in rows]
        self.run.log({"samples": self.wandb.Table(columns=columns, data=data)}, step=step)

    def close(self) -> None:
        self.run.finish()


def mlflow_key(name: str) -> str:
    """A metric name MLflow accepts: characters other than letters, digits, _ - . / : and space
    become _ (eval/test/pass@1 -> eval/test/pass_1)."""
    return re.sub(r"[^\w\-./: ]", "_", name)


class MlflowLogger:
    """An MLflow run (experiment trainer.project_name, name `run_name`) on MLflow's tracking URI
    (MLFLOW_TRACKING_URI): the config as params ("section.key"), the scalars at their step
    (names through `mlflow_key`), the samples as the artifact samples/step_<step>.jsonl.
    run_id: the run to continue (resume); its params are not logged again (MLflow keeps the first)."""

    name = "mlflow"

    def __init__(self, *, project: str, name: str, config: dict, run_id: str | None):
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.metric = Metric
        self.client = MlflowClient()
        if run_id is not None:
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            return
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in _flat(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params a call
            self.client.log_batch(self.run_id, params=params[i: i + 100])

    def ids(self) -> dict:
        return {"run_id": self.run_id}

    def log_metrics(self, step: int, scalars: dict) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self.metric(mlflow_key(k), float(v), now, step)
                                                    for k, v in scalars.items()])

    def log_samples(self, step: int, rows: list[dict]) -> None:
        self.client.log_text(self.run_id, "".join(json.dumps(r) + "\n" for r in rows), f"samples/step_{step:06d}.jsonl")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flat(tree: dict, prefix: str = "") -> dict:
    """{"trainer": {"steps": 3}} -> {"trainer.steps": 3}."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def open_loggers(cfg: RunConfig, out_dir: str | Path, *, resume: bool) -> list:
    """The loggers of cfg.trainer.loggers, started (call on process 0 only). With `resume`, W&B and
    MLflow continue the runs whose ids OUT/loggers.json holds (a logger without one starts a run);
    the ids are written back. The resolved config is each run's config / params.
    A logger that cannot start (W&B not logged in, MLflow's store unreachable) is a ConfigError."""
    check_loggers(cfg.trainer.loggers)
    out_dir = Path(out_dir)
    path = out_dir / LOGGERS_FILE
    known = json.loads(path.read_text()) if resume and path.is_file() else {}
    config, name, project = config_to_dict(cfg), run_name(cfg), cfg.trainer.project_name
    loggers = []
    for kind in cfg.trainer.loggers:
        try:
            if kind == "tensorboard":
                loggers.append(TensorBoardLogger(out_dir))
            elif kind == "wandb":
                loggers.append(WandbLogger(project=project, name=name, config=config,
                                           run_id=known.get("wandb", {}).get("run_id")))
            else:
                loggers.append(MlflowLogger(project=project, name=name, config=config,
                                            run_id=known.get("mlflow", {}).get("run_id")))
        except Exception as e:
            for started in loggers:
                started.close()
            hint = {"wandb": " (`wandb login`, or WANDB_MODE=offline)",
                    "mlflow": " (MLFLOW_TRACKING_URI: a tracking server http://HOST:PORT, or file:///PATH/mlruns with "
                              "MLFLOW_ALLOW_FILE_STORE=true; a sqlite:// store needs the full mlflow package)"}
            raise ConfigError(f"trainer.loggers: {kind} could not start{hint.get(kind, '')}: "
                              f"{type(e).__name__}: {e}") from e
    ids = {**known, **{lg.name: lg.ids() for lg in loggers if lg.ids()}}
    if ids:
        out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(ids, indent=1))
    return loggers


class MetricsWriter:
    """Appends one JSON object per step to OUT/metrics.jsonl, the step's scalars to each logger
    (`open_loggers`), the step's sample rollouts to OUT/samples.jsonl and the loggers.

    enabled=False (every process but the first of a multi-host run): writes nothing. A logger
    that raises warns once (RuntimeWarning) and is called again at the next step: the run goes on."""

    def __init__(self, out_dir: str | Path, *, total_steps: int, progress_bar: bool = True, start_step: int = 0,
                 enabled: bool = True, loggers: Sequence = ()):
        self.enabled = enabled
        self.loggers = list(loggers) if enabled else []
        self._failed: set[str] = set()
        self._bar = None
        if not enabled:
            return
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        self.samples_path = self.out_dir / SAMPLES_FILE
        if progress_bar:
            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True, leave=True)

    def truncate_after(self, step: int) -> None:
        """On resume, drop the lines (metrics and samples) of steps > step written after the last checkpoint."""
        if not self.enabled:
            return
        for path in (self.path, self.samples_path):
            if path.exists():
                keep = [line for line in path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= step]
                path.write_text("".join(line + "\n" for line in keep))

    def _each_logger(self, method: str, *args) -> None:
        for logger in self.loggers:
            try:
                getattr(logger, method)(*args)
            except Exception as e:  # a logger never stops the run: metrics.jsonl holds every step
                if logger.name not in self._failed:
                    self._failed.add(logger.name)
                    warnings.warn(f"trainer.loggers: {logger.name} failed ({type(e).__name__}: {e}); training goes "
                                  f"on, metrics.jsonl has every step (this warning is shown once).", RuntimeWarning,
                                  stacklevel=3)

    def write(self, step: int, metrics: dict, *, advance: bool = True) -> None:
        if not self.enabled:
            return
        clean = {k: _plain(v) for k, v in metrics.items()}
        clean["step"] = step
        clean["time"] = time.time()
        with self.path.open("a") as f:
            f.write(json.dumps(clean, sort_keys=True) + "\n")
        self._each_logger("log_metrics", step, logged_scalars(clean))
        if self._bar is not None and advance:
            self._bar.update(1)
            shown = {k: clean[k] for k in ("reward", "response_length", "loss", "entropy") if k in clean}
            self._bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()})

    def write_samples(self, step: int, rows: list[dict]) -> None:
        """Appends `rows` (train/samples.py: one dict per logged rollout) to OUT/samples.jsonl, each
        with "step", and gives them to the loggers as one table of the step."""
        if not self.enabled or not rows:
            return
        rows = [{"step": step, **_plain(row)} for row in rows]
        with self.samples_path.open("a") as f:
            f.write("".join(json.dumps(row) + "\n" for row in rows))
        self._each_logger("log_samples", step, rows)

    def close(self) -> None:
        """Closes the progress bar and the loggers (once; later calls do nothing). Call it before
        the program ends: an open TensorBoard writer closes at exit by starting a thread, which
        Python 3.12 refuses there ("can't create new thread at interpreter shutdown")."""
        if self._bar is not None:
            self._bar.close()
        self._bar = None
        self._each_logger("close")
        self.loggers = []


def logged_scalars(record: dict) -> dict:
    """What the loggers get of a metrics.jsonl record: its finite numbers, less step and time."""
    return {k: v for k, v in record.items()
            if isinstance(v, (int, float)) and k not in ("step", "time") and math.isfinite(v)}


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

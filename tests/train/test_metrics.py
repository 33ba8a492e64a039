"""train/metrics.py: the loggers of trainer.loggers (TensorBoard, W&B offline, MLflow on a file
store) log what metrics.jsonl holds, a resume continues the same W&B / MLflow run, a missing
package or a logger that cannot start is an error before any work, a logger failing mid-run
warns once and the run goes on."""

from __future__ import annotations

import glob
import shutil
import importlib.util
import json
import struct
import warnings

import pytest

from jaxrl4llm.train.config import LOGGERS, ConfigError, load_config
from jaxrl4llm.train.metrics import (LOGGER_PACKAGES, LOGGERS_FILE, SAMPLES_FILE, MetricsWriter, check_loggers, logged_scalars,
                                     mlflow_key, open_loggers, read_metrics)


@pytest.fixture
def offline_loggers(tmp_path, monkeypatch):
    """W&B offline in tmp_path/wandb, MLflow on a file store in tmp_path/mlruns; nothing reaches the network."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    for setting in ("WANDB_X_SAVE_REQUIREMENTS", "WANDB_X_DISABLE_STATS", "WANDB_X_DISABLE_META"):  # seconds a run
        monkeypatch.setenv(setting, "false" if "SAVE" in setting else "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path}/mlruns")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    import wandb

    wandb.teardown()  # wandb reads its environment once a process: this test's WANDB_DIR, not an earlier test's
    yield tmp_path
    wandb.teardown()


def wandb_history(wandb_dir, run_id: str) -> dict[int, dict]:
    """{step: {key: value}} of every offline run file of W&B run `run_id` (a resumed run writes a
    second file): the records of a .wandb file (a LevelDB-style log of 32 KiB blocks, 7-byte
    record headers: crc32, length, type; after a 7-byte file header) parsed as wandb's protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    history: dict[int, dict] = {}
    # offline-run-<time>-<id>, and <...>-1 for a run resumed within the same second
    files = sorted(glob.glob(f"{wandb_dir}/wandb/offline-run-*-{run_id}*/run-{run_id}.wandb"))
    for path in files:
        data = open(path, "rb").read()
        assert data[:4] == b":W&B"
        pos, block, chunks = 7, 32768, b""
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # a block's tail too short for a header is padding
                pos += block - pos % block
                continue
            _, length, kind = struct.unpack("<IHB", data[pos: pos + 7])
            chunk, pos = data[pos + 7: pos + 7 + length], pos + 7 + length
            if kind == 0:
                continue
            chunks = chunk if kind in (1, 2) else chunks + chunk  # full / first start a record
            if kind in (1, 4):  # full / last end it
                record = wandb_internal_pb2.Record()
                record.ParseFromString(chunks)
                if record.WhichOneof("record_type") == "history":
                    items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                    history.setdefault(int(items["_step"]), {}).update(items)
    return history, len(files)


def _config(out, *loggers, **extra):
    overrides = [f"trainer.out_dir={out}", f"trainer.loggers=[{', '.join(loggers)}]", "trainer.project_name=tests",
                 *(f"{k}={v}" for k, v in extra.items())]
    return load_config(None, overrides)


def _records(step: int) -> dict:
    return {"reward": 0.25 * step, "loss": -1.5 / step, "eval/test/pass@1": 0.5, "most_clipped_tokens": [["a", 2]],
            "nan_metric": float("nan"), "sampling_draws": 1}


def test_wandb_and_mlflow_log_what_metrics_jsonl_holds_and_a_resume_continues_their_runs(offline_loggers):
    from mlflow.tracking import MlflowClient

    out = offline_loggers / "run"
    cfg = _config(out, "tensorboard", "wandb", "mlflow")
    writer = MetricsWriter(out, total_steps=3, progress_bar=False, loggers=open_loggers(cfg, out, resume=False))
    for step in (1, 2):
        writer.write_samples(step, [{"row": 0, "prompt": "1+1=", "response": "2", "reward": 1.0}])
        writer.write(step, _records(step))
    writer.close()
    ids = json.loads((out / LOGGERS_FILE).read_text())
    # the resume: the same runs continue (a fresh start's open_loggers(resume=False) would start new ones)
    writer = MetricsWriter(out, total_steps=3, progress_bar=False, start_step=2,
                           loggers=open_loggers(cfg, out, resume=True))
    writer.write(3, _records(3))
    writer.close()
    assert json.loads((out / LOGGERS_FILE).read_text()) == ids

    expected = {r["step"]: logged_scalars(r) for r in read_metrics(out)}
    assert sorted(expected) == [1, 2, 3] and "nan_metric" not in expected[1] and "most_clipped_tokens" not in expected[1]
    client = MlflowClient()
    run = client.get_run(ids["mlflow"]["run_id"])
    assert run.info.run_name == "run" and run.data.params["trainer.project_name"] == "tests"
    assert client.get_experiment(run.info.experiment_id).name == "tests"
    for key in expected[1]:
        assert {m.step: m.value for m in client.get_metric_history(run.info.run_id, mlflow_key(key))} == \
            {step: scalars[key] for step, scalars in expected.items()}, key
    assert [a.path for a in client.list_artifacts(run.info.run_id, "samples")] == \
        ["samples/step_000001.jsonl", "samples/step_000002.jsonl"]

    history, files = wandb_history(offline_loggers, ids["wandb"]["run_id"])
    assert files == 2  # the first run and its resume, one W&B run id
    assert {step: {k: v for k, v in h.items() if k in expected[step]} for step, h in history.items()} == expected
    assert history[1]["samples/_type"] == "table-file" and history[2]["samples/nrows"] == 1


def test_samples_jsonl_rows_carry_their_step_and_a_resume_drops_those_after_the_checkpoint(tmp_path):
    writer = MetricsWriter(tmp_path, total_steps=3, progress_bar=False)
    for step in (1, 2, 3):
        writer.write_samples(step, [{"row": i, "response": f"r{step}{i}"} for i in range(2)])
    writer.write_samples(4, [])  # trainer.log_samples=0: nothing written
    writer.truncate_after(2)
    rows = [json.loads(line) for line in (tmp_path / SAMPLES_FILE).read_text().splitlines()]
    assert rows == [{"step": s, "row": i, "response": f"r{s}{i}"} for s in (1, 2) for i in range(2)]


def test_a_missing_logger_package_is_an_error_that_names_its_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("wandb", "mlflow", "tensorboardX") else real(name, *a))
    for name, install in [("wandb", "pip install 'jaxrl4llm[wandb]'"), ("mlflow", "pip install 'jaxrl4llm[mlflow]'"),
                          ("tensorboard", "pip install tensorboardX")]:
        with pytest.raises(ConfigError, match=f"includes {name}, but the .* package is not installed") as e:
            check_loggers([name])
        assert install in str(e.value)
    check_loggers([])  # console and metrics.jsonl only


def test_loggers_config_keys_default_to_tensorboard_and_four_samples_and_refuse_unknown_names(tmp_path):
    assert tuple(LOGGER_PACKAGES) == LOGGERS  # every choice of the config has its package and install line
    cfg = load_config(None, [])
    assert cfg.trainer.loggers == ["tensorboard"] and cfg.trainer.log_samples == 4
    assert cfg.trainer.project_name == "jaxrl4llm" and cfg.trainer.experiment_name is None
    assert load_config(None, ["trainer.loggers=wandb"]).trainer.loggers == ["wandb"]
    with pytest.raises(ConfigError, match=r"trainer.loggers\[1\]='comet' is not allowed"):
        load_config(None, ["trainer.loggers=[tensorboard, comet]"])
    with pytest.raises(ConfigError, match="trainer.log_samples=-1 is out of range"):
        load_config(None, ["trainer.log_samples=-1"])


def test_a_logger_that_cannot_start_is_a_config_error_that_says_what_to_set(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path}/mlruns")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # MLflow 3 refuses a file store without it
    with pytest.raises(ConfigError, match="trainer.loggers: mlflow could not start .*MLFLOW_TRACKING_URI"):
        open_loggers(_config(tmp_path / "run", "tensorboard", "mlflow"), tmp_path / "run", resume=False)
    assert not (tmp_path / "run" / LOGGERS_FILE).exists()


class _Broken:
    name = "broken"

    def __init__(self):
        self.calls = 0

    def log_metrics(self, step, scalars):
        self.calls += 1
        raise ConnectionError("service unreachable")

    def close(self):
        raise ConnectionError("service unreachable")


def test_a_logger_failing_mid_run_warns_once_and_the_metrics_go_on(tmp_path):
    broken = _Broken()
    writer = MetricsWriter(tmp_path, total_steps=3, progress_bar=False, loggers=[broken])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in (1, 2, 3):
            writer.write(step, {"reward": float(step)})
        writer.close()
    assert [str(w.message) for w in caught] == [
        "trainer.loggers: broken failed (ConnectionError: service unreachable); training goes on, metrics.jsonl has "
        "every step (this warning is shown once)."]
    assert broken.calls == 3 and [r["reward"] for r in read_metrics(tmp_path)] == [1.0, 2.0, 3.0]


def test_a_resumed_training_run_logs_to_the_same_wandb_and_mlflow_runs(finished_run, offline_loggers):
    """The loop's wiring: `train --resume` reads loggers.json (here the runs a 2-step run would
    have started) and logs step 3 and its samples to those runs, as metrics.jsonl holds them."""
    from mlflow.tracking import MlflowClient

    from jaxrl4llm.cli import main as cli_main

    out = offline_loggers / "run"
    shutil.copytree(finished_run["out"], out)
    overrides = [f"trainer.out_dir={out}" if o.startswith("trainer.out_dir=") else o for o in finished_run["overrides"]]
    overrides += ["trainer.loggers=[tensorboard, wandb, mlflow]", "trainer.project_name=tests"]
    for logger in open_loggers(load_config(None, overrides), out, resume=False):
        logger.close()
    ids = json.loads((out / LOGGERS_FILE).read_text())
    assert cli_main(["train", *overrides, "trainer.steps=3", "--resume"]) == 0
    assert json.loads((out / LOGGERS_FILE).read_text()) == ids
    step3 = [logged_scalars(r) for r in read_metrics(out) if r["step"] == 3]  # the step, then the evaluation after it
    expected = {k: v for scalars in step3 for k, v in scalars.items()}
    assert "reward" in expected and "eval/accuracy" in expected
    client, run_id = MlflowClient(), ids["mlflow"]["run_id"]
    assert {k: client.get_metric_history(run_id, mlflow_key(k))[-1].value for k in expected} == expected
    assert [a.path for a in client.list_artifacts(run_id, "samples")] == ["samples/step_000003.jsonl"]
    history, files = wandb_history(offline_loggers, ids["wandb"]["run_id"])
    assert files == 2 and {k: v for k, v in history[3].items() if k in expected} == expected
    assert history[3]["samples/nrows"] == 4  # trainer.log_samples' default


def test_length_cv_and_all_same_groups():
    from jaxrl4llm.train.metrics import all_same_groups, length_cv

    assert length_cv([10, 10, 10]) == 0.0 and length_cv([]) == 0.0
    assert abs(length_cv([5, 15]) - 0.5) < 1e-12
    rewards = [1, 1, 1, 1, 0, 1, 0, 1, 0, 0, 0, 0]  # groups of 4: all-correct, mixed, all-wrong
    share, mass = all_same_groups(rewards, [0.0] * 4 + [-1, 1, -1, 1] + [0.0] * 4, 4)
    assert share == 2 / 3 and mass == 0.0  # group-mean advantages: nothing on the all-same groups
    share, mass = all_same_groups(rewards, [0.5] * 4 + [-1, 1, -1, 1] + [-1.0] * 4, 4)
    assert share == 2 / 3 and abs(mass - 6 / 10) < 1e-12  # batch-level: 6 of the 10 units on them
    assert all_same_groups(rewards[:10], [1.0] * 10, 4) == (0.0, 0.0)  # not whole groups


def test_truncated_rows_by_kind():
    from jaxrl4llm.train.metrics import has_complete_box, truncated_kinds, truncated_repeat_ratio

    assert has_complete_box(r"1+2=3 \boxed{3} 4+4=?") and not has_complete_box(r"1+2=3 \boxed{3")
    assert has_complete_box(r"\boxed{ \boxed{1} ") and not has_complete_box("7+5=12")
    texts = ["1+2=3 1+2=3 1+2=3 1+2=3 1+2=3", r"\boxed{3} 4+5=? 4+5=9", "1+2=3 3+4=7 7-", r"\boxed{3}"]
    rows = [list(t) for t in texts]
    truncated = [True, True, True, False]
    kinds = truncated_kinds(rows, texts, truncated)
    assert kinds["truncated_boxed_ratio"] == 1 / 3  # the run-on; the last row was not truncated
    assert kinds["truncated_unfinished_ratio"] == 1 / 3  # the cut chain; not the loop
    assert kinds["truncated_repeat_ratio"] == 1 / 3 == truncated_repeat_ratio(rows, truncated)  # the loop
    assert set(truncated_kinds(rows, texts, [False] * 4).values()) == {0.0}

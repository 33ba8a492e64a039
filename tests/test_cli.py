"""The CLI's choice of device: JAX on the CPU where no accelerator can be, so libtpu stays quiet."""

import glob
import os
import subprocess
import sys

import pytest

from jaxrl4llm import cli
from jaxrl4llm.cli import ACCELERATOR_DEVICE_FILES, default_to_cpu

NO_ACCELERATOR = sys.platform.startswith("linux") and not any(glob.glob(p) for p in ACCELERATOR_DEVICE_FILES)
needs_no_accelerator = pytest.mark.skipif(not NO_ACCELERATOR, reason="an accelerator device file (or not Linux): JAX chooses")


def test_cpu_only_where_no_accelerator_device_file_and_no_setting(tmp_path):
    gpu_files = (str(tmp_path / "nvidia*"),)
    env = {}
    assert default_to_cpu(env, device_files=gpu_files, platform="linux") and env == {"JAX_PLATFORMS": "cpu"}
    (tmp_path / "nvidia0").touch()  # a GPU host
    env = {}
    assert not default_to_cpu(env, device_files=gpu_files, platform="linux") and env == {}
    for setting in ({"JAX_PLATFORMS": ""}, {"JAX_PLATFORMS": "tpu"}, {"JAX_PLATFORM_NAME": "gpu"}):  # the user's
        env = dict(setting)
        assert not default_to_cpu(env, device_files=(), platform="linux") and env == setting
    env = {}
    assert not default_to_cpu(env, device_files=(), platform="darwin") and env == {}


@needs_no_accelerator
def test_every_command_sets_it_first(tmp_path, monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    cli.main(["plot", str(tmp_path), "-o", str(tmp_path / "c.png")])  # any command; this one fails fast
    assert os.environ["JAX_PLATFORMS"] == "cpu"


@needs_no_accelerator
def test_no_tpu_errors_on_this_machine_without_jax_platforms():
    """libtpu (the test extras) probes for a TPU at JAX's start unless JAX_PLATFORMS says cpu."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_PLATFORM_NAME")}
    code = "from jaxrl4llm import cli; cli.default_to_cpu(); import jax; print(jax.devices()[0].platform)"
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "cpu"
    assert "TPU_WORKER_HOSTNAMES" not in p.stderr and "INVALID_ARGUMENT" not in p.stderr

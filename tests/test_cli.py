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


def test_overrides_anywhere_on_the_command_line():
    parse = lambda line: cli.parse_args(cli.build_parser(), line.split())  # noqa: E731
    args = parse("train -c cfg.yaml trainer.steps=3 --resume optim.lr=1e-5 -c more.yaml rollout.top_k=5")
    assert args.resume == "latest" and args.config == ["cfg.yaml", "more.yaml"] and args.command == "train"
    assert args.overrides == ["trainer.steps=3", "optim.lr=1e-5", "rollout.top_k=5"]  # in order: later wins
    args = parse("train --resume auto optim.lr=1e-5")
    assert args.resume == "auto" and args.overrides == ["optim.lr=1e-5"]
    assert parse("train optim.lr=1e-5").resume is None
    args = parse("sample --prompt 1+1=? rollout.top_k=5 -n 2 rollout.temperature=0")
    assert args.prompt == ["1+1=?"] and args.num_samples == 2
    assert args.overrides == ["rollout.top_k=5", "rollout.temperature=0"]
    args = parse("eval optim.lr=1 -c a.yaml data.eval_limit=3")
    assert args.overrides == ["optim.lr=1", "data.eval_limit=3"] and args.config == ["a.yaml"]


def test_unknown_flag_is_still_an_error(capsys):
    for line in ("train -c cfg.yaml a.b=1 --nope", "convert RUN --out o extra=1"):
        with pytest.raises(SystemExit) as e:
            cli.parse_args(cli.build_parser(), line.split())
        assert e.value.code == 2
    assert "unrecognized arguments: --nope" in capsys.readouterr().err


def test_bin_difficulty_options_as_key_value():
    args = cli.parse_args(cli.build_parser(), "bin-difficulty --model m data=d.jsonl rollouts=4 max_new_tokens=9 top-p=0.5".split())
    assert (args.data, args.rollouts, args.max_new_tokens, args.top_p) == ("d.jsonl", 4, 9, 0.5)
    with pytest.raises(SystemExit):
        cli.parse_args(cli.build_parser(), "bin-difficulty --model m --data d nope=1".split())


@pytest.mark.parametrize("signal_name, status", [("SIGINT", 130), ("SIGTERM", 143)])
def test_interrupted_train_prints_the_resume_command(tmp_path, monkeypatch, capsys, signal_name, status):
    import signal

    import jaxrl4llm.train.loop as loop

    (tmp_path / "checkpoints" / "7").mkdir(parents=True)

    def interrupted_train(cfg, resume, **kwargs):
        if signal_name == "SIGINT":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)  # the first asks for a stop after the step (preemption.stop_requested)
        os.kill(os.getpid(), signal.SIGTERM)  # the second: cmd_train's handler turns it into an exception
        raise AssertionError("SIGTERM did not stop the run")

    monkeypatch.setattr(loop, "train", interrupted_train)
    before = signal.getsignal(signal.SIGTERM)
    assert cli.main(["train", f"trainer.out_dir={tmp_path}", "trainer.steps=9"]) == status
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (f"jaxrl4llm train: interrupted; last checkpoint: step 7 in {tmp_path}; resume with: "
                   f"jaxrl4llm train trainer.out_dir={tmp_path} trainer.steps=9 --resume")
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is train's only
    (tmp_path / "checkpoints" / "7").rmdir()
    assert cli.main(["train", f"trainer.out_dir={tmp_path}"]) == status
    assert "interrupted before the first checkpoint" in capsys.readouterr().err

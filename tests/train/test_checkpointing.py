"""RunCheckpointer's asynchronous saves: the caller goes on while a save writes, and a process
killed in the middle of a save leaves the previous checkpoint as the latest."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from jaxrl4llm.train.checkpointing import RunCheckpointer
from jaxrl4llm.train.run_folder import checkpoint_steps

ROOT = Path(__file__).resolve().parents[2]

# Saves step 1 and waits; then starts step 2 with orbax's commit (the last act of a save, after
# every array is written) held forever, says so, and waits to be killed.
KILLED_MID_SAVE = r"""
import asyncio, os, sys, time
import jax.numpy as jnp
from orbax.checkpoint._src.path import atomicity
from jaxrl4llm.train.checkpointing import RunCheckpointer

out = sys.argv[1]
ckpt = RunCheckpointer(out, keep=3)
ckpt.save(1, {"w": jnp.full((64, 64), 1.0)}, {"step": 1})
ckpt.wait()

async def held(self):
    open(os.path.join(out, "commit_held"), "w").close()
    await asyncio.sleep(3600)

atomicity.AtomicRenameTemporaryPath.finalize = held
ckpt.save(2, {"w": jnp.full((64, 64), 2.0)}, {"step": 2})
open(os.path.join(out, "save_returned"), "w").close()  # the caller goes on while the write is in flight
time.sleep(3600)
"""


def test_a_save_killed_before_its_commit_never_becomes_latest(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    with open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", KILLED_MID_SAVE, str(out)], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        signs = (out / "commit_held", out / "save_returned")
        while not all(p.exists() for p in signs) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        # the commit is held, and save() returned all the same: it did not wait for the write
        assert all(p.exists() for p in signs), (tmp_path / "log").read_text()[-3000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # step 2's arrays are on disk, in orbax's temporary folder: not a checkpoint
    assert any(p.name.startswith("2.") for p in (out / "checkpoints").iterdir())
    assert checkpoint_steps(out) == [1]
    ckpt = RunCheckpointer(out, keep=3)
    assert ckpt.latest_step() == 1
    state, meta, step = ckpt.restore({"w": np.zeros((64, 64), np.float32)})
    assert step == 1 and meta == {"step": 1} and float(state["w"][0, 0]) == 1.0
    # the resumed run saves step 2 again, over the leftover
    ckpt.save(2, {"w": np.full((64, 64), 3.0, np.float32)}, {"step": 2})
    ckpt.close()
    assert checkpoint_steps(out) == [1, 2]
    state, _, step = RunCheckpointer(out, keep=3).restore({"w": np.zeros((64, 64), np.float32)})
    assert step == 2 and float(state["w"][0, 0]) == 3.0


def _truncate_largest_shard(step_dir: Path) -> None:
    shard = max((p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"),
                key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:100])


def test_an_unreadable_latest_checkpoint_falls_back_to_the_previous_with_a_warning(tmp_path):
    """`--resume auto` (restore_newest_readable): step 4 truncated -> step 2, one warning; step 4
    kept as 4.unreadable and written again by the resumed run."""
    ckpt = RunCheckpointer(tmp_path, keep=3)
    noise = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)  # incompressible: a shard of its own
    for step in (2, 4):
        ckpt.save(step, {"w": noise + step}, {"step": step})
    ckpt.close()
    _truncate_largest_shard(tmp_path / "checkpoints" / "4")
    warnings = []
    ckpt = RunCheckpointer(tmp_path, keep=3)
    state, meta, step = ckpt.restore_newest_readable({"w": np.zeros((64, 64), np.float32)}, warnings.append)
    assert step == 2 and meta == {"step": 2}
    np.testing.assert_array_equal(state["w"], noise + 2)
    [warning] = warnings
    assert warning.startswith(f"warning: checkpoint step 4 at {tmp_path / 'checkpoints' / '4'} cannot be read (")
    assert warning.endswith("; resuming from step 2, the newest readable one (the unreadable ones are kept as "
                            "4.unreadable)")
    assert checkpoint_steps(tmp_path) == [2] and (tmp_path / "checkpoints" / "4.unreadable").is_dir()
    ckpt.save(4, {"w": np.full((64, 64), 5.0, np.float32)}, {"step": 4})
    ckpt.close()
    assert checkpoint_steps(tmp_path) == [2, 4]



def test_a_write_that_fails_in_the_background_raises_at_the_next_wait_and_is_no_checkpoint(tmp_path, monkeypatch):
    """A disk that fills up during an asynchronous save: the error comes out of the next wait
    (or save, or close: the run stops there), and the step never becomes a checkpoint."""
    from orbax.checkpoint._src.path import atomicity

    ckpt = RunCheckpointer(tmp_path, keep=3)
    ckpt.save(1, {"w": np.ones((8, 8), np.float32)}, {"step": 1})
    ckpt.wait()

    async def disk_full(self):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", disk_full)
    ckpt.save(2, {"w": np.full((8, 8), 2.0, np.float32)}, {"step": 2})  # returns: the write goes on
    with pytest.raises(Exception, match="No space left on device"):
        ckpt.wait()
    monkeypatch.undo()
    assert checkpoint_steps(tmp_path) == [1] and RunCheckpointer(tmp_path).latest_step() == 1

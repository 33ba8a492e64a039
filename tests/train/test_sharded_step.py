"""The train step on 8 simulated CPU devices (data=2, fsdp=2, tensor=2) equals one device."""

import os
import subprocess
import sys
from pathlib import Path


def test_sharded_train_step_matches_single_device():
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("sharded_step_main.py"))], cwd=root, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "OK sharded params" in proc.stdout

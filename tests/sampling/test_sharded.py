"""generate() on a ("data", "fsdp", "tensor") = (2, 2, 2) mesh of simulated CPU devices."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_sharded_generate_equals_single_device():
    env = dict(os.environ, PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, "-m", "tests.sampling.sharded_main"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "OK" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]

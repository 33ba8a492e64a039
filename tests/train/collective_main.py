"""One process of a minimal 2-process JAX run: joins jax.distributed the way `jaxrl4llm train`
does (train.hosts.initialize, the heartbeat from JAXRL4LLM_HEARTBEAT_SECONDS) and then runs a
cross-process all-gather every `interval` seconds, printing "tick N" after each, forever.

    python -m tests.train.collective_main PROCESS_ID NUM_PROCESSES PORT [INTERVAL]

What the fault tests kill a peer of: no model, no compile of a train step, so it is up in a few
seconds (tests/train/test_multihost.py::test_a_lost_coordinator_stops_the_other_process)."""

import os
import sys
import time

pid, num, port = (int(a) for a in sys.argv[1:4])
interval = float(sys.argv[4]) if len(sys.argv) > 4 else 0.5
os.environ.update(JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(num),
                  JAX_PROCESS_ID=str(pid))
os.environ.setdefault("JAXRL4LLM_HEARTBEAT_SECONDS", "10")

from jaxrl4llm.train import hosts  # noqa: E402

hosts.initialize()
tick = 0
while True:
    assert hosts.all_true(True)
    tick += 1
    print(f"tick {tick}", flush=True)
    time.sleep(interval)

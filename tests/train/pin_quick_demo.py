"""Writes this host's pin into tests/train/data/quick_demo_metrics.json from a
`jaxrl4llm demo --quick trainer.packing=true` run folder (test_demo.PINNED_ROW_FORM), run from the
repository root:

    python -m tests.train.pin_quick_demo OUT/rl          # an intended change: this host's pin only
    python -m tests.train.pin_quick_demo --add OUT/rl    # another host: its pin beside the others

The pins are kept per host (jax, jaxlib, CPU name, instruction sets, caches and cores:
tests/host_identity.py), since the run's matrix products follow the CPU they run on and a last-bit
difference changes the sampled run; a host with no pin is checked for what does not depend on it. Re-pin only
for an intended change of the demo's numbers (say which and why in the commit); the other hosts'
pins are then gone, and each such host adds its own with --add."""

import json
import sys

from tests.host_identity import host_identity
from tests.train.test_demo import PINNED, pinned_metrics

HOW = ("`jaxrl4llm demo --quick --out-dir OUT trainer.packing=true`'s OUT/rl/metrics.jsonl less its wall-clock keys, "
       "one pin per host; rewrite only for an intended change: python -m tests.train.pin_quick_demo [--add] OUT/rl")


def main(argv: list[str]) -> None:
    add = "--add" in argv
    folders = [a for a in argv if a != "--add"]
    if len(folders) != 1:
        raise SystemExit("usage: python -m tests.train.pin_quick_demo [--add] OUT/rl")
    host = host_identity()
    pins = json.loads(PINNED.read_text())["pins"] if add and PINNED.exists() else []
    pins = [p for p in pins if {k: p.get(k) for k in host} != host]  # this host's earlier pin is replaced
    pins.append({**host, "rows": pinned_metrics(folders[0])})
    PINNED.write_text(json.dumps({"how": HOW, "pins": pins}, indent=1, sort_keys=True) + "\n")
    print(f"{PINNED}: {len(pins)} pin(s)")


if __name__ == "__main__":
    main(sys.argv[1:])

"""Writes tests/train/data/quick_demo_metrics.json from a `jaxrl4llm demo --quick trainer.packing=true`
run folder (test_demo.PINNED_ROW_FORM):
`python -m tests.train.pin_quick_demo OUT/rl`, run from the repository root. Only for an intended
change of the demo's numbers (say which and why in the commit)."""

import json
import sys

import jax
import jaxlib

from tests.train.test_demo import PINNED, cpu_name, pinned_metrics


def main(run_dir: str) -> None:
    pin = {"how": "`jaxrl4llm demo --quick --out-dir OUT trainer.packing=true`'s OUT/rl/metrics.jsonl less its wall-clock keys; "
                  "rewrite only for an intended change: python -m tests.train.pin_quick_demo OUT/rl",
           "jax": jax.__version__, "jaxlib": jaxlib.__version__, "cpu": cpu_name(), "rows": pinned_metrics(run_dir)}
    PINNED.write_text(json.dumps(pin, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])

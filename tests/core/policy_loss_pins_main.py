"""Writes `pinned_outputs` of every case of tests/core/test_policy_loss_pins.py to an .npz file
(keys "case|name"), in a process of its own: the test runs it with XLA:CPU capped at AVX2
(tests/host_identity.py), which XLA reads once, when its CPU backend starts.

    python -m tests.core.policy_loss_pins_main OUT.npz
"""

import sys

import numpy as np

from tests.core.test_policy_loss_pins import CASES, pinned_inputs, pinned_outputs


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        raise SystemExit("usage: python -m tests.core.policy_loss_pins_main OUT.npz")
    arrays = {f"{case}|{name}": value for case in sorted(CASES)
              for name, value in pinned_outputs(CASES[case], pinned_inputs()).items()}
    np.savez(argv[0], **arrays)


if __name__ == "__main__":
    main(sys.argv[1:])

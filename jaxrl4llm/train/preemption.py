"""Preemption and automatic resume: a run that is stopped and started again loses nothing.

SIGTERM is what a TPU VM gets before a maintenance event or a preemption (and what `kill`,
Kubernetes and SLURM send). Under `watch()` (`jaxrl4llm train` installs it) the first SIGTERM
only raises a flag; at the end of the step in progress every process learns whether any
process got one (`stop_requested`, one tiny all-gather a step with several processes), and
then all of them save a checkpoint of that step, wait for its write and stop with
`Preempted`, which the CLI turns into exit status RESUME_EXIT_CODE. A second SIGTERM stops at
once (`Terminated`, exit status 143), as does Ctrl-C (130).

    exit status   meaning                                           the launcher (tpu_scripts/launch.sh)
    0             finished                                          stops
    2             bad config or unreadable checkpoint (names the fix) stops
    75            preempted: checkpoint saved, resume me            relaunches with --resume auto
    other         crashed (a peer host died, out of memory, ...)    relaunches, a bounded number of times

75 is sysexits.h's EX_TEMPFAIL ("a temporary failure; the user is invited to retry").
`--resume auto` (`resume_from_checkpoint`) resumes from the latest complete checkpoint when
there is one and starts fresh otherwise, so one command serves the first launch and every
relaunch.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from pathlib import Path
from typing import Callable

from jaxrl4llm.train import hosts
from jaxrl4llm.train.run_folder import checkpoint_steps

RESUME_EXIT_CODE = 75


class Terminated(KeyboardInterrupt):
    """A second SIGTERM under `watch`: stop at once, like Ctrl-C (exit status 143)."""


class Preempted(Exception):
    """The run stopped at a step boundary after a SIGTERM, with a complete checkpoint of `step`."""

    def __init__(self, step: int, checkpoint_dir: str):
        super().__init__(f"preempted after step {step}; checkpoint {checkpoint_dir}")
        self.step, self.checkpoint_dir = step, checkpoint_dir


_state = {"watching": False, "signalled": False}


def _on_sigterm(signum, frame) -> None:
    if _state["signalled"]:
        raise Terminated()
    _state["signalled"] = True
    print("jaxrl4llm train: SIGTERM: finishing this step, then saving a checkpoint and stopping "
          "(a second SIGTERM stops at once)", file=sys.stderr, flush=True)


@contextlib.contextmanager
def watch():
    """Within: the first SIGTERM asks the run to stop after its current step (stop_requested);
    the previous handler comes back on exit."""
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    _state.update(watching=True, signalled=False)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        _state.update(watching=False, signalled=False)


def stop_requested() -> bool:
    """Whether any process of the run got a SIGTERM (under `watch`), the same answer on every
    process: with several processes an all-gather of the flags, so all stop after the same step
    even when the signal reached only some hosts, or reached them during different steps.
    Outside `watch` (the library's `train()` called directly): False, with no collective."""
    if not _state["watching"]:
        return False
    return not hosts.all_true(not _state["signalled"])


def resume_from_checkpoint(resume: bool | str, out_dir: str | Path, log: Callable[[str], None] = print) -> bool:
    """`train`'s resume argument as a decision: True / False as given; "auto": True when
    trainer.out_dir holds a complete checkpoint, else False (a fresh start, with one log line).
    Every process reads the same folder (checkpoints live where all processes see them), so all
    decide alike."""
    if resume != "auto":
        if not isinstance(resume, bool):
            raise ValueError(f"resume={resume!r}: expected True, False or 'auto'")
        return resume

    steps = checkpoint_steps(out_dir)
    if not steps:
        log(f"--resume auto: no complete checkpoint in {out_dir}: starting fresh")
    return bool(steps)

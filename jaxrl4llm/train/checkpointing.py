"""Orbax checkpoints of a run: train state (params, optimizer state, step) + JSON metadata
(data position, RNG key, config). Orbax writes each step to a temporary folder and renames it
when complete, so a run killed mid-write leaves the previous checkpoint usable; only the last
`keep` checkpoints are kept.

Saves are asynchronous: `save` returns once the arrays are copied to host memory and a
background thread writes them, so the next step starts at once; the next `save`, `wait` and
`close` wait for the write in flight (a run's end, a preemption). Until its commit (the
rename, or on gs:// the `commit_success.txt` orbax writes last) a step is not a checkpoint:
`latest_step` and `run_folder.checkpoint_steps` never return it. A checkpoint that cannot be read is a CheckpointError naming its
step folder, the cause and the newest earlier step that can be read.

`close` (or a `with` block) before the program ends: from Python 3.12 on, a write still in flight
at exit cannot finish (orbax's writer needs new threads, which the interpreter refuses once its
shutdown has begun: "can't create new thread at interpreter shutdown"; no exit hook runs early
enough), and that step is lost.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import jax
import orbax.checkpoint as ocp

from jaxrl4llm.storage import run_path
from jaxrl4llm.train import hosts


class CheckpointError(Exception):
    """A checkpoint that cannot be read (a truncated or corrupt file, missing metadata, another
    model's shapes); the message names the step folder, the cause and what to do."""


def _cause(e: BaseException) -> str:
    """The innermost cause of `e` in one line: orbax wraps tensorstore's errors, whose messages
    run on with the whole store spec."""
    while e.__cause__ is not None or (e.__context__ is not None and not e.__suppress_context__):
        e = e.__cause__ or e.__context__
    text = str(e.args[0] if isinstance(e, KeyError) and e.args else e).split(" [tensorstore_spec")[0].strip()
    text = text.splitlines()[0] if text else type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


class RunCheckpointer:
    """Saves and restores (state pytree, metadata dict) under OUT/checkpoints/<step>.

    `close` (or `with RunCheckpointer(...) as ckpt:`) waits for the write in flight and releases
    orbax's threads: call it before the program ends (module docstring)."""

    METADATA_FILES = ("state/_METADATA", "meta/metadata")  # what orbax writes next to the arrays of a step

    def __init__(self, out_dir: str | Path, *, keep: int = 2):
        """out_dir: the run folder, local or gs://bucket/path."""
        self.dir = run_path(out_dir) / "checkpoints"  # a local folder or gs:// (jaxrl4llm.storage)
        self._mngr = ocp.CheckpointManager(
            self.dir, options=ocp.CheckpointManagerOptions(max_to_keep=max(keep, 1), create=True)
        )
        self._closed = False

    def __enter__(self) -> "RunCheckpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def save(self, step: int, state: Any, meta: dict, pending: dict | None = None) -> float:
        """Starts writing checkpoint `step` and returns the seconds the caller was blocked: the
        wait for the previous save, if still writing, and the copy of `state` to host memory
        (after which its device buffers may be donated). The write goes on in the background.
        pending: {name: np.ndarray} saved beside the state (an asynchronous run's rollouts in
        flight, `train.rollout_pipeline.pending_to_host`), read back by `restore_pending`."""
        t0 = time.perf_counter()
        items = dict(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        if pending:
            items["pending"] = ocp.args.StandardSave(pending)
        self._mngr.save(step, args=ocp.args.Composite(**items))
        return time.perf_counter() - t0

    def restore_pending(self, step: int) -> dict:
        """The `pending` arrays saved with checkpoint `step` ({} when it has none), as np.ndarrays."""
        if not (self.dir / str(step) / "pending").exists():
            return {}
        try:
            return dict(self._mngr.restore(step, args=ocp.args.Composite(pending=ocp.args.StandardRestore()))["pending"])
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"checkpoint step {step} at {self.dir / str(step)}: its rollouts in flight (pending/) "
                                  f"cannot be read ({_cause(e)}); resume from an earlier step or delete this one.") from None

    def wait(self) -> None:
        """Returns when the save in flight (if any) is committed."""
        self._mngr.wait_until_finished()

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict, int]:
        """Restores onto the shardings of `abstract_state` (a pytree of arrays or ShapeDtypeStructs)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"No checkpoint in {self.dir}: nothing to resume (start without --resume).")
        out = self._read(step, self._state_args(abstract_state), "delete {bad} to resume from it")
        return out["state"], dict(out["meta"]), step

    def restore_newest_readable(self, abstract_state: Any, warn: Callable[[str], None] = print) -> tuple[Any, dict, int]:
        """`restore` of the latest step, or, when it cannot be read (a corrupt or truncated file),
        of the newest earlier step that can, with one warning naming the unreadable steps and
        their causes: what an unattended relaunch (`--resume auto`) does, where an error would
        stop the run for good. The unreadable steps are renamed `<step>.unreadable` (kept for a
        look, no longer checkpoints), so the run writes those steps again. A step counts as read
        only when every process read its part."""
        steps = sorted(self._mngr.all_steps(), reverse=True)
        if not steps:
            raise FileNotFoundError(f"No checkpoint in {self.dir}: nothing to resume.")
        args, bad = self._state_args(abstract_state), []
        for step in steps:
            try:
                out, cause = self._mngr.restore(step, args=args), None
            except Exception as e:  # noqa: BLE001 (any failure to read is handled the same way)
                out, cause = None, _cause(e)
            if not hosts.all_true(cause is None):
                bad.append((step, cause or "another process could not read its part"))
                continue
            if bad:
                hosts.barrier("checkpoint fallback")
                if hosts.is_main():
                    for s, _ in bad:
                        (self.dir / str(s)).rename(self.dir / f"{s}.unreadable")
                hosts.barrier("checkpoint fallback done")
                self._mngr.reload()
                warn("warning: " + "; ".join(f"checkpoint step {s} at {self.dir / str(s)} cannot be read ({c})"
                                             for s, c in bad)
                     + f"; resuming from step {step}, the newest readable one (the unreadable ones are kept as "
                     + ", ".join(f"{s}.unreadable" for s, _ in bad) + ")")
            return out["state"], dict(out["meta"]), step
        raise CheckpointError(f"none of the checkpoints in {self.dir} can be read: "
                              + "; ".join(f"step {s}: {c}" for s, c in bad)
                              + " (a cause naming shapes or keys may mean a config other than the run's config.json).")

    @staticmethod
    def _state_args(abstract_state: Any) -> ocp.args.Composite:
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), abstract_state
        )
        return ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())

    def restore_params(self, abstract_params: Any, step: int | None = None) -> tuple[Any, int]:
        """Restores only the parameters of a checkpoint (no optimizer state: an export reads a
        third of a full-parameter checkpoint) onto the shardings of `abstract_params`."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"No checkpoint in {self.dir}: train first (trainer.checkpoint_every).")
        item = {"params": jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), abstract_params)}
        args = ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True))
        out = self._read(step, args, "read it with step={good} (jaxrl4llm convert --step {good})")
        return out["state"]["params"], step

    def _read(self, step: int, args: ocp.args.Composite, fix: str) -> Any:
        """Restores `step` with `args`; when that fails, a CheckpointError naming the step folder,
        the cause in one line and the newest earlier step that restores with the same `args`
        (each earlier one is read in full to know: only on this error path). `fix` is formatted
        with bad= the folders of the unreadable steps after it, good= that earlier step."""
        steps = sorted(self._mngr.all_steps())
        if step not in steps:
            raise CheckpointError(f"no checkpoint step {step} in {self.dir} (its steps: {steps or 'none'}).")
        try:
            return self._mngr.restore(step, args=args)
        except Exception as e:  # noqa: BLE001 (any failure to read is reported the same way)
            cause = _cause(e)
        # orbax reads a step without its tree metadata as plain dicts: name the file, not the pytree mismatch
        missing = [name for name in self.METADATA_FILES
                   if name.split("/")[0] in args and not (self.dir / str(step) / name).is_file()]
        if missing:
            cause = f"{' and '.join(missing)} missing; orbax: {cause}"
        earlier = [s for s in reversed(steps) if s < step]
        good = next((s for s in earlier if self._readable(s, args)), None)
        if good is not None:
            unreadable = " and ".join(str(self.dir / str(s)) for s in steps if good < s <= step)
            then = f"the newest readable earlier one is step {good}: " + fix.format(bad=unreadable, good=good)
        else:
            then = ((f"none of the earlier ones ({', '.join(map(str, earlier))}) can be read either" if earlier else
                     "there is no earlier one") + " (a cause naming shapes or keys may mean a config other than the "
                    "run's config.json)")
        raise CheckpointError(f"checkpoint step {step} at {self.dir / str(step)} cannot be read ({cause}); {then}.")

    def _readable(self, step: int, args: ocp.args.Composite) -> bool:
        try:
            self._mngr.restore(step, args=args)
        except Exception:  # noqa: BLE001
            return False
        return True

    def close(self) -> None:
        """Waits for the save in flight, then releases orbax's threads (once; later calls do nothing)."""
        if self._closed:
            return
        self._closed = True
        self._mngr.close()

"""Orbax checkpoints of a run: train state (params, optimizer state, step) + JSON metadata
(data position, RNG key, config). Orbax writes each step to a temporary folder and renames it
when complete, so a run killed mid-write leaves the previous checkpoint usable; only the last
`keep` checkpoints are kept.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


class RunCheckpointer:
    """Saves and restores (state pytree, metadata dict) under OUT/checkpoints/<step>."""

    def __init__(self, out_dir: str | Path, *, keep: int = 2):
        self.dir = Path(out_dir).absolute() / "checkpoints"
        self._mngr = ocp.CheckpointManager(
            self.dir, options=ocp.CheckpointManagerOptions(max_to_keep=max(keep, 1), create=True)
        )

    def latest_step(self) -> int | None:
        return self._mngr.latest_step()

    def save(self, step: int, state: Any, meta: dict) -> None:
        self._mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)))
        self._mngr.wait_until_finished()

    def restore(self, abstract_state: Any, step: int | None = None) -> tuple[Any, dict, int]:
        """Restores onto the shardings of `abstract_state` (a pytree of arrays or ShapeDtypeStructs)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"No checkpoint in {self.dir}: nothing to resume (start without --resume).")
        target = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), abstract_state
        )
        out = self._mngr.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore())
        )
        return out["state"], dict(out["meta"]), step

    def restore_params(self, abstract_params: Any, step: int | None = None) -> tuple[Any, int]:
        """Restores only the parameters of a checkpoint (no optimizer state: an export reads a
        third of a full-parameter checkpoint) onto the shardings of `abstract_params`."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"No checkpoint in {self.dir}: train first (trainer.checkpoint_every).")
        item = {"params": jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)), abstract_params)}
        out = self._mngr.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True)))
        return out["state"]["params"], step

    def close(self) -> None:
        self._mngr.close()

"""Asynchronous RL with a staleness bound: rollouts sampled k policy versions ahead of the update.

With `trainer.max_staleness` = k >= 1 the loop keeps k rollouts in flight. The rollout the update of
step t trains on was sampled by policy version v(t) (the parameters after v updates):

    v(t) = max(t - k, start)        lag(t) = t - v(t) <= k      (start: the step a run or resume began at)

so while update t runs, the sampler draws the rollout of step t + k from the parameters update t
starts from. The schedule is fixed, not "whatever the sampler has ready": a run is reproducible,
its rollout t uses the same prompts and random numbers (fold_in(seed, t)) as the synchronous run,
and k = 0 is the synchronous loop itself. verl's one-step-off-policy trainer is k = 1; the
fully asynchronous trainers (verl `staleness_threshold`, ROLL `async_generation_ratio`, AReaL
`max_head_offpolicyness`, NeMo-RL `max_trajectory_age_steps`, TRL `max_staleness`) bound the same lag.

The objective for such rows (docs/objectives.md, "Off-policy rows"): the trainer recomputes
pi_old = pi_{theta_t} (the proximal policy of decoupled PPO, AReaL arXiv 2505.24298) and the PPO
ratio is taken against it; the behaviour policy's log-probs (the sampler's, version v) enter through
`algorithm.overrides.is_correction` (core/mismatch.py) as pi_old / pi_behaviour per token.

Rows are never dropped for age: the schedule bounds every token's lag by k by construction.
Without `rollout.partial` a row is sampled by one version from its first token to its last. With
it (`sampling/partial.py`) one engine runs across steps: the segment that hands out step t's
rollout is sampled by version max(t - k + 1, start) and admits step t+1's rows into the slots
step t's rows free; those still decoding continue in segment t+1 under its version. A row thus
spans at most two segments (a segment ends only when its rollout is complete): a row trained at
step t holds tokens of segments t - 1 and t, versions max(t - k, start) and max(t - k + 1, start),
at most k old. So no row is dropped or recomputed; the bound holds by construction, and the staleness metrics
(per token, `sampling.partial.RowVersions`) check it at every step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxrl4llm.models import make_mesh
from jaxrl4llm.sampling.partial import RowVersions
from jaxrl4llm.sampling.rollout import Rollout
from jaxrl4llm.train.config import ConfigError


@dataclasses.dataclass
class PendingRollout:
    """A rollout sampled ahead of its update: for training step `step`, by policy `version`.

    rollout: the Rollout (N rows); rewards [N] on the host; stats: the sampling figures of
    `loop.sample_groups` (times, draws, ...), logged with the step that trains on it;
    components: a `reward.fns` list's own rewards {name: [N]} ({} for a single reward.fn).
    """

    step: int
    version: int
    rollout: Any
    rewards: np.ndarray
    stats: dict
    versions: Any = None  # rollout.partial: sampling.partial.RowVersions (a version per token); None: all `version`
    components: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class PartialStream:
    """rollout.partial: the sampler's engine (`sampling.partial.PartialRollouts`) kept across steps,
    and the prompt ids of each rollout enqueued in it and not yet handed out ({step: ids})."""

    engine: Any
    prompt_ids: dict


def check_partial(partial: bool, max_staleness: int, engine: str, dynamic_sampling: bool) -> None:
    """rollout.partial's requirements, as a ConfigError naming the settings to change."""
    if not partial:
        return
    if max_staleness < 1:
        raise ConfigError("rollout.partial=true carries rows across policy versions: set trainer.max_staleness >= 1 "
                         "(k = 1: each segment sampled by the current policy, rows carried one version; k = 2: "
                         "segments also overlap the update)")
    if engine != "continuous":
        raise ConfigError("rollout.partial=true needs rollout.engine=continuous (the engine kept across steps)")
    if dynamic_sampling:
        raise ConfigError("rollout.partial=true with dynamic sampling: the redraws depend on rewards the engine "
                         "cannot see while it decodes; use a recipe without dynamic sampling (or rollout.partial=false)")


def check_tools(tools_on: bool, engine: str, partial: bool) -> None:
    """rollout.tools' requirements, as a ConfigError naming the setting to change: the continuous
    engine parks rows (the static engine and partial rollouts do not yet)."""
    if not tools_on:
        return
    if engine != "continuous":
        raise ConfigError("rollout.tools needs rollout.engine=continuous: the static engine does not park rows for "
                          "tool calls")
    if partial:
        raise ConfigError("rollout.tools with rollout.partial=true: partial rollouts do not park rows for tool calls "
                          "yet; set rollout.partial=false")


def partial_version(step: int, max_staleness: int, start: int) -> int:
    """The version that samples step t's segment under rollout.partial: max(t - k + 1, start)
    (its rows begun in segment t - 1 are then k versions old at step t)."""
    return sampling_version(step, max_staleness - 1, start)


def sampling_version(step: int, max_staleness: int, start: int) -> int:
    """v(t) = max(t - k, start): the policy version whose parameters sample step t's rollout."""
    return max(step - max_staleness, start)


def staleness_metrics(row_versions: np.ndarray, row_tokens: np.ndarray, step: int, max_staleness: int) -> dict:
    """Policy lag of the tokens a step trains on: lag = step - version of the row that holds them.

    row_versions [N] int; row_tokens [N]: each row's response tokens (`Rollout.lengths`). Returns staleness_mean
    (token-weighted), staleness_max (over rows with tokens) and staleness_tokens_lag_j for
    j = 0..k: the share of tokens j versions old.
    """
    lag = step - np.asarray(row_versions, np.int64)
    if np.any(lag < 0) or np.any(lag > max_staleness):
        raise ValueError(f"rows of versions {sorted(set(row_versions.tolist()))} trained at step {step}: lag outside "
                         f"[0, {max_staleness}]")
    tokens = np.asarray(row_tokens, np.float64)
    total = max(tokens.sum(), 1.0)
    out = {"staleness_mean": float((lag * tokens).sum() / total),
           "staleness_max": int(lag[tokens > 0].max()) if np.any(tokens > 0) else 0}
    for j in range(max_staleness + 1):
        out[f"staleness_tokens_lag_{j}"] = float(tokens[lag == j].sum() / total)
    return out


def split_devices(devices: list, sampler_devices: float, process_of=lambda d: d.process_index) -> tuple[list, list]:
    """(trainer devices, sampler devices) of `mesh.sampler_devices`: of each process's devices, the
    first n go to the sampler, n = sampler_devices (a count) or round(fraction x local devices) for
    a value in (0, 1); every process keeps devices on both sides (both programs span all
    processes, as multi-controller JAX needs). 0 -> (devices, []). Works on TPU topology
    descriptions too (`plan`): their devices carry their host's process_index."""
    if not sampler_devices:
        return list(devices), []
    by_process: dict[int, list] = {}
    for d in devices:
        by_process.setdefault(process_of(d), []).append(d)
    local = min(len(v) for v in by_process.values())
    n = int(round(sampler_devices * local)) if sampler_devices < 1 else int(sampler_devices)
    if sampler_devices != int(sampler_devices) and sampler_devices > 1:
        raise ValueError(f"mesh.sampler_devices={sampler_devices}: a count of devices (an integer) or a fraction "
                         f"in (0, 1)")
    if not 1 <= n < local:
        raise ValueError(f"mesh.sampler_devices={sampler_devices} gives the sampler {n} of the {local} devices of each "
                         f"process; it needs at least 1 and must leave at least 1 to train on (0 = share the devices)")
    trainer, sampler = [], []
    for p in sorted(by_process):
        sampler += by_process[p][:n]
        trainer += by_process[p][n:]
    return trainer, sampler


def sampler_mesh_shape(n: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) of the sampler's own n devices: fsdp = the largest power of two that
    divides n, data the rest. Parameters copied there are sharded over fsdp the way the trainer
    shards them (model widths are powers of two times small factors: an fsdp of 2^j divides them,
    48 would not and would leave every device a whole copy); `sampling.decode_mesh` regroups the
    devices for decoding as on a shared mesh."""
    fsdp = n & -n
    return n // fsdp, fsdp, 1


def sampler_base_mesh(devices: list):
    """The sampler's own devices as a (data, fsdp, 1) mesh (`sampler_mesh_shape`)."""
    return make_mesh(*sampler_mesh_shape(len(devices)), devices=devices)


_ROLLOUT_FIELDS = Rollout._fields


def pending_to_host(pending: list[PendingRollout], fetch) -> tuple[dict, list[dict]]:
    """(arrays, metadata) of the rollouts in flight, what a checkpoint keeps of them: arrays
    {"i/field": np.ndarray} (whole values, fetched to this host; a reward.fns list's components as
    "i/component_j", their names in the metadata), metadata [{step, version, stats, components}]."""
    arrays, meta = {}, []
    for i, p in enumerate(pending):
        for name in _ROLLOUT_FIELDS:
            if getattr(p.rollout, name) is not None:  # routes: only when recorded
                arrays[f"{i}/{name}"] = fetch(getattr(p.rollout, name))
        arrays[f"{i}/rewards"] = np.asarray(p.rewards)
        for j, values in enumerate(p.components.values()):
            arrays[f"{i}/component_{j}"] = np.asarray(values)
        if p.versions is not None:
            for name, x in p.versions._asdict().items():
                arrays[f"{i}/versions_{name}"] = np.asarray(x)
        meta.append({"step": p.step, "version": p.version, "stats": p.stats, "partial": p.versions is not None,
                     "components": list(p.components)})
    return arrays, meta


def pending_from_host(arrays: dict, meta: list[dict], place) -> list[PendingRollout]:
    """Inverse of `pending_to_host`; place: np.ndarray -> the array the loop uses (e.g. on the
    sampler's mesh)."""
    out = []
    for i, m in enumerate(meta):
        rollout = Rollout(*(place(np.asarray(arrays[f"{i}/{name}"])) if f"{i}/{name}" in arrays else None
                            for name in _ROLLOUT_FIELDS))
        versions = RowVersions(*(np.asarray(arrays[f"{i}/versions_{name}"]) for name in RowVersions._fields)) \
            if m.get("partial") else None
        components = {name: np.asarray(arrays[f"{i}/component_{j}"]) for j, name in enumerate(m.get("components", []))}
        out.append(PendingRollout(int(m["step"]), int(m["version"]), rollout, np.asarray(arrays[f"{i}/rewards"]),
                                  dict(m["stats"]), versions, components))
    return out

"""Asynchronous RL (trainer.max_staleness, train/rollout_pipeline.py): the schedule, its metrics,
equality with a loop composed by hand from the stages, exact resume with rollouts in flight."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxrl4llm.train.config import ConfigError, load_config
from jaxrl4llm.train.loop import (PromptStream, run_meshes, build_batch, partial_stream, sample_groups, sample_segment,
                                  setup_run, train)
from jaxrl4llm.train.rollout_pipeline import partial_version, sampling_version, split_devices, staleness_metrics

from tests.train.conftest import tiny_overrides


@settings(max_examples=50, deadline=None)
@given(k=st.integers(0, 4), start=st.integers(0, 5), ahead=st.integers(0, 12),
       lengths=st.lists(st.integers(0, 6), min_size=1, max_size=6), seed=st.integers(0, 99))
def test_every_row_is_at_most_k_versions_old_and_the_token_shares_add_up(k, start, ahead, lengths, seed):
    step = start + ahead
    version = sampling_version(step, k, start)
    assert start <= version <= step and step - version <= k
    assert version == step - k or version == start  # as fresh as the bound allows, never fresher
    rng = np.random.default_rng(seed)
    versions = np.array([max(step - int(rng.integers(0, k + 1)), 0) for _ in lengths])
    mask = np.array([[1.0] * n + [0.0] * (6 - n) for n in lengths])
    m = staleness_metrics(versions, mask.sum(axis=-1), step, k)
    shares = [m[f"staleness_tokens_lag_{j}"] for j in range(k + 1)]
    if mask.sum():
        assert sum(shares) == pytest.approx(1.0)
        assert m["staleness_mean"] == pytest.approx(sum(j * s for j, s in enumerate(shares)))
        assert m["staleness_max"] == max(step - v for v, n in zip(versions, lengths) if n)
    with pytest.raises(ValueError, match="lag outside"):
        staleness_metrics(np.array([step + 1]), np.array([2]), step, k)


def test_sampler_devices_take_the_same_share_of_every_process():
    devices = [types.SimpleNamespace(id=i, process_index=i // 4) for i in range(8)]
    trainer, sampler = split_devices(devices, 1)
    assert [d.id for d in sampler] == [0, 4] and [d.id for d in trainer] == [1, 2, 3, 5, 6, 7]
    trainer, sampler = split_devices(devices, 0.5)
    assert [d.id for d in sampler] == [0, 1, 4, 5]
    assert split_devices(devices, 0) == (devices, [])
    for bad in (4, 0.1, 2.5):
        with pytest.raises(ValueError, match="mesh.sampler_devices"):
            split_devices(devices, bad)


def test_sampler_devices_without_staleness_is_refused(demo_assets, tmp_path):
    cfg = load_config(None, tiny_overrides(demo_assets, tmp_path, **{"mesh.sampler_devices": 1}))
    with pytest.raises(ConfigError, match=r"trainer.max_staleness >= 1"):
        run_meshes(cfg)


# partial rollouts whose rows cross segments in the tiny runs: bursts of 3 steps, 6 slots for 8 rows a step
PARTIAL = {"rollout.partial": True, "rollout.decode_burst": 3, "rollout.slots": 6}


def _by_hand(cfg, k):
    """The loop composed from its stages, with the rollout of step t sampled by the parameters
    after max(t - k, 0) updates (kept aside as copies): what trainer.max_staleness = k promises.
    rollout.partial: step t's rollout from the engine's segment t, sampled by the parameters after
    max(t - k + 1, 0) updates (its rows begun in segment t - 1 by the version before)."""
    mesh, _ = run_meshes(cfg)
    run, state = setup_run(cfg, mesh, lambda s: None)
    stream = PromptStream(len(run.train_set), seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)
    versions = [jax.tree.map(jnp.copy, state.params)]
    rollouts = {}
    partial = partial_stream(run.policy, run.train_set, cfg) if cfg.rollout.partial else None
    ahead = k - 1 if partial else k
    for step in range(cfg.trainer.steps):
        for t in range(step, min(step + ahead, cfg.trainer.steps - 1) + 1):  # in step order, as the loop does
            if t not in rollouts:
                if partial:
                    v = max(t - k + 1, 0)
                    rollouts[t] = sample_segment(run.policy.with_params(versions[v]), partial, run.train_set, stream,
                                                 cfg, t, v, run.base_key, run.reward_fn)[:2]
                    continue
                policy = run.policy.with_params(versions[max(t - k, 0)])  # no LoRA here: no frozen base
                rollouts[t] = sample_groups(policy, run.train_set, stream, cfg, jax.random.fold_in(run.base_key, t),
                                            run.reward_fn, run.recipe)[:2]
        rollout, (rewards, _) = rollouts.pop(step)
        batch, _, _ = build_batch(run, state, rollout, rewards, 0)
        state, _, _ = run.update(state, batch)
        versions.append(jax.tree.map(jnp.copy, state.params))
    return state.params


@pytest.mark.parametrize("k, partial", [(0, False), (1, False), (2, True)])
def test_the_loop_equals_the_stages_composed_by_hand(demo_assets, tmp_path, k, partial):
    extra = {"trainer.steps": 3, "trainer.max_staleness": k, **(PARTIAL if partial else {})}
    cfg = load_config(None, tiny_overrides(demo_assets, tmp_path / "run", **extra))
    summary = train(cfg, log=lambda s: None)
    expected = _by_hand(load_config(None, tiny_overrides(demo_assets, tmp_path / "hand", **extra)), k)
    for x, y in zip(jax.tree.leaves(summary["state"].params), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    history = summary["history"]
    if partial:  # segment t by version max(t - 1, 0); rows begun in segment t - 1 one version older
        assert [r["staleness_max"] for r in history] == [0, 1, 2]
        assert history[1]["staleness_mean"] == 1.0 and 1.0 < history[2]["staleness_mean"] < 2.0
        assert history[2]["partial_rows_carried"] > 0  # rows of step 2 begun under version 0
    else:
        assert [r.get("staleness_mean") for r in history] == ([None] * 3 if k == 0 else [0.0, 1.0, 1.0])


def test_partial_rollouts_need_staleness_the_continuous_engine_and_no_dynamic_sampling(demo_assets, tmp_path):
    for extra, match in [({}, "trainer.max_staleness >= 1"),
                         ({"trainer.max_staleness": 1, "rollout.engine": "static"}, "rollout.engine=continuous"),
                         ({"trainer.max_staleness": 1, "algorithm.preset": "dapo"}, "dynamic sampling")]:
        cfg = load_config(None, tiny_overrides(demo_assets, tmp_path, **{"rollout.partial": True, **extra}))
        with pytest.raises(ConfigError, match=match):
            train(cfg, log=lambda s: None)


@settings(max_examples=30, deadline=None)
@given(k=st.integers(1, 4), start=st.integers(0, 5), ahead=st.integers(0, 12))
def test_a_partial_segment_keeps_its_carried_rows_within_k_versions(k, start, ahead):
    """Rows trained at step t hold tokens of segments t - 1 and t: both within k versions."""
    t = start + ahead
    assert 0 <= t - partial_version(t, k, start) <= k - 1
    assert 0 <= t - partial_version(max(t - 1, start), k, start) <= k


def test_a_preempted_asynchronous_run_resumes_exactly_with_its_rollouts_in_flight(demo_assets, tmp_path, monkeypatch):
    """k = 2 with partial rollouts: a checkpoint holds a whole rollout sampled ahead and the engine
    (slots, KV pages, rows half-sampled); the resumed run equals the uninterrupted one."""
    import jaxrl4llm.train.loop as loop
    from jaxrl4llm.train.preemption import Preempted

    cfg = lambda out: load_config(None, tiny_overrides(demo_assets, out, **{
        "trainer.steps": 5, "trainer.max_staleness": 2, **PARTIAL}))
    full = train(cfg(tmp_path / "a"), log=lambda s: None)
    # a SIGTERM during step 2: its checkpoint holds step 3's rollout and the engine with step 4's rows begun
    calls = iter([False, True])
    monkeypatch.setattr(loop, "stop_requested", lambda: next(calls))
    with pytest.raises(Preempted):
        train(cfg(tmp_path / "b"), log=lambda s: None)
    monkeypatch.undo()
    resumed = train(cfg(tmp_path / "b"), resume=True, log=lambda s: None)
    assert [r["staleness_max"] for r in full["history"]] == [0, 1, 2, 2, 2]
    assert len(resumed["history"]) == 3
    for a, b in zip(full["history"][2:], resumed["history"]):
        for key in ("reward", "loss", "grad_norm", "response_length", "staleness_mean", "partial_rows_carried"):
            assert a[key] == b[key], key
    for x, y in zip(jax.tree.leaves(full["state"].params), jax.tree.leaves(resumed["state"].params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_sampler_on_devices_of_its_own_gives_the_shared_run():
    """tests/train/async_split_main.py, in a subprocess with 8 simulated devices (4 sample, 4 train)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("async_split_main.py"))], cwd=root, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "OK async split" in proc.stdout


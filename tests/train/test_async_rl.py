"""Asynchronous RL (trainer.max_staleness, train/rollout_pipeline.py): the schedule, its metrics,
equality with a loop composed by hand from the stages, exact resume with rollouts in flight."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxrl4llm.train.config import ConfigError, load_config
from jaxrl4llm.train.loop import PromptStream, _meshes, build_batch, sample_groups, setup_run, train
from jaxrl4llm.train.rollout_pipeline import sampling_version, split_devices, staleness_metrics

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
        _meshes(cfg)


def _by_hand(cfg, k):
    """The loop composed from its stages, with the rollout of step t sampled by the parameters
    after max(t - k, 0) updates (kept aside as copies): what trainer.max_staleness = k promises."""
    mesh, _ = _meshes(cfg)
    run, state = setup_run(cfg, mesh, lambda s: None)
    stream = PromptStream(len(run.train_set), seed=cfg.trainer.seed, shuffle=cfg.data.shuffle)
    versions = [jax.tree.map(jnp.copy, state.params)]
    rollouts = {}
    for step in range(cfg.trainer.steps):
        for t in range(step, min(step + k, cfg.trainer.steps - 1) + 1):  # sampled in step order, as the loop does
            if t not in rollouts:
                policy = run.policy.with_params(versions[max(t - k, 0)])  # no LoRA here: no frozen base
                rollouts[t] = sample_groups(policy, run.train_set, stream, cfg, jax.random.fold_in(run.base_key, t),
                                            run.reward_fn, run.recipe)[:2]
        rollout, rewards = rollouts.pop(step)
        batch, _ = build_batch(run, state, rollout, rewards)
        state, _, _ = run.update(state, batch)
        versions.append(jax.tree.map(jnp.copy, state.params))
    return state.params


@pytest.mark.parametrize("k", [0, 1])
def test_the_loop_equals_the_stages_composed_by_hand(demo_assets, tmp_path, k):
    cfg = load_config(None, tiny_overrides(demo_assets, tmp_path / "run", **{
        "trainer.steps": 3, "trainer.max_staleness": k}))
    summary = train(cfg, log=lambda s: None)
    expected = _by_hand(load_config(None, tiny_overrides(demo_assets, tmp_path / "hand", **{"trainer.steps": 3})), k)
    for x, y in zip(jax.tree.leaves(summary["state"].params), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    lags = [r.get("staleness_mean") for r in summary["history"]]
    assert lags == ([None] * 3 if k == 0 else [0.0, 1.0, 1.0])


def test_a_preempted_asynchronous_run_resumes_exactly_with_its_rollouts_in_flight(demo_assets, tmp_path, monkeypatch):
    import jaxrl4llm.train.loop as loop
    from jaxrl4llm.train.preemption import Preempted

    cfg = lambda out: load_config(None, tiny_overrides(demo_assets, out, **{
        "trainer.steps": 5, "trainer.max_staleness": 2}))
    full = train(cfg(tmp_path / "a"), log=lambda s: None)
    calls = iter([False, True])  # a SIGTERM during step 2: its checkpoint holds the rollouts of steps 3 and 4
    monkeypatch.setattr(loop, "stop_requested", lambda: next(calls))
    with pytest.raises(Preempted):
        train(cfg(tmp_path / "b"), log=lambda s: None)
    monkeypatch.undo()
    resumed = train(cfg(tmp_path / "b"), resume=True, log=lambda s: None)
    assert [r["staleness_mean"] for r in full["history"]] == [0.0, 1.0, 2.0, 2.0, 2.0]
    assert len(resumed["history"]) == 3
    for a, b in zip(full["history"][2:], resumed["history"]):
        for key in ("reward", "loss", "grad_norm", "response_length", "staleness_mean", "sampling_draws"):
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


"""examples/rl_step.py, one RL iteration written out top to bottom: `main` runs a few iterations with
the verifier's reward, a step changes the policy (here with a reward on which even a barely trained
model's groups differ), and the update follows the advantages' sign: the same batch with the
advantages negated moves the favoured responses' log-probs the other way. A 1-step warm start and
8 prompts x 8 samples, so the cost is the programs' compiles."""

import importlib.util
import math
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
PROMPTS, G = 8, 8


def _example():
    """examples/rl_step.py as a module (examples/ is no package and is not installed)."""
    spec = importlib.util.spec_from_file_location("rl_step_example", REPO / "examples" / "rl_step.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


ex = _example()


def digit_share(responses, golds):
    """A shaping reward in [0, 1]: the share of each response's characters that are digits."""
    return [sum(c.isdigit() for c in r.strip()) / max(len(r.strip()), 1) for r in responses]


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """(graphdef, params, tokenizer, problems): the demo task and a 1-step warm start."""
    return ex.setup(tmp_path_factory.mktemp("rl_step"), seed=0, sft_steps=1, log=lambda _: None)


@pytest.fixture(scope="module")
def one_step(warm):
    """One rl_step from the warm start, rewarded by digit_share: (params before, after, stats, batch)."""
    graphdef, params, tokenizer, problems = warm
    opt = ex.OPTIMIZER
    after, _, stats, batch = ex.rl_step(graphdef, params, opt.init(params), ex.make_update(graphdef, opt),
                                        tokenizer, problems[:PROMPTS], jax.random.PRNGKey(0), reward_fn=digit_share,
                                        group_size=G)
    return params, after, stats, batch


def _changed(a, b) -> list[bool]:
    return [not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]


def test_an_iteration_changes_the_policy(one_step):
    before, after, stats, batch = one_step
    assert all(math.isfinite(v) for v in stats.values()), stats
    assert 0.0 < stats["reward"] < 1.0 and 0 < stats["response_length"] <= 32
    adv = np.asarray(batch.advantages).reshape(PROMPTS, G)
    np.testing.assert_allclose(adv.sum(axis=1), 0.0, atol=1e-4)  # Lite PPO: centred on each group's mean
    assert np.all(adv.std(axis=1) > 0)  # every group's rewards differ: every group has a gradient
    assert all(_changed(before, after))  # every parameter tensor moved


def test_the_update_follows_the_advantages_sign(warm, one_step):
    """From the same parameters and batch (old_logp the policy's own: ratio 1, nothing clipped), the first
    half of each group favoured (A = +1, the rest -1): their mean log-prob rises; with A negated it falls."""
    graphdef, params, _, _ = warm
    batch = jax.tree.map(lambda x: x[: PROMPTS * G // 2], one_step[3])  # rl_step's first mini-batch
    sign = np.where(np.arange(PROMPTS * G // 2) % G < G // 2, 1.0, -1.0).astype(np.float32)
    favoured = np.asarray(batch.loss_mask) * (sign > 0)[:, None]

    def favoured_logp(p):
        return float((np.asarray(ex.scores(graphdef, p, batch)[0]) * favoured).sum() / favoured.sum())

    update = ex.make_update(graphdef, ex.OPTIMIZER)
    moved = {}
    for s in (1.0, -1.0):
        new, _, metrics = update(params, ex.OPTIMIZER.init(params), batch._replace(advantages=s * sign))
        assert math.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
        moved[s] = favoured_logp(new)
    start = favoured_logp(params)
    assert moved[1.0] > start > moved[-1.0], (moved, start)


def test_main_runs_a_few_iterations_with_the_verifier(capsys):
    history = ex.main(["--steps", "2", "--seed", "0", "--sft-steps", "1", "--prompts", str(PROMPTS)])
    printed = capsys.readouterr().out
    assert len(history) == 2 and printed.count("reward ") == 2
    for stats in history:
        assert math.isfinite(stats["loss"]) and 0.0 <= stats["reward"] <= 1.0

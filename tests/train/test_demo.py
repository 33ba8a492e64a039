"""The README's first command, shortened: `jaxrl4llm demo --quick` end to end (task, SFT warm
start, Lite PPO, report, curves), the rule that reuses a warm start, and a short run from the
same warm start that must learn, and does not with the loss sign flipped."""

import contextlib
import io
import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxrl4llm.cli import main as cli_main
from jaxrl4llm.train.config import load_config
from jaxrl4llm.train.demo import config_path, warm_start_recipe
from jaxrl4llm.train.warm_start import RECIPE_FILE as WARMSTART_RECIPE
from jaxrl4llm.train.warm_start import warm_start_matches
from jaxrl4llm.train.loop import train
from tests.host_identity import describe, host_identity, matching_pin

# the quick demo's metrics pinned bit for bit: at XLA's default LLVM optimisation level (tests/conftest.py)
pytestmark = pytest.mark.xla_default_opt


# The pinned run's row form: packed rows, the default when the pin was made (issue #37: with the row
# form fixed as then, the metrics stay bit for bit). The default is now `auto` (shared-prompt rows on
# the demo's task: other floats); the learning runs below take the default.
PINNED_ROW_FORM = ("trainer.packing=true",)


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory):
    """`jaxrl4llm demo --quick` once: (its --out-dir, what it printed). It and the learning runs
    below use XLA's persistent compile cache (this module's folder), so those load the programs
    they share with it."""
    root = tmp_path_factory.mktemp("quick_demo")
    before = jax.config.jax_compilation_cache_dir
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            status = cli_main(["demo", "--quick", "--out-dir", str(root / "demo"), "trainer.progress_bar=false",
                               f"trainer.compile_cache={root / 'xla'}", *PINNED_ROW_FORM])
        assert status == 0
        yield root / "demo", printed.getvalue()
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_quick_demo_runs_end_to_end(quick_demo):
    out, printed = quick_demo
    assert "held-out accuracy: " in printed and "% -> " in printed
    assert (out / "rl" / "curves.png").stat().st_size > 10_000
    assert (out / "rl" / "hf_export" / "config.json").is_file()
    warm = out / "warmstart"
    assert (warm / "tokenizer.json").is_file() and (warm / "model.safetensors").is_file()
    assert json.loads((warm / WARMSTART_RECIPE).read_text())["sft"]["steps"] == 30
    steps = [json.loads(line)["step"] for line in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 3]  # eval before, three steps, eval after


PINNED = Path(__file__).parent / "data" / "quick_demo_metrics.json"
WALL_CLOCK = re.compile(r"(^|/)(time(_|$)|tokens_per_second)")


def pinned_metrics(run_dir) -> list[dict]:
    """The records of `run_dir`/metrics.jsonl without their wall-clock keys (`time`, `time_*`,
    `tokens_per_second`): what a change of layout, loggers or defaults must leave bit for bit."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not WALL_CLOCK.search(k)} for line in lines]


def test_quick_demo_metrics_are_bit_identical_to_the_pinned_run(quick_demo):
    """Issues #37 and #38: the quick demo's metrics (packed rows, PINNED_ROW_FORM) do not move when
    the layout, the loggers or the row-form code change: bit for bit against the pin made on this
    host. The pins are kept per host (`tests/host_identity.py`: jax, CPU name, instruction sets,
    caches, cores): the run multiplies matrices, which XLA:CPU hands to libraries that pick their
    kernels and blocking from the CPU they find, so no instruction-set cap makes its bits the same
    on every host, and a last-bit difference flips a sampled token and with it the whole run. On a
    host no pin was made on, the run is held to what does not depend on the host
    (`check_host_independent`), with a NOTICE; it is never compared with another host's run."""
    out, _ = quick_demo
    pins = json.loads(PINNED.read_text())["pins"]
    check_against_pins(pinned_metrics(out / "rl"), pins, host_identity())


def check_against_pins(got: list[dict], pins: list[dict], host: dict) -> str:
    """Bit for bit against `host`'s pin ("pinned"); with no pin for `host`, `check_host_independent`
    against the first pin's records ("host-independent", after a NOTICE). Raises AssertionError."""
    pin = matching_pin(pins, host)
    reference = (pin or pins[0])["rows"]
    assert len(got) == len(reference), "the demo logs another number of records"
    for g, p in zip(got, reference):  # new metrics may join; the pinned ones stay
        assert set(p) <= set(g), f"step {p['step']}: metrics no longer logged: {sorted(set(p) - set(g))}"
    got = [{k: g[k] for k in p} for g, p in zip(got, reference)]
    if pin is not None:
        assert got == pin["rows"], (
            f"the quick demo's metrics moved (pinned on {describe(pin)}, this host). If the change is intended, "
            f"re-pin: python -m tests.train.pin_quick_demo OUT/rl (a --quick {' '.join(PINNED_ROW_FORM)} run)")
        return "pinned"
    print(f"NOTICE: no pin for this host ({describe(host)}): the quick demo's run is checked for what does not "
          "depend on the host (steps, metric names, finite values, shares in [0, 1], the schedule), not bit for "
          "bit. To pin this host: python -m tests.train.pin_quick_demo --add OUT/rl")
    check_host_independent(got, reference)
    return "host-independent"


# Records that no host's float sums move: the step, the learning-rate schedule (a function of the step),
# how many prompts each step drew and the share of rows in the loss (the demo fills every group).
HOST_INDEPENDENT = ("step", "learning_rate", "sampling_draws", "sampling_prompts_drawn", "rows_in_loss")
SHARE = re.compile(r"(^|/)(accuracy|reward|reward_all_draws|clip_frac(_high|_low)?|dual_clip_frac|truncation_rate|"
                   r"truncated_\w+_ratio|all_same_\w+|rows_in_loss|pass@\d+|maj@\d+|mean@\d+)$")


def check_host_independent(got: list[dict], reference: list[dict]) -> None:
    """What another host's run of the quick demo shares with the pinned one: every value finite, the
    HOST_INDEPENDENT records equal (the schedule within float32 rounding), shares within [0, 1]."""
    for g, p in zip(got, reference):
        step = p["step"]
        for k, v in g.items():
            assert np.isfinite(v), f"step {step}: {k} = {v}"
            if SHARE.search(k):
                assert 0.0 <= v <= 1.0, f"step {step}: {k} = {v} is a share, outside [0, 1]"
        for k in HOST_INDEPENDENT:
            if k in p:
                np.testing.assert_allclose(g[k], p[k], rtol=1e-6, err_msg=f"step {step}: {k}")


def test_an_unknown_host_is_checked_for_what_does_not_depend_on_the_host():
    """A simulated host no pin was made on (another CPU's name and flags, or another jax): a run that
    sampled other tokens passes with a NOTICE; the pinned host's run must match to the last bit; a
    broken run (a NaN, a share above 1, another schedule) fails on any host."""
    pins = json.loads(PINNED.read_text())["pins"]
    own = next(pin for pin in pins if "cores" in pin)  # a pin that records the whole identity
    rows = own["rows"]
    pinned_host = {k: own[k] for k in ("jax", "jaxlib", "cpu", "isa", "caches", "cores") if k in own}
    resampled = [{k: (v * (1 + 1e-3) if k in ("entropy", "loss", "grad_norm") else v) for k, v in r.items()}
                 for r in rows]
    for unknown in ({**pinned_host, "cpu": "Imaginary CPU 9000", "isa": "avx avx2 avx512f avx512_fp16 fma"},
                    {**pinned_host, "jax": "9.9.9"}, {**pinned_host, "cores": "64"}):
        assert matching_pin(pins, unknown) is None
        assert check_against_pins(resampled, pins, unknown) == "host-independent"
        for broken in ({"entropy": float("nan")}, {"accuracy": 1.5}, {"learning_rate": 1.0}):
            bad = [dict(r) for r in rows]
            bad[1].update(broken)
            with pytest.raises(AssertionError):
                check_against_pins(bad, pins, unknown)
    assert check_against_pins(rows, pins, pinned_host) == "pinned"
    with pytest.raises(AssertionError, match="moved"):
        check_against_pins(resampled, pins, pinned_host)


def test_a_host_takes_only_its_own_pin():
    host = {"jax": "0.10.2", "jaxlib": "0.10.2", "cpu": "AMD EPYC", "isa": "avx avx2 avx512f", "caches": "L1d:32K",
            "cores": "2"}
    legacy = {"jax": "0.10.2", "jaxlib": "0.10.2", "cpu": "AMD EPYC", "rows": []}  # instruction sets not recorded
    own = {**host, "rows": [1]}
    before_caches = {k: v for k, v in own.items() if k not in ("caches", "cores")}
    other = {**host, "isa": "avx avx2", "rows": [2]}
    assert matching_pin([legacy, other, own], host) is own
    assert matching_pin([legacy, other, before_caches], host) is before_caches
    assert matching_pin([legacy, other], host) is None  # another host's run is never the reference
    assert matching_pin([own], {**host, "caches": "L1d:48K"}) is None
    assert matching_pin([own], {**host, "jax": "0.12.0"}) is None
    assert "with avx512f" in describe(host) and "not recorded" in describe(legacy)


def test_warm_start_is_reused_only_for_the_same_recipe(tmp_path):
    recipe = warm_start_recipe(None)
    assert not warm_start_matches(tmp_path, recipe)  # empty folder
    (tmp_path / "config.json").write_text("{}")
    assert not warm_start_matches(tmp_path, recipe)  # no recipe file: built by something else
    (tmp_path / WARMSTART_RECIPE).write_text(json.dumps(recipe))
    assert warm_start_matches(tmp_path, recipe)
    assert not warm_start_matches(tmp_path, warm_start_recipe(17))  # other SFT steps
    (tmp_path / WARMSTART_RECIPE).write_text("{not json")
    assert not warm_start_matches(tmp_path, recipe)


LEARN_STEPS = 15
MIN_RISE = 0.10


def learning_run(demo_out, run_dir, *overrides) -> list[dict]:
    """LEARN_STEPS steps of configs/demo.yaml (Lite PPO, seed 0, no evaluation) from the quick
    demo's warm start, rewarded for a boxed integer; the step records."""
    cfg = load_config(config_path(), [
        f"model.path={demo_out / 'warmstart'}", f"data.train_files=[{demo_out / 'data' / 'train.jsonl'}]",
        "data.eval_files=[]", f"trainer.out_dir={run_dir}", f"trainer.steps={LEARN_STEPS}", "trainer.eval_every=-1",
        "trainer.checkpoint_every=0", "trainer.export_hf=false", "trainer.progress_bar=false",
        f"trainer.compile_cache={demo_out.parent / 'xla'}",
        "reward.fn=tests.train.custom_parts:boxed_integer_reward", "reward.batched=false", *overrides])
    history = train(cfg, log=lambda *a: None)["history"]
    assert len(history) == LEARN_STEPS
    return history


def reward_rise(history: list[dict]) -> float:
    """Mean training reward of the last 3 steps minus that of the first 3."""
    rewards = [r["reward"] for r in history]
    return float(np.mean(rewards[-3:]) - np.mean(rewards[:3]))


def test_lite_ppo_from_the_demo_warm_start_learns(quick_demo, tmp_path):
    """15 steps of the demo's recipe must raise the share of responses that box an integer by
    MIN_RISE (a flipped loss sign or broken advantages make it fall or stay flat).

    The quick warm start (30 SFT steps) boxes an integer in about a third of its responses and
    almost never the right one: the verifier's reward is ~0.03 and stays flat for many steps,
    while the format is learnable in 15. Rise (steps 13-15 minus steps 1-3), measured on the
    2-core VM: trainer.seed=0..6 gave +0.25, +0.25, +0.19, +0.28, +0.24, +0.22, +0.23 (mean
    +0.24, sd 0.03; seed 0: 0.33 -> 0.58). Broken learning, seeds 0 and 1: the loss sign flipped
    -0.28, -0.28 (seed 2: -0.30; no box left by step 6), advantages zeroed -0.03, -0.01,
    advantages of another prompt's group -0.05, -0.23. MIN_RISE = 0.10 is 3 sd below the
    lowest learning seed and 0.11 above the highest broken run. ~20 s (the update compiles: its
    schedule differs from the quick demo's; the sampler and scoring programs come from the cache).
    """
    assert reward_rise(learning_run(quick_demo[0], tmp_path / "rl")) >= MIN_RISE


def test_the_same_run_with_the_loss_sign_flipped_fails_the_check(quick_demo, tmp_path):
    """What the test above catches: core.policy_loss negated (`algorithm.custom_loss` by import
    path, which this also proves reaches the update) and the reward falls. ~20 s."""
    history = learning_run(quick_demo[0], tmp_path / "rl",
                           "algorithm.custom_loss=tests.train.custom_parts:negated_policy_loss")
    assert all(r["custom_loss_used"] == 1.0 for r in history)
    assert reward_rise(history) < MIN_RISE

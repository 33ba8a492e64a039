"""The README's first command, shortened: `jaxrl4llm demo --quick` end to end (task, SFT warm
start, Lite PPO, report, curves), the rule that reuses a warm start, and a short run from the
same warm start that must learn, and does not with the loss sign flipped."""

import contextlib
import io
import json
import platform
import re
from pathlib import Path

import jax
import jaxlib
import numpy as np
import pytest

from jaxrl4llm.cli import main as cli_main
from jaxrl4llm.train.config import load_config
from jaxrl4llm.train.demo import config_path, warm_start_recipe
from jaxrl4llm.train.warm_start import RECIPE_FILE as WARMSTART_RECIPE
from jaxrl4llm.train.warm_start import warm_start_matches
from jaxrl4llm.train.loop import train

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
    the layout, the loggers or the row-form code change. XLA:CPU compiles for the host's instruction
    sets, and a last-bit difference flips a sampled token and with it the whole run, so the pins are
    kept per host (`host_identity`): bit for bit against this host's pin; on a host with none, within
    1e-4 relative of the first pin (what a different machine can hope for), saying so."""
    out, _ = quick_demo
    pins = json.loads(PINNED.read_text())["pins"]
    got = pinned_metrics(out / "rl")
    pin = matching_pin(pins, host_identity())
    reference = pin or pins[0]
    assert len(got) == len(reference["rows"]), "the demo logs another number of records"
    for g, p in zip(got, reference["rows"]):  # new metrics may join; the pinned ones stay
        assert set(p) <= set(g), f"step {p['step']}: metrics no longer logged: {sorted(set(p) - set(g))}"
    got = [{k: g[k] for k in p} for g, p in zip(got, reference["rows"])]
    if pin is not None:
        assert got == pin["rows"], (
            f"the quick demo's metrics moved (pinned on {describe(pin)}, this host). If the change is intended, "
            f"re-pin: python -m tests.train.pin_quick_demo OUT/rl (a --quick {' '.join(PINNED_ROW_FORM)} run)")
    else:
        print(f"NOTICE: no pin for this host ({describe(host_identity())}); compared within 1e-4 of the pin made on "
              f"{describe(reference)}. To pin this host: python -m tests.train.pin_quick_demo --add OUT/rl")
        for g, p in zip(got, reference["rows"]):
            for k in p:
                np.testing.assert_allclose(g[k], p[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_a_host_takes_its_own_pin_then_a_legacy_pin_of_its_name_then_none():
    host = {"jax": "0.10.2", "jaxlib": "0.10.2", "cpu": "AMD EPYC", "isa": "avx avx2 avx512f"}
    legacy = {"jax": "0.10.2", "jaxlib": "0.10.2", "cpu": "AMD EPYC", "rows": []}
    own = {**host, "rows": [1]}
    other = {**host, "isa": "avx avx2", "rows": [2]}
    assert matching_pin([legacy, other, own], host) is own
    assert matching_pin([legacy, other], host) is legacy  # no pin names its instruction sets
    assert matching_pin([other], host) is None
    assert matching_pin([legacy], {**host, "jax": "0.12.0"}) is None
    assert "with avx512f" in describe(host) and "not recorded" in describe(legacy)


def cpuinfo_field(*names: str) -> str | None:
    """The first /proc/cpuinfo line named one of `names`, its value; None where there is none."""
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.split(":")[0].strip() in names:
            return line.split(":", 1)[1].strip()
    return None


def cpu_name() -> str:
    return cpuinfo_field("model name") or platform.machine()


# The instruction-set flags XLA:CPU's code generation reads (LLVM targets the host's): two hosts with
# the same model name ("AMD EPYC" under a hypervisor) can differ here, and their runs with them.
ISA_PREFIXES = ("avx", "sse", "ssse", "fma", "f16c", "bmi", "amx", "vaes", "vpclmul", "gfni", "sha_ni", "adx", "asimd",
                "sve", "fphp", "bf16", "i8mm")


def cpu_isa() -> str:
    """This host's instruction-set flags (/proc/cpuinfo's flags / Features, ISA_PREFIXES), sorted."""
    flags = (cpuinfo_field("flags", "Features") or "").split()
    return " ".join(sorted(f for f in flags if f.startswith(ISA_PREFIXES)))


def host_identity() -> dict:
    """What a bit-for-bit pin depends on: jax, jaxlib, the CPU's name and instruction sets."""
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "cpu": cpu_name(), "isa": cpu_isa()}


def matching_pin(pins: list[dict], host: dict) -> dict | None:
    """The pin made on this host: same jax, jaxlib, CPU name and instruction sets. A pin from before
    the instruction sets were recorded (no "isa") serves a host of its name that no pin names by its
    instruction sets."""
    same = lambda pin: all(pin.get(k) == host[k] for k in ("jax", "jaxlib", "cpu"))
    exact = [pin for pin in pins if same(pin) and pin.get("isa") == host["isa"]]
    legacy = [pin for pin in pins if same(pin) and "isa" not in pin]
    return (exact or legacy or [None])[0]


def describe(identity: dict) -> str:
    """A host identity (or a pin) in words: jax, CPU name, and how many instruction-set flags."""
    isa = identity.get("isa")
    if not isa:
        return f"jax {identity['jax']}, {identity['cpu']}, instruction sets not recorded"
    avx512 = "with" if "avx512f" in isa.split() else "without"
    return f"jax {identity['jax']}, {identity['cpu']}, {len(isa.split())} instruction-set flags ({avx512} avx512f)"


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

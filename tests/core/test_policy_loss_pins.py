"""policy_loss equals the values pinned at commit cda4f50, before the surrogates became a table: for
every shipped preset and the surrogate variants (GSPO, GSPO-token, dual clip, SAPO, CISPO's absolute
cap, Clip-Cov, KL-Cov, TIS, MIS), on one fixed random batch, under jit, bit for bit.

The pins were made on an AMD EPYC host without AVX512-BF16. XLA:CPU compiles for the host's instruction sets
and sums a mean in the order its vector width gives (natively, an AVX-512 host moves approx_kl and
entropy by 1-2 ulps), so the outputs are computed in a process of their own with XLA capped at AVX2
(`tests/host_identity.py`, `policy_loss_pins_main.py`): the same code, and the same bits, on every
x86-64-v3 host. A host that cannot take the cap (not x86-64, or no AVX2) computes them in this
process and is held within MAX_ULP ulps, with a NOTICE naming why.

The fixture data/policy_loss_cda4f50.npz holds, per case (`cases`), what `pinned_outputs` returns
(`scalar_keys` "case:name" / `scalars`: the loss numerator and denominator and every metric;
`grad_logp` [cases, B, T]: d numerator / d logp) and the train step's clip flags (`clip_flags`
[cases, B, T]: `core.surrogate.clip_flags(...) & row_weights > 0`, as train/step.py computed them),
all computed at cda4f50 from the inputs below (float32 bits kept exactly).
"""

import dataclasses
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl4llm.core import CISPO, GRPO, LITE_PPO, PRESETS, apply_surrogate, compute_advantages, policy_loss
from tests.host_identity import portable_env, portable_isa_missing

# float32 bits pinned at cda4f50: at XLA's default LLVM optimisation level (tests/conftest.py)
pytestmark = pytest.mark.xla_default_opt

FIXTURE = Path(__file__).parent / "data" / "policy_loss_cda4f50.npz"
B, G, T = 8, 4, 12

CASES = {
    # the distillation presets' teacher signal enters in train.step, not policy_loss (tests/train/test_teacher.py)
    **{f"preset_{name}": recipe for name, recipe in PRESETS.items() if not recipe.distills},
    "gspo": dataclasses.replace(GRPO, name="gspo", ratio_level="sequence", eps_low=3e-4, eps_high=4e-4, kl_coef=0.0),
    "gspo_token": dataclasses.replace(GRPO, name="gspo_token", ratio_level="sequence_token", eps_low=3e-4,
                                      eps_high=4e-4, kl_coef=0.0),
    "dual_clip_k1_clamped": dataclasses.replace(GRPO, dual_clip=1.2, kl_kind="k1", kl_clamp=0.5, kl_coef=0.05),
    "sapo": dataclasses.replace(GRPO, name="sapo", surrogate="sapo", kl_coef=0.0),
    "cispo_absolute": dataclasses.replace(CISPO, cispo_cap_mode="absolute", eps_high=1.5, eps_low=0.2),
    "clip_cov": dataclasses.replace(LITE_PPO, cov_control="clip_cov", cov_ratio=0.3, clip_cov_low=-1e9,
                                    clip_cov_high=1e9),
    "clip_cov_cispo": dataclasses.replace(CISPO, eps_low=0.2, eps_high=0.2, cov_control="clip_cov", cov_ratio=0.3,
                                          clip_cov_low=-1e9, clip_cov_high=1e9),
    "kl_cov": dataclasses.replace(LITE_PPO, cov_control="kl_cov", cov_ratio=0.2),
    "tis_entropy": dataclasses.replace(LITE_PPO, entropy_coef=0.01, tis_cap=2.0),
    "mis_seq": dataclasses.replace(LITE_PPO, ratio_level="sequence", is_correction="mis_seq", is_cap=1.5),
}


def pinned_inputs():
    """The fixed batch: 2 prompts x 4 responses, 12 tokens, log-ratios of scale 0.5 (many clipped)."""
    g = np.random.default_rng(20261127)
    lengths = g.integers(1, T + 1, size=B)
    mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
    old = -g.exponential(1.0, size=(B, T)).astype(np.float32)
    return dict(
        rewards=np.array([1, 0, 0, 1, 0, 0, 0, 1], np.float32),
        truncated=lengths == T,
        lengths=lengths.astype(np.int32),
        mask=mask,
        old_logp=old,
        logp=(old + 0.5 * g.normal(size=(B, T))).astype(np.float32),
        ref_logp=(old - 0.1 * np.abs(g.normal(size=(B, T)))).astype(np.float32),
        sampler_logp=(old + 0.2 * g.normal(size=(B, T))).astype(np.float32),
        entropy=np.abs(g.normal(size=(B, T))).astype(np.float32),
    )


def loss_arguments(recipe, inputs):
    """policy_loss's keyword arguments (advantages from compute_advantages, eagerly)."""
    x = {k: jnp.asarray(v) for k, v in inputs.items()}
    batch = compute_advantages(x["rewards"], G, recipe, truncated=x["truncated"], lengths=x["lengths"])
    return dict(logp=x["logp"], old_logp=x["old_logp"], advantages=batch.advantages, mask=x["mask"],
                row_weights=batch.row_weights, denominator_weights=batch.denominator_weights,
                ref_logp=x["ref_logp"], sampler_logp=x["sampler_logp"], entropy=x["entropy"],
                key=jax.random.PRNGKey(7))


def _jitted_loss(recipe):
    def numerator(logp, kwargs):
        terms, metrics = policy_loss(recipe, logp=logp, **kwargs)
        return terms.numerator, (terms, metrics)

    return jax.jit(jax.grad(numerator, has_aux=True))


def pinned_outputs(recipe, inputs):
    """{name: array}: the loss numerator and denominator, each metric (metric/<key>), grad_logp."""
    kwargs = loss_arguments(recipe, inputs)
    logp = kwargs.pop("logp")
    grad, (terms, metrics) = _jitted_loss(recipe)(logp, kwargs)
    out = {"numerator": terms.numerator, "denominator": terms.denominator, "grad_logp": grad}
    out.update({f"metric/{k}": v for k, v in metrics.items()})
    return {k: np.asarray(v) for k, v in out.items()}


def load_pins(case):
    """({name: array} as pinned_outputs returns it, clip flags [B, T]) of one case, from the fixture."""
    with np.load(FIXTURE) as data:
        index = [c.decode() for c in data["cases"]].index(case)
        pinned = {k.decode().split(":", 1)[1]: v for k, v in zip(data["scalar_keys"], data["scalars"])
                  if k.decode().startswith(case + ":")}
        pinned["grad_logp"] = data["grad_logp"][index]
        return pinned, data["clip_flags"][index]


MAX_ULP = 4  # a host without the AVX2 cap: XLA:CPU sums a mean in the order its vector width gives
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def computed(tmp_path_factory):
    """(case -> {name: array} as pinned_outputs returns it, ulps allowed, why not bit for bit or None):
    from a process with XLA capped at AVX2 where this host can take the cap, else from this one."""
    missing = portable_isa_missing()
    if missing is not None:
        return {case: pinned_outputs(CASES[case], pinned_inputs()) for case in CASES}, MAX_ULP, missing
    out = tmp_path_factory.mktemp("policy_loss_pins") / "outputs.npz"
    done = subprocess.run([sys.executable, "-m", "tests.core.policy_loss_pins_main", str(out)], cwd=REPO,
                          env=portable_env(), capture_output=True, text=True)
    assert done.returncode == 0, f"policy_loss_pins_main failed:\n{done.stderr[-3000:]}"
    by_case = {}
    with np.load(out) as data:
        for key in data.files:
            case, name = key.split("|", 1)
            by_case.setdefault(case, {})[name] = data[key]
    return by_case, 0, None


@pytest.mark.parametrize("case", sorted(CASES))
def test_policy_loss_equals_cda4f50_to_the_last_bits(case, computed):
    outputs, max_ulp, why = computed
    got = outputs[case]
    want, _ = load_pins(case)
    assert set(got) == set(want), "the metrics' names changed"
    moved = []
    for key, value in got.items():
        try:
            np.testing.assert_array_max_ulp(value, want[key], maxulp=max_ulp)
        except AssertionError as error:
            raise AssertionError(f"{case}: {key} moved from the pin made at cda4f50: {error}") from None
        if not np.array_equal(value, want[key]):
            moved.append(key)
    if moved:
        print(f"NOTICE: {case}: {moved} within {max_ulp} ulps of the pins, not bit for bit: this is {why}, "
              "where XLA:CPU cannot be capped at AVX2 (tests/host_identity.py)")


@pytest.mark.parametrize("case", sorted(CASES))
def test_step_clip_flags_are_those_of_cda4f50(case):
    """The train step's flags (train/step.py: the surrogate's `clipped` on the loss mask, rows with
    weight 0 removed) are the ones core.surrogate.clip_flags gave at cda4f50."""
    recipe = CASES[case]
    kw = loss_arguments(recipe, pinned_inputs())
    flags = apply_surrogate(recipe, jax.lax.stop_gradient(kw["logp"]), kw["old_logp"], kw["advantages"],
                            kw["mask"]).clipped
    flags = flags & (kw["row_weights"][:, None] > 0)
    _, want = load_pins(case)
    np.testing.assert_array_equal(np.asarray(flags), want)

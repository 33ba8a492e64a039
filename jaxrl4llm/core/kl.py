"""Per-token estimators of KL(pi || pi_ref) from log-probs of sampled tokens (k1, k2, k3, abs).

Schulman, "Approximating KL divergence" (2020): with tokens drawn from pi and
d = ref_logp - logp,
  k1 = -d                      unbiased, high variance, can be negative
  k2 = d^2 / 2                 biased, low variance ("mse" in verl)
  k3 = exp(d) - d - 1          unbiased, low variance, always >= 0 (GRPO's KL term)
  abs = |d|
"""

from __future__ import annotations

from typing import Literal

import chex
import jax.numpy as jnp

KLKind = Literal["k1", "k2", "k3", "abs", "mse", "low_var_kl"]
KL_KINDS = ("k1", "k2", "k3", "abs", "mse", "low_var_kl")
_ALIASES = {"mse": "k2", "low_var_kl": "k3"}
# verl clamps the log-ratio before exp in k3; exp(20) is finite in float32.
K3_LOG_RATIO_CLAMP = 20.0


def kl_penalty(
    logp: chex.Array,
    ref_logp: chex.Array,
    kind: KLKind = "k3",
    *,
    clamp: float | None = None,
) -> chex.Array:
    """Per-token KL(pi || pi_ref) estimate; with d = ref_logp - logp: k1 = -d, k2 = d^2/2, k3 = e^d - d - 1, abs = |d|.

    DeepSeekMath GRPO uses k3 (DeepSeek-AI 2024); verl names k2 "mse" and k3 "low_var_kl",
    clamps k3's d to [-20, 20] and its result to [-10, 10] (pass clamp=10.0 for the latter).

    Args:
      logp: [B, T] log-probs of sampled tokens under the current policy (gradients flow).
      ref_logp: [B, T] log-probs under the frozen reference policy.
      kind: "k1" | "k2" | "k3" | "abs" (aliases "mse" = k2, "low_var_kl" = k3).
      clamp: if given, the estimate is clipped to [-clamp, clamp].

    Returns:
      [B, T] float32 per-token estimates (mask them before aggregation); float64 for float64
      inputs under jax_enable_x64.
    """
    chex.assert_equal_shape([logp, ref_logp])
    if kind not in KL_KINDS:
        raise ValueError(f"Unknown KL estimator {kind!r}; valid kinds: {', '.join(KL_KINDS)}.")
    kind = _ALIASES.get(kind, kind)
    # float32 for bf16/f16/f32 inputs; float64 only for float64 inputs under jax_enable_x64 (the
    # exact-gradient tests of core/distill.py), where a float32 cast would hide 1e-12 identities.
    dtype = jnp.promote_types(jnp.result_type(logp, ref_logp), jnp.float32)
    d = ref_logp.astype(dtype) - logp.astype(dtype)
    if kind == "k1":
        kl = -d
    elif kind == "k2":
        kl = 0.5 * jnp.square(d)
    elif kind == "k3":
        d = jnp.clip(d, -K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
        kl = jnp.exp(d) - d - 1.0
    else:
        kl = jnp.abs(d)
    if clamp is not None:
        kl = jnp.clip(kl, -clamp, clamp)
    return kl

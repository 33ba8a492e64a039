"""On-policy distillation (OPD): a teacher's log-probs at the student's sampled tokens as a dense signal.

The student pi samples y_t; the teacher pi_T scores the same tokens. Per sampled token

    d_t = log pi(y_t | h_t) - log pi_T(y_t | h_t),   E_{y ~ pi}[d_t] = KL(pi || pi_T)(h_t)

(the per-token reverse KL). Two ways to use it:

  advantage (Thinking Machines, slime, ROLL, verl use_policy_gradient=True):
      A_t = A_row - coef·sg(d_t) [+ sum_{t'>t} discount^(t'-t)·(-coef·sg(d_t'))], fed to the usual
      PPO/IS surrogate (which accepts [B, T] advantages): `distill_advantages`.
  loss (verl use_policy_gradient=False, GKD-style): back-propagate a single-sample estimator of
      the KL: `distill_loss`. Only k2 follows the reverse KL; k1's expected gradient is 0 and k3's
      is that of the FORWARD KL(pi_T || pi) (table in `distill_loss`).

At IS ratio 1 the advantage mode and the k2 loss give the same per-sample gradient,
coef·d_t·grad log pi(y_t); they differ only through the ratio and the clip when the update is
off-policy (several epochs or mini-batches).

Conventions: token arrays [B, T]; a token is counted where mask > 0 (the mask's value is not a
weight here); uncounted positions may hold anything (padding, -inf) and never reach an output.
Outputs are float32 (float64 only for float64 inputs under jax_enable_x64, as the exact-gradient
tests use); string/int options (kind, num_bins) and discount are static under jit.

References: Thinking Machines, "On-Policy Distillation" (Lu et al., 2025; tinker-cookbook
`distillation/train_on_policy.py`); Agarwal et al. 2024, "On-Policy Distillation of Language
Models: Learning from Self-Generated Mistakes" (GKD), arXiv 2306.13649; J. Schulman 2020,
"Approximating KL divergence" (k1, k2, k3).
"""

from __future__ import annotations

from typing import Literal

import chex
import jax
import jax.numpy as jnp

from jaxrl4llm.core.kl import kl_penalty

DistillLossKind = Literal["k1", "k2", "k3", "mse", "low_var_kl"]
# The kl_penalty kinds whose back-propagated expectation is a known gradient ("abs" is not one).
DISTILL_LOSS_KINDS = ("k1", "k2", "k3", "mse", "low_var_kl")


def _compute_dtype(*xs: chex.Array) -> jnp.dtype:
    """float32 for bf16/f16/f32 inputs; float64 for float64 inputs (only possible under x64)."""
    return jnp.promote_types(jnp.result_type(*xs), jnp.float32)


def _check_token_arrays(fn: str, **arrays: chex.Array) -> None:
    """ValueError unless every array is [B, T] with one common shape."""
    shapes = {name: tuple(jnp.shape(x)) for name, x in arrays.items()}
    listed = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
    if any(len(shape) != 2 for shape in shapes.values()) or len(set(shapes.values())) != 1:
        raise ValueError(f"{fn}: {', '.join(shapes)} must all be [B, T] of one shape; got {listed}.")


def teacher_log_ratio(student_logp: chex.Array, teacher_logp: chex.Array, mask: chex.Array) -> chex.Array:
    """d_t = log pi(y_t) - log pi_T(y_t) on counted tokens (mask > 0), 0 elsewhere.

    E_{y_t ~ pi}[d_t] = KL(pi || pi_T)(h_t), the per-token reverse KL (Thinking Machines 2025,
    "On-Policy Distillation": `reverse_kl = (sampled_logprobs - teacher_logprobs) * mask`).
    Gradients flow as the inputs allow (wrap in stop_gradient for an advantage).

    Args:
      student_logp: [B, T] the student's log-probs of its sampled tokens.
      teacher_logp: [B, T] the teacher's log-probs of the same tokens.
      mask: [B, T] counted response tokens (> 0).

    Returns:
      d [B, T] float32, 0 where mask == 0 (whatever the inputs hold there).
    """
    _check_token_arrays("teacher_log_ratio", student_logp=student_logp, teacher_logp=teacher_logp, mask=mask)
    dtype = _compute_dtype(student_logp, teacher_logp)
    d = student_logp.astype(dtype) - teacher_logp.astype(dtype)
    return jnp.where(mask > 0, d, jnp.zeros((), dtype))


def _discounted_future_sum(x: chex.Array, discount: float) -> chex.Array:
    """y_t = sum_{t' >= t} discount^(t' - t)·x_t' along axis 1 of [B, T] (y_t = x_t + discount·y_{t+1}).

    A reverse associative scan of the linear recurrence (log T depth, no loop over T); each
    element is (a, b) = (discount, x_t) and combining a later element with an earlier one
    composes the affine maps y -> a·y + b.
    """
    decay = jnp.full(x.shape, discount, x.dtype)

    def combine(later, earlier):
        a_later, b_later = later
        a_earlier, b_earlier = earlier
        return a_later * a_earlier, b_earlier + a_earlier * b_later

    _, y = jax.lax.associative_scan(combine, (decay, x), reverse=True, axis=1)
    return y


def distill_advantages(
    row_advantages: chex.Array | None,
    student_logp: chex.Array,
    teacher_logp: chex.Array,
    mask: chex.Array,
    *,
    coef: float,
    discount: float = 0.0,
    clip: float | None = None,
) -> chex.Array:
    """A_t = A_row + sum_{counted t' >= t} discount^(t'-t)·c_t', c_t = clip(-coef·sg(d_t), +-clip); 0 uncounted.

    The OPD advantage of Thinking Machines' "On-Policy Distillation" (2025): tinker-cookbook adds
    `-kl_penalty_coef·mask·d_t` to the advantages, optionally replaced by its discounted future
    sum (`kl_discount_factor`, default 0); slime (A_t - lambda_opd·d_t), ROLL (`use_opd`) and verl
    (`use_policy_gradient=True`, advantages = -distillation loss) use the same per-token signal.
    The result is an advantage: no gradient flows to any input (stop-gradient on both log-probs).

    (0^0 = 1:) discount = 0 gives the per-token form A_row - coef·d_t; discount > 0 adds the future tokens'
    terms, the exponent counting raw positions t' - t (as the cookbook's discounted sum over the
    row; uncounted positions add 0 but still count in the exponent). discount = 1 is the
    undiscounted sum to the end of the response.

    Clip (a choice): `clip` bounds each token's term c_t = -coef·d_t to [-clip, clip] BEFORE the
    discounted sum, not the total; the distillation part of A_t is then bounded by
    clip·sum_k discount^k. This is verl's placement: `loss_max_clamp` clamps the per-token
    estimator (d_t for k1, before verl's coefficient, so verl's c is clip = coef·c here) and
    its policy-gradient mode uses -clamped loss as the advantage (verl/trainer/distillation/
    losses.py). The Thinking Machines cookbook adds the unclipped term (`incorporate_kl_penalty`).

    Args:
      row_advantages: [B] the task advantage of each response (e.g. GRPO's), or None for pure
        distillation (A_row = 0, not a normalised zero reward).
      student_logp: [B, T] log-probs of the sampled tokens under the student (pi_old, or the
        sampler's log-probs when those define the behaviour policy).
      teacher_logp: [B, T] the teacher's log-probs of the same tokens.
      mask: [B, T] counted response tokens (> 0); right-, left-padded or holed rows alike.
      coef: beta >= 0, the weight of the distillation signal (Thinking Machines default 1.0).
      discount: gamma in [0, 1] of the future-token sum (static; 0: per token only).
      clip: bound > 0 on each token's term, or None.

    Returns:
      [B, T] float32 token advantages, 0 where mask == 0 (pass them to the surrogates as is).
    """
    _check_token_arrays("distill_advantages", student_logp=student_logp, teacher_logp=teacher_logp, mask=mask)
    b = student_logp.shape[0]
    if row_advantages is not None and tuple(jnp.shape(row_advantages)) != (b,):
        raise ValueError(
            f"distill_advantages: row_advantages must be [B] = ({b},) or None; got {tuple(jnp.shape(row_advantages))}."
        )
    discount = float(discount)
    if not 0.0 <= discount <= 1.0:
        raise ValueError(f"distill_advantages: discount must be in [0, 1], got {discount}.")
    if clip is not None and isinstance(clip, (int, float)) and not clip > 0:
        raise ValueError(f"distill_advantages: clip must be > 0 or None, got {clip}.")
    counted = mask > 0
    d = jax.lax.stop_gradient(teacher_log_ratio(student_logp, teacher_logp, mask))
    term = -coef * d
    if clip is not None:
        term = jnp.clip(term, -clip, clip)
    term = jnp.where(counted, term, jnp.zeros((), d.dtype)).astype(d.dtype)
    if discount > 0.0:
        term = _discounted_future_sum(term, discount)
    if row_advantages is not None:
        row = jax.lax.stop_gradient(row_advantages).astype(d.dtype)
        term = row[:, None] + term
    return jnp.where(counted, term, jnp.zeros((), d.dtype))


def distill_loss(student_logp: chex.Array, teacher_logp: chex.Array, kind: DistillLossKind) -> chex.Array:
    """loss_t = kl_penalty(logp, sg(teacher_logp), kind), d = logp - teacher_logp: k1 = d, k2 = d^2/2, k3 = e^-d+d-1.

    Back-propagated per sampled token y_t ~ pi (the GKD-style "distillation as a loss", Agarwal
    et al. 2024, arXiv 2306.13649; estimators from Schulman 2020). Differentiating the student's
    log-prob with the sampling distribution held fixed, the expected gradient is:

      kind               per-token quantity   E_{y~pi}[grad loss]              verl loss_mode
      -----------------  -------------------  -------------------------------  ------------------
      k1                 d                    0 (a useless loss)               "k1" / "kl"
      k2 ("mse")         d^2 / 2              grad KL(pi || pi_T), reverse     "k2" / "mse"
      k3 ("low_var_kl")  e^{-d} + d - 1       grad KL(pi_T || pi), FORWARD     "k3" / "low_var_kl"

    (verl: `use_policy_gradient=False` back-propagates these; its distillation.yaml defaults to
    low_var_kl.) Per sample, grad k2 = d·grad log pi(y), the same gradient as the advantage mode
    A = -coef·sg(d) at IS ratio 1 (`distill_advantages`). The same table applies to GRPO's
    KL-to-reference term: `kl_kind="k3"` as a loss follows KL(pi_ref || pi). k3's log-ratio is
    clamped to +-20 (kl_penalty, as verl).

    Args:
      student_logp: [B, T] log-probs of the sampled tokens under the student (gradients flow).
      teacher_logp: [B, T] the teacher's log-probs of the same tokens (no gradient).
      kind: "k1" | "k2" | "k3" (aliases "mse" = k2, "low_var_kl" = k3); static under jit.

    Returns:
      [B, T] float32 per-token loss, unmasked (mask it in the aggregation, as the KL term).
    """
    if kind not in DISTILL_LOSS_KINDS:
        raise ValueError(f"Unknown distillation loss kind {kind!r}; valid kinds: {', '.join(DISTILL_LOSS_KINDS)}.")
    _check_token_arrays("distill_loss", student_logp=student_logp, teacher_logp=teacher_logp)
    return kl_penalty(student_logp, jax.lax.stop_gradient(teacher_logp), kind)


def teacher_kl_metrics(
    student_logp: chex.Array, teacher_logp: chex.Array, mask: chex.Array, num_bins: int = 10
) -> dict[str, chex.Array]:
    """teacher_kl = sum_counted d_t / #counted; teacher_kl_by_position[k] = the same mean over the tokens of bin k.

    `teacher_kl` is Thinking Machines' metric (the mean log-ratio over the batch's counted tokens,
    a Monte-Carlo estimate of the per-token reverse KL). `teacher_kl_by_position` shows where in
    the response the student departs from the teacher (supervision is reported to degrade at late
    tokens). A token's bin: in a row with n counted tokens, the j-th counted one (j = 0..n-1, in
    position order, i.e. its rank among the row's counted tokens) falls in bin floor(num_bins·j/n),
    so every row spreads its tokens evenly over the bins (deciles for num_bins = 10) whether it is
    right-, left-padded or holed; a row with n < num_bins leaves some bins empty.
    Bin means are token-weighted over the whole batch; an empty bin (and an empty batch) reads 0,
    `teacher_tokens_by_position` tells them apart.

    Args:
      student_logp, teacher_logp: [B, T] log-probs of the sampled tokens.
      mask: [B, T] counted response tokens (> 0).
      num_bins: number of position bins (static), >= 1.

    Returns:
      {"teacher_kl": [] float32, "teacher_kl_by_position": [num_bins] float32,
       "teacher_tokens_by_position": [num_bins] float32 (counted tokens per bin)}; no gradients.
    """
    _check_token_arrays("teacher_kl_metrics", student_logp=student_logp, teacher_logp=teacher_logp, mask=mask)
    if not isinstance(num_bins, int) or num_bins < 1:
        raise ValueError(f"teacher_kl_metrics: num_bins must be an int >= 1, got {num_bins!r}.")
    d = jax.lax.stop_gradient(teacher_log_ratio(student_logp, teacher_logp, mask))
    counted = mask > 0
    ones = counted.astype(d.dtype)
    total = jnp.sum(ones)
    teacher_kl = jnp.where(total > 0, jnp.sum(d) / jnp.maximum(total, 1.0), 0.0).astype(d.dtype)

    rank = jnp.cumsum(counted.astype(jnp.int32), axis=1) - 1  # j: rank among the row's counted tokens
    n = jnp.sum(counted.astype(jnp.int32), axis=1, keepdims=True)  # [B, 1]
    bins = (num_bins * rank) // jnp.maximum(n, 1)  # floor(num_bins·j/n), exact in integers
    segment = jnp.where(counted, bins, num_bins).reshape(-1)  # uncounted tokens: a discarded extra bin
    tokens = jax.ops.segment_sum(ones.reshape(-1), segment, num_segments=num_bins + 1)[:num_bins]
    sums = jax.ops.segment_sum(d.reshape(-1), segment, num_segments=num_bins + 1)[:num_bins]
    by_position = jnp.where(tokens > 0, sums / jnp.maximum(tokens, 1.0), 0.0).astype(d.dtype)
    return {"teacher_kl": teacher_kl, "teacher_kl_by_position": by_position, "teacher_tokens_by_position": tokens}

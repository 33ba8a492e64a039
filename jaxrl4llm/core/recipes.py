"""Recipes: named compositions of the core functions (PPO baseline, GRPO, DAPO, Dr. GRPO, Lite PPO,
and beyond the study: CISPO, ScaleRL).

A `Recipe` is a frozen dataclass of knobs, not a class hierarchy: a new recipe is
`dataclasses.replace(LITE_PPO, eps_high=0.28)` in a notebook. Two pure functions apply it:

  compute_advantages(rewards, group_size, recipe, ...)   once per rollout batch (needs all rows:
                                                         batch std, group means, dynamic sampling)
  policy_loss(recipe, logp=..., old_logp=..., ...)       per micro-batch -> LossTerms + metrics

`policy_loss_from_rewards` chains both for a batch that fits at once.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import chex
import jax
import jax.numpy as jnp

from jaxrl4llm.core.advantages import batch_whiten, check_group_layout, normalize_advantages, rloo_advantages
from jaxrl4llm.core.aggregation import (
    AGGREGATION_MODES, NORM_MODES, PROMPT_MODES, LossTerms, aggregate_loss, prompt_weights,
)
from jaxrl4llm.core.entropy_control import COV_CONTROLS, clip_cov_mask, kl_cov_mask, kl_cov_penalty
from jaxrl4llm.core.filters import dynamic_sampling_mask, overlong_filter_mask, overlong_soft_penalty, void_turn_filter_mask
from jaxrl4llm.core.kl import KL_KINDS, kl_penalty
from jaxrl4llm.core.mismatch import IS_CORRECTIONS, mismatch_correction
from jaxrl4llm.core.surrogate import RATIO_LEVELS, SurrogateOutput
from jaxrl4llm.core.surrogate_registry import apply_surrogate, surrogate_problems

ADV_ESTIMATORS = ("normalized", "rloo", "reinforce_pp")


@dataclasses.dataclass(frozen=True)
class Recipe:
    """Every knob of the study's ablations; hashable, so it can be a static jit argument.

    Attributes:
      name: label for logs.
      adv_estimator: "normalized" (normalize_advantages with adv_mean/adv_std), "rloo"
        (leave-one-out baseline) or "reinforce_pp" (group-free batch whitening of rewards).
      adv_mean, adv_std: "group" | "batch" | "none" (normalized estimator only).
      adv_eps: added to the std.
      surrogate: a name in the surrogate table (core.surrogate_registry): "ppo" (ppo_clip_loss),
        "cispo" (cispo_loss), "sapo" (sapo_loss), or one added with register_surrogate; its
        row's check runs here.
      eps_low, eps_high: PPO clip range [1 - eps_low, 1 + eps_high]; eps_high > eps_low is
        Clip-Higher. For CISPO the IS-weight bounds (see cispo_cap_mode).
      cispo_cap_mode: "relative" (upper bound 1 + eps_high, verl) or "absolute" (upper bound
        eps_high, TRL's epsilon_high).
      sapo_tau_pos, sapo_tau_neg: SAPO gate temperatures for A > 0 / A <= 0.
      dual_clip: c > 1 or None (PPO only).
      ratio_level: "token" (PPO), "sequence" (GSPO) or "sequence_token" (GSPO-token); PPO only.
      loss_agg_mode: one of AGGREGATION_MODES ("prompt-mean-token-mean" needs response
        lengths in compute_advantages, which puts the prompt weights in denominator_weights).
      norm_length: divisor of "seq-mean-token-sum-norm" (Dr. GRPO: the max response length)
        and of "seq-sum-token-sum-norm" (verl's / ROLL's seq-mean-token-sum-norm, which sums
        over rows where Dr. GRPO's paper means over them; see core.aggregation).
      kl_coef, kl_kind, kl_clamp: KL(pi || pi_ref) loss term (0 = off, no reference model).
      entropy_coef: entropy bonus (0 = off).
      overlong_filter: drop truncated responses from the loss (not from advantage stats).
      void_turn_filter: drop tool-integrated responses whose last turn wrote neither code nor an
        answer from the loss (SimpleTIR's void turns; not from advantage stats). The trainer reads
        the flags from the text (`tools.protocol.is_void_turn`); a run needs rollout.tools.
      overlong_max_length, overlong_buffer_length, overlong_penalty: DAPO soft overlong
        punishment added to rewards (penalty 0 = off).
      dynamic_sampling: keep only groups whose rewards differ (DAPO). The trainer also
        over-samples prompts to refill the batch; in the loss it is a row mask.
      exclude_constant_groups: leave all-equal groups out of the loss denominators.
      tis_cap: truncated importance-sampling cap for sampler/trainer log-prob drift, or None.
        Legacy spelling of is_correction="tis_token", is_cap=tis_cap, except that without
        sampler_logp it is silently off (is_correction raises). Not combinable with is_correction.
      is_correction: sampler-trainer mismatch correction from old_logp vs sampler_logp
        (core.mismatch), or None: "tis_token" / "tis_seq" (truncated IS, token / sequence
        ratio), "mis_token" / "mis_seq" (masked IS: ratio > is_cap -> weight 0, else the
        ratio), "icepop" (ratio outside [icepop_low, icepop_high] -> 0, else 1), "seq_mask"
        (DeepSeek-V3.2: rows with A < 0 and mean(sampler_logp - old_logp) > seq_mask_delta -> 0).
        Needs sampler_logp and old_logp recomputed by the trainer.
      is_cap: the cap C of tis_* and mis_* (> 0).
      icepop_low, icepop_high: IcePop's band [alpha, beta] (0 <= alpha < beta).
      seq_mask_delta: DeepSeek-V3.2's threshold delta on the row's mean log-ratio.
      sampler_logp_kind: which sampler log-prob the corrections compare with: "untruncated"
        (log softmax(z / temperature), the distribution a trainer recomputes) or "sampled" (the
        distribution actually sampled from, after top-k / top-p). The loop reads it.
      cov_control: covariance-based entropy control (core.entropy_control, arXiv 2505.22617), or
        None: "clip_cov" (a random pick of tokens with covariance in (clip_cov_low,
        clip_cov_high) loses its surrogate gradient) or "kl_cov" (the tokens of largest
        covariance get kl_cov_coef * |logp - old_logp| added). Needs a PRNG key for clip_cov.
      cov_ratio: fraction of counted tokens selected (the paper: 2e-4 Clip-Cov, 2e-3 KL-Cov).
      clip_cov_low, clip_cov_high: Clip-Cov's covariance band (the paper: 1, 5).
      kl_cov_coef: KL-Cov's coefficient (the paper: 1).
      distill_coef: beta of on-policy distillation (core.distill, docs/objectives.md): the token
        advantage A_t = A_task - beta·sg(log pi_old(y_t) - log pi_teacher(y_t)) (`distill_advantages`);
        0 = off. Needs a teacher (the run's `teacher.model`).
      distill_discount: gamma in [0, 1] of the discounted future sum of the distillation terms (0:
        per token only, Thinking Machines' default).
      distill_clip: bound > 0 on each token's distillation term -beta·d_t, or None.
      task_reward: the task's advantage A_task enters the loss; False with distill_coef > 0 is pure
        distillation (A_task = 0: no reward signal, the verifier's reward is only logged).
    """

    name: str = "custom"
    adv_estimator: Literal["normalized", "rloo", "reinforce_pp"] = "normalized"
    adv_mean: Literal["group", "batch", "none"] = "group"
    adv_std: Literal["group", "batch", "none"] = "batch"
    adv_eps: float = 1e-6
    eps_low: float = 0.2
    eps_high: float = 0.2
    surrogate: str = "ppo"
    cispo_cap_mode: Literal["relative", "absolute"] = "relative"
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    dual_clip: float | None = None
    ratio_level: Literal["token", "sequence", "sequence_token"] = "token"
    loss_agg_mode: str = "token-mean"
    norm_length: float | None = None
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    kl_clamp: float | None = None
    entropy_coef: float = 0.0
    overlong_filter: bool = False
    void_turn_filter: bool = False
    overlong_max_length: int | None = None
    overlong_buffer_length: int | None = None
    overlong_penalty: float = 0.0
    dynamic_sampling: bool = False
    exclude_constant_groups: bool = False
    tis_cap: float | None = None
    is_correction: Literal["tis_token", "tis_seq", "mis_token", "mis_seq", "icepop", "seq_mask"] | None = None
    is_cap: float | None = None
    icepop_low: float = 0.5
    icepop_high: float = 5.0
    seq_mask_delta: float | None = None
    sampler_logp_kind: Literal["untruncated", "sampled"] = "untruncated"
    cov_control: Literal["clip_cov", "kl_cov"] | None = None
    cov_ratio: float = 2e-4
    clip_cov_low: float = 1.0
    clip_cov_high: float = 5.0
    kl_cov_coef: float = 1.0
    distill_coef: float = 0.0
    distill_discount: float = 0.0
    distill_clip: float | None = None
    task_reward: bool = True

    def __post_init__(self):
        problems = []
        if self.adv_estimator not in ADV_ESTIMATORS:
            problems.append(f"adv_estimator={self.adv_estimator!r} (valid: {', '.join(ADV_ESTIMATORS)})")
        for key in ("adv_mean", "adv_std"):
            if getattr(self, key) not in ("group", "batch", "none"):
                problems.append(f"{key}={getattr(self, key)!r} (valid: group, batch, none)")
        if self.loss_agg_mode not in AGGREGATION_MODES:
            problems.append(f"loss_agg_mode={self.loss_agg_mode!r} (valid: {', '.join(AGGREGATION_MODES)})")
        if self.loss_agg_mode in NORM_MODES and not self.norm_length:
            problems.append(f"loss_agg_mode={self.loss_agg_mode!r} needs norm_length (e.g. the max response length)")
        if self.kl_kind not in KL_KINDS:
            problems.append(f"kl_kind={self.kl_kind!r} (valid: {', '.join(KL_KINDS)})")
        if self.ratio_level not in RATIO_LEVELS:
            problems.append(f"ratio_level={self.ratio_level!r} (valid: {', '.join(RATIO_LEVELS)})")
        problems += surrogate_problems(self)  # an unknown name, or the checks registered with the surrogate
        if self.eps_low < 0 or self.eps_high < 0:
            problems.append(f"eps_low/eps_high must be >= 0, got {self.eps_low}/{self.eps_high}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            problems.append(f"dual_clip must be > 1 or None, got {self.dual_clip}")
        if self.overlong_penalty > 0 and (not self.overlong_max_length or not self.overlong_buffer_length):
            problems.append("overlong_penalty > 0 needs overlong_max_length and overlong_buffer_length")
        if self.tis_cap is not None and not self.tis_cap > 0:
            problems.append(f"tis_cap must be > 0 or None, got {self.tis_cap}")
        if self.is_correction is not None and self.is_correction not in IS_CORRECTIONS:
            problems.append(f"is_correction={self.is_correction!r} (valid: None, {', '.join(IS_CORRECTIONS)})")
        if self.is_correction is not None and self.tis_cap is not None:
            problems.append(f"tis_cap={self.tis_cap} with is_correction={self.is_correction!r}: set the cap as is_cap "
                            "(tis_cap alone is is_correction='tis_token')")
        if self.is_correction in ("tis_token", "tis_seq", "mis_token", "mis_seq") and not (
                self.is_cap is not None and self.is_cap > 0):
            problems.append(f"is_correction={self.is_correction!r} needs is_cap > 0, got is_cap={self.is_cap}")
        if self.is_cap is not None and not self.is_cap > 0:
            problems.append(f"is_cap must be > 0 or None, got {self.is_cap}")
        if not (self.icepop_low >= 0 and self.icepop_high > self.icepop_low):
            problems.append(f"icepop_low/icepop_high must satisfy 0 <= low < high, got {self.icepop_low}/{self.icepop_high}")
        if self.is_correction == "seq_mask" and self.seq_mask_delta is None:
            problems.append("is_correction='seq_mask' needs seq_mask_delta (the threshold on mean(sampler_logp - old_logp))")
        if self.sampler_logp_kind not in ("untruncated", "sampled"):
            problems.append(f"sampler_logp_kind={self.sampler_logp_kind!r} (valid: untruncated, sampled)")
        if self.cov_control is not None and self.cov_control not in COV_CONTROLS:
            problems.append(f"cov_control={self.cov_control!r} (valid: None, {', '.join(COV_CONTROLS)})")
        if not 0 < self.cov_ratio <= 1:
            problems.append(f"cov_ratio must be in (0, 1], got {self.cov_ratio}")
        if not self.clip_cov_high > self.clip_cov_low:
            problems.append(f"clip_cov_low/clip_cov_high must satisfy low < high, got {self.clip_cov_low}/{self.clip_cov_high}")
        if not self.kl_cov_coef >= 0:
            problems.append(f"kl_cov_coef must be >= 0, got {self.kl_cov_coef}")
        problems += self._distill_problems()
        if problems:
            raise ValueError(f"Invalid recipe {self.name!r}: " + "; ".join(problems) + ".")

    def _distill_problems(self) -> list[str]:
        """The distillation fields' checks (`distill_*`, `task_reward`)."""
        problems = []
        if not self.distill_coef >= 0:
            problems.append(f"distill_coef must be >= 0 (0 = no distillation), got {self.distill_coef}")
        if not 0.0 <= self.distill_discount <= 1.0:
            problems.append(f"distill_discount must be in [0, 1], got {self.distill_discount}")
        if self.distill_clip is not None and not self.distill_clip > 0:
            problems.append(f"distill_clip must be > 0 or None, got {self.distill_clip}")
        if not self.task_reward and not self.distill_coef > 0:
            problems.append("task_reward=False leaves no training signal without distill_coef > 0")
        return problems

    @property
    def distills(self) -> bool:
        """True when the loss takes the teacher's signal (distill_coef > 0): the run needs a teacher."""
        return self.distill_coef > 0

    @property
    def uses_sampler_logp(self) -> bool:
        """True when the loss weighs pi_old against the sampler (tis_cap or is_correction): old_logp must be recomputed."""
        return self.tis_cap is not None or self.is_correction is not None

    @property
    def needs_key(self) -> bool:
        """True when policy_loss needs a PRNG key (Clip-Cov's random pick)."""
        return self.cov_control == "clip_cov"

    def replace(self, **changes) -> "Recipe":
        """dataclasses.replace(self, **changes), validated."""
        return dataclasses.replace(self, **changes)


# The study's critic-free PPO baseline: vanilla clipped PPO loss on raw outcome rewards
# (REINFORCE-style advantage, no normalisation), sequence-level aggregation.
PPO_BASELINE = Recipe(name="ppo_baseline", adv_mean="none", adv_std="none", loss_agg_mode="seq-mean-token-mean")
# GRPO (DeepSeekMath): group mean/std, per-sequence token mean, k3 KL to the reference.
GRPO = Recipe(name="grpo", adv_mean="group", adv_std="group", loss_agg_mode="seq-mean-token-mean", kl_coef=0.001, kl_kind="k3")
# DAPO (Yu et al. 2025): Clip-Higher 0.2/0.28, token-mean, soft overlong punishment, dynamic sampling, no KL.
DAPO = Recipe(
    name="dapo", adv_mean="group", adv_std="group", eps_low=0.2, eps_high=0.28, loss_agg_mode="token-mean",
    overlong_max_length=20480, overlong_buffer_length=4096, overlong_penalty=1.0, dynamic_sampling=True,
)
# Dr. GRPO (Liu et al. 2025): no std, token sums divided by a constant length (set norm_length
# to the run's max response length; 1024 is a placeholder).
DR_GRPO = Recipe(name="dr_grpo", adv_mean="group", adv_std="none", loss_agg_mode="seq-mean-token-sum-norm", norm_length=1024)
# Lite PPO (Tricks or Traps): group mean + batch std, token-level aggregation, vanilla 0.2 clip, no KL.
LITE_PPO = Recipe(name="lite_ppo", adv_mean="group", adv_std="batch", loss_agg_mode="token-mean")
# CISPO (MiniMax-M1, arXiv 2506.13585): group-normalised advantages, token-mean, clipped and
# detached IS weight; no lower bound (eps_low = 1: bound 0), only the upper one is tuned. The
# paper gives no eps_high value: 4.0 (relative) = an IS-weight cap of 5.0, TRL's suggested cap.
CISPO = Recipe(
    name="cispo", adv_mean="group", adv_std="group", loss_agg_mode="token-mean",
    surrogate="cispo", cispo_cap_mode="relative", eps_low=1.0, eps_high=4.0,
)
# ScaleRL (Khatri et al. 2025, arXiv 2510.13786): CISPO loss, prompt-level aggregation,
# batch-level advantage normalisation (group-mean centring, batch std), zero-variance filtering
# (groups with equal rewards leave the loss). The IS-weight cap is the CISPO preset's; ScaleRL's
# FP32 LM head, PipelineRL, interruptions and no-positive-resampling curriculum live outside the loss.
SCALERL = Recipe(
    name="scalerl", adv_mean="group", adv_std="batch", loss_agg_mode="prompt-mean-token-mean",
    surrogate="cispo", cispo_cap_mode="relative", eps_low=1.0, eps_high=4.0, dynamic_sampling=True,
)

# On-policy distillation (Thinking Machines, "On-Policy Distillation", 2025; tinker-cookbook
# `distillation/train_on_policy.py`): no task reward, A_t = -sg(log pi(y_t) - log pi_T(y_t)) per
# token (kl_penalty_coef 1, kl_discount_factor 0), token-mean, one epoch; needs `teacher.model`.
OPD = Recipe(name="opd", adv_mean="none", adv_std="none", loss_agg_mode="token-mean", distill_coef=1.0,
             task_reward=False)
# Lite PPO + distillation: Lite PPO's task advantage plus the teacher's per-token term (slime's
# A_t - lambda_opd·d_t, ROLL's `use_opd`), beta 1.
LITE_PPO_OPD = Recipe(name="lite_ppo_opd", adv_mean="group", adv_std="batch", loss_agg_mode="token-mean",
                      distill_coef=1.0)

PRESETS: dict[str, Recipe] = {r.name: r for r in (PPO_BASELINE, GRPO, DAPO, DR_GRPO, LITE_PPO, CISPO, SCALERL, OPD,
                                                   LITE_PPO_OPD)}


class AdvantageBatch(NamedTuple):
    """Per-row outputs of compute_advantages, all [B] float32.

    advantages: per-response advantage.
    shaped_rewards: rewards plus the soft overlong penalty (if enabled).
    row_weights: loss-row mask (overlong filter x dynamic sampling mask, if enabled).
    denominator_weights: row_weights, times the non-constant-group mask if
      exclude_constant_groups; rows with 0 stay out of the loss denominators.
    """

    advantages: chex.Array
    shaped_rewards: chex.Array
    row_weights: chex.Array
    denominator_weights: chex.Array


def compute_advantages(
    rewards: chex.Array,
    group_size: int,
    recipe: Recipe,
    *,
    truncated: chex.Array | None = None,
    lengths: chex.Array | None = None,
    void: chex.Array | None = None,
) -> AdvantageBatch:
    """r' = r + overlong_penalty(L); A = estimator(r'); row mask = overlong_filter x void_turn_filter x
    dynamic_sampling.

    Advantage statistics use every row, including rows the overlong filter then removes from
    the loss (Tricks or Traps, Sec. 4.4).

    Args:
      rewards: [B] rewards, groups of `group_size` adjacent rows.
      group_size: G (static).
      recipe: the Recipe (static).
      truncated: [B] bool, needed when recipe.overlong_filter.
      void: [B] bool, rows whose last turn is void (`tools.protocol.is_void_turn`), needed when
        recipe.void_turn_filter.
      lengths: [B] response lengths (the loss mask's row sums), needed when
        recipe.overlong_penalty > 0 or recipe.loss_agg_mode is "prompt-mean-token-mean".

    Returns:
      AdvantageBatch of [B] float32 arrays; with a prompt-level loss_agg_mode,
      denominator_weights holds the per-row prompt weights (aggregation.prompt_weights).
    """
    check_group_layout(rewards, group_size)
    shaped = rewards.astype(jnp.float32)
    if recipe.overlong_penalty > 0:
        if lengths is None:
            raise ValueError(f"recipe {recipe.name!r} has a soft overlong penalty: pass lengths=[B] response lengths.")
        shaped = shaped + overlong_soft_penalty(
            lengths,
            max_length=recipe.overlong_max_length,
            buffer_length=recipe.overlong_buffer_length,
            penalty=recipe.overlong_penalty,
        )
    if recipe.adv_estimator == "normalized":
        # with dynamic sampling, batch statistics over the groups that train (not the filler groups)
        valid = dynamic_sampling_mask(rewards, group_size) if recipe.dynamic_sampling else None
        adv = normalize_advantages(shaped, group_size, mean=recipe.adv_mean, std=recipe.adv_std, eps=recipe.adv_eps,
                                   valid=valid)
    elif recipe.adv_estimator == "rloo":
        adv = rloo_advantages(shaped, group_size)
    else:
        adv = batch_whiten(shaped, eps=recipe.adv_eps)

    rows = jnp.ones_like(shaped)
    if recipe.overlong_filter:
        if truncated is None:
            raise ValueError(f"recipe {recipe.name!r} filters overlong responses: pass truncated=[B] flags.")
        rows = rows * overlong_filter_mask(truncated)
    if recipe.void_turn_filter:
        if void is None:
            raise ValueError(f"recipe {recipe.name!r} filters void turns: pass void=[B] flags.")
        rows = rows * void_turn_filter_mask(void)
    if recipe.dynamic_sampling:
        # DAPO filters on correctness (Eq. 11): the raw rewards, before any length shaping.
        rows = rows * dynamic_sampling_mask(rewards, group_size)
    # Zero-advantage groups are those whose *shaped* rewards are all equal.
    den = rows * dynamic_sampling_mask(shaped, group_size) if recipe.exclude_constant_groups else rows
    if recipe.loss_agg_mode in PROMPT_MODES:
        if lengths is None:
            raise ValueError(
                f"recipe {recipe.name!r} has loss_agg_mode={recipe.loss_agg_mode!r}: pass lengths=[B] response lengths."
            )
        den = prompt_weights(lengths, group_size, den)
    return AdvantageBatch(adv, shaped, rows, den)


def policy_loss(
    recipe: Recipe,
    *,
    logp: chex.Array,
    old_logp: chex.Array,
    advantages: chex.Array,
    mask: chex.Array,
    row_weights: chex.Array | None = None,
    denominator_weights: chex.Array | None = None,
    ref_logp: chex.Array | None = None,
    sampler_logp: chex.Array | None = None,
    entropy: chex.Array | None = None,
    key: chex.PRNGKey | None = None,
    total_rows: int | None = None,
    rows: int | None = None,
) -> tuple[LossTerms, dict[str, chex.Array]]:
    """l_bt = w_bt·S(r_bt, A_b) + beta·KL_bt - alpha·H_bt, aggregated by recipe.loss_agg_mode.

    S is the surrogate recipe.surrogate names in the table (core.surrogate_registry: PPO clip,
    CISPO, SAPO, or one added with register_surrogate), looked up at trace time. w is the
    sampler-trainer mismatch weight of recipe.is_correction (core.mismatch, from old_logp and
    sampler_logp; 0 on masked tokens, which stay counted in the denominators), or the
    truncated IS weight when the legacy recipe.tis_cap and sampler_logp are set, else 1.
    An IS weight (tis_*, and mis_* on kept tokens) multiplies the surrogate only, as the legacy
    TIS did; a masked token (mis_*, icepop, seq_mask) loses its whole loss l_bt, KL and entropy
    terms included, so it gets no gradient at all. recipe.cov_control adds Clip-Cov (S without
    gradient on the picked tokens) or KL-Cov (+ kl_cov_coef·|logp - old_logp| on the picked
    tokens), core.entropy_control.

    Args:
      recipe: the Recipe (static).
      logp: [B, T] current-policy log-probs of the response tokens (gradients flow).
      old_logp: [B, T] behaviour-policy log-probs (sampler's or recomputed by the trainer).
      advantages: [B] or [B, T] from compute_advantages.
      mask: [B, T] response-token mask.
      row_weights: [B] loss-row mask (AdvantageBatch.row_weights), default all ones.
      denominator_weights: [B] rows counted in denominators, default row_weights; for a
        prompt-level loss_agg_mode the prompt weights from compute_advantages (required).
      ref_logp: [B, T] reference-policy log-probs, required when recipe.kl_coef > 0.
      sampler_logp: [B, T] sampler log-probs for recipe.is_correction (required) or the
        legacy recipe.tis_cap (optional: without it TIS is off).
      entropy: [B, T] per-token policy entropy, required when recipe.entropy_coef > 0.
      key: PRNG key, required when recipe.needs_key (Clip-Cov's pick is a function of it).
      total_rows: "seq-sum-token-sum-norm" only (static): the rows of the optimizer step when
        this call is one micro-batch of it (aggregate_loss); default this call's rows.
      rows: "seq-sum-token-sum-norm" only: the rows this call really holds when some rows are
        empty slots (a packed micro-batch); default B.

    Returns:
      (LossTerms(numerator, denominator), metrics): metrics are scalars over this call's
      counted tokens: the SurrogateStats fields, "pg_loss", "kl" (if on), "entropy" (if
      given), "is_weight_mean" (if a correction is on), "is_truncated_frac" (tis_*) or
      "is_masked_frac" (mis_*, icepop, seq_mask): the fraction of counted tokens the correction
      truncated / masked (a sequence-level correction touches all tokens of a row, so this is
      the token-weighted fraction of rows), "cov_selected_frac" (cov_control on: the fraction
      of counted tokens picked), and "num_tokens" to weight them.
    """
    m, denominator_weights = _counted_tokens(recipe, logp, old_logp, mask, row_weights, denominator_weights,
                                             sampler_logp)
    surrogate, num, metrics = _surrogate_term(recipe, logp, old_logp, advantages, m)
    per_token, cov_metrics = _covariance_control(recipe, surrogate.loss, logp, old_logp, advantages, m, key,
                                                 surrogate.clipped, num)
    per_token, is_metrics, dropped = _mismatch_weighting(recipe, per_token, old_logp, sampler_logp, advantages, m, num)
    per_token, reg_metrics = _kl_and_entropy_terms(recipe, per_token, logp, ref_logp, entropy, m,
                                                   denominator_weights, num)
    if dropped is not None:
        per_token = jnp.where(dropped, 0.0, per_token)  # masked tokens leave the KL and entropy terms too
    terms = aggregate_loss(
        per_token, m, recipe.loss_agg_mode, norm_length=recipe.norm_length, row_weights=denominator_weights,
        total_rows=total_rows, rows=rows,
    )
    return terms, {**metrics, **cov_metrics, **is_metrics, **reg_metrics}


def _counted_tokens(
    recipe: Recipe, logp: chex.Array, old_logp: chex.Array, mask: chex.Array, row_weights: chex.Array | None,
    denominator_weights: chex.Array | None, sampler_logp: chex.Array | None,
) -> tuple[chex.Array, chex.Array | None]:
    """policy_loss's first stage: the arguments' checks, and the tokens the loss counts.

    Returns (m, denominator_weights): m [B, T] float32 = mask [B, T] x row_weights [B] (when
    given); denominator_weights [B] as given, else row_weights (None when both are None).
    """
    chex.assert_equal_shape([logp, old_logp, mask])
    m = mask.astype(jnp.float32)
    if row_weights is not None:
        chex.assert_shape(row_weights, logp.shape[:1])
        m = m * row_weights.astype(jnp.float32)[:, None]
    if denominator_weights is None:
        if recipe.loss_agg_mode in PROMPT_MODES:
            raise ValueError(
                f"recipe {recipe.name!r} has loss_agg_mode={recipe.loss_agg_mode!r}: pass denominator_weights "
                "(the prompt weights compute_advantages returns, computed on the full batch)."
            )
        denominator_weights = row_weights
    if recipe.is_correction is not None and sampler_logp is None:
        raise ValueError(
            f"recipe {recipe.name!r} has is_correction={recipe.is_correction!r}: pass sampler_logp=[B, T] (the sampler's "
            "log-probs; old_logp must be the trainer's recomputed ones)."
        )
    return m, denominator_weights


def _surrogate_term(
    recipe: Recipe, logp: chex.Array, old_logp: chex.Array, advantages: chex.Array, m: chex.Array,
) -> tuple[SurrogateOutput, chex.Array, dict[str, chex.Array]]:
    """policy_loss's surrogate stage: S(r_bt, A_b) of the surrogate recipe.surrogate names.

    Args: logp, old_logp [B, T]; advantages [B] or [B, T]; m [B, T] the counted tokens' weights.
    Returns (surrogate, num, metrics): the SurrogateOutput (loss [B, T], stats, clipped [B, T]);
    num = max(sum(m), 1), the metrics' token count; metrics = the SurrogateStats fields and
    "pg_loss", the surrogate's mean over the counted tokens.
    """
    surrogate = apply_surrogate(recipe, logp, old_logp, advantages, m)
    num = jnp.maximum(jnp.sum(m), 1.0)
    metrics: dict[str, chex.Array] = dict(surrogate.stats._asdict())
    metrics["pg_loss"] = jnp.sum(surrogate.loss * m) / num
    return surrogate, num, metrics


def _covariance_control(
    recipe: Recipe, per_token: chex.Array, logp: chex.Array, old_logp: chex.Array, advantages: chex.Array,
    m: chex.Array, key: chex.PRNGKey | None, clipped: chex.Array, num: chex.Array,
) -> tuple[chex.Array, dict[str, chex.Array]]:
    """policy_loss's covariance stage (recipe.cov_control, core.entropy_control) on the per-token
    loss [B, T]: Clip-Cov stops the surrogate's gradient on its picked tokens (a random pick by
    `key`, among the tokens the surrogate did not clip, `clipped` [B, T]); KL-Cov adds
    kl_cov_coef·|logp - old_logp| on its picked tokens. Off: per_token unchanged.

    Returns (per_token [B, T], metrics): {"cov_selected_frac": the fraction of counted tokens
    picked} when a control is on, else {}.
    """
    if recipe.cov_control == "clip_cov":
        if key is None:
            raise ValueError(f"recipe {recipe.name!r} has cov_control='clip_cov': pass key= (a PRNG key; the pick of "
                             "tokens is a function of it).")
        picked = clip_cov_mask(logp, advantages, m, key, ratio=recipe.cov_ratio, low=recipe.clip_cov_low,
                               high=recipe.clip_cov_high, exclude=clipped)
        per_token = jnp.where(picked, jax.lax.stop_gradient(per_token), per_token)
    elif recipe.cov_control == "kl_cov":
        picked = kl_cov_mask(logp, advantages, m, ratio=recipe.cov_ratio)
        per_token = per_token + jnp.where(picked, recipe.kl_cov_coef * kl_cov_penalty(logp, old_logp), 0.0)
    else:
        return per_token, {}
    return per_token, {"cov_selected_frac": jnp.sum(jnp.where(picked, m, 0.0)) / num}


def _mismatch_weighting(
    recipe: Recipe, per_token: chex.Array, old_logp: chex.Array, sampler_logp: chex.Array | None,
    advantages: chex.Array, m: chex.Array, num: chex.Array,
) -> tuple[chex.Array, dict[str, chex.Array], chex.Array | None]:
    """policy_loss's sampler-trainer mismatch stage: the per-token loss [B, T] times the weight
    w [B, T] of recipe.is_correction (or of the legacy recipe.tis_cap, "tis_token"), from
    old_logp and sampler_logp [B, T] (core.mismatch). Off, or no sampler_logp with the legacy
    tis_cap: per_token unchanged.

    Returns (per_token [B, T], metrics, dropped): metrics "is_weight_mean" and
    "is_truncated_frac" (tis_*) or "is_masked_frac" (the others), or {} when off; dropped [B, T]
    bool, the tokens a masking correction (mis_*, icepop, seq_mask) removes, which lose their KL
    and entropy terms too; None for tis_* and when off.
    """
    kind = recipe.is_correction or ("tis_token" if recipe.tis_cap is not None else None)
    if kind is None or sampler_logp is None:
        return per_token, {}, None
    w, touched = mismatch_correction(
        kind, old_logp, sampler_logp, m, advantages=advantages, cap=recipe.tis_cap if recipe.is_correction is None else recipe.is_cap,
        low=recipe.icepop_low, high=recipe.icepop_high, delta=recipe.seq_mask_delta,
    )
    per_token = per_token * w
    metrics = {"is_weight_mean": jnp.sum(w * m) / num}
    frac_key = "is_truncated_frac" if kind.startswith("tis") else "is_masked_frac"
    metrics[frac_key] = jnp.sum(jnp.where(touched, m, 0.0)) / num
    dropped = None if kind.startswith("tis") else touched
    return per_token, metrics, dropped


def _kl_and_entropy_terms(
    recipe: Recipe, per_token: chex.Array, logp: chex.Array, ref_logp: chex.Array | None,
    entropy: chex.Array | None, m: chex.Array, denominator_weights: chex.Array | None, num: chex.Array,
) -> tuple[chex.Array, dict[str, chex.Array]]:
    """policy_loss's regulariser stage: per_token [B, T] + kl_coef·KL(logp [B, T], ref_logp [B, T])
    - entropy_coef·H (entropy [B, T]), each term only on the rows some denominator counts
    (denominator_weights [B] > 0; an exclude_constant_groups row's terms would enter the
    numerator uncounted).

    Returns (per_token [B, T], metrics): "kl" when kl_coef > 0, "entropy" when entropy is given
    (means over the counted tokens, without gradient).
    """
    metrics: dict[str, chex.Array] = {}
    in_den = 1.0 if denominator_weights is None else (denominator_weights > 0).astype(jnp.float32)[:, None]
    if recipe.kl_coef > 0:
        if ref_logp is None:
            raise ValueError(f"recipe {recipe.name!r} has kl_coef={recipe.kl_coef} > 0: pass ref_logp (reference-model log-probs).")
        kl = kl_penalty(logp, ref_logp, recipe.kl_kind, clamp=recipe.kl_clamp)
        per_token = per_token + recipe.kl_coef * kl * in_den
        metrics["kl"] = jax.lax.stop_gradient(jnp.sum(kl * m) / num)
    if entropy is not None:
        metrics["entropy"] = jax.lax.stop_gradient(jnp.sum(entropy * m) / num)
    if recipe.entropy_coef > 0:
        if entropy is None:
            raise ValueError(f"recipe {recipe.name!r} has entropy_coef={recipe.entropy_coef} > 0: pass entropy=[B, T].")
        per_token = per_token - recipe.entropy_coef * entropy * in_den
    return per_token, metrics


def policy_loss_from_rewards(
    recipe: Recipe,
    *,
    logp: chex.Array,
    old_logp: chex.Array,
    rewards: chex.Array,
    mask: chex.Array,
    group_size: int,
    truncated: chex.Array | None = None,
    lengths: chex.Array | None = None,
    ref_logp: chex.Array | None = None,
    sampler_logp: chex.Array | None = None,
    entropy: chex.Array | None = None,
) -> tuple[LossTerms, dict[str, chex.Array]]:
    """compute_advantages then policy_loss, for a rollout batch that is processed at once.

    Args: as compute_advantages and policy_loss; rewards [B], token arrays [B, T].

    Returns:
      (LossTerms, metrics) with the advantage mean/std added to metrics.
    """
    if lengths is None and recipe.loss_agg_mode in PROMPT_MODES:
        lengths = jnp.sum(mask.astype(jnp.float32), axis=1)
    batch = compute_advantages(rewards, group_size, recipe, truncated=truncated, lengths=lengths)
    terms, metrics = policy_loss(
        recipe, logp=logp, old_logp=old_logp, advantages=batch.advantages, mask=mask,
        row_weights=batch.row_weights, denominator_weights=batch.denominator_weights,
        ref_logp=ref_logp, sampler_logp=sampler_logp, entropy=entropy,
    )
    metrics["advantage_mean"] = jnp.mean(batch.advantages)
    metrics["advantage_std"] = jnp.std(batch.advantages)
    return terms, metrics

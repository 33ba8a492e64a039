"""jaxrl4llm.core: the loss math of RL for LLM reasoning, as small pure JAX functions.

Every technique isolated by "Tricks or Traps? A Deep Dive into RL for LLM Reasoning"
(arXiv 2508.08221) is one function here. Conventions: a batch holds P prompts x G
responses = B rows, each prompt's G responses adjacent (row b in group b // G); token arrays
are [B, T] with a float mask [B, T]; sequence arrays are [B]. Every function jits with its
string options static, works under vmap and stays finite on degenerate input.

Advantages:   normalize_advantages, rloo_advantages, batch_whiten, scale_rewards
Log-probs:    token_logprobs, token_logprobs_chunked, token_logprobs_from_hidden,
              token_logprobs_from_head, entropy_from_logits
Surrogate:    ppo_clip_loss (PPO / Clip-Higher / dual clip / GSPO / GSPO-token), cispo_loss, sapo_loss
              -> SurrogateOutput(loss, stats, clipped); clipped_surrogate, cispo_surrogate,
              sapo_surrogate -> (loss, stats); sapo_gate, SurrogateStats, surrogate_stats,
              broadcast_advantages, truncated_is_weights
Surrogate table: register_surrogate, registered_surrogate, surrogate_names, apply_surrogate,
              RegisteredSurrogate (Recipe.surrogate names a row; core.surrogate_registry)
Mismatch:     sampler-trainer corrections from old_logp vs sampler_logp: tis_token, tis_sequence,
              mis_token, mis_sequence, icepop, seq_mask, mismatch_correction, Correction, IS_CORRECTIONS;
              how far apart they are: agreement_stats
Entropy:      Clip-Cov / KL-Cov (arXiv 2505.22617): token_covariance, clip_cov_mask, kl_cov_mask,
              kl_cov_penalty, top_k_mask, COV_CONTROLS
Aggregation:  aggregate_loss -> LossTerms(numerator, denominator), AGGREGATION_MODES, prompt_weights
KL:           kl_penalty (k1, k2/mse, k3/low_var_kl, abs)
Distillation: on-policy distillation from a teacher's log-probs at the sampled tokens:
              teacher_log_ratio, distill_advantages (advantage mode), distill_loss (loss mode,
              DISTILL_LOSS_KINDS and the KL direction each follows), teacher_kl_metrics
Filters:      overlong_filter_mask, overlong_soft_penalty, dynamic_sampling_mask, void_turn_filter_mask
Routing:      a mixture of experts' routes compared (router replay's metrics): route_disagreement,
              expert_load, load_imbalance
Recipes:      Recipe, PPO_BASELINE, GRPO, DAPO, DR_GRPO, LITE_PPO, CISPO, SCALERL, OPD, LITE_PPO_OPD, PRESETS,
              compute_advantages, policy_loss, policy_loss_from_rewards
"""

from jaxrl4llm.core.advantages import batch_whiten
from jaxrl4llm.core.advantages import normalize_advantages
from jaxrl4llm.core.advantages import rloo_advantages
from jaxrl4llm.core.advantages import scale_rewards
from jaxrl4llm.core.aggregation import AGGREGATION_MODES
from jaxrl4llm.core.aggregation import LossTerms
from jaxrl4llm.core.aggregation import aggregate_loss
from jaxrl4llm.core.aggregation import prompt_weights
from jaxrl4llm.core.distill import DISTILL_LOSS_KINDS
from jaxrl4llm.core.distill import distill_advantages
from jaxrl4llm.core.distill import distill_loss
from jaxrl4llm.core.distill import teacher_kl_metrics
from jaxrl4llm.core.distill import teacher_log_ratio
from jaxrl4llm.core.entropy_control import COV_CONTROLS
from jaxrl4llm.core.entropy_control import clip_cov_mask
from jaxrl4llm.core.entropy_control import kl_cov_mask
from jaxrl4llm.core.entropy_control import kl_cov_penalty
from jaxrl4llm.core.entropy_control import token_covariance
from jaxrl4llm.core.entropy_control import top_k_mask
from jaxrl4llm.core.filters import dynamic_sampling_mask
from jaxrl4llm.core.filters import overlong_filter_mask
from jaxrl4llm.core.filters import overlong_soft_penalty
from jaxrl4llm.core.filters import void_turn_filter_mask
from jaxrl4llm.core.kl import KL_KINDS
from jaxrl4llm.core.kl import kl_penalty
from jaxrl4llm.core.logprobs import entropy_from_logits
from jaxrl4llm.core.logprobs import token_logprobs
from jaxrl4llm.core.logprobs import token_logprobs_chunked
from jaxrl4llm.core.logprobs import token_logprobs_from_head
from jaxrl4llm.core.logprobs import token_logprobs_from_hidden
from jaxrl4llm.core.mismatch import IS_CORRECTIONS
from jaxrl4llm.core.mismatch import Correction
from jaxrl4llm.core.mismatch import agreement_stats
from jaxrl4llm.core.mismatch import icepop
from jaxrl4llm.core.mismatch import mis_sequence
from jaxrl4llm.core.mismatch import mis_token
from jaxrl4llm.core.mismatch import mismatch_correction
from jaxrl4llm.core.mismatch import seq_mask
from jaxrl4llm.core.mismatch import tis_sequence
from jaxrl4llm.core.mismatch import tis_token
from jaxrl4llm.core.recipes import CISPO
from jaxrl4llm.core.recipes import DAPO
from jaxrl4llm.core.recipes import DR_GRPO
from jaxrl4llm.core.recipes import GRPO
from jaxrl4llm.core.recipes import LITE_PPO
from jaxrl4llm.core.recipes import LITE_PPO_OPD
from jaxrl4llm.core.recipes import OPD
from jaxrl4llm.core.recipes import PPO_BASELINE
from jaxrl4llm.core.recipes import PRESETS
from jaxrl4llm.core.recipes import SCALERL
from jaxrl4llm.core.recipes import AdvantageBatch
from jaxrl4llm.core.recipes import Recipe
from jaxrl4llm.core.recipes import compute_advantages
from jaxrl4llm.core.recipes import policy_loss
from jaxrl4llm.core.recipes import policy_loss_from_rewards
from jaxrl4llm.core.routing import expert_load
from jaxrl4llm.core.routing import load_imbalance
from jaxrl4llm.core.routing import route_disagreement
from jaxrl4llm.core.surrogate import SurrogateOutput
from jaxrl4llm.core.surrogate import SurrogateStats
from jaxrl4llm.core.surrogate import broadcast_advantages
from jaxrl4llm.core.surrogate import cispo_loss
from jaxrl4llm.core.surrogate import cispo_surrogate
from jaxrl4llm.core.surrogate import clipped_surrogate
from jaxrl4llm.core.surrogate import ppo_clip_loss
from jaxrl4llm.core.surrogate import sapo_gate
from jaxrl4llm.core.surrogate import sapo_loss
from jaxrl4llm.core.surrogate import sapo_surrogate
from jaxrl4llm.core.surrogate import surrogate_stats
from jaxrl4llm.core.surrogate import truncated_is_weights
from jaxrl4llm.core.surrogate_registry import RegisteredSurrogate
from jaxrl4llm.core.surrogate_registry import apply_surrogate
from jaxrl4llm.core.surrogate_registry import register_surrogate
from jaxrl4llm.core.surrogate_registry import registered_surrogate
from jaxrl4llm.core.surrogate_registry import surrogate_names

__all__ = [
    "AGGREGATION_MODES", "AdvantageBatch", "CISPO", "COV_CONTROLS", "clip_cov_mask", "kl_cov_mask", "kl_cov_penalty",
    "token_covariance", "top_k_mask", "Correction", "IS_CORRECTIONS", "agreement_stats", "icepop", "mis_sequence", "mis_token",
    "mismatch_correction", "seq_mask", "tis_sequence", "tis_token", "DAPO", "DR_GRPO", "GRPO", "KL_KINDS", "LITE_PPO", "LITE_PPO_OPD", "OPD", "LossTerms",
    "PPO_BASELINE", "PRESETS", "Recipe", "RegisteredSurrogate", "SCALERL", "SurrogateOutput", "SurrogateStats",
    "aggregate_loss", "apply_surrogate", "batch_whiten", "broadcast_advantages", "cispo_loss", "cispo_surrogate",
    "clipped_surrogate", "ppo_clip_loss", "register_surrogate", "registered_surrogate", "sapo_loss",
    "surrogate_names", "surrogate_stats", "compute_advantages", "dynamic_sampling_mask", "entropy_from_logits",
    "kl_penalty", "normalize_advantages", "overlong_filter_mask", "overlong_soft_penalty", "void_turn_filter_mask",
    "policy_loss", "policy_loss_from_rewards", "prompt_weights", "rloo_advantages", "sapo_gate", "scale_rewards", "sapo_surrogate", "token_logprobs",
    "token_logprobs_chunked", "token_logprobs_from_head", "token_logprobs_from_hidden", "truncated_is_weights",
    "expert_load", "load_imbalance", "route_disagreement",
    "DISTILL_LOSS_KINDS", "distill_advantages", "distill_loss", "teacher_kl_metrics", "teacher_log_ratio",
]

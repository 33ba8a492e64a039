"""The train step: `update(state, batch) -> (state, metrics)`, one jitted function over a Mesh.

One rollout batch of B rows is split into `mini_batches` optimizer steps (repeated for
`ppo_epochs`), each mini-batch into `micro` gradient-accumulation slices. Loss numerators and
denominators come from the core as LossTerms: gradients of the numerators are summed over
micro-batches (and, under GSPMD, over devices) and divided once by the mini-batch's global
denominator, so the update equals the one computed on the whole mini-batch at once.

The model enters as `logprob_fn(params, input_tokens, targets, positions, attention_mask)
-> (logp [B, L], entropy [B, L])`, so this module knows nothing of any architecture. With a
frozen part (LoRA: `TrainState.frozen` holds the base weights), `params` passed to it is
`join_params(trainable, frozen)` = (trainable, frozen), and only the trainable part is
differentiated, optimised and checkpointed. With `UpdateSettings.scored_tokens` = n it is
called with `last=n` and scores only the last n positions (the response targets; the others
come back 0): the LM head never runs over the prompt. With `UpdateSettings.prompt_group` = G as
well, it is called with `group=G` on micro-batches of whole groups (rows n*G .. n*G+G-1 share
one prompt) and runs each prompt's forward once for its G rows.

With `UpdateSettings.packing` (a train.packing.PackLayout) the update takes a PackedBatch
instead: whole sequences packed into [rows, S] micro-batches of a fixed token budget, as many as
the step's lengths fill (a while loop over `num_micro`); the model scores the packed rows
(`logprob_fn(..., segment_ids=)`) and the loss runs on their per-sequence view
(`packing.unpack_micro`), with the same numerator / denominator accumulation.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import chex
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl4llm.core import LossTerms, Recipe, apply_surrogate, distill_advantages, policy_loss, teacher_kl_metrics
from jaxrl4llm.core.aggregation import ROW_SUM_MODES
from jaxrl4llm.core.routing import (RouterStats, load_balancing_loss, load_imbalance,
                                    route_disagreement, router_entropy)
from jaxrl4llm.models.sharding import DEFAULT_RULES, logical_to_spec
from jaxrl4llm.train.packing import scatter_slots, unpack_micro
from jaxrl4llm.train.train_batch import TrainBatch

LogprobFn = Callable[..., tuple[chex.Array, chex.Array]]


@chex.dataclass
class TrainState:
    """Everything an update changes: step count, trainable parameters, optimizer state; and the
    frozen parameters an update reads but never changes (None, or the LoRA base)."""

    step: chex.Array
    params: Any
    opt_state: Any
    frozen: Any = None


def join_params(params, frozen):
    """What `logprob_fn` takes: the trainable params alone, or (trainable, frozen)."""
    return params if frozen is None else (params, frozen)


@dataclasses.dataclass(frozen=True)
class UpdateSettings:
    """Static shape of an update (hashable; part of the jit key)."""

    ppo_epochs: int = 1
    mini_batches: int = 1
    micro_batches: int = 1
    # old_logp = sg(logp) of the update's own forward pass instead of batch.old_logp: exact when
    # the update is one optimizer step from the policy that will be scored (ppo_epochs =
    # mini_batches = 1, no dropout), and it saves the separate recompute pass over the batch.
    old_logp_from_update: bool = False
    # score only the last n positions of each row (the response targets); None = all
    scored_tokens: int | None = None
    # G: rows n*G .. n*G+G-1 answer one prompt; micro-batches take whole groups and each prompt's
    # forward runs once for its G rows (logprob_fn(..., group=G); needs scored_tokens). None: per row.
    prompt_group: int | None = None
    # the update takes a PackedBatch (train/packing.py) instead of a TrainBatch; of its layout it
    # reads response_width, sequences and mini_batches (the rest comes from the batch's shapes)
    packing: Any = None  # train.packing.PackLayout | None
    # trainer.router_aux_loss_coef: c > 0 adds c * the switch transformer's load-balancing loss of a
    # mixture-of-experts model's routers to the loss (`with_router_aux_loss`); 0: none (no router stats)
    router_aux_loss_coef: float = 0.0


def make_optimizer(
    *, lr: float, schedule: str = "constant", warmup_steps: int = 0, total_steps: int = 1, min_lr_ratio: float = 0.0,
    weight_decay: float = 0.0, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, max_grad_norm: float | None = 1.0,
    frozen: Callable | None = None,
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """optax chain: global-norm clipping -> AdamW with linear warm-up then constant or cosine decay.

    frozen: params -> a pytree of bools, True at leaves that stay as they are: their gradients are
    zeroed before clipping (so the norm counts the others) and weight decay skips them, so Adam's
    update of them is 0 / (0 + eps) = 0 exactly."""
    if schedule == "constant":
        sched = optax.join_schedules(
            [optax.linear_schedule(0.0 if warmup_steps else lr, lr, max(warmup_steps, 1)), optax.constant_schedule(lr)],
            [max(warmup_steps, 1)],
        ) if warmup_steps else optax.constant_schedule(lr)
    elif schedule == "cosine":
        sched = optax.warmup_cosine_decay_schedule(
            0.0, lr, warmup_steps, max(total_steps, warmup_steps + 1), end_value=lr * min_lr_ratio
        )
    else:
        raise ValueError(f"Unknown schedule {schedule!r}; valid: constant, cosine.")
    parts = [] if frozen is None else [optax.masked(optax.set_to_zero(), frozen)]
    parts += [optax.clip_by_global_norm(max_grad_norm)] if max_grad_norm else []
    decayed = None if frozen is None else (lambda params: jax.tree.map(lambda f: not f, frozen(params)))
    parts.append(optax.adamw(sched, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decayed))
    return optax.chain(*parts), sched


def init_train_state(params, optimizer: optax.GradientTransformation, frozen=None) -> TrainState:
    """Step 0; the optimizer state covers `params` only (never `frozen`)."""
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params), frozen=frozen)


def train_state_shardings(params_shardings, optimizer: optax.GradientTransformation, abstract_params, mesh,
                          frozen_shardings=None) -> TrainState:
    """TrainState of shardings: params and frozen as given, every optimizer-state leaf that
    mirrors a parameter (Adam's mu, nu) pinned to that parameter's sharding, the rest (step
    counts) replicated. Left to propagation, an optimizer state built with `eval_shape` or by a
    jit without out_shardings loses the parameter layout."""
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
    opt = optax.tree_map_params(optimizer, lambda _, sharding: sharding, abstract_opt, params_shardings,
                                transform_non_params=lambda _: replicated)
    return TrainState(step=replicated, params=params_shardings, opt_state=opt, frozen=frozen_shardings)


def batch_shardings(mesh, rules=DEFAULT_RULES) -> TrainBatch:
    """TrainBatch of shardings: every array's rows split as the rules' "batch" axis says."""
    rows = NamedSharding(mesh, logical_to_spec(("batch",), rules))
    return TrainBatch(*([rows] * len(TrainBatch._fields)))


def _split(x: chex.Array, n: int, group: int = 1) -> chex.Array:
    """[B, ...] -> [n, B/n, ...] with slice i = the groups of `group` consecutive rows i, i+n,
    i+2n, ... (strided, so that every slice keeps rows from every data shard; whole groups, so
    that rows sharing a prompt stay together)."""
    b = x.shape[0]
    return jnp.swapaxes(x.reshape(b // (n * group), n, group, *x.shape[1:]), 0, 1).reshape(n, b // n, *x.shape[1:])


def _unsplit(x: chex.Array, group: int = 1) -> chex.Array:
    """The inverse of `_split(x, n, group)`: [n, B/n, ...] -> [B, ...]."""
    n, m = x.shape[:2]
    return jnp.swapaxes(x.reshape(n, m // group, group, *x.shape[2:]), 0, 1).reshape(n * m, *x.shape[2:])


def batch_loss_terms(
    params, batch: TrainBatch, *, logprob_fn: LogprobFn, recipe: Recipe, loss_fn=policy_loss, loss_key=None,
    old_logp_from_update: bool = False, scored_tokens: int | None = None, prompt_group: int | None = None,
    total_rows: int | None = None, router_aux_loss_coef: float = 0.0,
) -> tuple[LossTerms, dict, chex.Array]:
    """LossTerms and metrics of one (micro-)batch, plus per-token clip flags [B, L] for analysis:
    `score_batch` then `loss_terms_from_scores` (see there for the arguments), then with
    router_aux_loss_coef > 0 `with_router_aux_loss`."""
    scores = score_batch(logprob_fn, params, batch, scored_tokens, prompt_group,
                         router_stats=router_aux_loss_coef > 0)
    terms, metrics, clipped = loss_terms_from_scores(
        scores[0], scores[1], batch, recipe=recipe, loss_fn=loss_fn, loss_key=loss_key,
        old_logp_from_update=old_logp_from_update, total_rows=total_rows)
    if router_aux_loss_coef > 0:
        terms, metrics = with_router_aux_loss(terms, metrics, scores[2], router_aux_loss_coef)
    return terms, metrics, clipped


def with_router_aux_loss(terms: LossTerms, metrics: dict, stats: RouterStats, coef: float) -> tuple[LossTerms, dict]:
    """The loss plus coef * the routers' load-balancing loss (`core.routing.load_balancing_loss`, the
    switch transformer's, as transformers' Qwen3-MoE adds it with `router_aux_loss_coef`):

        numerator' = numerator + coef * aux * denominator

    so a one-micro-batch step's loss is policy + coef * aux, and a step's micro-batches' aux terms are
    weighted by their shares of its denominator. metrics gain router_aux_loss (aux)."""
    aux = load_balancing_loss(stats)
    return (LossTerms(terms.numerator + coef * aux * jax.lax.stop_gradient(terms.denominator), terms.denominator),
            dict(metrics, router_aux_loss=aux))


def loss_terms_from_scores(
    logp: chex.Array, entropy: chex.Array, batch: TrainBatch, *, recipe: Recipe, loss_fn=policy_loss, loss_key=None,
    old_logp_from_update: bool = False, total_rows: int | None = None, rows=None,
) -> tuple[LossTerms, dict, chex.Array]:
    """LossTerms and metrics of the rows of `batch` given the model's logp, entropy [B, W] on
    them, plus per-token clip flags [B, W] for analysis.

    loss_key: PRNG key passed to loss_fn as key= when recipe.needs_key (Clip-Cov).
    total_rows: the optimizer step's rows when this is one micro-batch of it; passed to loss_fn
    as total_rows= for a loss that sums over rows ("seq-sum-token-sum-norm", whose denominator
    is the micro-batch's share of the step), else unused. rows: the real rows among the B (a
    packed micro-batch's view has empty slots), passed as rows= with total_rows.
    old_logp_from_update: see UpdateSettings. With it the metrics also hold
    "sampler_trainer_logp_gap", mean |old_logp - sampler_logp| over the counted tokens."""
    gap = None
    if old_logp_from_update:
        old = jax.lax.stop_gradient(logp) * batch.loss_mask
        batch = batch._replace(old_logp=old)
        counted = batch.loss_mask * batch.row_weights[:, None]
        gap = jnp.sum(jnp.abs(old - batch.sampler_logp) * counted) / jnp.maximum(jnp.sum(counted), 1.0)
    batch, teacher_sums = distill_batch(batch, recipe)
    extra = {"key": loss_key} if recipe.needs_key else {}
    if recipe.loss_agg_mode in ROW_SUM_MODES:
        extra["total_rows"] = total_rows
        if rows is not None:
            extra["rows"] = rows
    terms, metrics = loss_fn(
        recipe,
        logp=logp,
        old_logp=batch.old_logp,
        advantages=batch.advantages,
        mask=batch.loss_mask,
        row_weights=batch.row_weights,
        denominator_weights=batch.denominator_weights,
        ref_logp=batch.ref_logp,
        sampler_logp=batch.sampler_logp,
        entropy=entropy,
        **extra,
    )
    clipped = apply_surrogate(recipe, jax.lax.stop_gradient(logp), batch.old_logp, batch.advantages,
                              batch.loss_mask).clipped
    clipped = clipped & (batch.row_weights[:, None] > 0)
    if gap is not None:
        metrics = dict(metrics, sampler_trainer_logp_gap=gap)
    if teacher_sums:  # sums over the counted tokens / their count: token-weighted means, combined exactly
        metrics = dict(metrics, **{k: v / jnp.maximum(metrics["num_tokens"], 1.0) for k, v in teacher_sums.items()})
    return terms, metrics, clipped


# position bins of the teacher_kl curve (`core.teacher_kl_metrics`: deciles of each response)
TEACHER_KL_BINS = 10


def distill_batch(batch: TrainBatch, recipe: Recipe) -> tuple[TrainBatch, dict]:
    """On-policy distillation on a batch with the teacher's log-probs (`teacher_logp`; else (batch, {})):

        d_t = old_logp_t - teacher_logp_t,   A_t = A_task - distill_coef·sg(d_t)   (core.distill_advantages)

    the advantages replaced by the token advantages [B, W] when recipe.distill_coef > 0 (A_task =
    0 with task_reward=False: pure distillation), and the teacher's sums over the counted tokens
    (loss mask x row weights): teacher_kl (sum of d_t), teacher_kl_by_position/k (sum of d_t in
    position bin k of `TEACHER_KL_BINS`) and teacher_tokens_by_position/k (its tokens); divided by
    the tokens counted, they combine over micro- and mini-batches as the other token means do
    (`train.metrics.teacher_curve` turns the bins into the curve)."""
    if batch.teacher_logp is None:
        return batch, {}
    counted = batch.loss_mask * batch.row_weights[:, None]
    kl = teacher_kl_metrics(batch.old_logp, batch.teacher_logp, counted, num_bins=TEACHER_KL_BINS)
    tokens = kl["teacher_tokens_by_position"]
    sums = {"teacher_kl": kl["teacher_kl"] * jnp.sum(tokens)}
    for k in range(TEACHER_KL_BINS):
        sums[f"teacher_kl_by_position/{k}"] = kl["teacher_kl_by_position"][k] * tokens[k]
        sums[f"teacher_tokens_by_position/{k}"] = tokens[k]
    if recipe.distills:
        advantages = distill_advantages(batch.advantages if recipe.task_reward else None, batch.old_logp,
                                        batch.teacher_logp, batch.loss_mask, coef=recipe.distill_coef,
                                        discount=recipe.distill_discount, clip=recipe.distill_clip)
        batch = batch._replace(advantages=advantages)
    return batch, sums


def score_batch(logprob_fn: LogprobFn, params, batch: TrainBatch, scored_tokens: int | None = None,
                prompt_group: int | None = None, router_stats: bool = False):
    """logprob_fn on a batch's arrays -> (logp, entropy) [B, L]; with scored_tokens = n only the
    last n positions are scored (`last=n`; the others are 0); with prompt_group = G each group of
    G rows runs its shared prompt once (`group=G`); a batch with routes replays them (`routes=`);
    router_stats: (logp, entropy, the routers' `core.routing.RouterStats`) (`router_stats=True`)."""
    extra = {} if scored_tokens is None else {"last": scored_tokens}
    if batch.routes is not None:
        extra["routes"] = batch.routes
    if router_stats:
        extra["router_stats"] = True
    if prompt_group and prompt_group > 1:
        if scored_tokens is None:
            raise ValueError("prompt_group needs scored_tokens (where each row's prompt ends).")
        extra["group"] = prompt_group
    return logprob_fn(params, batch.input_tokens, batch.targets, batch.positions, batch.attention_mask, **extra)


_MIN_KEYS = ("ratio_min",)
_MAX_KEYS = ("ratio_max",)


def _combine_metrics(acc: dict, new: dict) -> dict:
    """Token-weighted running means; min/max for ratio extremes; `num_tokens` summed."""
    n_old, n_new = acc["num_tokens"], new["num_tokens"]
    total = n_old + n_new
    out = {}
    for k, v in new.items():
        if k == "num_tokens":
            out[k] = total
        elif k in _MIN_KEYS:
            out[k] = jnp.where(n_new > 0, jnp.where(n_old > 0, jnp.minimum(acc[k], v), v), acc[k])
        elif k in _MAX_KEYS:
            out[k] = jnp.where(n_new > 0, jnp.where(n_old > 0, jnp.maximum(acc[k], v), v), acc[k])
        else:
            out[k] = (acc[k] * n_old + v * n_new) / jnp.maximum(total, 1.0)
    return out


def make_update_fn(
    *,
    logprob_fn: LogprobFn,
    recipe: Recipe,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    settings: UpdateSettings,
    loss_fn=policy_loss,
    dropout_seed: int | None = None,
    loss_seed: int = 0,
) -> Callable[[TrainState, TrainBatch], tuple[TrainState, dict, chex.Array]]:
    """Builds update(state, batch) -> (state, metrics, clipped[B, L]); jit it (with shardings).

    B must be divisible by mini_batches * micro_batches. Metrics are token-weighted means over
    the last epoch plus grad_norm (mean over optimizer steps), learning_rate, loss.
    dropout_seed: call `logprob_fn(..., rng=key)` with key = fold(seed, optimizer step,
    micro-batch) for models with dropout (LoRA adapters); None: no rng argument.
    loss_seed: when recipe.needs_key (Clip-Cov), the loss gets key = fold(seed, 1, optimizer step,
    micro-batch): a run with the same seed picks the same tokens.

    The stages: `_micro_step` / `_packed_micro_step` (one micro-batch's gradient),
    `_mini_step` / `_packed_mini_step` (a mini-batch's micro-batches accumulated, then
    `_optimizer_step`), `_mini_batches` (the batch's split), `_run_epochs` (ppo_epochs passes
    over the mini-batches) and `_last_epoch_summary` (the metrics).
    """
    s = settings
    group = s.prompt_group or 1
    keys_of = functools.partial(_micro_batch_keys, dropout_seed=dropout_seed, loss_seed=loss_seed,
                                needs_key=recipe.needs_key)
    optimizer_step = functools.partial(_optimizer_step, optimizer=optimizer, schedule=schedule)
    loss_parts = {"logprob_fn": logprob_fn, "recipe": recipe, "loss_fn": loss_fn, "settings": s}
    if s.packing is not None:
        mini_step = functools.partial(_packed_mini_step, micro_step=functools.partial(_packed_micro_step, **loss_parts),
                                      keys_of=keys_of, optimizer_step=optimizer_step, needs_key=recipe.needs_key)
    else:
        mini_step = functools.partial(_mini_step, micro_step=functools.partial(_micro_step, **loss_parts),
                                      keys_of=keys_of, optimizer_step=optimizer_step, micro_batches=s.micro_batches,
                                      group=group, needs_key=recipe.needs_key)

    def update(state: TrainState, batch):
        if s.packing is not None:
            minis, rows = batch, None  # PackedBatch [n, M, ...]: one mini-batch per n
        else:
            minis, rows = _mini_batches(batch, s.mini_batches, s.micro_batches, group), batch.input_tokens.shape[0]
        state, metrics, clipped = _run_epochs(mini_step, state, minis, s.ppo_epochs, rows)
        return state, _last_epoch_summary(metrics), clipped[-1]

    return update


def _micro_step(params, frozen, mb: TrainBatch, key=None, loss_key=None, *, logprob_fn: LogprobFn, recipe: Recipe,
                loss_fn, settings: UpdateSettings):
    """One micro-batch `mb` (a TrainBatch of b rows, [b, L] arrays) -> (grads, terms, metrics,
    clipped [b, L]): the gradient of its loss numerator with respect to the trainable `params`
    (`frozen` joined in, never differentiated), its LossTerms, metrics and clip flags.
    key: dropout key (`logprob_fn(..., rng=key)`) or None; loss_key: the loss's key or None."""
    s = settings
    fn = logprob_fn if key is None else functools.partial(logprob_fn, rng=key)
    step_rows = mb.input_tokens.shape[0] * s.micro_batches  # the mini-batch's rows (static)

    def num_fn(p):
        terms, metrics, clipped = batch_loss_terms(join_params(p, frozen), mb, logprob_fn=fn, recipe=recipe,
                                                   loss_fn=loss_fn, loss_key=loss_key,
                                                   old_logp_from_update=s.old_logp_from_update,
                                                   scored_tokens=s.scored_tokens, prompt_group=s.prompt_group,
                                                   total_rows=step_rows, router_aux_loss_coef=s.router_aux_loss_coef)
        return terms.numerator, (terms, metrics, clipped)

    grads, (terms, metrics, clipped) = jax.grad(num_fn, has_aux=True)(params)
    return grads, terms, metrics, clipped


def _packed_micro_step(params, frozen, mb, key=None, loss_key=None, *, logprob_fn: LogprobFn, recipe: Recipe,
                       loss_fn, settings: UpdateSettings):
    """_micro_step on one packed micro-batch (train/packing.py): the model on its [RR, S]
    rows, the loss on their per-sequence view; clipped [RR, S] (the flags scattered back to the
    packed slots)."""
    s = settings
    lay = s.packing
    fn = logprob_fn if key is None else functools.partial(logprob_fn, rng=key)

    def num_fn(p):
        scores = score_packed(fn, join_params(p, frozen), mb, router_stats=s.router_aux_loss_coef > 0)
        view, logp, entropy, rows = unpack_micro(mb, scores[0], scores[1], lay.response_width)
        terms, metrics, clipped = loss_terms_from_scores(
            logp, entropy, view, recipe=recipe, loss_fn=loss_fn, loss_key=loss_key,
            old_logp_from_update=s.old_logp_from_update, total_rows=lay.sequences // lay.mini_batches, rows=rows)
        if s.router_aux_loss_coef > 0:
            terms, metrics = with_router_aux_loss(terms, metrics, scores[2], s.router_aux_loss_coef)
        return terms.numerator, (terms, metrics, scatter_slots(clipped, mb, mb.input_tokens.shape[1]))

    grads, (terms, metrics, clipped) = jax.grad(num_fn, has_aux=True)(params)
    return grads, terms, metrics, clipped


def _micro_batch_keys(step, index, *, dropout_seed: int | None, loss_seed: int, needs_key: bool):
    """(dropout key or None, loss key or None) of micro-batch `index` of optimizer step `step`."""
    key = None
    if dropout_seed is not None:
        key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(dropout_seed), step), index)
    loss_key = None
    if needs_key:
        loss_key = jax.random.fold_in(jax.random.fold_in(
            jax.random.fold_in(jax.random.PRNGKey(loss_seed), 1), step), index)
    return key, loss_key


def _optimizer_step(state: TrainState, grads, num, den, metrics, *, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule):
    """One optimizer step on a mini-batch's summed numerator gradients, divided once by its
    global denominator `den` -> (state, metrics + loss, grad_norm, learning_rate)."""
    scale = jnp.where(den > 0, 1.0 / jnp.maximum(den, 1e-30), 0.0)
    grads = jax.tree.map(lambda g: g * scale, grads)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)  # in the parameters' dtypes
    # the optimizer state stays in the dtypes it was created in (Adam's moments in bfloat16 parameters'
    # dtype: float32 gradients would promote them, and the mini-batch scan's carry must not change type)
    opt_state = jax.tree.map(lambda new, old: new.astype(old.dtype), opt_state, state.opt_state)
    metrics = dict(metrics, loss=LossTerms(num, den).value, grad_norm=grad_norm, learning_rate=schedule(state.step))
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state, frozen=state.frozen), metrics


def _zero_metrics(micro_step, state: TrainState, first_micro, needs_key: bool) -> dict:
    """Zeros of the metrics micro_step returns (their structure from an abstract evaluation on
    `first_micro`), so the accumulation loop's carry is fixed."""
    probe_key = jax.random.PRNGKey(0) if needs_key else None
    _, _, metrics_shape, _ = jax.eval_shape(micro_step, state.params, state.frozen, first_micro, None, probe_key)
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), metrics_shape)


def _mini_step(state: TrainState, mini: TrainBatch, *, micro_step, keys_of, optimizer_step, micro_batches: int,
               group: int, needs_key: bool):
    """One mini-batch (a TrainBatch of m rows, [m, L] arrays) -> (state, (metrics, clipped [m, L])):
    its `micro_batches` strided slices (`_split`, whole groups of `group` rows) scanned through
    micro_step, gradients, numerators, denominators and metrics accumulated, then one optimizer step."""
    micros = jax.tree.map(lambda x: _split(x, micro_batches, group), mini)
    zero_grads = jax.tree.map(jnp.zeros_like, state.params)
    zero_metrics = _zero_metrics(micro_step, state, jax.tree.map(lambda x: x[0], micros), needs_key)

    def body(carry, xs):
        mb, index = xs
        g_acc, num, den, met = carry
        g, terms, metrics, clipped = micro_step(state.params, state.frozen, mb, *keys_of(state.step, index))
        g_acc = jax.tree.map(jnp.add, g_acc, g)
        return (g_acc, num + terms.numerator, den + terms.denominator, _combine_metrics(met, metrics)), clipped

    zero = jnp.zeros((), jnp.float32)
    (grads, num, den, metrics), clipped = jax.lax.scan(body, (zero_grads, zero, zero, zero_metrics),
                                                       (micros, jnp.arange(micro_batches)))
    new_state, metrics = optimizer_step(state, grads, num, den, metrics)
    return new_state, (metrics, _unsplit(clipped, group))


def _packed_mini_step(state: TrainState, mini, *, micro_step, keys_of, optimizer_step, needs_key: bool):
    """_mini_step over a packed mini-batch ([M, RR, S] buffers): a while loop over its `num_micro`
    micro-batches (the rest of the [M, ...] buffers are empty and never run); clipped [M, RR, S]."""
    micros = mini._replace(num_micro=None)
    at = lambda i: jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), micros)
    zero_grads = jax.tree.map(jnp.zeros_like, state.params)
    zero_metrics = _zero_metrics(micro_step, state, jax.tree.map(lambda x: x[0], micros), needs_key)

    def body(carry):
        index, g_acc, num, den, met, flags = carry
        g, terms, metrics, clipped = micro_step(state.params, state.frozen, at(index), *keys_of(state.step, index))
        g_acc = jax.tree.map(jnp.add, g_acc, g)
        flags = jax.lax.dynamic_update_index_in_dim(flags, clipped, index, 0)
        return index + 1, g_acc, num + terms.numerator, den + terms.denominator, _combine_metrics(met, metrics), flags

    zero = jnp.zeros((), jnp.float32)
    init = (jnp.zeros((), jnp.int32), zero_grads, zero, zero, zero_metrics, jnp.zeros(micros.input_tokens.shape, bool))
    _, grads, num, den, metrics, clipped = jax.lax.while_loop(lambda c: c[0] < mini.num_micro, body, init)
    new_state, metrics = optimizer_step(state, grads, num, den, metrics)
    return new_state, (metrics, clipped)


def _mini_batches(batch: TrainBatch, mini_batches: int, micro_batches: int, group: int) -> TrainBatch:
    """[B, ...] arrays -> [n, B/n, ...], n = mini_batches: mini-batch j holds the contiguous rows
    [j*B/n, (j+1)*B/n), so whole groups stay together. A B that the mini-batches, micro-batches
    and prompt groups do not divide is a ValueError."""
    b = batch.input_tokens.shape[0]
    if b % (mini_batches * micro_batches * group):
        raise ValueError(
            f"batch of {b} rows is not divisible by mini_batches*micro_batches*prompt_group = "
            f"{mini_batches}*{micro_batches}*{group}; change trainer.mini_batches / "
            "trainer.micro_batch_size or rollout sizes (or trainer.share_prompt=false)."
        )
    return jax.tree.map(lambda x: x.reshape(mini_batches, b // mini_batches, *x.shape[1:]), batch)


def _run_epochs(mini_step, state: TrainState, minis, ppo_epochs: int, rows: int | None):
    """`ppo_epochs` scans of mini_step over the mini-batches `minis` ([n, ...] leading axis) ->
    (state, metrics [ppo_epochs, n] each, clipped [ppo_epochs, B, L]); rows = B reshapes the
    padded mini-batches' flags [n, B/n, L] to [B, L]; None (packed) keeps them as they are."""

    def epoch(state: TrainState, _):
        state, (metrics, clipped) = jax.lax.scan(mini_step, state, minis)
        return state, (metrics, clipped if rows is None else clipped.reshape(rows, -1))

    state, (metrics, clipped) = jax.lax.scan(epoch, state, None, length=ppo_epochs)
    return state, metrics, clipped


def _last_epoch_summary(metrics: dict) -> dict:
    """The update's metrics from the epochs' [ppo_epochs, n] per-mini-batch metrics: of the last
    epoch, num_tokens summed, ratio extremes min/max, grad_norm, learning_rate and loss averaged
    over the optimizer steps, the rest token-weighted means."""
    last = jax.tree.map(lambda m: m[-1], metrics)  # last epoch, one entry per mini-batch
    n = last["num_tokens"]
    summary = {}
    for k, v in last.items():
        if k == "num_tokens":
            summary[k] = jnp.sum(v)
        elif k in _MIN_KEYS:
            summary[k] = jnp.min(v)
        elif k in _MAX_KEYS:
            summary[k] = jnp.max(v)
        elif k in ("grad_norm", "learning_rate", "loss"):
            summary[k] = jnp.mean(v)
        else:
            summary[k] = jnp.sum(v * n) / jnp.maximum(jnp.sum(n), 1.0)
    return summary


def score_packed(logprob_fn: LogprobFn, params, micro, router_stats: bool = False):
    """logprob_fn on one packed micro-batch's rows [RR, S] (segment ids keep its sequences apart; its
    routes, if any, replayed) -> (logp, entropy) [RR, S] (router_stats: and the routers'
    `core.routing.RouterStats`, as `score_batch`)."""
    attention_mask = (micro.segment_ids > 0).astype(jnp.int32)
    extra = {} if micro.routes is None else {"routes": micro.routes}
    if router_stats:
        extra["router_stats"] = True
    return logprob_fn(params, micro.input_tokens, micro.targets, micro.positions, attention_mask,
                      segment_ids=micro.segment_ids, **extra)


def make_logprob_pass(logprob_fn: LogprobFn, micro_batches: int, scored_tokens: int | None = None,
                      prompt_group: int | None = None):
    """(params, batch) -> (logp, entropy) computed micro-batch by micro-batch: [B, L] for a
    TrainBatch (scored_tokens, prompt_group: as in UpdateSettings), [n, M, RR, S] for a
    PackedBatch (its num_micro micro-batches per mini-batch run, the empty ones stay 0)."""
    group = prompt_group or 1

    def run(params, batch: TrainBatch):
        parts = jax.tree.map(lambda x: _split(x, micro_batches, group), batch)

        def one(mb: TrainBatch):
            return score_batch(logprob_fn, params, mb, scored_tokens, prompt_group)

        logp, ent = jax.lax.map(one, parts)
        return _unsplit(logp, group), _unsplit(ent, group)

    def run_packed(params, packed):
        micros = packed._replace(num_micro=None)

        def mini(_, xs):
            one_mini, count = xs

            def body(carry):
                i, logp, ent = carry
                micro = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), one_mini)
                lp, en = score_packed(logprob_fn, params, micro)
                put = lambda buf, v: jax.lax.dynamic_update_index_in_dim(buf, v.astype(buf.dtype), i, 0)
                return i + 1, put(logp, lp), put(ent, en)

            zeros = jnp.zeros(one_mini.input_tokens.shape, jnp.float32)
            _, logp, ent = jax.lax.while_loop(lambda c: c[0] < count, body, (jnp.zeros((), jnp.int32), zeros, zeros))
            return None, (logp, ent)

        _, (logp, ent) = jax.lax.scan(mini, None, (micros, packed.num_micro))
        return logp, ent

    def dispatch(params, batch):
        return run(params, batch) if isinstance(batch, TrainBatch) else run_packed(params, batch)

    return dispatch


def make_routing_pass(routing_fn: Callable, micro_batches: int, scored_tokens: int | None = None):
    """(params, batch) -> router replay's metrics of a TrainBatch carrying the sampler's routes, micro-batch
    by micro-batch: the trainer's own routes and log-probs with no replay (`routing_fn`: (params, inputs,
    targets, positions, attention_mask, last=None) -> (logp [B, T], routes [B, T, L, k], RouterStats [L, ...]);
    `train.policy.make_routing_fn`) against the sampler's (`core.routing`):

        route_disagreement            share of real (token, layer) pairs whose k experts differ as sets
        expert_load_max_over_mean     max / mean of the experts' shares of the choices, mean over layers
        router_entropy                mean over real tokens and layers of the router softmax's entropy
        sampler_trainer_logp_gap_native   mean |logp_native - sampler_logp| over the counted tokens (the
                                      gap replay closes: `sampler_trainer_logp_gap` is the replayed one)
    """
    extra = {} if scored_tokens is None else {"last": scored_tokens}

    def one(params, mb: TrainBatch):
        logp, routes, stats = routing_fn(params, mb.input_tokens, mb.targets, mb.positions, mb.attention_mask, **extra)
        real = mb.attention_mask.astype(jnp.float32)
        counted = mb.loss_mask * mb.row_weights[:, None]
        pairs = jnp.sum(real) * routes.shape[2]
        return {"differ": route_disagreement(routes, mb.routes, real) * pairs, "pairs": pairs,
                "gap": jnp.sum(jnp.abs(logp - mb.sampler_logp) * counted), "counted": jnp.sum(counted),
                "stats": stats}

    def run(params, batch: TrainBatch) -> dict:
        parts = jax.tree.map(lambda x: _split(x, micro_batches), batch)
        sums = jax.tree.map(lambda x: jnp.sum(x, axis=0), jax.lax.map(lambda mb: one(params, mb), parts))
        # the experts' shares of each layer's choices (`core.routing.expert_load` of the native routes), from the
        # router stats' counts: no [B, T, L, k, E] one-hot
        load = sums["stats"].load / jnp.maximum(jnp.sum(sums["stats"].load, axis=-1, keepdims=True), 1e-30)
        return {"route_disagreement": sums["differ"] / jnp.maximum(sums["pairs"], 1.0),
                "expert_load_max_over_mean": load_imbalance(load), "router_entropy": router_entropy(sums["stats"]),
                "sampler_trainer_logp_gap_native": sums["gap"] / jnp.maximum(sums["counted"], 1.0)}

    return run

"""The run's trainer programs, built in one place: `train` runs them, `plan` lowers the same ones on
abstract arrays for a topology and prices them (MaxText's rule: `train_compile.py` compiles
`train.py`'s own step).

    programs = trainer_programs(cfg, mesh, logprob_fn=..., settings=layout.update, params=..., frozen=...)
    state = programs.init_state(params, frozen)            # TrainState on programs.state_shardings
    state, metrics, clipped = programs.update(state, batch)  # batch: TrainBatch, or PackedBatch when packing
    logp, entropy = programs.logprob_pass(join_params(params, frozen), batch)
    teacher_logp = programs.teacher_pass(teacher.params, batch)   # a run with a teacher (train/teacher.py)

`optimizer_for` and `loss_fn_for` are the only places the run's optimizer (with its schedule,
warm-up, weight decay and Adam's constants) and its loss (`algorithm.custom_loss` or
`core.policy_loss`) are made; `trainer_programs` the only place the update and the log-prob pass
are jitted, with their shardings.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import optax

from jaxrl4llm.core import policy_loss
from jaxrl4llm.train.config import RunConfig
from jaxrl4llm.train.layout import lora_dropout, replays_routes
from jaxrl4llm.train.packing import pack, packed_shardings
from jaxrl4llm.train.step import (UpdateSettings, batch_shardings, init_train_state, make_logprob_pass, join_params,
                                  make_optimizer, make_routing_pass, make_update_fn, train_state_shardings)
from jaxrl4llm.train.user_code import import_object


def optimizer_for(cfg: RunConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """`cfg.optim` as the run's optax chain and its learning-rate schedule, over every optimizer step
    of the run (steps x ppo_epochs x mini_batches); with `model.freeze_router` the routers' leaves
    get no update (`make_optimizer(frozen=)`)."""
    optim = cfg.optim
    return make_optimizer(
        lr=optim.lr, schedule=optim.schedule, warmup_steps=optim.warmup_steps,
        total_steps=cfg.trainer.steps * cfg.trainer.ppo_epochs * cfg.trainer.mini_batches,
        min_lr_ratio=optim.min_lr_ratio, weight_decay=optim.weight_decay, b1=optim.b1, b2=optim.b2, eps=optim.eps,
        max_grad_norm=optim.max_grad_norm, frozen=router_frozen if cfg.model.freeze_router else None)


def router_frozen(params):
    """True at a mixture-of-experts layer's router leaves (`router_labels`), False elsewhere."""
    return jax.tree.map(lambda label: label == "frozen", router_labels(params))


def router_labels(params):
    """"frozen" for a mixture-of-experts layer's router leaves (a path through `router`), "trained"
    for every other leaf of `params`."""
    def label(path, _):
        names = {str(getattr(key, "key", getattr(key, "name", key))) for key in path}
        return "frozen" if "router" in names else "trained"
    return jax.tree_util.tree_map_with_path(label, params)


def loss_fn_for(cfg: RunConfig) -> Callable:
    """The update's loss: `algorithm.custom_loss` (an import path, `policy_loss`'s signature) or
    `core.policy_loss`."""
    if cfg.algorithm.custom_loss:
        return import_object(cfg.algorithm.custom_loss, "algorithm.custom_loss")
    return policy_loss


def routing_metrics_on(cfg: RunConfig) -> bool:
    """Whether the run measures router replay's metrics (`trainer.router_metrics_every` > 0 on a run
    that replays routes): the loop runs the routing pass, `plan` prices it."""
    return replays_routes(cfg) and cfg.trainer.router_metrics_every > 0


@dataclasses.dataclass(frozen=True)
class TrainerPrograms:
    """The trainer's jitted programs and the shardings they keep (`trainer_programs`)."""

    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    loss_fn: Callable
    state_shardings: Any  # TrainState of NamedShardings: the update keeps every leaf where it is
    batch_shardings: Any  # TrainBatch of NamedShardings: what `make_batch` places
    update_shardings: Any  # what the update and the log-prob pass take: batch_shardings, or PackedBatch's
    update: Any  # jitted (state, batch) -> (state, metrics, clipped); donates the state
    logprob_pass: Any  # jitted (join_params(params, frozen), batch) -> (logp, entropy) [rows, T] each
    pack: Any  # jitted (TrainBatch, PackPlan) -> PackedBatch on update_shardings, or None (padded rows)
    init_state: Any  # jitted (params, frozen) -> TrainState on state_shardings
    routing_pass: Any = None  # jitted (join_params(params, frozen), batch) -> router replay's metrics, or None
    teacher_pass: Any = None  # jitted (teacher params, batch) -> the teacher's logp [rows, T] (as logprob_pass's), or None


def trainer_programs(cfg: RunConfig, mesh, *, logprob_fn: Callable, settings: UpdateSettings, params, frozen=None,
                     recipe=None, routing_fn: Callable | None = None, teacher=None) -> TrainerPrograms:
    """The update, the log-prob pass, the packer and the state's initialiser of `cfg` on `mesh`.

    logprob_fn: the model's scoring function (`train.policy.make_logprob_fn`). settings: the
    layout's `UpdateSettings`. params / frozen: the trainable parameters and the frozen base (LoRA;
    None without), concrete or `jax.ShapeDtypeStruct`s, each leaf with its sharding. recipe: the
    algorithm (default `cfg.recipe()`). routing_fn: a mixture-of-experts model's native routing pass
    (`train.policy.make_routing_fn`), or None (a dense model): router replay's
    metrics (`train.step.make_routing_pass`) are built from it when the run replays routes and
    `trainer.router_metrics_every` > 0 (`routing_metrics_on`). teacher: on-policy distillation's
    `train.teacher.Teacher` (its params concrete or abstract, with shardings), or None: its log-prob
    pass (`teacher_pass`) is the student's pass (`make_logprob_pass`: padded, packed or shared-prompt
    rows as the layout's) over the teacher's own graphdef, returning the log-probs only."""
    recipe = recipe if recipe is not None else cfg.recipe()
    optimizer, schedule = optimizer_for(cfg)
    loss_fn = loss_fn_for(cfg)
    sharding_of = lambda tree: None if tree is None else jax.tree.map(lambda x: x.sharding, tree)
    state_shardings = train_state_shardings(sharding_of(params), optimizer, params, mesh, sharding_of(frozen))
    batch_in = batch_shardings(mesh)
    update_in = packed_shardings(mesh) if settings.packing else batch_in
    update = jax.jit(
        make_update_fn(logprob_fn=logprob_fn, recipe=recipe, optimizer=optimizer, schedule=schedule, settings=settings,
                       loss_fn=loss_fn, dropout_seed=cfg.trainer.seed if lora_dropout(cfg) else None,
                       loss_seed=cfg.trainer.seed),
        in_shardings=(state_shardings, update_in), out_shardings=(state_shardings, None, None), donate_argnums=(0,))
    logprob_pass = jax.jit(make_logprob_pass(logprob_fn, settings.micro_batches, settings.scored_tokens,
                                             settings.prompt_group),
                           in_shardings=(join_params(sharding_of(params), sharding_of(frozen)), update_in))
    teacher_pass = None
    if teacher is not None:
        scores = make_logprob_pass(teacher.logprob_fn, settings.micro_batches, settings.scored_tokens,
                                   settings.prompt_group)
        teacher_pass = jax.jit(lambda p, batch: scores(p, batch)[0], in_shardings=(sharding_of(teacher.params), update_in))
    return TrainerPrograms(
        teacher_pass=teacher_pass, optimizer=optimizer, schedule=schedule, loss_fn=loss_fn, state_shardings=state_shardings,
        batch_shardings=batch_in, update_shardings=update_in, update=update, logprob_pass=logprob_pass,
        pack=jax.jit(pack, out_shardings=update_in) if settings.packing else None,
        init_state=jax.jit(lambda p, f: init_train_state(p, optimizer, f), out_shardings=state_shardings),
        routing_pass=None if routing_fn is None or not routing_metrics_on(cfg) else jax.jit(
            make_routing_pass(routing_fn, settings.micro_batches, settings.scored_tokens),
            in_shardings=(join_params(sharding_of(params), sharding_of(frozen)), batch_in)))

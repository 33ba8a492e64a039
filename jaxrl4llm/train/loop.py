"""The RL loop: sample P prompts x G responses, reward, shape, filter, compute advantages, update,
log, evaluate, checkpoint; the sampler reads the freshly updated parameters directly.

    summary = train(load_config("configs/lite_ppo.yaml"), resume=False)

Exact resume: the prompt order is a pure function of (seed, epoch), the cursor into it is
checkpointed, and every step's PRNG key is fold_in(seed key, step), so 2 steps + resume + 2
steps equals 4 steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm.core import compute_advantages, scale_rewards
from jaxrl4llm.models import make_mesh, param_shardings
from jaxrl4llm.sampling.buckets import PROMPT_BUCKETS, bucket
from jaxrl4llm.sampling.partial import PartialRollouts
from jaxrl4llm.sampling.generate import use_cpu_kernels
from jaxrl4llm.storage import as_path
from jaxrl4llm.train import hosts
from jaxrl4llm.train.batching import batch_program, merge_groups
from jaxrl4llm.train.checkpointing import RunCheckpointer
from jaxrl4llm.train.config import ConfigError, RunConfig, config_to_dict
from jaxrl4llm.train.evaluation import evaluate
from jaxrl4llm.train.export import export_policy
from jaxrl4llm.train.compile_cache import enable_compile_cache
from jaxrl4llm.train.metrics import (MetricsWriter, all_same_groups, check_loggers, length_cv, most_clipped_tokens,
                                     open_loggers, teacher_curve, truncated_kinds, write_lengths)
from jaxrl4llm.train.layout import (RunLayout, micro_batches, packing_layout_for, replays_routes, run_layout,
                                    sampler_mesh_for, split_for_sampler)
from jaxrl4llm.train.policy import Policy, load_policy
from jaxrl4llm.train.preemption import Preempted, resume_from_checkpoint, stop_requested
from jaxrl4llm.train.programs import TrainerPrograms, loss_fn_for, trainer_programs
from jaxrl4llm.train.prompts import PromptSet, load_prompt_sets
from jaxrl4llm.train.resume import check_config_changes, finished_summary, logged_eval, record_config_changes
from jaxrl4llm.train.reward_fn import CORRECT_REWARD_THRESHOLD, make_reward_fn
from jaxrl4llm.train.rollout_pipeline import (PartialStream, PendingRollout, check_partial, check_tools, partial_version,
                                              pending_from_host, pending_to_host, sampler_base_mesh, sampling_version,
                                              staleness_metrics)
from jaxrl4llm.train.run_files import RunFiles
from jaxrl4llm.train.run_folder import mark_finished, prepare_out_dir
from jaxrl4llm.train.samples import sample_rows
from jaxrl4llm.train.teacher import Teacher, check_teacher_needed, load_teacher
from jaxrl4llm.train.scoring import RowScores, score_rows_with_components
from jaxrl4llm.train.packing import pack_plan
from jaxrl4llm.train.tool_turns import check_void_turn_filter, rollout_turns, run_tool_format, tool_metrics, void_rows
from jaxrl4llm.train.step import (
    TrainBatch,
    UpdateSettings,
    join_params,
)


class PromptStream:
    """Deterministic prompt order: epoch e is permutation(seed + e) of the train set; `cursor`
    counts positions consumed so far, `retired` the prompts that left the stream for good
    (No-Positive-Resampling); both are checkpointed."""

    def __init__(self, num: int, *, seed: int, shuffle: bool, cursor: int = 0, retired=()):
        if num == 0:
            raise ConfigError("The training set is empty: check data.train_files (and data.max_prompt_tokens with data.on_overlong_prompt=drop).")
        self.num, self.seed, self.shuffle, self.cursor = num, seed, shuffle, cursor
        self.retired: set[int] = set(int(i) for i in retired)

    def take(self, k: int) -> list[int]:
        """The next k prompts of the order that have not retired."""
        if len(self.retired) >= self.num:
            raise ConfigError(f"every one of the {self.num} training prompts has retired (rollout.retire_pass_rate): "
                              f"the stream is empty; raise the threshold, add data, or stop earlier.")
        out = []
        while len(out) < k:
            epoch, i = divmod(self.cursor, self.num)
            order = np.random.default_rng(self.seed + epoch).permutation(self.num) if self.shuffle else np.arange(self.num)
            self.cursor += 1
            if int(order[i]) not in self.retired:
                out.append(int(order[i]))
        return out

    def retire(self, prompt_ids, pass_rates, threshold: float | None) -> int:
        """No-Positive-Resampling (ScaleRL, arXiv 2510.13786): prompts whose pass rate reached
        `threshold` never come back. Returns how many retired now."""
        if threshold is None:
            return 0
        new = {int(p) for p, rate in zip(prompt_ids, pass_rates) if rate >= threshold} - self.retired
        self.retired |= new
        return len(new)


def run_meshes(cfg: RunConfig):
    """(training mesh, the sampler's own mesh or None) over this process's view of the run's devices:
    `layout.split_for_sampler` splits them, `jax.make_mesh` orders each side by the topology."""
    trainer, sampler, dims = split_for_sampler(cfg, jax.devices())
    mesh = make_mesh(*dims, devices=trainer if sampler else None)
    return mesh, (sampler_base_mesh(sampler) if sampler else None)


def _in_mesh(fn: Callable, mesh) -> Callable:
    """fn(*args) traced and run under `jax.set_mesh(mesh)` (what `models.sharding.constrain` reads)."""
    def run(*args):
        with jax.set_mesh(mesh):
            return fn(*args)
    return run


def prompts_to_draw(P: int, missing: int, mixed: int, drawn: int) -> int:
    """Prompts a dynamic-sampling redraw takes: enough to fill the `missing` groups at the share of
    mixed-reward groups seen so far (mixed of the drawn prompts), rounded up to a power of two (a
    sampler program per size: at most log2 P more), at most P, and P when none was mixed:

        n = min(P, 2^ceil(log2(ceil(missing / max(mixed / drawn, 1 / P)))))

    DAPO redraws a whole batch of P; with the continuous sampler a smaller call costs in
    proportion to its rows."""
    rate = max(mixed / drawn, 1.0 / P) if drawn else 1.0
    want = max(math.ceil(missing / rate - 1e-9), 1)
    return min(P, 1 << (want - 1).bit_length())


def sample_groups(policy: Policy, prompts: PromptSet, stream: PromptStream, cfg: RunConfig, rng, reward_fn, recipe,
                  on_params_read: Callable[[], None] | None = None):
    """Samples until P groups with differing rewards are found (dynamic sampling) or the draw cap
    is reached, each redraw only as many prompts as the missing groups need (`prompts_to_draw`);
    returns (rollout rows of P groups, RowScores of those rows on the host: rewards [P*G] and a
    `reward.fns` list's components {name: [P*G]} ({} for a single reward.fn), stats).
    on_params_read: called once the sampler has read the policy's parameters for the last time
    (after the tokens of the last possible draw), before the rewards are scored: an asynchronous
    loop dispatches the update there, which may donate those parameters."""
    P, G = cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt
    kept: list[tuple] = []  # (rollout, index in it, rewards, prompt id, components)
    spare: list[tuple] = []
    draws = retired = drawn = mixed = 0
    t_sample = t_reward = 0.0
    all_rewards, all_components, all_tools = [], [], []
    max_draws = cfg.rollout.dynamic_sampling_max_draws if recipe.dynamic_sampling else 1
    # data.prompt_bucket=dataset: every step pads to the training set's longest prompt (one program)
    prompt_len = prompts.longest if cfg.data.prompt_bucket == "dataset" else None
    while len(kept) < P and draws < max_draws:
        draws += 1
        ids = stream.take(P if draws == 1 else prompts_to_draw(P, P - len(kept), mixed, drawn))
        t0 = time.perf_counter()
        rollout, tool_stats = policy.sample(
            [prompts.token_ids[i] for i in ids], num_samples=G, max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
            rng=jax.random.fold_in(rng, draws), prompt_len=prompt_len, record_routes=replays_routes(cfg))
        if tool_stats is not None:
            all_tools.append(tool_stats.metrics())
        jax.block_until_ready(rollout.response_tokens)
        t1 = time.perf_counter()
        if on_params_read is not None and draws == max_draws:
            on_params_read()  # no further draw reads the parameters: the update may run while rewards score
        rows = [i for i in ids for _ in range(G)]
        rewards, components = score_rows_with_components(
            policy, rollout, [prompts.answers[i] for i in rows], reward_fn, [prompts.problems[i] for i in rows],
            [prompts.metadata[i] for i in rows])
        t2 = time.perf_counter()
        t_sample += t1 - t0
        t_reward += t2 - t1
        all_rewards.append(rewards)
        all_components.append(components)
        retired += stream.retire(ids, (rewards.reshape(-1, G) > CORRECT_REWARD_THRESHOLD).mean(axis=1),
                                 cfg.rollout.retire_pass_rate)
        for g, pid in enumerate(ids):
            rows = slice(g * G, (g + 1) * G)
            entry = (rollout, g, rewards[rows], pid, {name: values[rows] for name, values in components.items()})
            varied = rewards[rows].max() != rewards[rows].min()
            drawn, mixed = drawn + 1, mixed + int(varied)
            if varied or not recipe.dynamic_sampling:
                if len(kept) < P:
                    kept.append(entry)
            else:
                spare.append(entry)
    if on_params_read is not None and draws < max_draws:
        on_params_read()  # enough mixed groups before the draw cap
    filled_with_constant = max(P - len(kept), 0)
    kept.extend(spare[:filled_with_constant])  # fixed shapes: constant groups get zero weight below
    merged = merge_groups([(rollout, g) for rollout, g, *_ in kept], G, policy.pad_token_id)
    stats = {
        "time_sampling": t_sample,
        "time_reward": t_reward,
        "sampling_draws": draws,
        "sampling_prompts_drawn": drawn,
        "groups_filled_constant": filled_with_constant,
        "reward_all_draws": float(np.mean(np.concatenate(all_rewards))),
        **component_means(all_components),
        **({k: float(np.mean([t[k] for t in all_tools])) for k in all_tools[0]} if all_tools else {}),
    }
    scores = RowScores(np.concatenate([e[2] for e in kept]),
                       {name: np.concatenate([e[4][name] for e in kept]) for name in kept[0][4]} if kept else {})
    return merged, scores, with_scoring_stats(stats, reward_fn, stream, cfg, retired)


def component_means(components: list[dict]) -> dict[str, float]:
    """`reward/<name>`: each `reward.fns` entry's own reward, averaged over every response scored
    (all draws, as reward_all_draws); {} for a single reward.fn. components: one {name: [N]} per draw."""
    names = components[0] if components else {}
    return {f"reward/{name}": float(np.mean(np.concatenate([c[name] for c in components]))) for name in names}


def with_scoring_stats(stats: dict, reward_fn, stream: PromptStream, cfg: RunConfig, retired: int) -> dict:
    """A rollout's stats plus what scoring it left: responses whose reward failed (a RewardFn's,
    scored 0, warned once) and, with rollout.retire_pass_rate, the prompts retired."""
    if hasattr(reward_fn, "drain"):
        stats["reward_errors"] = reward_fn.drain("sampling")
    if cfg.rollout.retire_pass_rate is not None:
        stats.update(prompts_retired=retired, prompts_retired_total=len(stream.retired))
    return stats


def partial_stream(policy: Policy, prompts: PromptSet, cfg: RunConfig) -> PartialStream:
    """rollout.partial: an empty engine for P prompts x G samples of width bucket(the training set's
    longest prompt) (one program for the run), on the sampler's mesh."""
    r = cfg.rollout
    width = bucket(prompts.longest, PROMPT_BUCKETS)
    try:
        engine = PartialRollouts(
            policy.graphdef, policy.state, num_prompts=r.prompts_per_step, num_samples=r.samples_per_prompt,
            max_new_tokens=r.max_new_tokens, prompt_len=width, eos_token_ids=policy.eos_token_ids,
            pad_token_id=policy.pad_token_id, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
            mesh=policy.sampler_mesh, cpu_kernels=policy.cpu_kernels, decode_burst=r.decode_burst, fetch=hosts.fetch,
            paged_attention=policy.decode_attention, min_p=policy.min_p, stop_token_ids=policy.stop_token_ids,
            stop_strings=policy.stop_strings, tokenizer=policy.tokenizer, record_routes=replays_routes(cfg),
            slots=policy.slots_for(r.prompts_per_step, r.samples_per_prompt, width, r.max_new_tokens,
                                   record_routes=replays_routes(cfg)))
    except (ValueError, TypeError) as e:
        raise ConfigError(f"rollout.partial=true: {e}") from None
    return PartialStream(engine, {})


def sample_segment(policy: Policy, partial: PartialStream, prompts: PromptSet, stream: PromptStream, cfg: RunConfig,
                   step: int, version: int, base_key, reward_fn, on_params_read: Callable[[], None] | None = None):
    """rollout.partial: step's rollout from the engine's next segment, sampled by `policy` (version
    `version`) until it is complete, with step + 1's prompts enqueued first (their rows start in the
    slots step's rows free). Prompts and random numbers are the synchronous run's: rollout t takes
    the stream's next P prompts and draws from fold_in(fold_in(base_key, t), 1). Returns
    (rollout, RowScores (rewards [P*G] and components, as `sample_groups`) on the host, stats, RowVersions)."""
    P, G = cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt
    for t in (step, step + 1):
        if t not in partial.prompt_ids and t < cfg.trainer.steps:
            ids = partial.prompt_ids[t] = stream.take(P)
            partial.engine.enqueue([prompts.token_ids[i] for i in ids],
                                   jax.random.fold_in(jax.random.fold_in(base_key, t), 1))
    t0 = time.perf_counter()
    rollout, versions = partial.engine.segment(policy.graphdef, policy.state, version=version)
    jax.block_until_ready(rollout.response_tokens)
    t1 = time.perf_counter()
    if on_params_read is not None:
        on_params_read()
    ids = partial.prompt_ids.pop(step)
    rows = [i for i in ids for _ in range(G)]
    rewards, components = score_rows_with_components(
        policy, rollout, [prompts.answers[i] for i in rows], reward_fn, [prompts.problems[i] for i in rows],
        [prompts.metadata[i] for i in rows])
    retired = stream.retire(ids, (rewards.reshape(-1, G) > CORRECT_REWARD_THRESHOLD).mean(axis=1), cfg.rollout.retire_pass_rate)
    stats = {"time_sampling": t1 - t0, "time_reward": time.perf_counter() - t1, "sampling_draws": 1,
             "sampling_prompts_drawn": P, "groups_filled_constant": 0, "reward_all_draws": float(np.mean(rewards)),
             "partial_rows_carried": float(np.mean(versions.split < cfg.rollout.max_new_tokens)),
             **component_means([components])}
    return rollout, RowScores(rewards, components), with_scoring_stats(stats, reward_fn, stream, cfg, retired), versions


@dataclasses.dataclass
class Run:
    """What every step of a run uses, built once by `setup_run`."""

    cfg: RunConfig
    recipe: Any
    policy: Policy
    train_set: PromptSet
    eval_sets: list
    reward_fn: Callable
    update: Callable  # (state, batch) -> (state, metrics, clipped)
    logprob_pass: Callable  # (state, batch) -> (logp, entropy)
    make_batch: Callable  # (rollout, rewards, void) -> (TrainBatch on the training mesh, Advantages)
    ref_params: Any  # the reference policy's params (KL / reference log-probs), or None
    base_key: jax.Array
    batch_shardings: Any  # TrainBatch of NamedShardings on the training mesh
    settings: UpdateSettings = UpdateSettings()  # the layout's: old_logp_from_update, packing, prompt group
    layout: RunLayout | None = None  # the run's layout (train/layout.py), written to layout.json
    pack: Callable | None = None  # (TrainBatch, PackPlan) -> PackedBatch on the training mesh (trainer.packing)
    sampler_mesh: Any = None  # the sampler's own devices (mesh.sampler_devices), or None: the training devices
    sampler_params: Any = None  # the trainable parameters' shardings on sampler_mesh (fsdp over its devices)
    sampler_frozen: Any = None  # the frozen base (LoRA) on sampler_mesh, moved there once
    programs: TrainerPrograms | None = None  # the jitted trainer programs (train/programs.py) that `update` / `logprob_pass` run
    routing_pass: Callable | None = None  # (params, batch) -> router replay's metrics (`routing_metrics`), or None
    teacher: Teacher | None = None  # on-policy distillation's frozen teacher (train/teacher.py), or None
    teacher_pass: Callable | None = None  # (teacher params, batch) -> the teacher's logp [rows, T], or None


def sampler_policy(run: Run, state) -> Policy:
    """The policy the sampler draws with at `state`: the state itself on the training devices; on
    `mesh.sampler_devices` a copy of its parameters moved there (taken before the update that
    donates them is dispatched)."""
    if run.sampler_mesh is None:
        return run.policy.with_state(state)
    return dataclasses.replace(run.policy, params=jax.device_put(state.params, run.sampler_params),
                               frozen=run.sampler_frozen)


def trainer_rows(run: Run, rollout):
    """An asynchronous run's rollout with its rows on the training mesh as the batch's are (from the
    sampler's devices, or a checkpoint's host copy): every step reads it with the same sharding."""
    return jax.tree.map(lambda x: jax.device_put(x, run.batch_shardings[0]), rollout)


def update_while_sampling(run: Run, state, rollout, rewards, sample_next: Callable | None, step: int):
    """An asynchronous step's update of `state` on (rollout, rewards), overlapped with
    sample_next(policy, on_params_read) drawing a later step's rollout from the same `state`:
    on the sampler's own devices the update is dispatched first (the sampler reads a copy of the
    parameters); on shared devices once the sampler has read the parameters for the last time, so
    the rewards score while it runs. Returns (dispatch time, (batch, adv, state, metrics, clipped,
    router replay's metrics))."""
    updated = {}

    def dispatch():  # asynchronous dispatch: returns before the update has run
        if not updated:
            updated["t"] = time.perf_counter()
            batch, adv, routing = build_batch(run, state, rollout, rewards, step)
            updated["out"] = (batch, adv, *run.update(state, batch), routing)

    if sample_next is not None:
        policy = sampler_policy(run, state)  # own devices: a copy, taken before the update donates the state
        if run.sampler_mesh is not None:
            dispatch()
        sample_next(policy, dispatch)
    dispatch()
    return updated["t"], updated["out"]


def setup_run(cfg: RunConfig, mesh, log: Callable[[str], None], sampler_mesh=None) -> tuple[Run, Any]:
    """The policy, data and the jitted update / log-prob programs of `cfg` on `mesh`; returns
    (run, initial train state). sampler_mesh: the sampler's own devices (`run_meshes`), or None."""
    recipe = cfg.recipe()
    rate = cfg.rollout.retire_pass_rate
    if rate is not None and not 0.0 < rate <= 1.0:
        raise ConfigError(f"rollout.retire_pass_rate={rate} must be in (0, 1] (a pass rate; null = off).")
    if not cfg.reward.scale > 0:
        raise ConfigError(f"reward.scale={cfg.reward.scale} must be > 0 (a zero scale removes the reward, a negative "
                          f"one rewards wrong answers); use reward.offset to shift the reward.")
    if recipe.uses_sampler_logp and cfg.trainer.old_logp_source == "sampler":
        knob = f"tis_cap={recipe.tis_cap}" if recipe.tis_cap is not None else f"is_correction={recipe.is_correction!r}"
        raise ConfigError(
            f"algorithm {knob} weighs tokens by pi_old / pi_sampler, but with trainer.old_logp_source=sampler the old "
            f"log-probs are the sampler's: the ratio is always 1. Set trainer.old_logp_source=recompute (the trainer "
            f"re-scores the rollout), or drop the correction.")
    loss_fn_for(cfg)  # a bad algorithm.custom_loss fails here, before the weights load
    check_teacher_needed(cfg)  # a distilling recipe without a teacher: before anything loads
    G = cfg.rollout.samples_per_prompt
    micro_batches(cfg, cfg.rollout.prompts_per_step * G, mesh.shape["data"] * mesh.shape["fsdp"])  # fails fast
    # the reward and the data first (then the tokenizer alone, no weights): a bad one fails in seconds
    reward_fn = make_reward_fn(cfg, log if hosts.is_main() else lambda line: None)
    train_set, eval_sets = load_prompt_sets(cfg)
    policy = load_policy(cfg, mesh)
    teacher = load_teacher(cfg, mesh, policy.tokenizer)  # None without teacher.model
    if sampler_mesh is not None:
        policy = dataclasses.replace(policy, decode_mesh=sampler_mesh_for(cfg, sampler_mesh, policy.config))
    try:  # the sampler's C++ CPU kernels, as `generate` decides them for its calls
        cpu_kernels = policy.config is not None and use_cpu_kernels(policy.cpu_kernels, policy.sampler_mesh)
    except ValueError as e:
        raise ConfigError(f"rollout.cpu_kernels: {e}") from None
    layout = run_layout(cfg, mesh, policy.config, prompt_width=train_set.longest, prompt_tokens=train_set.mean_length,
                        sampler_mesh=sampler_mesh, cpu_kernels=cpu_kernels, log=log)
    if layout.decode_attention is not None:  # the sampler runs the layout's kernel (kernels.choice: decided once)
        policy = dataclasses.replace(policy, decode_attention=layout.decode_attention.kernel)
    settings = layout.update
    programs = trainer_programs(cfg, mesh, logprob_fn=policy.logprob_fn, settings=settings, params=policy.params,
                                frozen=policy.frozen, recipe=recipe, routing_fn=policy.routing_fn, teacher=teacher)
    state = programs.init_state(policy.params, policy.frozen)
    need_ref = cfg.trainer.reference_model or recipe.kl_coef > 0
    run = Run(
        cfg=cfg, recipe=recipe, policy=policy, train_set=train_set, eval_sets=eval_sets,
        reward_fn=reward_fn,
        # under the mesh context the model constrains its activations (rows over data x fsdp)
        update=_in_mesh(programs.update, mesh), logprob_pass=_in_mesh(programs.logprob_pass, mesh),
        routing_pass=None if programs.routing_pass is None else _in_mesh(programs.routing_pass, mesh),
        make_batch=batch_program(lambda r, t, l, v: compute_advantages(
            scale_rewards(r, cfg.reward.scale, cfg.reward.offset), G, recipe, truncated=t, lengths=l, void=v),
            programs.batch_shardings, sampled_logp=recipe.sampler_logp_kind == "sampled"),
        ref_params=jax.tree.map(jnp.copy, policy.params) if need_ref else None,  # LoRA: the adapters at init
        base_key=jax.random.PRNGKey(cfg.trainer.seed),
        batch_shardings=programs.batch_shardings,
        settings=settings,
        pack=programs.pack,
        layout=layout,
        sampler_mesh=sampler_mesh,
        sampler_params=None if sampler_mesh is None else param_shardings(policy.params, sampler_mesh),
        sampler_frozen=None if sampler_mesh is None or policy.frozen is None else
        jax.device_put(policy.frozen, param_shardings(policy.frozen, sampler_mesh)),
        programs=programs,
        teacher=teacher,
        teacher_pass=None if programs.teacher_pass is None else _in_mesh(programs.teacher_pass, mesh),
    )
    return run, state


def pack_step(run: Run, rollout, batch):
    """The step's padded TrainBatch packed (train/packing.py) by its real prompt and response
    lengths; the plan is computed alike on every process."""
    rows, width = rollout.prompt_tokens.shape
    layout = packing_layout_for(run.cfg, rows, run.settings.packing.shards, width)
    prompt_lengths = hosts.fetch(_prompt_lengths(rollout.prompt_mask))
    plan = pack_plan(prompt_lengths, hosts.fetch(rollout.lengths), layout, width)
    return run.pack(batch, plan)


def build_batch(run: Run, state, rollout, rewards: np.ndarray, step: int):
    """Advantages of the rows and the train batch, with the current policy's log-probs as
    old_logp (`trainer.old_logp_source: recompute`; a single-step update scores them itself:
    UpdateSettings.old_logp_from_update) and the reference's when needed, the teacher's with a
    teacher (`teacher_logp`); and the step's extra figures: router replay's metrics of the current
    policy on the batch (`routing_metrics`: {} on other steps and runs) and, with a teacher, the
    seconds of its pass (`time_teacher`)."""
    # the rollout lives on the sampler's mesh (rollout.tensor_parallel): the batch lands on the trainer's
    void = void_turn_flags(run, rollout)
    batch, adv = run.make_batch(rollout, np.asarray(rewards, np.float32), None if void is None else jnp.asarray(void))
    padded = batch  # router replay's metrics read the padded rows (the routing pass scores whole rows)
    if run.pack is not None:
        batch = pack_step(run, rollout, batch)
    if run.cfg.trainer.old_logp_source == "recompute" and not run.settings.old_logp_from_update:
        old_logp, _ = run.logprob_pass(join_params(state.params, state.frozen), batch)
        batch = batch._replace(old_logp=old_logp * batch.loss_mask)
    if run.ref_params is not None:  # the reference routes natively (no replay of the sampler's routes)
        ref_logp, _ = run.logprob_pass(join_params(run.ref_params, state.frozen), batch._replace(routes=None))
        batch = batch._replace(ref_logp=ref_logp * batch.loss_mask)
    extra = routing_metrics(run, state, padded, step)
    if run.teacher_pass is not None:  # timed: its share of the step (docs/results/distill.md)
        t0 = time.perf_counter()
        teacher_logp = jax.block_until_ready(run.teacher_pass(run.teacher.params, batch._replace(routes=None)))
        extra = dict(extra, time_teacher=time.perf_counter() - t0)
        batch = batch._replace(teacher_logp=teacher_logp * batch.loss_mask)
    return batch, adv, extra


def void_turn_flags(run: Run, rollout) -> np.ndarray | None:
    """[N] bool, the rows whose last turn is void (`tool_turns.void_rows`), when the recipe filters
    them (`algorithm.overrides.void_turn_filter`); None otherwise. Every process decodes all rows."""
    if not run.recipe.void_turn_filter:
        return None
    turns = rollout_turns(rollout._replace(**{k: hosts.fetch(getattr(rollout, k))
                                              for k in ("response_tokens", "lengths", "tool_mask")}))
    return void_rows(turns, run.policy.decode_ids, run_tool_format(run.cfg))


def routing_metrics(run: Run, state, batch, step: int) -> dict:
    """Router replay's metrics (`train.step.make_routing_pass`: the current policy's own routes and
    log-probs against the sampler's) every `trainer.router_metrics_every` steps; {} otherwise."""
    every = run.cfg.trainer.router_metrics_every
    if run.routing_pass is None or not every or step % every:
        return {}
    return run.routing_pass(join_params(state.params, state.frozen), batch)


@jax.jit
def _prompt_lengths(prompt_mask) -> jax.Array:
    """[N, P] -> [N] real prompt tokens of each row, summed on the devices (the host fetches [N],
    not the mask)."""
    return jnp.sum(prompt_mask, axis=-1).astype(jnp.int32)


@jax.jit
def _batch_scalars(batch, adv, prompt_mask) -> dict:
    """The step's device-side figures in one program (scalars, replicated on every process);
    batch: the TrainBatch or its PackedBatch."""
    weights = batch.row_weights[:, None] if isinstance(batch, TrainBatch) else batch.token_row_weights
    counted = batch.loss_mask * weights
    return {
        # the update's own figure (in `metrics`) replaces it when the update scored pi_old itself
        "sampler_trainer_logp_gap": jnp.sum(jnp.abs(batch.old_logp - batch.sampler_logp) * counted)
        / jnp.maximum(jnp.sum(counted), 1.0),
        "advantage_mean": jnp.mean(adv.advantages),
        "advantage_std": jnp.std(adv.advantages),
        "advantage_abs_max": jnp.max(jnp.abs(adv.advantages)),
        "rows_in_loss": jnp.mean(adv.row_weights),
        "prompt_tokens": jnp.sum(prompt_mask),
    }


def step_record(run: Run, rollout, rewards: np.ndarray, adv, batch, metrics: dict, clipped, step: int) -> dict:
    """The step's metrics (the same on every process: global arrays are gathered first)."""
    lengths = hosts.fetch(rollout.lengths)
    truncated = hosts.fetch(rollout.truncated)
    record = {
        **{k: float(v) for k, v in jax.device_get(_batch_scalars(batch, adv, rollout.prompt_mask)).items()},
        **{k: float(v) for k, v in jax.device_get(metrics).items()},
        "reward": float(np.mean(rewards)),
        "accuracy": float(np.mean(rewards > CORRECT_REWARD_THRESHOLD)),
        "response_length": float(lengths.mean()),
        "response_length_max": int(lengths.max()),
        "truncation_rate": float(truncated.mean()),
        "response_length_cv": length_cv(lengths),
    }
    same_share, same_advantage = all_same_groups(rewards, hosts.fetch(adv.advantages),
                                                 run.cfg.rollout.samples_per_prompt)
    record["all_same_groups"], record["all_same_advantage_share"] = same_share, same_advantage
    record.update(truncated_kinds([], [], []))  # zeros; the rows are decoded only when some were cut
    if truncated.any():
        tokens = hosts.fetch(rollout.response_tokens)
        rows = [tokens[i, : lengths[i]].tolist() if truncated[i] else [] for i in range(len(lengths))]
        texts = run.policy.decode_rows(rows)
        record.update(truncated_kinds(rows, texts, truncated))
    if rollout.tool_mask is not None:  # a run with tools: tool tokens, rows with calls, void turns (with the filter)
        record.update(tool_metrics(hosts.fetch(rollout.tool_mask), hosts.fetch(rollout.response_mask),
                                   void=void_turn_flags(run, rollout)))
    if run.ref_params is None:
        record.pop("kl", None)
    record = teacher_curve(record)
    every = run.cfg.trainer.clipped_tokens_every
    if every and (step + 1) % every == 0:
        top = most_clipped_tokens(hosts.fetch(batch.targets), hosts.fetch(clipped), run.policy.decode_ids)
        record["most_clipped_tokens"] = [[t, c] for t, c in top]
    return record


def train(cfg: RunConfig, *, resume: bool | str = False, allow_config_change: bool = False,
          log: Callable[[str], None] = print) -> dict:
    """Runs the configured RL experiment; returns a summary dict (final metrics, eval, paths,
    start_step: the checkpoint step a resume continued from).
    resume: True (continue from the latest checkpoint), False, or "auto" (continue if there is
    a complete checkpoint, from the newest readable one with a warning, else start fresh). After
    a SIGTERM under `preemption.watch()`, saves the step in progress once it ends and raises
    `preemption.Preempted`.

    A resume of a run that already reached trainer.steps changes nothing and returns that run's
    summary (finished_before: its last step); a resume whose config differs from the run's lists
    the changes and refuses those of train.resume.FIXED_ON_RESUME unless `allow_config_change`.
    Every process of a multi-host run calls it alike (`train.hosts`); process 0 writes the files."""
    # However the run ends (a raise included), its checkpointer and metrics writer close before the
    # program ends: Python 3.12 refuses the threads they would start at exit (the checkpoint write in
    # flight, TensorBoard's writer: train/checkpointing.py, train/metrics.py).
    with contextlib.ExitStack() as closing:
        return _train(cfg, resume, allow_config_change, log, closing)


def save_checkpoint(ckpt, steps_done: int, state, stream, cfg: RunConfig, pending: list, partial) -> None:
    """Checkpoints the run after `steps_done` steps (asynchronous: the next step starts at once):
    the train state (no frozen base), the data cursor and retired prompts, the rollouts sampled
    for the steps ahead (`pending_to_host`) and, with partial rollouts, the engine's begun rows
    (KV cache included) and their prompt ids."""
    arrays, in_flight = pending_to_host(pending, hosts.fetch)
    meta = {"data_cursor": stream.cursor, "seed": cfg.trainer.seed, "step": steps_done,
            "retired_prompts": sorted(stream.retired), "pending": in_flight}
    if partial is not None:
        engine_arrays, engine_meta = partial.engine.host_state(hosts.fetch)
        arrays.update({f"engine/{i}": a for i, a in engine_arrays.items()})
        meta["partial"] = {"engine": engine_meta,
                           "prompt_ids": {str(t): list(map(int, ids)) for t, ids in partial.prompt_ids.items()}}
    ckpt.save(steps_done, state.replace(frozen=None), meta, pending=arrays)


def _restore(ckpt: RunCheckpointer, state, partial, unattended: bool, log: Callable[[str], None]):
    """A resumed run's stage: the newest checkpoint (the newest readable one when `unattended`) into
    `state` (its frozen base kept), and with it the data cursor, the retired prompts, the rollouts in
    flight and the partial engine's rows. Returns (state, start_step, cursor, retired, pending)."""
    abstract = state.replace(frozen=None)  # checkpoints hold no frozen base
    restored, meta, start_step = ckpt.restore_newest_readable(abstract, log) if unattended else ckpt.restore(abstract)
    state = restored.replace(frozen=state.frozen)
    cursor = int(meta["data_cursor"])
    retired, pending = meta.get("retired_prompts", []), []
    if meta.get("pending") or meta.get("partial"):  # an asynchronous run's rollouts in flight
        arrays = ckpt.restore_pending(start_step)
        pending = pending_from_host(arrays, meta.get("pending", []), lambda a: a)
        if partial is not None and meta.get("partial"):  # the engine, its rows mid-way
            partial.engine.restore({k[7:]: v for k, v in arrays.items() if k.startswith("engine/")},
                                   meta["partial"]["engine"])
            partial.prompt_ids.update({int(t): ids for t, ids in meta["partial"]["prompt_ids"].items()})
    log(f"resumed from {ckpt.dir / str(start_step)} (step {start_step}, data cursor {cursor})")
    return state, start_step, cursor, retired, pending


def _draw(run, cfg: RunConfig, stream: PromptStream, partial, start_step: int, t: int, policy,
          on_params_read=None) -> PendingRollout:
    """An asynchronous run's stage: the rollout that step `t` trains on, sampled by `policy` (whole
    groups, `sample_groups`; with partial rollouts the engine's next segment, `sample_segment`), with
    the policy version it was sampled at (trainer.max_staleness steps behind at most)."""
    k = cfg.trainer.max_staleness
    if partial is None:
        rollout, scores, stats = sample_groups(policy, run.train_set, stream, cfg, jax.random.fold_in(run.base_key, t),
                                               run.reward_fn, run.recipe, on_params_read)
        return PendingRollout(t, sampling_version(t, k, start_step), rollout, scores.rewards, stats,
                              components=scores.components)
    version = partial_version(t, k, start_step)
    rollout, scores, stats, versions = sample_segment(policy, partial, run.train_set, stream, cfg, t, version,
                                                      run.base_key, run.reward_fn, on_params_read)
    return PendingRollout(t, version, rollout, scores.rewards, stats, versions, scores.components)


def _stop_preempted(steps_done: int, save: Callable[[], None] | None, writer, files, ckpt: RunCheckpointer,
                    log: Callable[[str], None]) -> None:
    """A preempted run's last stage (every process, after the same step): `save` this step's
    checkpoint (None: the step's periodic one is already on its way), flush the metrics and the run
    folder, wait for the write, then raise Preempted (exit 75: the relaunch resumes here)."""
    if save is not None:
        save()
    writer.close()
    files.sync()
    ckpt.close()  # waits for the write
    log(f"preempted: checkpoint of step {steps_done} saved in {ckpt.dir}")
    raise Preempted(steps_done, str(ckpt.dir / str(steps_done)))


def _final_eval(run, cfg: RunConfig, history: list, out, writer, evaluate_now: Callable[[], dict]) -> dict | None:
    """The run's held-out figures after its last step: the last step's own evaluation, else the one a
    resumed run logged before it stopped, else a new one (`evaluate_now`, then logged). None without
    eval sets or with trainer.eval_every < 0."""
    if not run.eval_sets or cfg.trainer.eval_every < 0:
        return None
    if history and any(k.startswith("eval/") for k in history[-1]):
        return {k[5:]: v for k, v in history[-1].items() if k.startswith("eval/")}
    if not history and (logged := logged_eval(out, cfg.trainer.steps)) is not None:
        return logged  # a resume at the last step (the run stopped after its evaluation): not again
    eval_after = evaluate_now()
    writer.write(cfg.trainer.steps, {f"eval/{k}": v for k, v in eval_after.items()}, advance=False)
    return eval_after


def _train(cfg: RunConfig, resume: bool | str, allow_config_change: bool, log: Callable[[str], None],
           closing: contextlib.ExitStack) -> dict:
    if resume and (done := finished_summary(cfg)) is not None:
        log(f"{cfg.trainer.out_dir} holds a run that finished at step {done['finished_before']} "
            f"(trainer.steps={cfg.trainer.steps}): nothing to resume, nothing written. Raise trainer.steps to train on.")
        return done
    check_partial(cfg.rollout.partial, cfg.trainer.max_staleness, cfg.rollout.engine, cfg.recipe().dynamic_sampling)
    check_tools(cfg.rollout.tools.enabled, cfg.rollout.engine, cfg.rollout.partial)
    check_void_turn_filter(cfg, cfg.recipe())
    check_loggers(cfg.trainer.loggers)  # a missing package: an error before anything is written or loaded
    enable_compile_cache(cfg.trainer.compile_cache)  # a resume loads its programs instead of compiling them
    unattended = resume == "auto"  # a relaunch: an unreadable latest checkpoint falls back to the one before
    resume = resume_from_checkpoint(resume, cfg.trainer.out_dir, log if hosts.is_main() else lambda s: None)
    files = RunFiles(cfg.trainer.out_dir, enabled=hosts.is_main())  # gs://: appended to locally, synced (run_files.py)
    if hosts.is_main():
        prepare_out_dir(cfg, resume, log)  # checks before it writes: a refused start leaves the folder as it was
        files.pull()
    hosts.barrier("out_dir ready")
    # every process reads the run's config.json: a refused change stops them all, before the model loads
    changes = check_config_changes(cfg, allow=allow_config_change, log=log if hosts.is_main() else lambda line: None) \
        if resume else {}
    # W&B / MLflow start (or continue the run of loggers.json) before the model loads: one that cannot fails fast
    loggers = open_loggers(cfg, files.dir, resume=bool(resume)) if hosts.is_main() else []
    # a failure before the metrics writer exists closes them; the callback reads `loggers` when it runs: [] by then
    closing.callback(lambda: [logger.close() for logger in loggers])
    out = as_path(cfg.trainer.out_dir)
    mesh, sampler_mesh = run_meshes(cfg)
    run, state = setup_run(cfg, mesh, log, sampler_mesh=sampler_mesh)
    partial = partial_stream(sampler_policy(run, state), run.train_set, cfg) if cfg.rollout.partial else None
    ckpt = closing.enter_context(RunCheckpointer(out, keep=cfg.trainer.keep_checkpoints))
    start_step, cursor, retired, pending = 0, 0, [], []
    if resume:
        state, start_step, cursor, retired, pending = _restore(ckpt, state, partial, unattended, log)
    if hosts.is_main():  # after the restore: a --resume that fails leaves the run's config.json as it was
        record_config_changes(files.dir, start_step, changes)
        (out / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=2))
        (out / "layout.json").write_text(json.dumps(run.layout.to_dict(), indent=2))  # what the config resolved to
    stream = PromptStream(len(run.train_set), seed=cfg.trainer.seed, shuffle=cfg.data.shuffle, cursor=cursor,
                          retired=retired)
    writer = MetricsWriter(files.dir, total_steps=cfg.trainer.steps, progress_bar=cfg.trainer.progress_bar and hosts.is_main(),
                           start_step=start_step, enabled=hosts.is_main(), loggers=loggers)
    loggers = []  # the writer closes them
    closing.callback(writer.close)
    writer.truncate_after(start_step)
    evaluate_at = lambda step, st: evaluate(sampler_policy(run, st), run.eval_sets, cfg, run.reward_fn,
                                            jax.random.fold_in(run.base_key, 10**9 + step))

    eval_before = logged_eval(out, 0) if start_step > 0 else None  # a resumed run's, from before its first step
    if run.eval_sets and start_step == 0 and cfg.trainer.eval_every >= 0:
        eval_before = evaluate_at(0, state)
        writer.write(0, {f"eval/{k}": v for k, v in eval_before.items()}, advance=False)

    history = []
    k = cfg.trainer.max_staleness
    if k and not run.recipe.uses_sampler_logp and cfg.trainer.old_logp_source == "recompute":
        log(f"trainer.max_staleness={k}: rows up to {k} policy versions old, and no algorithm.overrides.is_correction "
            f"weighs them by pi_old / pi_behaviour (decoupled PPO, docs/objectives.md: e.g. is_correction=mis_token, "
            f"is_cap=5); the update treats them as on-policy.")
    ahead = k - 1 if partial is not None else k  # rollouts sampled whole before the update that trains on them

    draw = functools.partial(_draw, run, cfg, stream, partial, start_step)

    for step in range(start_step, cfg.trainer.steps):
        t_step = time.perf_counter()
        if k == 0:  # synchronous: this step's rollout from the current policy
            rollout, (rewards, components), sample_stats = sample_groups(
                run.policy.with_state(state), run.train_set, stream, cfg, jax.random.fold_in(run.base_key, step),
                run.reward_fn, run.recipe)
            t_update = time.perf_counter()
            batch, adv, routing = build_batch(run, state, rollout, rewards, step)
            state, metrics, clipped = run.update(state, batch)
            staleness, versions = {}, step
        else:  # asynchronous (train/rollout_pipeline.py): train on a rollout sampled k versions ago, sample the next
            while len(pending) < ahead and step + len(pending) < cfg.trainer.steps:  # a run's first rollouts
                pending.append(draw(step + len(pending), sampler_policy(run, state)))
            current = pending.pop(0) if ahead else draw(step, sampler_policy(run, state))
            rollout, rewards, sample_stats = trainer_rows(run, current.rollout), current.rewards, current.stats
            components = current.components
            sample_next = (lambda policy, dispatch: pending.append(draw(step + ahead, policy, dispatch))) \
                if ahead and step + ahead < cfg.trainer.steps else None
            t_update, (batch, adv, state, metrics, clipped, routing) = update_while_sampling(
                run, state, rollout, rewards, sample_next, step)
            lengths = hosts.fetch(rollout.lengths)  # [N]: the host needs no [N, R] mask
            staleness = staleness_metrics(*(current.versions.token_versions(lengths) if current.versions is not None
                                            else (np.full(rollout.num_rows, current.version), lengths)), step, k)
            versions = current.version if current.versions is None else current.versions.first
        record = step_record(run, rollout, rewards, adv, batch, {**metrics, **routing}, clipped, step)
        t_end = time.perf_counter()
        record.update(time_update=t_end - t_update, time_step=t_end - t_step, **sample_stats, **staleness,
                      tokens_per_second=(record["response_length"] * rollout.num_rows + record.pop("prompt_tokens"))
                      / (t_end - t_step))
        if cfg.trainer.eval_every > 0 and (step + 1) % cfg.trainer.eval_every == 0 and run.eval_sets:
            record.update({f"eval/{k}": v for k, v in evaluate_at(step + 1, state).items()})
        writer.write_samples(step + 1, sample_rows(run.policy, rollout, rewards, adv, versions, cfg.trainer.log_samples,
                                                   components))
        writer.write(step + 1, record)
        lengths = [hosts.fetch(x) for x in (rollout.lengths, _prompt_lengths(rollout.prompt_mask))]  # all processes
        if hosts.is_main():
            write_lengths(files.dir, step + 1, *lengths)
        history.append(record)
        save = functools.partial(save_checkpoint, ckpt, step + 1, state, stream, cfg, pending, partial)
        checkpoint_now = cfg.trainer.checkpoint_every and (step + 1) % cfg.trainer.checkpoint_every == 0
        if checkpoint_now:
            save()
            files.sync()  # gs://: the metrics so far reach the run folder with each checkpoint
        if stop_requested():  # a SIGTERM reached some process: all save this step and stop together
            _stop_preempted(step + 1, None if checkpoint_now else save, writer, files, ckpt, log)

    eval_after = _final_eval(run, cfg, history, out, writer, lambda: evaluate_at(cfg.trainer.steps, state))
    writer.close()
    files.sync()
    export_dir = export_policy(run.policy.with_state(state), out / "hf_export") if cfg.trainer.export_hf else None
    ckpt.close()
    if hosts.is_main():
        mark_finished(out)  # a finished run is not started over without trainer.overwrite
    return {"history": history, "eval_before": eval_before, "eval_after": eval_after, "state": state,
            "out_dir": str(out), "export_dir": None if export_dir is None else str(export_dir), "start_step": start_step}

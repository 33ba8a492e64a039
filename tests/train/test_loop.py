"""End-to-end loop: every recipe runs and logs; resume is exact; bad input fails clearly."""

import json

import jax
import numpy as np
import pytest

from jaxrl4llm.cli import main as cli_main
from jaxrl4llm.core import PRESETS
from jaxrl4llm.train.config import ConfigError, load_config
from jaxrl4llm.train.loop import prepare_out_dir, run_meshes, setup_run, train
from jaxrl4llm.train.programs import router_labels
from jaxrl4llm.train.run_folder import MARKER, mark_run_folder

from tests.train.conftest import tiny_overrides

REQUIRED_METRICS = (
    "reward", "accuracy", "advantage_mean", "advantage_std", "response_length", "response_length_max",
    "truncation_rate", "truncated_repeat_ratio", "entropy", "clip_frac_low", "clip_frac_high", "approx_kl",
    "grad_norm", "learning_rate", "tokens_per_second", "time_sampling", "time_reward", "time_update",
    "sampler_trainer_logp_gap", "most_clipped_tokens", "response_length_cv", "all_same_groups",
    "all_same_advantage_share", "truncated_boxed_ratio", "truncated_unfinished_ratio",
)


def test_every_recipe_runs_finite_with_metrics(demo_assets, tmp_path):
    for name in PRESETS:
        if PRESETS[name].distills:
            continue  # a teacher's recipes: tests/train/test_teacher.py runs them with a teacher
        extra = {"algorithm.preset": name}
        if name == "dapo":
            extra["algorithm.overrides"] = "{overlong_max_length: 8, overlong_buffer_length: 4}"
        if name == "dr_grpo":
            extra["algorithm.overrides"] = "{norm_length: 8}"
        cfg = load_config(None, tiny_overrides(demo_assets, tmp_path / name, **extra))
        summary = train(cfg, log=lambda s: None)
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [1, 2], name
        for key in REQUIRED_METRICS:
            assert key in records[-1], (name, key)
        numbers = [v for r in records for v in r.values() if isinstance(v, float)]
        assert all(np.isfinite(numbers)), name
        if name == "grpo":
            assert "kl" in records[-1]
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(summary["state"].params))


def test_resume_is_exact(demo_assets, tmp_path):
    straight = load_config(None, tiny_overrides(demo_assets, tmp_path / "a", **{"trainer.steps": 4, "trainer.checkpoint_every": 2}))
    full = train(straight, log=lambda s: None)

    first = load_config(None, tiny_overrides(demo_assets, tmp_path / "b", **{"trainer.steps": 2, "trainer.checkpoint_every": 2}))
    train(first, log=lambda s: None)
    second = load_config(None, tiny_overrides(demo_assets, tmp_path / "b", **{"trainer.steps": 4, "trainer.checkpoint_every": 2}))
    # A fresh run over it would keep its checkpoints and mix its metrics: refused, with the fixes.
    with pytest.raises(ConfigError, match=r"already holds a run \(checkpoints, metrics.jsonl.*--resume.*trainer.overwrite=true"):
        train(second, log=lambda s: None)
    resumed = train(second, resume=True, log=lambda s: None)

    for a, b in zip(full["history"][2:], resumed["history"]):
        for key in ("reward", "loss", "grad_norm", "response_length", "entropy", "clip_frac"):
            np.testing.assert_allclose(a[key], b[key], rtol=1e-5, atol=1e-6, err_msg=key)
    for x, y in zip(jax.tree.leaves(full["state"].params), jax.tree.leaves(resumed["state"].params)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
    steps = [json.loads(line)["step"] for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    # every step's per-row lengths, for `plan --response-lengths RUN`: the resumed steps appended
    lengths = [json.loads(line) for line in (tmp_path / "b" / "response_lengths.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lengths] == [1, 2, 3, 4]
    for r, record in zip(lengths[2:], resumed["history"]):
        assert len(r["response_lengths"]) == 8 and np.mean(r["response_lengths"]) == pytest.approx(record["response_length"])


def test_overwrite_removes_only_the_earlier_runs_outputs(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "2").mkdir(parents=True)
    mark_run_folder(run)  # a run's folder (tests/train/test_run_folder.py: other folders are refused)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "notes.txt").write_text("mine")
    cfg = load_config(None, [f"trainer.out_dir={run}", "trainer.overwrite=true"])
    messages = []
    assert prepare_out_dir(cfg, resume=False, log=messages.append) == run
    assert sorted(p.name for p in run.iterdir()) == [MARKER, "notes.txt"]
    assert "removed the earlier run's checkpoints, metrics.jsonl" in messages[0]
    # --resume never deletes anything.
    (run / "checkpoints" / "2").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    prepare_out_dir(load_config(None, [f"trainer.out_dir={run}"]), resume=True)
    assert (run / "metrics.jsonl").exists()


def test_missing_data_file_is_a_clear_error(demo_assets, tmp_path, capsys):
    code = cli_main(["train"] + tiny_overrides(demo_assets, tmp_path, **{"data.train_files": "[/nope/train.jsonl]"}))
    assert code == 2
    assert "Data file '/nope/train.jsonl' does not exist" in capsys.readouterr().err


def test_prompt_over_budget_is_a_clear_error(demo_assets, tmp_path):
    cfg = load_config(None, tiny_overrides(demo_assets, tmp_path, **{"data.max_prompt_tokens": 10}))
    with pytest.raises(ConfigError, match=r"over the budget of max_prompt_tokens=10.*data.max_prompt_tokens"):
        train(cfg, log=lambda s: None)


def test_bad_config_key_on_the_command_line(capsys):
    assert cli_main(["train", "trainer.stepz=3"]) == 2
    err = capsys.readouterr().err
    assert "'trainer.stepz'" in err and "valid keys: steps" in err


def test_every_command_has_help(capsys):
    for command in ("train", "eval", "sample", "plot", "convert", "bin-difficulty", "demo"):
        with pytest.raises(SystemExit) as e:
            cli_main([command, "--help"])
        assert e.value.code == 0
        assert "usage: jaxrl4llm " + command in capsys.readouterr().out


def test_truncated_is_with_sampler_old_logp_is_refused(demo_assets, tmp_path):
    """tis_cap corrects pi_old against the sampler; with old_logp_source=sampler both are the
    sampler's and the weight is 1: a silent no-op before, now an error that names the keys."""
    cfg = load_config(None, tiny_overrides(demo_assets, tmp_path, **{"algorithm.overrides": "{tis_cap: 2.0}",
                                                                      "trainer.old_logp_source": "sampler"}))
    with pytest.raises(ConfigError, match=r"tis_cap=2.0.*trainer.old_logp_source=recompute"):
        train(cfg, log=lambda s: None)


def test_no_positive_resampling_retires_prompts_for_good_across_resume(demo_assets, tmp_path):
    """rollout.retire_pass_rate: prompts that reached the pass rate never come back (each step
    draws fresh ones), and the retired set survives a checkpoint and resume."""
    extra = {"reward.fn": "tests.train.custom_parts:always_correct_reward", "rollout.retire_pass_rate": 0.5,
             "trainer.checkpoint_every": 2}
    straight = train(load_config(None, tiny_overrides(demo_assets, tmp_path / "a", **extra, **{"trainer.steps": 4})),
                     log=lambda s: None)
    totals = [r["prompts_retired_total"] for r in straight["history"]]
    assert totals == [2, 4, 6, 8] and all(r["prompts_retired"] == 2 for r in straight["history"])
    train(load_config(None, tiny_overrides(demo_assets, tmp_path / "b", **extra, **{"trainer.steps": 2})),
          log=lambda s: None)
    resumed = train(load_config(None, tiny_overrides(demo_assets, tmp_path / "b", **extra, **{"trainer.steps": 4})),
                    resume=True, log=lambda s: None)
    assert [r["prompts_retired_total"] for r in resumed["history"]] == [6, 8]
    with pytest.raises(ConfigError, match=r"rollout.retire_pass_rate=1.5"):
        train(load_config(None, tiny_overrides(demo_assets, tmp_path / "c", **{"rollout.retire_pass_rate": 1.5})),
              log=lambda s: None)


def test_reward_scale_reaches_the_advantages_not_the_accuracy(demo_assets, tmp_path):
    """reward.scale / reward.offset (the study's {-1, 1} setting): Dr. GRPO's advantages (no std)
    double at scale 2, while the logged accuracy, the verifier's own 0/1 value, is unchanged."""
    extra = {"algorithm.preset": "dr_grpo", "trainer.steps": 1}
    plain = train(load_config(None, tiny_overrides(demo_assets, tmp_path / "a", **extra)), log=lambda s: None)
    scaled = train(load_config(None, tiny_overrides(demo_assets, tmp_path / "b", **extra,
                                                    **{"reward.scale": 2.0, "reward.offset": -1.0})), log=lambda s: None)
    a, b = plain["history"][0], scaled["history"][0]
    assert a["accuracy"] == b["accuracy"] and a["reward"] == b["reward"]
    assert a["advantage_abs_max"] > 0
    np.testing.assert_allclose(b["advantage_abs_max"], 2 * a["advantage_abs_max"], rtol=1e-5)
    with pytest.raises(ConfigError, match=r"reward.scale=0.0 must be > 0"):
        train(load_config(None, tiny_overrides(demo_assets, tmp_path / "c", **{"reward.scale": 0.0})), log=lambda s: None)


def test_entropy_control_and_sampled_logp_recipe_run_end_to_end(demo_assets, tmp_path):
    """Clip-Cov through the loop (the train step hands the loss its PRNG key) with the
    corrections comparing against the sampled (top-k/top-p) distribution's log-probs."""
    overrides = ("{cov_control: clip_cov, cov_ratio: 0.2, clip_cov_low: -1.0e9, clip_cov_high: 1.0e9, "
                 "is_correction: icepop, sampler_logp_kind: sampled}")
    cfg = load_config(None, tiny_overrides(demo_assets, tmp_path, **{"algorithm.overrides": overrides,
                                                                      "trainer.steps": 1}))
    summary = train(cfg, log=lambda s: None)
    record = summary["history"][-1]
    assert 0 < record["cov_selected_frac"] <= 0.2
    assert "is_masked_frac" in record and np.isfinite(record["is_masked_frac"])


def test_a_remat_policy_reaches_the_model_and_changes_no_number(demo_assets, tmp_path):
    """model.remat_policy trades memory for recomputation; the run's numbers stay the same."""
    runs = {}
    for name, extra in {"plain": {}, "save_dots": {"model.remat": True, "model.remat_policy": "save_dots"}}.items():
        cfg = load_config(None, tiny_overrides(demo_assets, tmp_path / name, **{"trainer.steps": 1, **extra}))
        runs[name] = train(cfg, log=lambda s: None)
        if extra:
            from jaxrl4llm.train.policy import load_policy

            config = load_policy(cfg, None).config
            assert config.remat and config.remat_policy == "save_dots"
    for k in ("loss", "grad_norm", "entropy"):
        assert runs["save_dots"]["history"][0][k] == pytest.approx(runs["plain"]["history"][0][k], rel=1e-5), k


def test_shared_prompt_forward_changes_no_number_and_says_when_it_cannot(demo_assets, tmp_path):
    """trainer.share_prompt (each prompt's forward once for its samples_per_prompt rows): on by
    default where micro-batches hold whole groups, the same numbers as every row run whole; with
    true where it cannot apply, an error naming the fix. The second step of each run re-samples
    from the updated policy, so equal histories also say the update was the same."""
    from jaxrl4llm.train.layout import shared_prompt_group

    runs = {}
    for share in ("auto", "false"):
        cfg = load_config(None, tiny_overrides(demo_assets, tmp_path / share, **{"trainer.share_prompt": share}))
        runs[share] = train(cfg, log=lambda s: None)["history"]
    assert len(runs["auto"]) == 2
    for a, b in zip(runs["auto"], runs["false"]):
        for k in ("loss", "grad_norm", "entropy", "reward", "response_length"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-7), k
    cfg = lambda **extra: load_config(None, tiny_overrides(demo_assets, tmp_path / "c", **extra))
    assert shared_prompt_group(cfg(), own_model=True, micro_batches=1) == 4  # 2 prompts x 4 samples
    assert shared_prompt_group(cfg(**{"trainer.micro_batch_size": 2}), own_model=True, micro_batches=4) is None
    assert shared_prompt_group(cfg(), own_model=False, micro_batches=1) is None
    assert shared_prompt_group(cfg(), own_model=True, micro_batches=1, data_parallel=2) == 4  # a group per device
    assert shared_prompt_group(cfg(), own_model=True, micro_batches=1, data_parallel=4) is None  # groups split
    assert shared_prompt_group(cfg(**{"trainer.share_prompt": False}), own_model=True, micro_batches=1) is None
    with pytest.raises(ConfigError, match=r"micro-batch of 2 rows does not give each device whole groups.*multiple of 4"):
        train(cfg(**{"trainer.share_prompt": True, "trainer.micro_batch_size": 2}), log=lambda s: None)


@pytest.mark.xla_default_opt  # zero differing bits, at the level users run (tests/conftest.py)
def test_a_training_run_in_exact_numerics_has_no_sampler_trainer_gap(demo_assets, tmp_path):
    """The loop with packed rows and partial rollouts: the mean |old_logp - sampler_logp| it logs is 0."""
    cfg = load_config(None, tiny_overrides(demo_assets, tmp_path, **{
        "model.numerics": "exact", "trainer.packing": True, "rollout.partial": True, "trainer.max_staleness": 1}))
    train(cfg, log=lambda s: None)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["sampler_trainer_logp_gap"] for r in records] == [0.0, 0.0]


def test_router_replay_trains_a_tiny_mixture_of_experts_model(demo_assets, tmp_path):
    """trainer.router_replay=rollout end to end on a random Qwen3-MoE of the size fields: the sampler
    records routes, the update replays them on packed rows (its own forward gives old_logp: one
    optimizer step), the reference (GRPO's KL) routes natively; the reward (the share of digits in the
    response) rises over 12 steps, with finite numbers, router replay's metrics, and frozen routers
    (model.freeze_router). The recompute pass's replay, padded and packed: tests/train/test_agreement.py."""
    cfg = load_config(None, tiny_overrides(demo_assets, tmp_path, **{
        "model.architecture": "qwen3_moe", "model.num_experts": 4,
        "model.num_experts_per_tok": 2, "model.moe_intermediate_size": 16, "trainer.router_replay": "rollout",
        "model.freeze_router": True, "algorithm.preset": "grpo", "trainer.steps": 12, "trainer.packing": "true",
        "rollout.prompts_per_step": 4, "optim.lr": 2e-2, "reward.fn": "tests.train.custom_parts:digit_share_reward"}))
    summary = train(cfg, log=lambda s: None)
    assert json.loads((tmp_path / "layout.json").read_text())["row_form"] == "packed"
    rewards = [r["reward"] for r in summary["history"]]
    # it learns with replayed routes: +0.50, +0.29, +0.50 on seeds 0, 1, 2 (0.1 at the start)
    assert np.mean(rewards[-4:]) > np.mean(rewards[:4]) + 0.2, rewards
    record = summary["history"][-1]
    assert all(np.isfinite(record[k]) for k in ("loss", "grad_norm", "kl", "sampler_trainer_logp_gap"))
    assert record["sampler_trainer_logp_gap"] < 1e-4  # float32: the trainer scores what the sampler ran
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(summary["state"].params))
    # router replay's metrics (trainer.router_metrics_every=1): the policy that sampled, routing natively
    assert 0.0 <= record["route_disagreement"] < 0.05
    assert 1.0 <= record["expert_load_max_over_mean"] <= 4.0
    assert 0.0 < record["router_entropy"] <= np.log(4) + 1e-6  # nats, log E when uniform
    assert 0.0 <= record["sampler_trainer_logp_gap_native"] < 1e-2
    # model.freeze_router: the routers are the initial ones, bit for bit; the rest trained
    _, initial = setup_run(cfg, run_meshes(cfg)[0], lambda s: None)
    labels = jax.tree.leaves(router_labels(initial.params))
    pairs = list(zip(labels, jax.tree.leaves(initial.params), jax.tree.leaves(summary["state"].params)))
    assert labels.count("frozen") == 1  # the layers' stacked routers [L, D, E]
    assert all(np.array_equal(a, b) for label, a, b in pairs if label == "frozen")
    assert any(not np.array_equal(a, b) for label, a, b in pairs if label == "trained")


def test_a_run_with_rollout_tools_samples_through_the_tool_engine(demo_assets, tmp_path):
    """rollout.tools.format=fence: the loop samples with `generate_with_tools` (a Python executor
    started, rows carrying a tool mask) and logs the tool metrics; the static engine is refused."""
    tools = {"rollout.tools.format": "fence", "rollout.tools.workers": 1, "trainer.steps": 1}
    cfg = load_config(None, tiny_overrides(demo_assets, tmp_path / "tools", **tools))
    train(cfg, log=lambda s: None)
    record = json.loads((tmp_path / "tools" / "metrics.jsonl").read_text().splitlines()[-1])
    for key in ("tools/calls_per_row", "tools/segments", "tools/parked_share", "tools/hidden_share"):
        assert key in record, key
    assert record["tools/segments"] >= 1
    static = load_config(None, tiny_overrides(demo_assets, tmp_path / "static", **tools, **{"rollout.engine": "static"}))
    with pytest.raises(ConfigError, match="rollout.engine=continuous"):
        train(static, log=lambda s: None)


def test_router_replay_with_partial_rollouts_and_shared_prompts_and_the_load_balancing_loss(demo_assets, tmp_path):
    """trainer.router_replay=rollout on a random Qwen3-MoE with rollout.partial (routes recorded across
    segments) and trainer.share_prompt=true (each prompt run once with its recorded routes), and
    trainer.router_aux_loss_coef > 0: two steps run, the update logs the load-balancing loss (k = 2 for
    a uniform router, at most E = 4) and the routing pass the router entropy (at most log E)."""
    cfg = load_config(None, tiny_overrides(demo_assets, tmp_path, **{
        "model.architecture": "qwen3_moe", "model.num_experts": 4, "model.num_experts_per_tok": 2,
        "model.moe_intermediate_size": 16, "trainer.router_replay": "rollout", "trainer.router_aux_loss_coef": 0.01,
        "rollout.partial": True, "trainer.max_staleness": 1, "trainer.share_prompt": True,
        "trainer.clipped_tokens_every": 0}))
    summary = train(cfg, log=lambda s: None)
    assert json.loads((tmp_path / "layout.json").read_text())["row_form"] == "shared_prompt"
    for record in summary["history"]:
        assert 2.0 <= record["router_aux_loss"] <= 4.0
        assert 0.0 < record["router_entropy"] <= np.log(4) + 1e-6
        assert all(np.isfinite(record[k]) for k in ("loss", "grad_norm", "sampler_trainer_logp_gap",
                                                    "route_disagreement"))

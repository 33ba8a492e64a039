"""Configs: every shipped YAML loads; unknown / mistyped keys fail with messages listing the fix."""

from pathlib import Path

import pytest

from jaxrl4llm.core import LITE_PPO, PRESETS
from jaxrl4llm.train.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


GRIDS = CONFIGS / "sweeps"  # `jaxrl4llm sweep` grid files, not run configs


@pytest.mark.parametrize("path", sorted(p for p in CONFIGS.rglob("*.yaml") if GRIDS not in p.parents),
                         ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.recipe().name in PRESETS


@pytest.mark.parametrize("path", sorted(GRIDS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_sweep_grid_validates(path):
    """Every cell of every shipped grid loads as a RunConfig (paths to run outputs not checked)."""
    from jaxrl4llm.study.sweep import expand_cells, read_grid, validate_cells

    cells = expand_cells(read_grid(path))
    assert cells
    validate_cells(cells, check_paths=False)


def test_recipe_configs_select_their_preset():
    for name in PRESETS:
        assert load_config(CONFIGS / f"{name}.yaml").algorithm.preset == name
    assert load_config(CONFIGS / "lite_ppo.yaml").recipe() == LITE_PPO


def test_ablation_changes_one_knob_of_the_baseline():
    r = load_config(CONFIGS / "ablations" / "clip_higher_0.28.yaml").recipe()
    assert (r.eps_low, r.eps_high) == (0.2, 0.28)
    r = load_config(CONFIGS / "ablations" / "norm_group_mean_batch_std.yaml").recipe()
    assert (r.adv_mean, r.adv_std) == ("group", "batch")


def test_model_preset_has_the_study_settings():
    cfg = load_config([CONFIGS / "models" / "qwen3_8b_base.yaml", CONFIGS / "lite_ppo.yaml"])
    assert (cfg.rollout.prompts_per_step, cfg.rollout.samples_per_prompt) == (128, 8)
    assert (cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k) == (0.99, 0.99, 100)
    assert cfg.optim.lr == 1e-6 and cfg.rollout.max_new_tokens == 8192
    assert cfg.algorithm.preset == "lite_ppo"


def test_overrides_are_typed():
    cfg = load_config(None, ["optim.lr=2e-6", "rollout.samples_per_prompt=16", "data.train_files=[a.jsonl, b.jsonl]",
                             "algorithm.overrides.eps_high=0.28"])
    assert cfg.optim.lr == 2e-6 and cfg.rollout.samples_per_prompt == 16
    assert cfg.data.train_files == ["a.jsonl", "b.jsonl"]
    assert cfg.recipe().eps_high == 0.28


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ConfigError, match=r"'optim.learning_rate'.*valid keys: lr, schedule"):
        load_config(None, ["optim.learning_rate=1e-6"])
    with pytest.raises(ConfigError, match=r"Unknown config key.*'optimizer'.*valid keys: model, data"):
        load_config(None, ["optimizer.lr=1e-6"])


def test_mistyped_value_names_key():
    with pytest.raises(ConfigError, match=r"rollout.samples_per_prompt must be an integer, got 'eight'"):
        load_config(None, ["rollout.samples_per_prompt=eight"])
    with pytest.raises(ConfigError, match=r"trainer.old_logp_source='vllm' is not allowed"):
        load_config(None, ["trainer.old_logp_source=vllm"])
    with pytest.raises(ConfigError, match=r"model.remat_policy='dots' is not allowed; choose one of 'full', 'save_attention'"):
        load_config(None, ["model.remat_policy=dots"])


def test_bad_recipe_override_is_reported():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['eps_hi'\].*valid keys"):
        load_config(None, ["algorithm.overrides.eps_hi=0.3"])
    with pytest.raises(ConfigError, match=r"algorithm.preset='ppo2' is not a recipe"):
        load_config(None, ["algorithm.preset=ppo2"])
    with pytest.raises(ConfigError, match="loss_agg_mode"):
        load_config(None, ["algorithm.overrides.loss_agg_mode=mean"])


def test_missing_config_file_is_clear(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_include_merges_and_later_wins(tmp_path):
    (tmp_path / "base.yaml").write_text("optim: {lr: 1.0e-5, warmup_steps: 3}\n")
    (tmp_path / "top.yaml").write_text("include: base.yaml\noptim: {lr: 2.0e-5}\n")
    cfg = load_config(tmp_path / "top.yaml")
    assert cfg.optim.lr == 2e-5 and cfg.optim.warmup_steps == 3


def test_rollout_cpu_kernels_switch_reaches_the_sampler():
    from jaxrl4llm.train.policy import Policy

    assert load_config(None, []).rollout.cpu_kernels == "auto"
    assert load_config(None, ["rollout.cpu_kernels=false"]).rollout.cpu_kernels is False
    assert load_config(None, ["rollout.cpu_kernels=off"]).rollout.cpu_kernels is False  # YAML: off = false
    with pytest.raises(ConfigError, match="rollout.cpu_kernels='fast' is not allowed; use 'auto' or bool"):
        load_config(None, ["rollout.cpu_kernels=fast"])
    seen = {}
    policy = Policy(config=None, graphdef=None, params=None, tokenizer=None, mesh=None, eos_token_ids=(1,), pad_token_id=0,
                    temperature=1.0, chunk_size=0, cpu_kernels=False)
    import jaxrl4llm.train.policy as policy_module

    original = policy_module.generate
    policy_module.generate = lambda *a, **kw: seen.update(kw)
    try:
        policy.generate([[1]], num_samples=1, max_new_tokens=1, temperature=1.0, top_p=1.0, top_k=0, rng=None)
    finally:
        policy_module.generate = original
    assert seen["cpu_kernels"] is False


@pytest.mark.parametrize("override, allowed", [
    ("rollout.samples_per_prompt=0", ">= 1"), ("rollout.prompts_per_step=-2", ">= 1"),
    ("rollout.max_new_tokens=0", ">= 1"), ("rollout.top_p=0", "in (0, 1]"), ("rollout.top_p=1.5", "in (0, 1]"),
    ("rollout.temperature=-0.5", ">= 0"), ("optim.lr=-1", "> 0"), ("optim.lr=0", "> 0"),
    ("optim.b2=1", "in [0, 1)"), ("trainer.mini_batches=0", ">= 1"), ("trainer.ppo_epochs=0", ">= 1"),
    ("trainer.micro_batch_size=0", ">= 1"), ("trainer.steps=-1", ">= 0"), ("trainer.eval_samples=0", ">= 1"),
    ("data.max_prompt_tokens=0", ">= 1"), ("rollout.retire_pass_rate=0", "in (0, 1]"), ("mesh.data=0", "-1"),
    ("rollout.min_p=1.5", "in [0, 1]"),
    ("eval.samples=0", ">= 1"), ("eval.temperature=-1", ">= 0"), ("eval.top_p=0", "in (0, 1]"), ("eval.top_k=-1", ">= 0"),
])
def test_out_of_range_value_names_key_value_and_range(override, allowed):
    key, value = override.split("=")
    with pytest.raises(ConfigError, match=rf"^{key}={value}(\.0)? is out of range; it must be .*{allowed.replace('(', '.').replace(')', '.').replace('[', '.')}"):
        load_config(None, [override])


def test_in_range_edges_load():
    cfg = load_config(None, ["rollout.top_p=1", "rollout.temperature=0", "trainer.steps=0", "trainer.micro_batch_size=null",
                             "optim.max_grad_norm=0", "rollout.prompts_per_chunk=auto", "mesh.data=-1"])
    assert cfg.rollout.top_p == 1.0 and cfg.trainer.micro_batch_size is None


def test_rollout_decode_attention_is_validated():
    assert load_config(None, []).rollout.decode_attention == "auto"
    assert load_config(None, ["rollout.decode_attention=xla"]).rollout.decode_attention == "xla"
    with pytest.raises(ConfigError, match="rollout.decode_attention='fast' is not allowed; choose one of 'auto', "
                                          "'kernel', 'xla'"):
        load_config(None, ["rollout.decode_attention=fast"])


class _Stop(Exception):
    """Raised once the sampler has resolved its attention: the test needs no compiled program."""


@pytest.mark.parametrize("requested", ["xla", "kernel", "auto"])
def test_rollout_decode_attention_reaches_generate_and_the_partial_engine(requested, demo_assets, tmp_path,
                                                                          monkeypatch):
    """A tiny run's `rollout.decode_attention` is the `paged_attention` that `generate` resolves
    (`kernels.choice.decode_attention_choice`; "kernel" on CPU is the CPU kernel, "auto" today's choice),
    for the rollout and eval (both `Policy.generate`) and for the partial-rollout engine; the run's
    layout resolves the same kernel, which the loop hands to the sampler."""
    import importlib

    import jax

    from jaxrl4llm.kernels import load_kernels
    from jaxrl4llm.kernels.choice import DecodeAttention
    from jaxrl4llm.train import loop
    from jaxrl4llm.train.layout import run_layout
    from jaxrl4llm.train.policy import load_policy
    from jaxrl4llm.train.prompts import load_prompt_sets
    from tests.train.conftest import tiny_overrides

    if requested == "kernel" and not load_kernels():
        pytest.skip("the CPU kernels do not build here: 'kernel' has no CPU kernel to run")
    # generate and the partial engine both build their EngineSpec by continuous.engine_spec_for, which resolves it
    engine_module = importlib.import_module("jaxrl4llm.sampling.continuous")
    choice, seen = engine_module.decode_attention_choice, []

    def recording_choice(*args, requested, **kw):
        seen.append((requested, choice(*args, requested=requested, **kw).kernel))
        raise _Stop

    monkeypatch.setattr(engine_module, "decode_attention_choice", recording_choice)
    cfg = load_config(None, tiny_overrides(demo_assets, tmp_path, **{"rollout.decode_attention": requested}))
    policy = load_policy(cfg, None)
    assert policy.decode_attention == requested
    with pytest.raises(_Stop):
        policy.generate([[1, 2, 3]], num_samples=2, max_new_tokens=4, temperature=1.0, top_p=1.0, top_k=0,
                        rng=jax.random.key(0))
    on_cpu = "cpu_native" if load_kernels() else "xla"
    expected = {"xla": "xla", "kernel": "cpu_native", "auto": on_cpu}[requested]
    assert seen == [(requested, expected)]

    with pytest.raises(_Stop):
        loop.partial_stream(policy, load_prompt_sets(cfg, policy.tokenizer)[0], cfg)
    assert seen[1] == (requested, expected)

    layout = run_layout(cfg, jax.make_mesh((1, 1, 1), ("data", "fsdp", "tensor")), policy.config, prompt_width=16,
                        cpu_kernels=load_kernels())
    assert layout.decode_attention.kernel == expected and isinstance(layout.decode_attention.kernel, DecodeAttention)


def test_rollout_min_p_and_stops_reach_the_sampler_and_the_scored_text(demo_assets, tmp_path, monkeypatch):
    """rollout.min_p / stop_token_ids / stop_strings: defaults off; they reach `generate` and the
    partial engine; Policy.generate cuts a row at its stop string, and the scored text
    (`decode_rows`) ends before the string or leaves a last stop token out."""
    import jax.numpy as jnp

    from jaxrl4llm.sampling import Rollout
    from jaxrl4llm.train import loop
    from jaxrl4llm.train import policy as policy_module
    from jaxrl4llm.train.prompts import load_prompt_sets
    from tests.train.conftest import tiny_overrides

    default = load_config(None, []).rollout
    assert (default.min_p, default.stop_token_ids, default.stop_strings) == (0.0, [], [])
    with pytest.raises(ConfigError, match="rollout.stop_strings=.* is out of range; it must be a list of non-empty"):
        load_config(None, ["rollout.stop_strings=['']"])
    with pytest.raises(ConfigError, match=r"rollout.stop_token_ids=\[-1\] is out of range; it must be a list of token"):
        load_config(None, ["rollout.stop_token_ids=[-1]"])
    cfg = load_config(None, tiny_overrides(demo_assets, tmp_path, **{
        "rollout.min_p": 0.05, "rollout.stop_token_ids": [7], "rollout.stop_strings": "=>"}))
    policy = policy_module.load_policy(cfg, None)
    ids = policy.tokenizer("12=>34", add_special_tokens=False)["input_ids"]
    assert len(ids) == 6
    seen = {}

    def fake_generate(*args, **kw):
        seen.update(kw)
        tokens = jnp.asarray([ids + [0, 0]], jnp.int32)
        mask = jnp.asarray([[1.0] * 6 + [0.0] * 2])
        return Rollout(tokens[:, :2], mask[:, :2], tokens, mask, mask * -0.5, mask * -0.7, jnp.asarray([6]),
                       jnp.asarray([True]))

    monkeypatch.setattr(policy_module, "generate", fake_generate)
    rollout = policy.generate([[1]], num_samples=1, max_new_tokens=8, temperature=1.0, top_p=1.0, top_k=0, rng=None)
    assert (seen["min_p"], seen["stop_token_ids"]) == (0.05, (7,))
    assert int(rollout.lengths[0]) == 4 and not bool(rollout.truncated[0])  # "12=>": the match ends at token 4
    assert rollout.response_mask[0].tolist() == [1.0] * 4 + [0.0] * 4
    assert policy.decode_rows([ids[:4], [*ids[:2], 7]]) == ["12", policy.decode_rows([ids[:2]])[0]]

    made = {}
    monkeypatch.setattr(loop, "PartialRollouts", lambda *a, **kw: made.update(kw))
    loop.partial_stream(policy, load_prompt_sets(cfg, policy.tokenizer)[0], cfg)
    assert (made["min_p"], made["stop_token_ids"], made["stop_strings"]) == (0.05, (7,), ("=>",))
    assert made["tokenizer"] is policy.tokenizer


def test_a_random_model_takes_model_vocab_size_at_least_the_tokenizers(demo_assets, tmp_path):
    """model.vocab_size sizes a random model's embedding and head (Qwen3 pads 151669 tokens to 151936
    rows); unset, the tokenizer's length; smaller than the tokenizer, a ConfigError naming both numbers."""
    from jaxrl4llm.models import load_tokenizer
    from jaxrl4llm.train.policy import load_policy
    from tests.train.conftest import tiny_overrides

    tokens = len(load_tokenizer(demo_assets["tokenizer"]))
    vocab = lambda **extra: load_policy(load_config(None, tiny_overrides(demo_assets, tmp_path, **extra)),
                                        None).config.vocab_size
    assert vocab() == tokens
    assert vocab(**{"model.vocab_size": tokens + 19}) == tokens + 19
    with pytest.raises(ConfigError, match=rf"model.vocab_size={tokens - 1} is smaller than the tokenizer's {tokens} "
                                          rf"tokens .*set model.vocab_size >= {tokens}, or unset it"):
        vocab(**{"model.vocab_size": tokens - 1})


@pytest.mark.parametrize("name, total, non_embedding", [
    ("qwen3_0.6b_base", 0.6, 0.44), ("qwen3_1.7b_base", 1.7, 1.4), ("qwen3_4b_base", 4.0, 3.6),
    ("qwen3_8b_base", 8.2, 6.95)])
def test_shipped_model_configs_have_the_model_cards_parameter_counts(name, total, non_embedding):
    """The size fields of configs/models/*.yaml (what `plan` and a random model build) give the
    Qwen3 model cards' parameter counts, in billions (total, and without the embedding)."""
    from jaxrl4llm.plan.programs import plan_model_config

    config = plan_model_config(load_config(CONFIGS / "models" / f"{name}.yaml"))
    embedding = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    assert round(config.num_params / 1e9, 1) == total
    assert round((config.num_params - embedding) / 1e9, len(str(non_embedding)) - 2) == non_embedding
    assert (config.rope_theta, config.rms_norm_eps, config.head_dim, config.num_kv_heads) == (1e6, 1e-6, 128, 8)


def test_eval_sampling_takes_eval_keys_else_the_older_trainer_and_rollout_keys():
    base = ["rollout.top_p=0.9", "rollout.top_k=20", "trainer.eval_samples=4", "trainer.eval_temperature=0.6"]
    old = load_config(None, base).eval_sampling()
    assert (old.samples, old.temperature, old.top_p, old.top_k, old.greedy) == (4, 0.6, 0.9, 20, False)
    new = load_config(None, base + ["eval.samples=16", "eval.temperature=1.0", "eval.top_p=1.0", "eval.top_k=0"])
    assert new.eval_sampling() == type(old)(samples=16, temperature=1.0, top_p=1.0, top_k=0)
    greedy = load_config(None, base + ["eval.samples=16", "eval.temperature=0"]).eval_sampling()
    assert (greedy.samples, greedy.top_p, greedy.top_k, greedy.greedy) == (1, 1.0, 0, True)  # greedy: one sample
    assert load_config(None, []).eval_sampling().greedy  # the defaults: greedy, as before


@pytest.mark.parametrize("fns, message", [
    ("[{fn: a:r}, {fn: b:r}]", r"two entries are named 'r'.*its own `name:`"),
    ("[{fn: a:r, weight: .inf}]", r"reward.fns\[0\].weight=inf is not a finite number"),
    ("[{weight: 1.0}]", r"reward.fns\[0\] has no fn"),
    ("[{fn: a:r, wieght: 1}]", r"Unknown config key\(s\) 'reward.fns\[0\].wieght'.*valid keys: fn, weight, name, batched"),
    ("[]", r"reward.fns is empty"),
])
def test_reward_fns_are_checked_when_the_config_loads(fns, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"reward.fns={fns}"])


def test_reward_terms_default_to_reward_fn_and_name_entries_by_function():
    assert [(t.fn, t.weight, t.name) for t in load_config(None, []).reward.terms()] == [
        ("jaxrl4llm.rewards:batch_math_reward", 1.0, "batch_math_reward")]
    terms = load_config(None, ["reward.fns=[{fn: jaxrl4llm.rewards:batch_math_reward, name: correct}, "
                               "{fn: jaxrl4llm.rewards:boxed_format_reward, weight: 0.1}]"]).reward.terms()
    assert [(t.name, t.weight) for t in terms] == [("correct", 1.0), ("boxed_format_reward", 0.1)]
    with pytest.raises(ConfigError, match=r"reward.fn='x:y' and reward.fns are both set"):
        load_config(None, ["reward.fn=x:y", "reward.fns=[{fn: a:b}]"])


def test_rollout_tools_section_builds_the_tools_spec_and_refuses_the_engines_without_parking():
    """rollout.tools.format turns tools on (ToolsSpec, ExecutorConfig); out-of-range values, the
    static engine and partial rollouts are one-line ConfigErrors naming the fix."""
    from jaxrl4llm.train.rollout_pipeline import check_tools

    assert load_config(None, []).rollout.tools.spec() is None
    cfg = load_config(None, ["rollout.tools.format=fence", "rollout.tools.max_turns=2", "rollout.tools.workers=1"])
    spec = cfg.rollout.tools.spec()
    assert (spec.format, spec.max_turns, spec.max_tool_tokens) == ("fence", 2, 128)
    assert cfg.rollout.tools.executor_config().workers == 1
    with pytest.raises(ConfigError, match="rollout.tools.format="):
        load_config(None, ["rollout.tools.format=xml"])
    with pytest.raises(ConfigError, match="rollout.tools.max_tool_tokens=0 is out of range"):
        load_config(None, ["rollout.tools.format=fence", "rollout.tools.max_tool_tokens=0"])
    check_tools(False, "static", True)
    with pytest.raises(ConfigError, match="rollout.engine=continuous"):
        check_tools(True, "static", False)
    with pytest.raises(ConfigError, match="rollout.partial=false"):
        check_tools(True, "continuous", True)

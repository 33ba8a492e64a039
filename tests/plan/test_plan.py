"""`jaxrl4llm plan`: a small model's programs compiled by XLA's TPU compiler for a small topology,
our analytic bytes against XLA's, errors that name the keys, and sharding that holds under FSDP."""

import json

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl4llm.cli import main as cli_main
from jaxrl4llm.models import ModelConfig, abstract_model, param_shardings, score_tokens
from jaxrl4llm.train.config import ConfigError, load_config
from jaxrl4llm.plan.programs import format_plan, per_chip_bytes, plan_run, topology_mesh, with_lengths

from tests.plan.conftest import TINY  # noqa: E402




def test_every_program_compiles_for_the_topology_and_fits(plan):
    assert [p.name for p in plan.programs] == ["sampler/weights", "sampler/decode", "logprob pass", "update"]
    assert plan.fits and plan.mesh == {"data": 1, "fsdp": 4, "tensor": 1}
    for p in plan.programs:
        assert p.fits and p.argument_bytes > 0 and p.total_bytes < plan.chip.hbm


def test_trainer_programs_run_packed_rows_with_the_splash_kernel(plan):
    """trainer.packing=true (TINY's): the update and log-prob pass take packed micro-batches
    (their loop priced at the expected count), and on TPU their attention is the splash kernel,
    whose FLOPs the meter adds (XLA counts a custom call as none)."""
    assert plan.packing is not None and plan.attention_kernel["impl"] == "splash"
    for name in ("update", "logprob pass"):
        program = next(p for p in plan.programs if p.name == name)
        assert "tpu_custom_call" in program.hlo, name
        assert 0 < program.kernel_flops < program.flops
    text = format_plan(plan)
    assert "packed rows (trainer.packing)" in text and "the splash kernel" in text
    # packed programs follow the lengths (re-priced, no compile): longer responses, more micro-batches
    short, long = (next(p for p in with_lengths(plan, f"fixed:{n}").programs if p.name == "update") for n in (1, 64))
    assert short.seconds < long.seconds


def test_analytic_arguments_equal_xla_arguments(plan):
    """The bytes a program takes in are known exactly from the shardings: ours must match XLA's."""
    update = next(p for p in plan.programs if p.name == "update")
    ours = update.analytic["parameters"] + update.analytic["optimizer state"] + update.analytic["batch"]
    assert ours == pytest.approx(update.argument_bytes, rel=0.05)
    logprob = next(p for p in plan.programs if p.name == "logprob pass")
    assert logprob.analytic["parameters"] + logprob.analytic["batch"] == pytest.approx(logprob.argument_bytes, rel=0.05)
    # FSDP over 4 chips: a chip holds at least a quarter of the float32 parameters (more: tile padding)
    assert update.analytic["parameters"] >= plan.model.num_params * 4 / 4


def test_a_run_that_does_not_fit_exits_1_and_says_what_to_change(capsys):
    # 64 rows a chip of 8k-token sequences: activations far beyond a 16 GiB v5e chip (22.7 GiB). The
    # trainer's programs alone (--only trainer): the sampler's are not what this run is short of
    code = cli_main(["plan", "--topology", "v5e:2x2", "--json", "--only", "trainer", *TINY,
                     "rollout.prompts_per_step=128", "rollout.max_new_tokens=8192", "trainer.micro_batch_size=256"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and not out["fits"]
    assert out["only"] == "trainer" and [p["name"] for p in out["programs"]] == ["logprob pass", "update"]
    update = next(p for p in out["programs"] if p["name"] == "update")
    assert not update["fits"] and update["needed_bytes"] > 16 * 2**30
    assert any(a.startswith("update: needs") and "trainer.micro_batch_size" in a for a in out["advice"])


def test_mesh_and_micro_batch_errors_name_the_keys():
    with pytest.raises(ConfigError, match=r"mesh.data/fsdp/tensor.*4"):
        topology_mesh("v5e:2x2", 1, 8, 1)
    with pytest.raises(ConfigError, match=r"trainer.micro_batch_size=2.*4 data-parallel.*mesh.data x mesh.fsdp"):
        plan_run(load_config(None, TINY + ["trainer.micro_batch_size=2"]), "v5e:2x2")
    with pytest.raises(ConfigError, match=r"cannot build TPU topology .v9z:8.*h100:8"):
        plan_run(load_config(None, TINY), "v9z:8")


def test_fsdp_activations_stay_split_over_the_batch():
    """Per-chip temporaries of the scoring pass under FSDP within 1.5x of pure data parallelism
    at equal rows per chip (the layer-boundary constraints; unconstrained GSPMD kept whole-batch
    activations on every chip)."""
    config = ModelConfig(vocab_size=32768, hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=64, remat=True)
    graphdef, abstract = abstract_model(config)

    def temp(data, fsdp, constrained=True):
        mesh = topology_mesh("v5e:2x2", data, fsdp, 1)
        params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract,
                              param_shardings(abstract, mesh))
        tokens = jax.ShapeDtypeStruct((16, 1024), jnp.int32, sharding=NamedSharding(mesh, P(("data", "fsdp"))))
        fn = jax.jit(lambda s, x: score_tokens(graphdef, s, x, x, positions=x, attention_mask=x, chunk_size=512))
        if constrained:
            with jax.set_mesh(mesh):
                return fn.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes
        return fn.lower(params, tokens).compile().memory_analysis().temp_size_in_bytes

    data_parallel, fsdp = temp(4, 1), temp(1, 4)
    assert 0 < fsdp <= 1.5 * data_parallel, (fsdp, data_parallel)  # measured: 552 MB against 576 MB
    assert temp(1, 4, constrained=False) > 1.5 * data_parallel  # measured 1358 MB: what the constraints fix


def test_per_chip_bytes_counts_the_largest_shard():
    mesh = topology_mesh("v5e:2x2", 1, 4, 1)
    a = jax.ShapeDtypeStruct((8, 6), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))
    b = jax.ShapeDtypeStruct((3,), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    assert per_chip_bytes([a, b], tiled=False) == 2 * 6 * 4 + 3 * 2
    assert per_chip_bytes([a]) == 2 * 128 * 4  # the 6-wide minor dim padded to 128 lanes
    assert per_chip_bytes([b]) == 512  # 3 bf16 padded to a 128-lane row is 256 bytes; every buffer takes >= 512
    assert per_chip_bytes([jax.ShapeDtypeStruct((4, 256), jnp.float32)]) == 4 * 256 * 4  # no sharding: whole


def test_decode_tensor_parallel_splits_the_decode_weights():
    """rollout.tensor_parallel=2: the sampler's mesh is (2, 1, 2); each chip holds half the decode
    weights (XLA's argument bytes of the decode program), our count says the same. The sampler's
    programs alone (sampler_only: the trainer's do not change with rollout.tensor_parallel)."""
    plans = {tp: plan_run(load_config(None, TINY + [f"rollout.tensor_parallel={tp}", "model.vocab_size=32768",
                                                    "model.hidden_size=512", "model.intermediate_size=1024"]),
                          "v5e:2x2", sampler_only=True) for tp in (0, 2)}
    decode = {tp: next(p for p in plan.programs if p.name == "sampler/decode") for tp, plan in plans.items()}
    assert plans[2].sampler["tensor_parallel"] == 2 and plans[2].sampler["data_parallel"] == 2
    assert decode[2].argument_bytes == pytest.approx(decode[0].argument_bytes / 2, rel=0.1)
    assert decode[2].analytic["decode weights"] == pytest.approx(decode[2].argument_bytes, rel=0.1)
    text = format_plan(plans[2])  # `plan --only sampler`'s report: no trainer line, the step says what it leaves out
    assert "--only sampler" in text and "\ntrainer:" not in text and "sampler: the static engine" in text
    with pytest.raises(ConfigError, match="rollout.tensor_parallel=3"):
        plan_run(load_config(None, TINY + ["rollout.tensor_parallel=3"]), "v5e:2x2", sampler_only=True)


def test_auto_chunk_fits_a_rollout_that_does_not_fit_at_once():
    """64 prompts x 8 rows of 16k tokens: the KV cache (64 GiB over 4 chips) does not fit a 16 GiB
    v5e chip at once; rollout.prompts_per_chunk=auto samples them in chunks that do. Our count
    never under-counts XLA's (so a chunk it picks fits): with HBM to spare XLA keeps about two
    KV blocks beyond the cache (docs/scaling.md); short of it, as here, it keeps none (jax 0.10.2)
    or part of them (jax 0.12.0.1: 1.1 GB more), and the rest of our count is within 5%. The
    sampler's programs alone (the chunk is the sampler's; the trainer's compiles were two thirds of its time)."""
    wide = TINY + ["model.hidden_size=1024", "model.intermediate_size=2048", "model.num_heads=8", "model.num_kv_heads=8",
                   "model.head_dim=128", "rollout.prompts_per_step=64", "rollout.samples_per_prompt=8",
                   "rollout.max_new_tokens=16384", "trainer.micro_batch_size=4", "trainer.mini_batches=128"]
    plan = plan_run(load_config(None, wide + ["rollout.prompts_per_chunk=auto"]), "v5e:2x2", sampler_only=True)
    chunk = plan.sampler["prompts_per_chunk"]
    assert 4 <= chunk < 64 and plan.sampler["chunks"] == -(-64 // chunk)
    decode = next(p for p in plan.programs if p.name == "sampler/decode")
    train_state = 12 * plan.model.num_params / plan.chips  # waits beside it: float32 parameters + Adam's 2 moments, FSDP
    assert decode.fits and decode.total_bytes + train_state <= 0.9 * plan.chip.hbm
    assert decode.total_bytes <= decode.analytic_total
    without_blocks = decode.analytic_total - decode.analytic["blocks in flight"]
    assert 0.95 * decode.total_bytes <= without_blocks <= 1.05 * decode.total_bytes or \
        without_blocks <= decode.total_bytes <= decode.analytic_total
    assert plan.sampler["fitting_chunk"] == chunk


def test_an_asynchronous_split_compiles_each_side_on_its_chips_and_overlaps_them():
    """mesh.sampler_devices=0.5 with trainer.max_staleness=1: the sampler's programs on 2 of the 4
    chips, the trainer's on the other 2; a step is the slower side plus the parameters' copy."""
    cfg = load_config(None, TINY + ["mesh.fsdp=-1", "mesh.sampler_devices=0.5", "trainer.max_staleness=1"])
    split = plan_run(cfg, "v5e:2x2")
    assert split.sampler["own_chips"] == 2 and split.sampler["trainer_chips"] == 2 and split.chips == 4
    assert split.mesh == {"data": 1, "fsdp": 2, "tensor": 1} and split.fits
    side = split.side_seconds
    assert side["sampler"] > 0 and side["trainer"] > 0
    assert split.step_seconds == pytest.approx(max(side.values()) + split.sampler["weight_copy_seconds"])
    params = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract_model(split.model)[1]))
    # fsdp over the sampler's 2 chips: about half the parameters a chip (TPU tiling pads the tiny model's small dims)
    assert params / 2 <= split.sampler["weight_copy_bytes"] < 0.75 * params
    assert "the sampler on 2 chips of its own" in format_plan(split)
    with pytest.raises(ConfigError, match="trainer.max_staleness >= 1"):
        plan_run(load_config(None, TINY + ["mesh.fsdp=-1", "mesh.sampler_devices=0.5"]), "v5e:2x2")


def test_a_lora_run_is_planned_with_its_adapters_and_without_the_base_s_optimizer_state(plan):
    """`model.lora`: plan compiles the adapted model, the adapters train and the base stays frozen: the
    state beside the sampler and the update's arguments shrink by the optimizer state it no longer holds."""
    lora = plan_run(load_config(None, TINY + ["model.lora.rank=4"]), "v5e:2x2")
    assert lora.layout.lora is not None and plan.layout.lora is None
    full_update, lora_update = (next(p for p in x.programs if p.name == "update") for x in (plan, lora))
    full_opt, lora_opt = (u.analytic["optimizer state"] for u in (full_update, lora_update))
    adapters = lora_update.analytic["parameters"] - full_update.analytic["parameters"]
    assert 0 < adapters and lora_opt < full_opt / 5
    saved = full_opt - lora_opt - adapters
    full_resident, lora_resident = (next(p for p in x.programs if p.name == "sampler/decode").resident_bytes
                                    for x in (plan, lora))
    assert full_resident - lora_resident == saved
    assert full_update.argument_bytes - lora_update.argument_bytes >= 0.9 * saved


def test_a_teacher_too_large_for_the_mesh_is_a_verdict_naming_the_fix(tmp_path, capsys):
    """On-policy distillation from a Qwen3-32B-shaped teacher (its config.json alone: plan reads no
    weights) on four 16 GiB v5e chips: the teacher pass is priced and does not fit, and one advice
    line names the teacher and what to change. Its attention runs the splash kernel, as the
    student's: the kernel's FLOPs (which XLA does not count) are added at the teacher's layers x heads x
    head_dim, as for the student's log-prob pass (the same rows and blocks: 64 x 64 x 128 against 2 x 4 x 32)."""
    teacher = tmp_path / "teacher"
    teacher.mkdir()
    (teacher / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 5120, "intermediate_size": 25600,
        "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
        "tie_word_embeddings": False, "rope_theta": 1000000, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6}))
    # every response at its budget: the packed passes run all their micro-batches (the teacher pass, which
    # does not compile, keeps the count it was priced at; the others are re-priced at the lengths)
    code = cli_main(["plan", "--topology", "v5e:2x2", "--json", "--only", "trainer", "--response-lengths", "fixed",
                     *TINY, "algorithm.preset=opd", f"teacher.model={teacher}", "teacher.dtype=float32"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and not out["fits"]
    assert [p["name"] for p in out["programs"]] == ["logprob pass", "update", "teacher pass"]
    assert out["teacher_bytes_per_chip"] > 16 * 2**30  # 32.8e9 float32 parameters over 4 chips (fsdp 4)
    kernel = {p["name"]: p["kernel_flops"] for p in out["programs"]}
    assert kernel["logprob pass"] > 0 and kernel["teacher pass"] == pytest.approx(
        kernel["logprob pass"] * (64 * 64 * 128) / (2 * 4 * 32))
    line = next(a for a in out["advice"] if a.startswith("teacher.model:"))
    assert "raise mesh.fsdp" in line and "teacher.dtype=bfloat16" in line and "\n" not in line


def test_a_full_fine_tune_whose_state_alone_does_not_fit_is_told_the_chips_it_needs_or_lora():
    """An update over the limit whose parameters, optimizer state and gradients alone exceed a chip
    (Qwen3-30B-A3B on h100:8: 71 GiB a GPU by our count) gets the chips a full fine-tune needs and
    LoRA; with LoRA on, or where the state fits (activations over), the usual advice."""
    import dataclasses

    from jaxrl4llm.plan.chips import ChipSpec
    from jaxrl4llm.plan.gpu import GPU_CHIPS
    from jaxrl4llm.plan.programs import ProgramPlan, RunPlan, advice

    gib = 2**30
    state = {"parameters": 14.2 * gib, "optimizer state": 28.4 * gib, "gradients": 28.4 * gib, "activations": 14 * gib}
    update = ProgramPlan("update", True, temp_bytes=330 * gib, analytic=state)
    chip = GPU_CHIPS["h100"]._replace(memory_fraction=0.75)  # JAX takes 75% of a GPU by default
    assert isinstance(chip, ChipSpec) and chip.fit_bytes < 71 * gib
    plan = RunPlan("h100:8", {"data": 1, "fsdp": 8, "tensor": 1}, chip, ModelConfig(), 1024, 1024, 8192, [update])
    (line,) = advice(plan)
    assert "alone take 71.00 GiB a chip over 8 chips of FSDP: a full fine-tune needs more than 11 chips" in line
    assert "model.lora.rank=16" in line
    small = dataclasses.replace(update, analytic={**state, "optimizer state": 0.1 * gib, "gradients": 0.1 * gib})
    (line,) = advice(dataclasses.replace(plan, programs=[small]))
    assert "raise mesh.fsdp" in line and "LoRA" not in line

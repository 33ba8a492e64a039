"""`jaxrl4llm plan`: compile a run's programs for a TPU topology, on any machine, and report per chip.

    jaxrl4llm plan -c configs/models/qwen3_8b_base.yaml -c configs/lite_ppo.yaml --topology v5p:4x4x4

XLA's TPU compiler (libtpu, `pip install -e .[tpu]`) runs on a CPU host: `get_topology_desc`
gives the devices of a named slice, and `jax.jit(f).lower(<ShapeDtypeStructs with shardings>)
.compile()` compiles for them without a chip (MaxText's `train_compile` does the same). Each
program of a step is compiled at the run's shapes and shardings:

    sampler/weights   the decode layout of the weights (once per rollout)
    sampler/decode    prefill + the decode while_loop for prompts_per_step x samples_per_prompt rows
                      (rollout.engine=continuous: refills and bursts on rollout.slots slots over the
                      paged KV cache, the ragged paged attention kernel on TPU)
    logprob pass      old (and reference) log-probs of the rollout batch
    update            the optimizer steps of one rollout batch (mini-batches x micro-batches)

and reported with XLA's bytes per chip (arguments, outputs, temporaries), the share of the
chip's HBM, and beside them our own analytic count of the same categories (parameters,
optimizer state, gradient accumulator, batch, KV cache, activations), so a config can be
sized before a pod is rented. A program that does not fit is reported with what XLA needed
and what to change; `plan` then exits 1.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jaxrl4llm.kernels.choice import (DecodeAttention, ExpertForm, TrainAttention, decode_attention_choice,
                                      expert_form_for, mesh_devices)
from jaxrl4llm.models import abstract_model, param_shardings, split_trainable
from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.models.decode import DecodeBackend
from jaxrl4llm.models.hub import HubFilesMissing, resolve_model
from jaxrl4llm.models.layers.moe import route_dtype
from jaxrl4llm.models.layers.segment_attention import DEFAULT_BLOCKS, kernel_attention_flops
from jaxrl4llm.models.lora import plain_graphdef
from jaxrl4llm.models.remat import saved_floats_per_token
from jaxrl4llm.plan.compile_errors import classify as classify_compile_error
from jaxrl4llm.plan.compile_errors import error_frames
from jaxrl4llm.plan.chips import FIT_SHARE, GiB, ChipSpec, jax_memory_fraction, measure_cpu_chip, measured_peaks, tpu_chip_spec
from jaxrl4llm.plan.decode_work import continuous_decode_work, decode_block_trips, static_decode_work
from jaxrl4llm.plan.gpu import compile_options, gpu_chip_spec, gpu_topology_devices, is_gpu_topology
from jaxrl4llm.plan.hlo_cost import (ProgramCost, collective_breakdown, compiled_hlo_text, computation_flops,
                                     find_loops, meter_notice, parse_module, program_cost)
from jaxrl4llm.sampling.buckets import BATCH_BUCKETS, PROMPT_BUCKETS, bucket
from jaxrl4llm.sampling.continuous import (PAGE_SIZE, PAGES_PER_CHUNK, continuous_program, engine_spec_for,
                                           prefill_batch, shard_sizes)
from jaxrl4llm.sampling.decode_loop import decode_backend, sample_program, weights_jit
from jaxrl4llm.sampling.gpu_paged_attention import dot_rows as gpu_kernel_dot_rows
from jaxrl4llm.sampling.gpu_paged_attention import partial_bytes as gpu_kernel_partial_bytes
from jaxrl4llm.sampling.gpu_paged_attention import written_partitions as gpu_kernel_written_partitions
from jaxrl4llm.sampling.memory import (SIZING_SHARE, continuous_memory, decode_memory, decode_sizing, prompts_per_chunk,
                                       slots_that_fit, weights_program_memory)
from jaxrl4llm.train.config import ConfigError, RunConfig
from jaxrl4llm.train.layout import (RunLayout, lora_settings, mesh_dims, model_config_from_fields, replays_routes,
                                    run_layout, sampler_mesh_for, split_for_sampler)
from jaxrl4llm.train.packing import expected_micro_batches, packed_abstract
from jaxrl4llm.train.policy import make_logprob_fn, make_routing_fn
from jaxrl4llm.train.programs import optimizer_for, trainer_programs
from jaxrl4llm.train.response_lengths import LengthDistribution, parse_lengths
from jaxrl4llm.train.rollout_pipeline import sampler_mesh_shape
from jaxrl4llm.train.teacher import Teacher, check_teacher_needed
from jaxrl4llm.train.step import (TrainBatch, batch_shardings, init_train_state, join_params, train_state_shardings)


PEAKS = ("datasheet", "measured")


def chip_spec(topology: str, *, peak: str = "datasheet", peak_flops: float | None = None,
              hbm_bandwidth: float | None = None, memory_fraction: float | None = None) -> ChipSpec:
    """The chip of a topology name: `cpu` (this machine, measured now), a GPU (`h100:8`), or a TPU slice,
    priced at its datasheet peaks, or (`peak="measured"`) at the matmul rate and copy bandwidth this
    host's accelerator shows now (`chips.measured_peaks`), or at `peak_flops` / `hbm_bandwidth` given
    (bytes read + written per second, as a copy measures it). `memory_fraction`: the share of the
    chip's memory JAX hands a process; default JAX's own (`chips.jax_memory_fraction`: 0.75 on a GPU
    unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise)."""
    if peak not in PEAKS:
        raise ConfigError(f"--peak {peak!r}: valid: {', '.join(PEAKS)}")
    if topology == "cpu":
        chip = measure_cpu_chip()
    elif is_gpu_topology(topology):
        chip = gpu_chip_spec(topology)._replace(memory_fraction=jax_memory_fraction("gpu"))
    else:
        chip = tpu_chip_spec(topology)
    if peak == "measured" and topology != "cpu":
        accelerator = jax.devices()[0]
        if accelerator.platform == "cpu":
            raise ConfigError(f"--peak measured prices {topology} at this host's accelerator, but JAX sees none here "
                              f"(JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS', '')!r}); run plan on the GPU/TPU host, "
                              f"or pass --peak-flops and --hbm-bandwidth measured there")
        chip = measured_peaks(chip, accelerator)
    for name, value in (("peak-flops", peak_flops), ("hbm-bandwidth", hbm_bandwidth), ("memory-fraction", memory_fraction)):
        if value is not None and not (value > 0 and (name != "memory-fraction" or value <= 1)):
            raise ConfigError(f"--{name} {value}: must be positive" + (" and at most 1" if name == "memory-fraction" else ""))
    if peak_flops is not None or hbm_bandwidth is not None:
        chip = chip._replace(peak_flops=float(peak_flops or chip.peak_flops),
                             hbm_bandwidth=float(hbm_bandwidth or chip.hbm_bandwidth), peak_source="given")
    if memory_fraction is not None:
        chip = chip._replace(memory_fraction=float(memory_fraction))
    return chip


def topology_devices(topology: str) -> list:
    """The devices of a topology name, no chip needed: `cpu` (this machine's CPU devices), a GPU
    layout (`h100:8`, `h100:2x8`: XLA's CUDA compiler, the `gpu` extra) or a TPU slice (`v5p:4x4x4`:
    libtpu, the `tpu` extra)."""
    if topology == "cpu":
        return jax.devices("cpu")
    if is_gpu_topology(topology):
        return gpu_topology_devices(topology)
    # Compiling takes no chip: let several processes (tests, a plan beside a run) load libtpu at
    # once instead of the first one holding its lockfile; no TPU host worker list to discover.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    try:
        return topologies.get_topology_desc(platform="tpu", topology_name=topology).devices
    except Exception as e:  # noqa: BLE001 - libtpu missing or an unknown topology name
        raise ConfigError(f"cannot build TPU topology {topology!r} ({type(e).__name__}: {str(e).splitlines()[0]}). "
                          f"Install XLA's TPU compiler with `pip install -e .[tpu]` (libtpu), and name a topology "
                          f"like v5p:4x4x4, v5e:8x8, v6e:8x8, v4:4x4x4; or a GPU layout like h100:8 (the gpu extra); "
                          f"or cpu (this machine)") from None


def topology_mesh(topology: str, data: int, fsdp: int, tensor: int) -> Mesh:
    """A ("data", "fsdp", "tensor") mesh over the devices of a named topology (no chip needed).

    One of data / fsdp / tensor may be -1 (the rest of the devices). `jax.make_mesh` refuses
    these devices, so the mesh is built from the device array directly.
    """
    devices = topology_devices(topology)
    dims = mesh_dims(data, fsdp, tensor, len(devices), f"chips of {topology}")
    return Mesh(np.array(devices).reshape(dims), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)


def topology_meshes(topology: str, cfg: RunConfig) -> tuple[Mesh, Mesh | None]:
    """(training mesh, the sampler's own mesh or None) over a topology's chips, split as the loop
    splits its devices (`train.layout.split_for_sampler`); the meshes are built from the device
    arrays (`jax.make_mesh` refuses topology devices)."""
    trainer, sampler, dims = split_for_sampler(cfg, list(topology_devices(topology)), f"chips of {topology}")
    axes, types = ("data", "fsdp", "tensor"), (AxisType.Auto,) * 3
    return (Mesh(np.array(trainer).reshape(dims), axes, axis_types=types),
            Mesh(np.array(sampler).reshape(sampler_mesh_shape(len(sampler))), axes, axis_types=types) if sampler else None)


def plan_model_config(cfg: RunConfig):
    """The ModelConfig a run would train: `model.path`'s config.json when it exists, else the
    size fields of the `model` section (the shipped model configs carry them, so a plan needs
    no checkpoint)."""
    m = cfg.model
    folder, missing = None, None
    if m.path:
        try:
            folder = resolve_model(m.path, files=("config.json",))  # a Hub id: its config.json alone
        except HubFilesMissing as e:  # offline: the size fields below, when the config has them
            missing = e
    if folder is not None and (Path(folder) / "config.json").is_file():
        return ModelConfig.from_pretrained_dir(folder, dtype=m.dtype, param_dtype=m.param_dtype, remat=m.remat,
                                                remat_policy=m.remat_policy, attention_impl=m.attention_impl, numerics=m.numerics)
    if m.vocab_size is None:
        if missing is not None:
            raise ConfigError(f"model.path={m.path!r}: {missing}")
        raise ConfigError("plan needs the model's shape: set model.path to a folder with config.json, or "
                          "model.vocab_size (with model.hidden_size, num_layers, ...) as configs/models/*.yaml do.")
    return model_config_from_fields(cfg, vocab_size=m.vocab_size)


def plan_teacher_config(cfg: RunConfig):
    """The ModelConfig of `teacher.model` (its config.json alone: a Hub id's is fetched without the
    weights), in `teacher.dtype`; None without a teacher. A missing folder or config is a one-line ConfigError."""
    t = cfg.teacher
    check_teacher_needed(cfg)
    if not t.model:
        return None
    try:
        folder = resolve_model(t.model, files=("config.json",))
    except HubFilesMissing as e:
        raise ConfigError(f"teacher.model={t.model!r}: {e}") from None
    if folder is None or not (Path(folder) / "config.json").is_file():
        raise ConfigError(f"teacher.model={t.model!r} is not a folder with config.json; point it at a Hugging Face "
                          f"checkpoint folder or a Hub id (org/name[@revision]), or set teacher.model=null.")
    return ModelConfig.from_pretrained_dir(folder, dtype=t.dtype, param_dtype=t.dtype,
                                            attention_impl=cfg.model.attention_impl)


def plan_teacher(cfg: RunConfig, mesh: Mesh) -> Teacher | None:
    """The run's teacher as abstract parameters on the trainer's mesh (the loop's shardings), or None."""
    config = plan_teacher_config(cfg)
    if config is None:
        return None
    graphdef, abstract = abstract_model(config)
    params = _with_shardings(abstract, param_shardings(abstract, mesh))
    return Teacher(config=config, graphdef=graphdef, params=params, temperature=cfg.teacher.temperature,
                   chunk_size=cfg.teacher.logprob_chunk_size)


# ---------------------------------------------------------------------------- per-chip bytes
def tpu_tiled_bytes(shape: tuple[int, ...], dtype) -> int:
    """Bytes of an array in TPU HBM as XLA lays it out: the minor (lane) dimension is padded to
    128, and XLA picks as minor a dimension that needs no padding when there is one (measured
    on v5e with libtpu 0.0.42: [128, 32] takes 16 KiB, [2, 32, 4, 32] four times its size, a
    [4, 95] int32 2 KiB); every buffer takes at least 512 bytes. So a shard none of whose dims
    is a multiple of 128 (e.g. a 4096-wide dim split 64 ways next to small dims) costs more."""
    itemsize = jnp.dtype(dtype).itemsize
    n = math.prod(shape) * itemsize
    if shape and not any(d % 128 == 0 for d in shape):
        widest = max(shape)
        n = n // widest * (-(-widest // 128) * 128)
    return max(n, 512)


def per_chip_bytes(tree, *, tiled: bool = True) -> int:
    """Bytes one chip holds of a pytree of ShapeDtypeStructs with shardings (its shard of each
    leaf, TPU-tiled unless `tiled=False`)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if getattr(leaf, "sharding", None) is not None else leaf.shape
        total += tpu_tiled_bytes(shape, leaf.dtype) if tiled else math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
    return total


def _with_shardings(abstract, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)


@dataclasses.dataclass
class ProgramPlan:
    """One compiled program: XLA's memory per chip, our analytic bytes, what one run of it costs
    (XLA's HLO cost with every loop trip counted, `plan.hlo_cost`), how often a step runs it, and
    its time on the chip (`seconds`)."""

    name: str
    fits: bool
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    needed_bytes: int | None = None  # from RESOURCE_EXHAUSTED when it does not fit
    failure: str = ""  # why it did not compile (`compile_errors.KINDS`: hbm, vmem, smem, kernel, shape); "" compiled
    model_flops: float = 0.0  # ours: the program's matmul FLOPs per chip per run, loops unrolled, as run
    analytic: dict = dataclasses.field(default_factory=dict)  # category -> bytes per chip
    error: str = ""
    resident_bytes: int = 0  # the train state's bytes that stay in HBM beside the program (not its arguments)
    runs: float = 1.0  # how many times a step runs it (the sampler: once per chunk)
    flops: float = 0.0  # XLA's count per chip per run, every loop body times its trips (+ kernel_flops)
    kernel_flops: float = 0.0  # what XLA cannot count: the attention kernels' custom calls (Pallas), per run
    kernel_bytes: float = 0.0  # the same for HBM bytes: the paged attention kernel's KV pages read, per run
    hbm_bytes: float = 0.0  # bytes per chip per run to and from HBM (XLA's "bytes accessed", trips counted)
    collective_bytes: float = 0.0  # bytes a chip sends over its links per run (ring model)
    collectives: float = 0.0  # collective ops per run
    once_counted_flops: float = 0.0  # what XLA's cost_analysis() reports (loop bodies once), for comparison
    lowered: Any = dataclasses.field(default=None, repr=False, compare=False)  # jax's Lowered: what was compiled
    compute_seconds: float = 0.0  # flops / peak
    memory_seconds: float = 0.0  # hbm_bytes / HBM bandwidth
    collective_seconds: float = 0.0  # collective_bytes / interconnect bandwidth
    kernels: float = 0.0  # kernel launches per run on a GPU (`plan.hlo_cost.kernel_launches`, trips counted)
    launch_seconds: float = 0.0  # kernels x the chip's kernel_seconds (0 on TPU and CPU)
    padding_fraction: float = 0.0  # positions (trainer) or row-steps (sampler) that carry no real token
    overlap: bool = True  # the chip's: time = max(compute, memory) (TPU, GPU) or their sum (CPU)
    loops: list = dataclasses.field(default_factory=list)  # (loop, trips) of the program
    hlo: str = dataclasses.field(default="", repr=False)  # the optimized per-chip HLO (`reprice` reads it)
    devices: int = 1  # chips the program spans

    @property
    def total_bytes(self) -> int:
        """Peak bytes per chip: live arguments + outputs (minus donated aliases) + temporaries."""
        if self.needed_bytes is not None:
            return self.needed_bytes
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def analytic_total(self) -> int:
        return sum(self.analytic.values())

    @property
    def seconds(self) -> float:
        """One run: max(flops / peak, HBM bytes / bandwidth) + collective bytes / link bandwidth
        + kernels x kernel_seconds (compute and memory traffic overlap on TPU and GPU; collectives
        and a GPU's kernel launches are counted as exposed); on a CPU (`ChipSpec.overlap` false)
        compute + memory: XLA:CPU runs one op at a time."""
        work = max(self.compute_seconds, self.memory_seconds) if self.overlap else \
            self.compute_seconds + self.memory_seconds
        return work + self.collective_seconds + self.launch_seconds

    @property
    def binding(self) -> str:
        if not self.fits:
            return "-"
        parts = {"compute": self.compute_seconds, "HBM": self.memory_seconds,
                 "collectives": self.collective_seconds, "launches": self.launch_seconds}
        return max(parts, key=parts.get)

    def price(self, cost: ProgramCost, chip: ChipSpec) -> None:
        """Sets the per-run figures from `cost` on `chip`."""
        self.flops, self.hbm_bytes = cost.flops + self.kernel_flops, cost.hbm_bytes + self.kernel_bytes
        self.collective_bytes, self.collectives = cost.collective_bytes, cost.collectives
        self.once_counted_flops = cost.once_counted_flops
        self.compute_seconds = self.flops / chip.peak_flops
        self.memory_seconds = self.hbm_bytes / chip.hbm_bandwidth
        self.collective_seconds = cost.collective_bytes / chip.ici_bandwidth if cost.collective_bytes else 0.0
        self.kernels, self.launch_seconds = cost.kernels, cost.kernels * chip.kernel_seconds
        self.overlap = chip.overlap
        self.loops = [(loop.name, loop.trips) for loop in cost.loops]


def _compile(name: str, lowered_fn, analytic: dict, model_flops: float, mesh: Mesh,
             log=None) -> tuple[ProgramPlan, Any]:
    """Lower and compile under the mesh context (as the loop runs them: the model's activation
    constraints read it); XLA's HBM verdict (RESOURCE_EXHAUSTED in HBM) becomes a plan that does not
    fit, another compile failure (a kernel's VMEM or SMEM, a kernel that fails to lower, a shape:
    `compile_errors.classify`) a plan that does not compile, with its one line; others raise."""
    start = time.perf_counter()
    try:
        with jax.set_mesh(mesh):
            lowered = lowered_fn()
            compiled = lowered.compile(compiler_options=compile_options(mesh.devices.flat))
    except Exception as e:  # noqa: BLE001 - XLA raises XlaRuntimeError / JaxRuntimeError, kernels their own
        failure = classify_compile_error(f"{type(e).__name__}: {e}", name, error_frames(e))
        if failure is None:
            raise
        if log:
            log(f"  compiled {name:<16} {time.perf_counter() - start:6.1f} s: "
                + ("does not fit" if failure.kind == "hbm" else f"does not compile ({failure.kind})"))
        return ProgramPlan(name, False, needed_bytes=failure.needed if failure.kind == "hbm" else None,
                           analytic=analytic, model_flops=model_flops, failure=failure.kind,
                           error=failure.line or str(e).splitlines()[0][:300]), None
    if log:
        log(f"  compiled {name:<16} {time.perf_counter() - start:6.1f} s")
    m = compiled.memory_analysis()
    return ProgramPlan(name, True, argument_bytes=m.argument_size_in_bytes, output_bytes=m.output_size_in_bytes,
                       alias_bytes=m.alias_size_in_bytes, temp_bytes=m.temp_size_in_bytes,
                       analytic=analytic, model_flops=model_flops, lowered=lowered), compiled


# ---------------------------------------------------------------------------- the programs
@dataclasses.dataclass
class RunPlan:
    topology: str
    mesh: dict
    chip: ChipSpec
    model: Any  # ModelConfig
    rows: int
    prompt_len: int
    response_len: int
    programs: list[ProgramPlan]
    sampler: dict = dataclasses.field(default_factory=dict)  # decode mesh and chunking
    prompt_group: int | None = None  # trainer.share_prompt: rows per shared prompt forward, None = whole rows
    lengths: LengthDistribution | None = None  # the response lengths the step is modelled at
    mean_response: float = 0.0  # expected tokens a row generates under `lengths`
    prompt_tokens: float = 0.0  # real (unpadded) prompt tokens of a row
    chips: int = 1
    decode: dict | None = dataclasses.field(default=None, repr=False)  # what `with_lengths` needs to re-price decode
    trainer_positions: float = 0.0  # positions one trainer pass runs through the stack (all chips)
    packing: Any = None  # trainer.packing: the PackLayout the trainer programs were compiled for, or None
    attention_kernel: dict | None = None  # a Pallas attention kernel's FLOPs per micro-batch (`kernel_flops`)
    teacher_attention_kernel: dict | None = None  # the same at the teacher's heads (its pass), or None
    trainer_hlo_flops: dict = dataclasses.field(default_factory=dict, repr=False)  # 2N/6N per position, by program
    layout: Any = None  # the run's layout (train.layout.RunLayout) the trainer programs were compiled for
    only: str = ""  # "trainer" / "sampler": one side's programs alone (`plan --only`), the step time that side's
    teacher_bytes: int = 0  # on-policy distillation: the teacher's parameters on a trainer chip (resident all run)

    @property
    def fits(self) -> bool:
        return all(p.fits and p.total_bytes + p.resident_bytes <= self.chip.fit_bytes for p in self.programs)

    @property
    def step_seconds(self) -> float:
        """One RL step: every program times how often the step runs it; with the sampler on chips
        of its own (asynchronous RL) the sampler's and the trainer's programs run at the same time:
        the slower side plus the copy of the new parameters to the sampler's chips."""
        total = lambda ps: sum(p.seconds * p.runs for p in ps)
        if not self.sampler.get("own_chips"):
            return total(self.programs)
        sampling = total(p for p in self.programs if p.name.startswith("sampler/"))
        training = total(p for p in self.programs if not p.name.startswith("sampler/"))
        return max(sampling, training) + self.sampler["weight_copy_seconds"]

    @property
    def side_seconds(self) -> dict:
        """Seconds a step spends on the sampler's programs and on the trainer's."""
        side = lambda sampler: sum(p.seconds * p.runs for p in self.programs if p.name.startswith("sampler/") == sampler)
        return {"sampler": side(True), "trainer": side(False)}

    def share(self, p: ProgramPlan) -> float:
        return p.seconds * p.runs / self.step_seconds if self.step_seconds else 0.0

    @property
    def generated_tokens_per_second_per_chip(self) -> float:
        return self.rows * self.mean_response / self.step_seconds / self.chips if self.step_seconds else 0.0

    @property
    def useful_mfu(self) -> float:
        """6 N (real prompt + response tokens of the step's rows) / (step seconds x chips x peak):
        the work a padding-free trainer must do, over what the step takes."""
        tokens = self.rows * (self.prompt_tokens + self.mean_response)
        return 6 * self.model.num_active_params * tokens / (self.step_seconds * self.chips * self.chip.peak_flops) \
            if self.step_seconds else 0.0

    @property
    def padding_fraction(self) -> float:
        """Of the step's time-weighted work, the share spent on padding positions and finished rows."""
        total = sum(p.seconds * p.runs for p in self.programs)
        return sum(p.seconds * p.runs * p.padding_fraction for p in self.programs) / total if total else 0.0


def plan_layout(cfg: RunConfig, topology: str) -> RunLayout:
    """The layout (`train.layout.run_layout`) of `cfg` on `topology`'s chips, as `plan_run` compiles it:
    the model from `plan_model_config`, prompts padded to `data.max_prompt_tokens`' bucket (the
    longest a run can meet), the sampler's XLA programs (no C++ CPU kernels: custom calls XLA cannot
    cost). `jaxrl4llm plan --show-layout` prints it without compiling."""
    mesh, own_sampler = topology_meshes(topology, cfg)
    return run_layout(cfg, mesh, plan_model_config(cfg), prompt_width=bucket(cfg.data.max_prompt_tokens, PROMPT_BUCKETS),
                      sampler_mesh=own_sampler)


@dataclasses.dataclass
class PlanInputs:
    """What every stage of `plan_run` reads: the run's meshes and chip, the model, the rows' shapes,
    and the abstract parameters and train state, each leaf with its sharding (`plan_inputs`)."""

    cfg: RunConfig
    topology: str
    mesh: Mesh
    own_sampler: Mesh | None  # asynchronous RL on chips of its own, or None
    chip: ChipSpec
    config: Any  # ModelConfig
    layout: RunLayout | None  # None: an evaluation's sampler alone
    prompt_len: int
    graphdef: Any
    train_params: Any  # the trainable parameters (LoRA: the adapters)
    frozen: Any  # the frozen base (LoRA), or None
    train_state: Any
    sampler_params: Any  # what the sampler's weights program reads
    log: Any = None
    teacher: Any = None  # on-policy distillation's train.teacher.Teacher (abstract parameters), or None

    @property
    def teacher_bytes(self) -> int:
        """The teacher's parameters on a trainer chip: they stay in HBM the whole run."""
        return 0 if self.teacher is None else per_chip_bytes(self.teacher.params)

    @property
    def response_len(self) -> int:
        return self.cfg.rollout.max_new_tokens

    @property
    def rows(self) -> int:
        return self.cfg.rollout.prompts_per_step * self.cfg.rollout.samples_per_prompt

    @property
    def params(self):
        """What the forward takes: the whole model."""
        return join_params(self.train_params, self.frozen)

    @property
    def state_bytes(self) -> int:
        return per_chip_bytes(self.train_state)  # stays in HBM while the sampler runs

    @property
    def sampler_resident(self) -> int:
        """What waits in a sampler chip's HBM while it decodes: the train state, or on chips of its own
        the parameters' copy."""
        return self.state_bytes if self.own_sampler is None else per_chip_bytes(self.sampler_params)

    def price(self, program: ProgramPlan, compiled, *, dynamic_trips=(), devices=None) -> None:
        if compiled is not None:
            program.hlo, program.devices = compiled_hlo_text(compiled), devices or self.mesh.size
            program.price(program_cost(program.hlo, num_devices=program.devices, dynamic_trips=dynamic_trips),
                          self.chip)


def plan_inputs(cfg: RunConfig, topology: str, *, chip: ChipSpec | None = None, sampler_only: bool = False,
                log=None) -> PlanInputs:
    """`cfg` on `topology`'s chips as abstract arrays: meshes, chip, layout (none for an evaluation's
    sampler alone), the model's parameters and the run's own train state (train/programs.py's
    optimizer: its state is what waits in HBM)."""
    mesh, own_sampler = topology_meshes(topology, cfg)
    config = plan_model_config(cfg)
    lora = lora_settings(cfg)
    graphdef, abstract = abstract_model(config, lora=lora)
    # model.lora: the adapters train (and carry optimizer state), the base is frozen beside them
    trainable, frozen_abstract = split_trainable(abstract) if lora is not None else (abstract, None)
    p_shard = param_shardings(trainable, mesh)
    f_shard = None if frozen_abstract is None else param_shardings(frozen_abstract, mesh)
    train_params = _with_shardings(trainable, p_shard)
    frozen = None if frozen_abstract is None else _with_shardings(frozen_abstract, f_shard)
    optimizer, _ = optimizer_for(cfg)
    state_sh = train_state_shardings(p_shard, optimizer, trainable, mesh, f_shard)
    train_state = _with_shardings(jax.eval_shape(lambda p, f: init_train_state(p, optimizer, f), trainable,
                                                 frozen_abstract), state_sh)
    whole = join_params(trainable, frozen_abstract)
    sampler_params = join_params(train_params, frozen) if own_sampler is None else \
        _with_shardings(whole, param_shardings(whole, own_sampler))
    return PlanInputs(cfg=cfg, topology=topology, mesh=mesh, own_sampler=own_sampler, chip=chip or chip_spec(topology),
                      config=config, layout=None if sampler_only else plan_layout(cfg, topology),
                      prompt_len=bucket(cfg.data.max_prompt_tokens, PROMPT_BUCKETS), graphdef=graphdef,
                      train_params=train_params, frozen=frozen, train_state=train_state, sampler_params=sampler_params,
                      log=log, teacher=None if sampler_only else plan_teacher(cfg, mesh))


def plan_run(cfg: RunConfig, topology: str | None = None, *, lengths: LengthDistribution | str | None = None,
             prompt_tokens: float | None = None, log=None, sampler_only: bool = False,
             trainer_only: bool = False, chip: ChipSpec | None = None) -> RunPlan:
    """Compile the sampler, log-prob pass and update of `cfg` for `topology` (default: the
    config's `mesh.topology`; see the module docstring) and model one step's time with the
    responses' lengths drawn from `lengths` (`train.response_lengths`; default lognormal, mean a
    quarter of the budget) and `prompt_tokens` real prompt tokens a row (default: the prompts' bucket).
    `log` gets a line per compiled program as it goes. `sampler_only`: the sampler's programs alone
    (`plan_eval`, `plan --only sampler`); `trainer_only`: the log-prob pass and the update alone (`plan --only
    trainer`: a trainer setting's fit in a fraction of the time, the rollout not priced). `chip`: the chip to price and fit on (default `chip_spec(topology)`: its datasheet)."""
    topology = topology or cfg.mesh.topology
    if not topology:
        raise ConfigError("plan needs a topology: pass --topology (e.g. v5p:4x4x4, h100:8, or cpu for this machine) "
                          "or set mesh.topology.")
    lengths = parse_lengths(lengths, cfg.rollout.max_new_tokens) if not isinstance(lengths, LengthDistribution) \
        else lengths  # parsed first: a bad --response-lengths fails before minutes of compiles
    if sampler_only and trainer_only:
        raise ConfigError("plan: sampler_only and trainer_only leave no program to compile; pass at most one "
                          "(plan --only sampler | trainer).")
    ins = plan_inputs(cfg, topology, chip=chip, sampler_only=sampler_only, log=log)
    programs, sampler, decode = ([], {}, None) if trainer_only else plan_sampler(ins)
    shape = (topology, dict(ins.mesh.shape), ins.chip, ins.config, ins.rows, ins.prompt_len, ins.response_len)
    if sampler_only:
        return with_lengths(RunPlan(*shape, programs, sampler, chips=ins.mesh.size, decode=decode, only="sampler"),
                            lengths, prompt_tokens)
    trainer, extra = plan_trainer(ins)
    programs += trainer
    param_bytes = per_chip_bytes(ins.params)
    for p in programs:  # while sampling and scoring, the train state waits in HBM beside the program
        p.resident_bytes = {"sampler/decode": ins.sampler_resident, "update": 0,
                            "teacher pass": ins.state_bytes}.get(p.name, ins.state_bytes - param_bytes)
        if ins.own_sampler is not None and p.name == "sampler/weights":
            p.resident_bytes = 0  # its argument is the parameters' copy itself
        # a teacher's parameters stay on the trainer's chips beside every other program
        if p.name != "teacher pass" and (ins.own_sampler is None or not p.name.startswith("sampler/")):
            p.resident_bytes += ins.teacher_bytes
    own = None if trainer_only else ins.own_sampler
    if own is not None:  # asynchronous RL on chips of its own: what the step's overlap costs
        copy = per_chip_bytes(ins.sampler_params)
        sampler.update(own_chips=own.size, trainer_chips=ins.mesh.size, max_staleness=cfg.trainer.max_staleness,
                       weight_copy_bytes=copy, weight_copy_seconds=copy / ins.chip.ici_bandwidth)
    n, epochs = ins.config.num_active_params, cfg.trainer.ppo_epochs
    plan = RunPlan(*shape, programs, sampler, extra["group"], chips=ins.mesh.size + (own.size if own is not None else 0),
                   decode=decode, trainer_positions=extra["tokens"], packing=extra["packing"],
                   attention_kernel=extra["kernel"], teacher_attention_kernel=extra["teacher_kernel"], layout=ins.layout,
                   only="trainer" if trainer_only else "",
                   trainer_hlo_flops={"logprob pass": 2 * n / ins.mesh.size, "update": 6 * n * epochs / ins.mesh.size,
                                      "teacher pass": 0 if ins.teacher is None else
                                      2 * ins.teacher.config.num_active_params / ins.mesh.size},
                   teacher_bytes=ins.teacher_bytes)
    return with_lengths(plan, lengths, prompt_tokens)


def plan_sampler(ins: PlanInputs) -> tuple[list[ProgramPlan], dict, dict | None]:
    """The sampler's programs on its own mesh (rollout.tensor_parallel), one chunk of prompts at a
    time: (the weights and decode programs, the sampler's settings, what `with_lengths` needs to
    price decode or None where a program did not compile)."""
    cfg, config, chip = ins.cfg, ins.config, ins.chip
    smesh = ins.own_sampler or ins.mesh
    dmesh = sampler_mesh_for(cfg, smesh, config) or smesh
    prompts = cfg.rollout.prompts_per_step
    sizing = decode_sizing(config, dmesh, samples=cfg.rollout.samples_per_prompt, prompt_len=ins.prompt_len,
                           max_new_tokens=ins.response_len)
    ddp, dtp, block, embed_dtype = (sizing[k] for k in ("data_parallel", "tensor_parallel", "block_size", "embed_dtype"))
    # the backend the run would pick (on CPU: the XLA path; the C++ kernels are custom calls XLA cannot cost)
    backend = decode_backend(config, mesh=dmesh, use_kernels=False, block_size=block) if ins.topology == "cpu" \
        else DecodeBackend(mesh=dmesh)
    if config.num_kv_heads % dtp:
        raise ConfigError(f"the decode mesh's tensor axis ({dtp}) does not divide the model's {config.num_kv_heads} "
                          f"KV heads; set rollout.tensor_parallel to a divisor of {config.num_kv_heads}.")
    budget = chip.sizing_bytes - ins.sampler_resident
    chunk = cfg.rollout.prompts_per_chunk
    if chunk == "auto":
        chunk = prompts_per_chunk(config, budget, prompts=prompts, **sizing)
    chunk = min(chunk or prompts, prompts)
    build_weights = weights_jit(ins.graphdef, ins.sampler_params, config=config, backend=backend)
    if lora_settings(cfg) is not None:
        plain_graphdef(config)  # merge_lora's plain model, built outside the mesh (models.lora.plain_graphdef)
    with jax.set_mesh(smesh):
        weights_abstract = jax.eval_shape(build_weights, ins.sampler_params)
    plan_w, compiled_w = _compile("sampler/weights", lambda: build_weights.lower(ins.sampler_params),
                                  weights_program_memory(config, param_bytes=per_chip_bytes(ins.sampler_params),
                                                         tensor_parallel=dtp, embed_dtype=embed_dtype),
                                  0.0, smesh, ins.log)
    ins.price(plan_w, compiled_w)
    sampler = dict(engine=cfg.rollout.engine, tensor_parallel=dtp, data_parallel=ddp, prompts_per_chunk=chunk,
                   chunks=-(-prompts // chunk), fitting_chunk=prompts_per_chunk(config, budget, prompts=prompts, **sizing))
    if compiled_w is None:
        return [plan_w], sampler, None
    weights = _with_shardings(weights_abstract, compiled_w.output_shardings)
    decode_program = plan_continuous_decode if cfg.rollout.engine == "continuous" else plan_static_decode
    plan_s, compiled_s, decode, settings = decode_program(ins, weights, dmesh, backend, sizing, budget, chunk)
    sampler.update(settings)
    if compiled_s is not None:  # priced by `with_lengths`: its loops run as long as the longest row
        plan_s.hlo, plan_s.devices = compiled_hlo_text(compiled_s), dmesh.size
    return [plan_w, plan_s], sampler, decode if compiled_s is not None else None


def decode_arguments(ins: PlanInputs, dmesh: Mesh, num_prompts: int) -> tuple:
    """The decode programs' abstract arguments for `num_prompts` prompts: (tokens, mask, valid, key,
    seed, temperature, top_p, eos, pad, budget) as `generate` passes them."""
    rows_sharding = NamedSharding(dmesh, PartitionSpec(("data", "fsdp")))
    tok = jax.ShapeDtypeStruct((num_prompts, ins.prompt_len), jnp.int32, sharding=rows_sharding)
    valid = jax.ShapeDtypeStruct((num_prompts,), jnp.bool_, sharding=rows_sharding)
    scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype)
    budget = jax.ShapeDtypeStruct((num_prompts * ins.cfg.rollout.samples_per_prompt,), jnp.int32, sharding=rows_sharding)
    return (tok, tok, valid, jax.eval_shape(lambda: jax.random.PRNGKey(0)), scalar(jnp.int32), scalar(jnp.float32),
            scalar(jnp.float32), jax.ShapeDtypeStruct((1,), jnp.int32), scalar(jnp.int32), budget)


def plan_continuous_decode(ins: PlanInputs, weights, dmesh: Mesh, backend, sizing: dict, budget: float, chunk: int):
    """The continuous engine's decode program: every prompt in one call, `slots` rows at a time, its
    EngineSpec as `generate` builds it. Returns (plan, compiled, decode pricing, sampler settings)."""
    cfg, config = ins.cfg, ins.config
    g_samples, ddp, dtp = cfg.rollout.samples_per_prompt, sizing["data_parallel"], sizing["tensor_parallel"]
    num_prompts = bucket(cfg.rollout.prompts_per_step, BATCH_BUCKETS, multiple_of=ddp)
    routes = replays_routes(cfg)
    platform = mesh_devices(dmesh)[0].platform
    fitting_slots = slots_that_fit(config, budget, prompts=num_prompts, record_routes=routes, platform=platform,
                                   **sizing)
    attention = ins.layout.decode_attention.kernel if ins.layout is not None else decode_attention_choice(
        config, mesh_devices(dmesh), cpu_kernels=False, requested=cfg.rollout.decode_attention, page_size=PAGE_SIZE,
        engine=cfg.rollout.engine, tensor_parallel=dmesh.shape["tensor"]).kernel  # the layout's, else its rule
    spec = engine_spec_for(config, backend, mesh=dmesh, num_prompts=num_prompts, num_samples=g_samples,
                           max_new_tokens=ins.response_len, top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p,
                           greedy=False, use_kernels=False, page_size=PAGE_SIZE, burst=cfg.rollout.decode_burst,
                           slots=fitting_slots if cfg.rollout.slots == "auto" else int(cfg.rollout.slots),
                           attention=attention, record_routes=routes)
    analytic = continuous_memory(config, prompts=num_prompts, slots=spec.slots, samples=g_samples,
                                 prompt_len=ins.prompt_len, max_new_tokens=ins.response_len, data_parallel=ddp,
                                 tensor_parallel=dtp, embed_dtype=sizing["embed_dtype"], record_routes=routes,
                                 platform=platform)
    args = decode_arguments(ins, dmesh, num_prompts)
    plan_s, compiled_s = _compile("sampler/decode", lambda: continuous_program.lower(weights, *args, spec=spec),
                                  analytic, 0.0, dmesh, ins.log)
    decode = dict(engine="continuous", slots=spec.slots, shards=ddp, samples=g_samples, burst=cfg.rollout.decode_burst,
                  partial=bool(cfg.rollout.partial), page_size=PAGE_SIZE, pages_per_chunk=PAGES_PER_CHUNK,
                  attention=attention, num_prompts=num_prompts,
                  q_heads=kernel_query_rows(config, dtp, attention == DecodeAttention.GPU_TRITON),
                  kv_heads=config.num_kv_heads // dtp, group=config.num_heads // config.num_kv_heads,
                  cache_bytes=jnp.dtype(config.dtype).itemsize,
                  table_pages=shard_sizes(prompts_per_shard=num_prompts // ddp, slots_per_shard=spec.slots // ddp,
                                          samples=g_samples, prompt_len=ins.prompt_len,
                                          max_new_tokens=ins.response_len).table_pages)
    settings = dict(prompts_per_chunk=cfg.rollout.prompts_per_step, chunks=1, slots=spec.slots,
                    fitting_slots=fitting_slots, attention=attention)  # fits or not
    return plan_s, compiled_s, decode, settings


def plan_static_decode(ins: PlanInputs, weights, dmesh: Mesh, backend, sizing: dict, budget: float, chunk: int):
    """The static engine's decode program: `chunk` prompts a call, each run to the longest row.
    Returns (plan, compiled, decode pricing, sampler settings)."""
    cfg, g_samples, prompts = ins.cfg, ins.cfg.rollout.samples_per_prompt, ins.cfg.rollout.prompts_per_step
    num_prompts = bucket(chunk, BATCH_BUCKETS, multiple_of=sizing["data_parallel"])
    args = decode_arguments(ins, dmesh, num_prompts)[:-1]  # no per-row budgets
    plan_s, compiled_s = _compile("sampler/decode", lambda: sample_program.lower(
        weights, *args, config=ins.config, num_samples=g_samples, max_new_tokens=ins.response_len,
        top_k=int(cfg.rollout.top_k), use_top_p=cfg.rollout.top_p < 1.0, greedy=False, block_size=sizing["block_size"],
        backend=backend, use_kernels=False), decode_memory(ins.config, prompts=num_prompts, **sizing), 0.0, dmesh,
        ins.log)
    plan_s.runs = -(-prompts // chunk)
    decode = dict(engine="static", block=sizing["block_size"], kv_rows=num_prompts * g_samples,
                  rows_per_chunk=min(chunk, prompts) * g_samples, num_prompts=num_prompts)
    return plan_s, compiled_s, decode, {}


def trainer_arguments(ins: PlanInputs) -> tuple:
    """The trainer programs' abstract batch (a TrainBatch of padded rows [rows, prompt + response - 1],
    or the packing layout's PackedBatch) and its row width."""
    packing = ins.layout.update.packing
    if packing is not None:  # packed rows: the micro-batch is the token budget's rows, the count follows the data
        return packed_abstract(packing, ins.mesh, replayed_routes(ins), teacher=ins.teacher is not None), packing.row_width
    return padded_batch(ins), ins.prompt_len + ins.response_len - 1


def replayed_routes(ins: PlanInputs) -> tuple | None:
    """(layers, k, dtype) of the routes a batch carries for router replay (the sampler's expert ids of
    every position, train/batching.py), or None (no replay)."""
    c = ins.config
    return (c.num_layers, c.num_experts_per_tok, route_dtype(c.num_experts)) if replays_routes(ins.cfg) else None


def padded_batch(ins: PlanInputs) -> TrainBatch:
    """The step's TrainBatch of padded rows [rows, prompt + response - 1] as abstract arrays on the
    trainer's mesh: what the loop's `make_batch` places (and, packed or not, the routing pass scores)."""
    rows, seq = ins.rows, ins.prompt_len + ins.response_len - 1
    routes = replayed_routes(ins)
    b_sh = batch_shardings(ins.mesh)
    shapes = dict(input_tokens=((rows, seq), jnp.int32), targets=((rows, seq), jnp.int32),
                  positions=((rows, seq), jnp.int32), attention_mask=((rows, seq), jnp.int32),
                  loss_mask=((rows, seq), jnp.float32), old_logp=((rows, seq), jnp.float32),
                  ref_logp=((rows, seq), jnp.float32), sampler_logp=((rows, seq), jnp.float32),
                  advantages=((rows,), jnp.float32), row_weights=((rows,), jnp.float32),
                  denominator_weights=((rows,), jnp.float32))
    if routes is not None:
        shapes["routes"] = ((rows, seq) + routes[:2], routes[2])
    if ins.teacher is not None:
        shapes["teacher_logp"] = ((rows, seq), jnp.float32)
    return TrainBatch(**{k: jax.ShapeDtypeStruct(s, d, sharding=getattr(b_sh, k)) for k, (s, d) in shapes.items()})


def plan_trainer(ins: PlanInputs) -> tuple[list[ProgramPlan], dict]:
    """The log-prob pass and the update: the loop's own programs (train/programs.py), lowered on
    abstract arrays, with our analytic bytes beside XLA's. Returns (the two plans, {group, packing,
    tokens: positions one pass runs through the stack, kernel: the attention kernel's FLOPs})."""
    cfg, config, mesh, settings = ins.cfg, ins.config, ins.mesh, ins.layout.update
    batch, seq = trainer_arguments(ins)
    work = trainer_work(ins, seq)
    param_bytes, trainable_bytes, batch_bytes = (per_chip_bytes(x) for x in (ins.params, ins.train_params, batch))
    recipe = cfg.recipe()
    kernel = attention_kernel_flops(config, mesh, ins.layout.train_attention.kernel, work["per_chip_rows"], seq,
                                    remat=config.remat, epochs=cfg.trainer.ppo_epochs, minis=cfg.trainer.mini_batches)
    routing_fn = make_routing_fn(ins.graphdef, cfg.rollout.temperature, cfg.model.logprob_chunk_size) \
        if config.num_experts else None
    trainer = trainer_programs(cfg, mesh, logprob_fn=make_logprob_fn(ins.graphdef, cfg.rollout.temperature,
                                                                     cfg.model.logprob_chunk_size),
                               settings=settings, params=ins.train_params, frozen=ins.frozen, recipe=recipe,
                               routing_fn=routing_fn, teacher=ins.teacher)
    plan_l, compiled_l = _compile("logprob pass", lambda: trainer.logprob_pass.lower(ins.params, batch),
                                  {"parameters": param_bytes, "batch": batch_bytes,
                                   "activations": work["layer"] + work["head"] + work["attention"]
                                   + 2 * ins.rows * seq * 4 // work["data_parallel"]},
                                  2 * config.num_active_params * work["tokens"] / mesh.size, mesh, ins.log)
    old_pass = cfg.trainer.old_logp_source == "recompute" and not settings.old_logp_from_update
    plan_l.runs = int(old_pass) + int(cfg.trainer.reference_model or recipe.kl_coef > 0)  # pi_old, pi_ref
    plan_l.kernel_flops = kernel_flops_of(kernel, "logprob pass", work["micro"])
    ins.price(plan_l, compiled_l)
    residuals, saved = work["residuals"], work["saved"]
    plan_u, compiled_u = _compile("update", lambda: trainer.update.lower(ins.train_state, batch),
                                  {"parameters": param_bytes, "optimizer state": ins.state_bytes - param_bytes,
                                   "gradients": 2 * trainable_bytes,  # a micro-batch's gradients and their accumulator
                                   "batch": batch_bytes,
                                   "activations": (residuals + saved if config.remat else 3 * residuals)
                                   + 2 * work["layer"] + work["head"] + 2 * work["attention"]},
                                  6 * config.num_active_params * work["tokens"] * cfg.trainer.ppo_epochs / mesh.size, mesh,
                                  ins.log)
    plan_u.kernel_flops = kernel_flops_of(kernel, "update", work["micro"])
    ins.price(plan_u, compiled_u)
    plans = [plan_l, plan_u]
    if trainer.routing_pass is not None:  # router replay's metrics: a native forward of the padded rows
        padded = padded_batch(ins)
        positions = ins.rows * (ins.prompt_len + ins.response_len - 1)
        plan_r, compiled_r = _compile("routing pass", lambda: trainer.routing_pass.lower(ins.params, padded),
                                      {"parameters": param_bytes, "batch": per_chip_bytes(padded),
                                       "activations": routing_pass_activations(ins)},
                                      2 * config.num_active_params * positions / mesh.size, mesh, ins.log)
        plan_r.runs = 1 / cfg.trainer.router_metrics_every  # every router_metrics_every steps
        ins.price(plan_r, compiled_r)
        plans.append(plan_r)
    teacher_kernel = None
    if trainer.teacher_pass is not None:
        plan_t, teacher_kernel = plan_teacher_pass(ins, trainer, batch, seq)
        plans.append(plan_t)
    return plans, dict(group=settings.prompt_group, packing=settings.packing, tokens=work["tokens"],
                       kernel=kernel, teacher_kernel=teacher_kernel)


def plan_teacher_pass(ins: PlanInputs, trainer, batch, seq: int) -> tuple[ProgramPlan, dict | None]:
    """On-policy distillation's teacher pass (train/programs.py `teacher_pass`): the teacher's forward
    over the batch's rows, once a step, priced at 2 N_teacher a position plus, under a Pallas attention
    kernel (the student's kind: `model.attention_impl` on the platform), the kernel's forward FLOPs at
    the teacher's heads, as the log-prob pass's; its parameters are its argument here and resident beside
    every other program (`plan_run`). Returns (its plan, the teacher's kernel FLOPs or None)."""
    config = ins.teacher.config
    work = trainer_work(ins, seq, config=config, chunk_size=ins.teacher.chunk_size)
    kernel = attention_kernel_flops(config, ins.mesh, ins.layout.train_attention.kernel, work["per_chip_rows"], seq,
                                    remat=False, epochs=1, minis=ins.cfg.trainer.mini_batches)
    plan_t, compiled_t = _compile("teacher pass", lambda: trainer.teacher_pass.lower(ins.teacher.params, batch),
                                  {"parameters": ins.teacher_bytes, "batch": per_chip_bytes(batch),
                                   "activations": work["layer"] + work["head"] + work["attention"]},
                                  2 * config.num_active_params * work["tokens"] / ins.mesh.size, ins.mesh, ins.log)
    plan_t.kernel_flops = kernel_flops_of(kernel, "logprob pass", work["micro"])  # a forward, once a mini-batch
    ins.price(plan_t, compiled_t)
    return plan_t, kernel


def routing_pass_activations(ins: PlanInputs) -> int:
    """Per-chip bytes the routing pass holds beyond its arguments: a forward's working set (`trainer_work`:
    a layer's, the head's, and attention's scores where the training attention is XLA's, none under a
    kernel: splash, Pallas) on its micro-batch of padded rows, plus its outputs: log-probs and entropies
    [rows, S] float32 and the native routes [rows, S, L, k] int32 beside the sampler's (cast to int32,
    and both sorted for the set comparison: 4 copies). Qwen3-30B-A3B on v5p:4x4x4 (4 rows of 9,215
    positions a chip): 18.55 GiB with the arguments against XLA's 18.41 (docs/results/scaling.md)."""
    seq = ins.prompt_len + ins.response_len - 1
    work = trainer_work(ins, seq, routing_pass=True)
    c = ins.config
    positions = work["per_chip_rows"] * seq
    outputs = positions * (2 * 4 + 4 * c.num_layers * c.num_experts_per_tok * 4)
    scores = work["attention"] if ins.layout.train_attention.kernel == TrainAttention.XLA else 0
    return int(work["layer"] + work["head"] + scores + outputs)


def trainer_work(ins: PlanInputs, seq: int, routing_pass: bool = False, config=None,
                 chunk_size: int | None = None) -> dict:
    """Our analytic view of a trainer micro-batch on one chip, rows of width `seq`: per_chip_rows,
    micro (micro-batches a mini-batch), tokens (positions one pass runs through the stack, all
    chips), and the bytes of its residual stream (`residuals`), of what remat keeps (`saved`), of a
    layer's, the head's and attention's working sets (`layer`, `head`, `attention`). routing_pass:
    the routing pass's micro-batch instead (`train.step.make_routing_pass`: the padded batch split
    into micro_batches parts, whole rows, no prompt sharing). config, chunk_size: another model's
    (the teacher's) instead of the student's."""
    cfg, mesh, settings = ins.cfg, ins.mesh, ins.layout.update
    config = config or ins.config
    dp, tensor = mesh.shape["data"] * mesh.shape["fsdp"], mesh.shape["tensor"]
    micro, packing, group = settings.micro_batches, settings.packing, settings.prompt_group
    per_chip_rows = ins.rows // cfg.trainer.mini_batches // micro / dp
    if routing_pass:
        packing, group, per_chip_rows = None, None, ins.rows // micro / dp
    if packing is not None:
        micro, per_chip_rows = packing.micro_batches, packing.rows_per_shard
    # positions a chip runs through the stack per micro-batch (the prompt once per group when shared)
    per_chip_positions = per_chip_rows * (seq if group is None else ins.response_len - 1 + ins.prompt_len / group)
    d, v = config.hidden_size, config.vocab_size
    # a token's feed-forward width: a mixture of experts runs k experts of moe_intermediate_size, or
    # every expert in the dense_capacity form (the layout's, or the platform's for the teacher)
    f = config.intermediate_size
    if config.num_experts:
        chosen = (ins.layout.experts or {}).get("train") if config is ins.config else None
        form = chosen.kernel if chosen else expert_form_for(mesh.devices.flat[0].platform, "train").kernel
        f = (config.num_experts if form == ExpertForm.DENSE_CAPACITY else config.num_experts_per_tok) * \
            config.moe_intermediate_size
    chunk = min(chunk_size or cfg.model.logprob_chunk_size, ins.response_len if packing is None else seq)  # head positions at once
    heads = config.num_heads // tensor if config.num_heads % tensor == 0 else config.num_heads
    query_block = min(seq, config.attention_query_chunk or seq)
    return dict(
        per_chip_rows=per_chip_rows, micro=micro, data_parallel=dp,
        tokens=per_chip_positions * dp * micro * cfg.trainer.mini_batches,  # through the stack, per pass (at most)
        residuals=config.num_layers * per_chip_positions * d * 4,  # the scan's saved residual stream (remat)
        saved=config.num_layers * per_chip_positions * 4 * saved_floats_per_token(  # what the remat policy keeps
            config.remat_policy, hidden=d, intermediate=f, heads=config.num_heads, kv_heads=config.num_kv_heads,
            head_dim=config.head_dim, tensor=tensor),
        layer=per_chip_positions * (6 * d + 3 * f // tensor) * 4,
        head=per_chip_rows * chunk * v // tensor * 4 * 3,
        attention=per_chip_rows * heads * query_block * seq * 4 * 3)  # scores, softmax, its cotangent


def plan_eval(cfg: RunConfig, topology: str | None = None, *, problems: int, lengths=None, prompt_tokens=None,
              log=None, chip: ChipSpec | None = None) -> RunPlan:
    """The sampler's programs of an evaluation of `problems` problems x `eval.samples`
    samples (at eval.top_p / eval.top_k: RunConfig.eval_sampling) (`train.evaluation.evaluate`), compiled and priced as `plan_run` prices a rollout:
    the continuous engine takes every problem in one call on `rollout.slots` slots; the static
    one runs calls of `rollout.prompts_per_step` problems (the decode program's `runs`)."""
    sampling = cfg.eval_sampling()
    k = sampling.samples
    continuous = cfg.rollout.engine == "continuous"
    per_call = problems if continuous else min(cfg.rollout.prompts_per_step, problems)
    rollout = dataclasses.replace(cfg.rollout, prompts_per_step=per_call, samples_per_prompt=k,
                                  top_k=sampling.top_k, top_p=sampling.top_p)
    plan = plan_run(dataclasses.replace(cfg, rollout=rollout), topology, lengths=lengths, prompt_tokens=prompt_tokens,
                    log=log, sampler_only=True, chip=chip)
    calls = -(-problems // per_call)
    for p in plan.programs:
        if p.name == "sampler/decode":
            p.runs *= calls
    return dataclasses.replace(plan, rows=problems * k)


def kernel_query_rows(config, tensor_parallel: int, gpu_kernel: bool) -> int:
    """Query heads each kv token of a slot meets in a chip's paged attention kernel: the model's, or on
    GPU the Triton kernel's padded rows (`gpu_paged_attention.dot_rows`, its layout's)."""
    kv_heads, group = config.num_kv_heads // tensor_parallel, config.num_heads // config.num_kv_heads
    if not gpu_kernel:
        return kv_heads * group
    return gpu_kernel_dot_rows(kv_heads, group)


def attention_kernel_flops(config, mesh: Mesh, impl: str, rows_per_chip: float, seq: int, *, remat: bool,
                           epochs: int, minis: int) -> dict | None:
    """The FLOPs per chip and micro-batch of the training attention when it runs a Pallas kernel
    (`impl`, the layout's `train_attention`: splash on TPU, Triton flash on GPU): XLA's cost analysis
    counts a custom call as no FLOPs, so the meter adds them (`segment_attention.kernel_attention_flops`,
    every layer). None on the XLA path."""
    if impl not in ("splash", "pallas_gpu"):
        return None
    tp = mesh.shape["tensor"]
    heads = config.num_heads // tp if config.num_heads % tp == 0 else config.num_heads
    per = lambda backward: config.num_layers * kernel_attention_flops(
        max(int(round(rows_per_chip)), 1), seq, heads, config.head_dim, block=DEFAULT_BLOCKS[impl], backward=backward,
        impl=impl)
    return dict(impl=impl, forward=per(False), backward=per(True), remat=remat, epochs=epochs, minis=minis)


def kernel_flops_of(kernel: dict | None, program: str, micro: float) -> float:
    """A trainer program's attention-kernel FLOPs per chip per run, `micro` micro-batches a
    mini-batch: the log-prob pass runs the forward, the update forward (twice under remat) and
    backward, every epoch."""
    if kernel is None:
        return 0.0
    if program == "logprob pass":
        return kernel["forward"] * micro * kernel["minis"]
    per_micro = kernel["forward"] * (2 if kernel["remat"] else 1) + kernel["backward"]
    return per_micro * micro * kernel["minis"] * kernel["epochs"]


def reprice(plan: RunPlan, chip: ChipSpec | None = None) -> RunPlan:
    """The plan's trainer and weight programs costed again from their stored HLO (on `chip`, default
    the plan's), e.g. after the cost model changed; the decode program is re-priced by `with_lengths`."""
    chip = chip or plan.chip
    programs = [dataclasses.replace(p) for p in plan.programs]
    for p in programs:
        if p.hlo and p.name != "sampler/decode":
            p.price(program_cost(p.hlo, num_devices=p.devices), chip)
    return with_lengths(dataclasses.replace(plan, programs=programs, chip=chip), plan.lengths, plan.prompt_tokens)


def with_lengths(plan: RunPlan, lengths: LengthDistribution | str | None, prompt_tokens: float | None = None) -> RunPlan:
    """The plan re-priced at a length distribution (no recompile): the decode loops' trips (a
    static batch runs until its longest row ends), the padding of every program, the step figures.
    `prompt_tokens`: real prompt tokens a row (default: the plan's, else the prompt bucket)."""
    if not isinstance(lengths, LengthDistribution):
        lengths = parse_lengths(lengths, plan.response_len)
    prompt_tokens = plan.prompt_tokens or plan.prompt_len if prompt_tokens is None else prompt_tokens
    prompt_tokens = float(min(prompt_tokens, plan.prompt_len))
    mean_response = float(np.mean(lengths.sample(4096, plan.response_len, np.random.default_rng(0))))
    programs = [dataclasses.replace(p) for p in plan.programs]
    n = plan.model.num_active_params  # the FLOPs a token costs: a mixture of experts runs k of its E experts
    # of the positions a trainer pass runs, the real ones: a row's prompt (once per group when shared) and response
    real = plan.rows * (prompt_tokens / (plan.prompt_group or 1) + mean_response - 1)
    positions = plan.trainer_positions
    if plan.packing is not None:  # the packed passes run as many micro-batches as the lengths fill
        micro = expected_micro_batches(plan.packing, lengths, prompt_tokens)
        positions = micro * plan.packing.mini_batches * plan.packing.positions
        for p in programs:
            if p.name in ("logprob pass", "update", "teacher pass") and p.hlo:
                p.kernel_flops = kernel_flops_of(plan.teacher_attention_kernel, "logprob pass", micro) \
                    if p.name == "teacher pass" else kernel_flops_of(plan.attention_kernel, p.name, micro)
                p.price(program_cost(p.hlo, num_devices=p.devices, dynamic_trips=[micro]), plan.chip)
                p.model_flops = plan.trainer_hlo_flops[p.name] * positions
    for p in programs:
        if p.name in ("logprob pass", "update", "teacher pass"):
            p.padding_fraction = max(0.0, 1 - real / positions)
    d = plan.decode
    decode = next((p for p in programs if p.name == "sampler/decode"), None)
    if d is not None and decode is not None and d.get("engine") == "continuous":
        gpu_kernel = d["attention"] == DecodeAttention.GPU_TRITON and "table_pages" in d  # (a plan saved before: none)
        partitions = functools.partial(gpu_kernel_written_partitions, width=d["table_pages"],
                                       slots=d["slots"] // d["shards"], kv_heads=d["kv_heads"],
                                       group=d["group"]) if gpu_kernel else None
        work = continuous_decode_work(lengths, plan.rows, d["slots"], plan.response_len, shards=d["shards"],
                                      samples=d.get("samples", 1), burst=d["burst"], page_size=d["page_size"],
                                      pages_per_chunk=d["pages_per_chunk"], prompt_tokens=prompt_tokens,
                                      partial=bool(d.get("partial")),
                                      prefill=prefill_batch(d["num_prompts"] // d["shards"], d["slots"] // d["shards"],
                                                            d.get("samples", 1)), partitions=partitions)
        if d["attention"] not in ("xla", "cpu_native"):  # XLA counts the Pallas call as nothing: its keys and pages, every layer
            layers = plan.model.num_layers * work.steps
            decode.kernel_flops = layers * 4 * d["q_heads"] * plan.model.head_dim * work.kv_tokens
            decode.kernel_bytes = layers * work.kv_pages * d["page_size"] * 2 * d["kv_heads"] * plan.model.head_dim \
                * d["cache_bytes"]
            if gpu_kernel:  # and the float32 partials it writes (the combine's reads are XLA's, counted by it)
                decode.kernel_bytes += layers * work.kv_partitions * gpu_kernel_partial_bytes(
                    d["kv_heads"], d["group"], plan.model.head_dim)
        decode.price(program_cost(decode.hlo, num_devices=decode.devices,
                                  dynamic_trips=continuous_trips(decode.hlo, work)), plan.chip)
        decode.model_flops = 2 * n * (d["slots"] * work.steps + d["num_prompts"] * plan.prompt_len) / decode.devices
        decode.padding_fraction = 1 - work.useful_fraction
        d = dict(d, work=dataclasses.asdict(work))
    elif d is not None and decode is not None:
        work = static_decode_work(lengths, d["rows_per_chunk"], plan.response_len)
        trips = decode_block_trips(work.longest, d["block"], plan.response_len)
        decode.price(program_cost(decode.hlo, num_devices=decode.devices, dynamic_trips=trips), plan.chip)
        decode.model_flops = 2 * n * (d["kv_rows"] * work.steps + d["num_prompts"] * plan.prompt_len) / decode.devices
        decode.padding_fraction = 1 - plan.rows * mean_response / (decode.runs * d["kv_rows"] * (work.steps + 1))
        d = dict(d, work=dict(steps=work.steps, mean_length=work.mean_length, idle_fraction=work.idle_fraction))
    if d is not None and decode is not None:
        d["step_collectives"] = decode_step_collectives(decode.hlo, decode.devices, d.get("engine", "static"))
    return dataclasses.replace(plan, programs=programs, lengths=lengths, mean_response=mean_response,
                               prompt_tokens=prompt_tokens, trainer_positions=positions, decode=d)


def decode_loops(hlo: str):
    """(computations, every loop in walk order, the loop whose body is one decode step): the first
    KV-block loop of the static program; the burst loop of the continuous one (the last
    data-dependent loop inside its outer refill loop)."""
    comps = parse_module(hlo)
    loops = find_loops(comps)
    entry = next(c.name for c in comps.values() if c.is_entry)
    dynamic = [loop for loop in loops if loop.trips is None]
    top = [loop for loop in dynamic if loop.parent == entry]
    inner = [loop for loop in dynamic if top and loop.parent == top[0].body]
    return comps, loops, top, inner


def continuous_trips(hlo: str, work) -> list[float]:
    """`dynamic_trips` of `sampling.continuous.continuous_program` under a
    `ContinuousWork`: the refill loop runs `bursts` times; inside it the admission loop
    `prefill_rounds` and the burst loop `steps_per_burst` times; the page-chunk loops inside a step
    `chunks_per_step` times. When a refill chooses its prefill batch (`prefill_batch`), the
    admission is two loops one after the other, one of them with no trips: the batched one (the
    one with more flops) runs `batched_rounds` rounds on `batched_refills` of the `bursts` refills,
    the one-prompt one `single_rounds` rounds on the others (two loops, not a `lax.cond`: a
    conditional there made XLA:TPU copy the page pool)."""
    comps, loops, top, inner = decode_loops(hlo)
    if not top or not inner:
        raise ValueError("the continuous sampler's HLO has no refill loop holding a burst loop")
    outer, burst = top[0], inner[-1]
    admissions = [loop for loop in loops if loop.trips is None and loop.parent == outer.body and loop is not burst]
    per_refill = {loop.body: work.prefill_rounds for loop in admissions}
    if len(admissions) == 2:
        batched = max((0, 1), key=lambda i: computation_flops(hlo, comps, admissions[i].body))
        share = work.batched_refills / max(work.bursts, 1e-9)
        per_refill = {admissions[batched].body: share * work.batched_rounds,
                      admissions[1 - batched].body: (1 - share) * work.single_rounds}
    elif len(admissions) > 2:
        raise ValueError(f"the continuous sampler's refill holds {len(admissions)} admission loops, not one or two")
    under_burst = {burst.body}
    trips = []
    for loop in loops:
        if loop.parent in under_burst:
            under_burst.add(loop.body)
        if loop.trips is not None:
            continue
        if loop is outer:
            trips.append(work.bursts)
        elif loop is burst:
            trips.append(work.steps_per_burst)
        elif loop.parent == outer.body:
            trips.append(per_refill[loop.body])
        elif loop.parent in under_burst:
            trips.append(work.chunks_per_step)
        else:
            trips.append(1.0)
    return trips


def decode_step_collectives(hlo: str, devices: int, engine: str) -> dict:
    """The collectives of one decode step of the sampler's program (its step loop's body, a
    chunk loop inside counted once): count, bytes a chip sends (ring model), and each kind
    (op, dtype, group, result shape). A chip sends these every step, for every row it decodes."""
    comps, loops, top, inner = decode_loops(hlo)
    body = (inner[-1] if engine == "continuous" and inner else top[0] if top else None)
    if body is None:
        return {}
    ops = collective_breakdown(hlo, num_devices=devices, root=body.body)
    kinds = [dict(op=op, dtype=shape.lstrip("(").split("[")[0], group=group, shape=shape, count=c, bytes=b)
             for (op, group, shape), (c, b) in sorted(ops.items(), key=lambda kv: -kv[1][1])]
    return dict(count=sum(k["count"] for k in kinds), bytes=sum(k["bytes"] for k in kinds), kinds=kinds)


# ---------------------------------------------------------------------------- report
def _gib(n) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def memory_limit_text(chip: ChipSpec) -> str:
    """The fit check's limit in words: "90% of 79.1 GiB" or, where JAX's allocator hands a process a
    share of the chip, "90% of the 59.3 GiB JAX takes of 79.1 GiB (XLA_PYTHON_CLIENT_MEM_FRACTION 0.75)"."""
    if chip.memory_fraction >= 1:
        return f"{100 * FIT_SHARE:.0f}% of {_gib(chip.hbm)} GiB"
    return (f"{100 * FIT_SHARE:.0f}% of the {_gib(chip.usable_bytes)} GiB JAX takes of {_gib(chip.hbm)} GiB "
            f"(XLA_PYTHON_CLIENT_MEM_FRACTION {chip.memory_fraction:g})")


def compile_failures(plan: RunPlan) -> list[str]:
    """One line for each program that did not compile for another reason than HBM (a kernel's VMEM
    or SMEM, a kernel that fails to lower, a shape: `compile_errors`): what failed and a fix."""
    return [p.error for p in plan.programs if p.failure not in ("", "hbm")]


def advice(plan: RunPlan) -> list[str]:
    """What to change for each program that does not compile (`compile_failures`) or does not fit
    (or is over the fit check's limit, `memory_limit_text`)."""
    out = compile_failures(plan)
    if plan.teacher_bytes > plan.chip.fit_bytes:
        out.append(f"teacher.model: its parameters take {_gib(plan.teacher_bytes)} GiB per chip, over "
                   f"{memory_limit_text(plan.chip)}: raise mesh.fsdp (shards them as the student's), set "
                   f"teacher.dtype=bfloat16, or distill from a smaller teacher")
    for p in plan.programs:
        if p.failure not in ("", "hbm") or p.fits and p.total_bytes + p.resident_bytes <= plan.chip.fit_bytes:
            continue
        if not p.fits and p.needed_bytes is None:  # out of HBM by XLA's word, with no figures to read
            out.append(f"{p.name}: XLA's compiler ran out of HBM ({p.error}): lower what the program holds")
            continue
        what = {
            "update": "raise mesh.fsdp (shards parameters, gradients and optimizer state), lower "
                      "trainer.micro_batch_size (activations), or keep model.remat=true",
            "logprob pass": "lower trainer.micro_batch_size or model.logprob_chunk_size",
            "teacher pass": "raise mesh.fsdp (shards the teacher's parameters as the student's), set "
                            "teacher.dtype=bfloat16, lower trainer.micro_batch_size or teacher.logprob_chunk_size, or "
                            "distill from a smaller teacher",
            "routing pass": "lower trainer.micro_batch_size or model.logprob_chunk_size, or set "
                            "trainer.router_metrics_every=0 (no router replay metrics)",
            "sampler/decode": (f"set rollout.slots={plan.sampler.get('fitting_slots')} (the most slots that fit "
                               f"{100 * SIZING_SHARE:.0f}% of the memory JAX takes, by our count; or auto), or raise rollout.tensor_parallel (splits the decode "
                               f"weights and KV heads)") if plan.sampler.get("engine") == "continuous" else
                              f"set rollout.prompts_per_chunk={plan.sampler.get('fitting_chunk')} (the largest "
                              f"chunk of prompts that fits {100 * SIZING_SHARE:.0f}% of the memory JAX takes, by our count; or auto), or raise "
                              f"rollout.tensor_parallel (splits the decode weights and KV heads)",
            "sampler/weights": "raise rollout.tensor_parallel (the decode weights are replicated over the "
                               "sampler's data-parallel chips, split only over its tensor axis)",
        }[p.name]
        if p.name == "update" and (state := train_state_advice(plan, p)):
            what = state
        out.append(f"{p.name}: needs {_gib(p.total_bytes + p.resident_bytes)} GiB per chip, over "
                   f"{memory_limit_text(plan.chip)} (with the train state that stays beside it): {what}")
    return out


def train_state_advice(plan: RunPlan, update: ProgramPlan) -> str | None:
    """What fits when the update's parameters, optimizer state and gradients alone (by our count, FSDP
    over every chip of the trainer's data x fsdp) take more than a chip may hold: the chips a full
    fine-tune needs at this share, or LoRA adapters (the base frozen: no optimizer state or gradients
    for it). None where the state alone fits (activations are what to lower)."""
    state = sum(update.analytic.get(k, 0) for k in ("parameters", "optimizer state", "gradients"))
    if not update.analytic or state <= plan.chip.fit_bytes:
        return None
    sharded = plan.mesh.get("data", 1) * plan.mesh.get("fsdp", 1)
    chips = math.ceil(sharded * state / plan.chip.fit_bytes)  # the state divided over more FSDP chips
    lora_on = plan.layout is not None and plan.layout.lora is not None
    lora = "" if lora_on else ("; or train LoRA adapters (model.lora.rank=16, model.param_dtype=bfloat16: the base "
                               "frozen, no optimizer state or gradients for it)")
    return (f"the parameters, optimizer state and gradients alone take {_gib(state)} GiB a chip over "
            f"{sharded} chips of FSDP: a full fine-tune needs more than {chips} chips "
            f"(a larger topology, mesh.fsdp covering them){lora}")


def _seconds(x: float) -> str:
    return f"{x * 1e3:.2f} ms" if x < 1 else f"{x:.2f} s"


def _sampler_lines(plan: RunPlan) -> list[str]:
    """format_plan's lines on the sampler: its engine and mesh, its schedule at the lengths, the
    asynchronous split, a decode step's collectives."""
    lines: list[str] = []
    sm = plan.sampler
    d = plan.decode or {}
    if sm and sm.get("engine") == "continuous":
        work = d.get("work", {})
        kernel = {"tpu_ragged": "the ragged paged attention kernel", "gpu_triton": "the Triton paged attention kernel",
                  "cpu_native": "the C++ paged attention kernel"}.get(sm["attention"], "XLA's chunks of live pages")
        lines.append(f"sampler: the continuous engine (rollout.engine=continuous): decode mesh data "
                     f"{sm['data_parallel']} x tensor {sm['tensor_parallel']} (rollout.tensor_parallel), "
                     f"{sm['slots']} slots (rollout.slots; the most that fit by our count: {sm['fitting_slots']}), "
                     f"attention by {kernel}")
        if work:
            lines.append(f"  at these lengths: {work['bursts']:.0f} refills x {work['steps_per_burst']:.1f} decode steps "
                         f"= {work['steps']:.0f} steps, {100 * work['useful_fraction']:.0f}% of slot-steps make a token, "
                         f"{work['kv_pages']:.0f} KV pages read a step per shard"
                         + (" (rollout.partial: a segment's, the next rollout's rows filling the slots its rows free)"
                            if d.get("partial") else ""))
    elif sm:
        lines.append(f"sampler: the static engine (rollout.engine=static): decode mesh data {sm['data_parallel']} x "
                     f"tensor {sm['tensor_parallel']} "
                     f"(rollout.tensor_parallel), {sm['prompts_per_chunk']} prompts per chunk x {sm['chunks']} "
                     f"(rollout.prompts_per_chunk; the largest that fits by our count: {sm['fitting_chunk']})")
    if sm.get("own_chips"):
        side = plan.side_seconds
        lines.append(f"asynchronous (trainer.max_staleness={sm['max_staleness']}, mesh.sampler_devices): the sampler on "
                     f"{sm['own_chips']} chips of its own, the trainer on {sm['trainer_chips']}, at the same time: a step "
                     f"= max(sampler {_seconds(side['sampler'])}, trainer {_seconds(side['trainer'])}) + the new "
                     f"parameters' copy to the sampler {_seconds(sm['weight_copy_seconds'])} "
                     f"({_gib(sm['weight_copy_bytes'])} GiB a sampler chip over its links)")
    coll = d.get("step_collectives")
    if coll:
        kinds: dict = {}
        for k in coll["kinds"]:
            key = f"{k['op']} {k['dtype']}"
            kinds[key] = [kinds.get(key, [0, 0])[0] + k["count"], kinds.get(key, [0, 0])[1] + k["bytes"]]
        parts = ", ".join(f"{key} x{c:.0f} ({b / 1e6:.2f} MB)" for key, (c, b) in sorted(kinds.items(), key=lambda x: -x[1][1]))
        lines.append(f"decode step collectives (one step, per chip): {coll['count']:.0f} ops, {coll['bytes'] / 1e6:.2f} MB "
                     f"sent: {parts}")
    return lines


def format_plan(plan: RunPlan) -> str:
    c = plan.model
    active = f" ({c.num_active_params / 1e9:.2f}B active a token)" if c.num_experts else ""
    lines = [f"plan: {c.architecture} {c.num_params / 1e9:.2f}B params{active} on {plan.topology} "
             f"(mesh {plan.mesh}, {_gib(plan.chip.hbm)} GiB HBM per chip); {plan.rows} rows x "
             f"{plan.prompt_len} prompt + {plan.response_len} response tokens",
             f"chip: {plan.chip.peak_flops / 1e12:.1f} TFLOP/s bf16, {plan.chip.hbm_bandwidth / 1e9:.0f} GB/s memory "
             f"({plan.chip.peak_source}; --peak measured prices at what this host measures), programs fit under "
             f"{memory_limit_text(plan.chip)}"]
    if plan.lengths is not None:
        lines.append(f"responses: {plan.lengths.describe(plan.response_len)}: {plan.mean_response:.0f} tokens a row "
                     f"on average (--response-lengths); prompts: {plan.prompt_tokens:.0f} real tokens a row "
                     f"(--prompt-tokens)")
    lines += _sampler_lines(plan)
    lay = plan.packing
    if lay is not None:
        lines.append(f"trainer: packed rows (trainer.packing): micro-batches of {lay.rows_per_shard} rows x {lay.row_width} "
                     f"positions a chip (trainer.tokens_per_micro_batch), {plan.trainer_positions / max(lay.mini_batches, 1) / lay.positions:.1f} "
                     f"of at most {lay.micro_batches} filled a mini-batch at these lengths")
    elif plan.only != "sampler":
        lines.append(f"trainer: each prompt's forward runs once for its {plan.prompt_group} rows (trainer.share_prompt)"
                     if plan.prompt_group else "trainer: padded rows, every row runs its own prompt (trainer.packing "
                     "off; trainer.share_prompt off or not applicable: micro-batches must give every data-parallel "
                     "chip whole groups)")
    if plan.attention_kernel:
        lines.append(f"trainer attention: the {plan.attention_kernel['impl']} kernel (model.attention_impl); its FLOPs "
                     f"are counted from its blocks (XLA cannot see into the kernel)")
    lines.append("")
    header = f"{'program':<16} {'fits':>4} {'XLA GiB/chip':>12} {'+state':>7} {'HBM %':>6} {'args':>7} {'temp':>7} " \
             f"{'ours GiB':>8} {'ours/XLA':>8}"
    lines += ["memory per chip", header, "-" * len(header)]
    for p in plan.programs:
        if p.failure not in ("", "hbm"):  # no bytes: it did not compile (its line is under DOES NOT COMPILE)
            lines.append(f"{p.name:<16} {'NO':>4} {'-':>12} {_gib(p.resident_bytes):>7} {'-':>6} {'-':>7} {'-':>7} "
                         f"{_gib(p.analytic_total):>8} {'-':>8}  does not compile: {p.failure}")
            continue
        ratio = p.analytic_total / p.total_bytes if p.total_bytes else float("nan")
        lines.append(f"{p.name:<16} {'yes' if p.fits else 'NO':>4} {_gib(p.total_bytes):>12} "
                     f"{_gib(p.resident_bytes):>7} {100 * (p.total_bytes + p.resident_bytes) / plan.chip.hbm:>6.1f} "
                     f"{_gib(p.argument_bytes):>7} {_gib(p.temp_bytes):>7} {_gib(p.analytic_total):>8} {ratio:>8.2f}")
    lines.append("")
    header = f"{'program':<16} {'runs':>5} {'TFLOP':>9} {'/ours':>6} {'HBM GB':>8} {'coll GB':>8} {'compute':>10} " \
             f"{'memory':>10} {'collect.':>10} {'launches':>10} {'binding':>11} {'time':>10} {'share':>6} {'padding':>7}"
    lines += ["time per chip (one run of each program; time x runs = its share of the step)", header, "-" * len(header)]
    for p in plan.programs:
        lines.append(f"{p.name:<16} {p.runs:>5.0f} {p.flops / 1e12:>9.3f} "
                     f"{p.flops / p.model_flops if p.model_flops else float('nan'):>6.2f} {p.hbm_bytes / 1e9:>8.2f} "
                     f"{p.collective_bytes / 1e9:>8.2f} {_seconds(p.compute_seconds):>10} "
                     f"{_seconds(p.memory_seconds):>10} {_seconds(p.collective_seconds):>10} "
                     f"{_seconds(p.launch_seconds):>10} {p.binding:>11} "
                     f"{_seconds(p.seconds):>10} {100 * plan.share(p):>5.1f}% {100 * p.padding_fraction:>6.1f}%")
    lines.append("")
    lines.append(f"step: {_seconds(plan.step_seconds)}, {plan.generated_tokens_per_second_per_chip:,.0f} generated "
                 f"tokens/s/chip, useful-token MFU {100 * plan.useful_mfu:.1f}%, {100 * plan.padding_fraction:.0f}% of "
                 f"the step's time on padding and finished rows")
    if plan.only:
        other = {"trainer": "the sampler's", "sampler": "the log-prob pass's and the update's"}[plan.only]
        lines.append(f"  (--only {plan.only}: the {plan.only}'s programs alone; {other} are not compiled, fitted "
                     f"or in this step time)")
    lines.append(f"compiles: a run compiles these {len(plan.programs)} programs once (data.prompt_bucket=dataset; =step: "
                 f"once per prompt bucket met), plus a sampler program per eval set; trainer.compile_cache keeps "
                 f"them on disk for a resume")
    for p in plan.programs:
        parts = ", ".join(f"{k} {_gib(v)}" for k, v in p.analytic.items())
        lines.append(f"  {p.name}: ours per chip (GiB): {parts}")
    lines.append("")
    lines.append("+state: the train state's bytes (parameters, optimizer state) that stay in HBM beside the program "
                 "and are not among its arguments; HBM % counts them.")
    lines.append("TFLOP, HBM GB, coll GB: per chip and run, XLA's HLO cost with every loop body times its trips "
                 "(/ours: against our 2N/6N count); time = max(compute, memory) + collectives at the chip's peak "
                 "FLOP/s, HBM and link bandwidth + launches (a GPU's kernel launches x the chip's kernel_seconds) "
                 "(docs/scaling.md). padding: positions (trainer) or row-steps "
                 "(sampler) that hold no real token under the length distribution.")
    if notice := meter_notice():  # the public fallback: coarser TFLOP and HBM GB (plan.hlo_cost)
        lines.append(notice)
    failed = compile_failures(plan)
    problems = advice(plan)[len(failed):]
    lines.append("")
    if failed:
        lines += ["DOES NOT COMPILE (not an HBM verdict):"] + ["  " + a for a in failed]
    if problems:
        lines += ["DOES NOT FIT:"] + ["  " + a for a in problems]
    if not failed and not problems:
        lines.append(f"every program fits (< {memory_limit_text(plan.chip)})")
    return "\n".join(lines)


def format_eval(plan: RunPlan, problems: int) -> str:
    """An evaluation's sampler (`plan_eval`): what it holds and how long it takes a chip."""
    sm, d = plan.sampler, plan.decode or {}
    decode = next((p for p in plan.programs if p.name == "sampler/decode"), None)
    how = (f"one call on {sm.get('slots')} slots" if sm.get("engine") == "continuous" else
           f"{decode.runs:.0f} static calls of {sm['prompts_per_chunk']} problems" if decode else "")
    lines = [f"eval: {problems} problems x {plan.rows // max(problems, 1)} samples, {sm.get('engine')} engine ({how}): "
             f"{_seconds(plan.step_seconds)} a chip, {100 * plan.padding_fraction:.0f}% of it on finished rows"]
    for p in plan.programs:  # fits: it compiled, and with the state beside it under 90% of HBM (`RunPlan.fits`)
        if p.failure not in ("", "hbm"):
            lines.append(f"  {p.error}")
            continue
        fits = p.fits and p.total_bytes + p.resident_bytes <= plan.chip.fit_bytes
        lines.append(f"  {p.name:<16} fits {'yes' if fits else 'NO':<3} {_gib(p.total_bytes + p.resident_bytes)} GiB "
                     f"with the state, {p.runs:.0f} x {_seconds(p.seconds)} ({p.binding}-bound)"
                     + ("" if fits else f": over {memory_limit_text(plan.chip)} (lower rollout.slots)"))
    coll = d.get("step_collectives")
    if coll:
        lines.append(f"  decode step collectives: {coll['count']:.0f} ops, {coll['bytes'] / 1e6:.2f} MB a chip")
    return "\n".join(lines)


def plan_to_dict(plan: RunPlan) -> dict:
    return {
        "topology": plan.topology, "mesh": plan.mesh, "hbm_bytes_per_chip": plan.chip.hbm, "fits": plan.fits,
        "chip": plan.chip._asdict(),
        "model_params": plan.model.num_params,
        "model_active_params": plan.model.num_active_params, "rows": plan.rows, "prompt_len": plan.prompt_len,
        "response_len": plan.response_len, "sampler": plan.sampler, "side_seconds": plan.side_seconds,
        "only": plan.only or None,
        "teacher_bytes_per_chip": plan.teacher_bytes,
        "response_lengths": plan.lengths.describe(plan.response_len) if plan.lengths else None,
        "mean_response_tokens": plan.mean_response, "prompt_tokens": plan.prompt_tokens,
        "decode": {k: (dict((a, float(b)) for a, b in v.items()) if k == "work" else v)
                   for k, v in (plan.decode or {}).items()},
        "programs": [dict({k: v for k, v in dataclasses.asdict(dataclasses.replace(p, lowered=None)).items()
                                 if k not in ("hlo", "lowered")}, total_bytes=p.total_bytes, analytic_total=p.analytic_total,
                          seconds=p.seconds, binding=p.binding, share=plan.share(p))
                     for p in plan.programs],
        "step_seconds": plan.step_seconds,
        "generated_tokens_per_second_per_chip": plan.generated_tokens_per_second_per_chip,
        "useful_mfu": plan.useful_mfu, "padding_fraction": plan.padding_fraction,
        "advice": advice(plan),
        "meter": meter_notice() or "hlo_cost: every loop body times its trips, off-HBM and fusion corrections",
    }

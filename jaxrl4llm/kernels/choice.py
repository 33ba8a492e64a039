"""Which attention kernel runs: the one place that decides it, for decoding and for training.

    decode attention (the continuous engine's paged attention; `rollout.decode_attention`):
        xla         `paged_cache.paged_attention`: XLA's chunks of live pages, on every platform
        tpu_ragged  `paged_cache.kernel_paged_attention`: JAX's ragged paged attention kernel (TPU)
        gpu_triton  `gpu_paged_attention`: our Pallas/Triton paged attention kernel (NVIDIA GPU)
        cpu_native  `kernels.paged_attention`: the C++ kernel (one CPU device, the CPU kernels on)
    training attention (`segment_attention.segment_causal_attention`; `model.attention_impl`):
        xla | splash (TPU) | pallas_gpu (GPU)
    mixture-of-experts feed-forward (`models.layers.moe.expert_ffn`; `model.expert_form`):
        ragged_dot | dense_capacity | reference, by platform and phase (`expert_form_for`); the
        ragged form's weight gradient: ragged_dot | tgmm (`expert_weight_grad_for`)

`train.layout.run_layout` resolves both once for a run's devices (`RunLayout.decode_attention`,
`RunLayout.train_attention`: a `KernelChoice`, the kernel and why; layout.json, `plan --show-layout`);
the loop hands the decode choice to `generate` and the partial-rollout engine, `plan` compiles and
prices what the layout says. `generate` called on its own (a request: auto | kernel | xla) resolves
with `decode_attention_choice` too; the continuous engine runs the `DecodeAttention` it is given.
What each kernel takes is written here (`tpu_kernel_supports`, `gpu_kernel_supports`,
`cpu_kernel_supports`), next to the rule that reads it.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp

from jaxrl4llm.kernels.decode_attention import supports as cpu_kernel_supports
from jaxrl4llm.kernels.tpu_blocks import ragged_blocks

try:  # Pallas' Triton backend: deprecated in jax 0.11, it may leave any release (docs/gpu.md, "Without Pallas' Triton backend")
    from jax.experimental.pallas import triton as pallas_triton
except ImportError:
    pallas_triton = None
NO_TRITON = ("this jax has no Pallas Triton backend (jax.experimental.pallas.triton), which the GPU kernels "
             "need: XLA's path runs; install the `cuda` extra's jax (pip install -e .[cuda]) for the kernels")


class DecodeAttention(enum.StrEnum):
    """The continuous engine's paged decode attention (module docstring)."""

    XLA = "xla"
    TPU_RAGGED = "tpu_ragged"
    GPU_TRITON = "gpu_triton"
    CPU_NATIVE = "cpu_native"
    EXACT = "exact"


class TrainAttention(enum.StrEnum):
    """The training forward's segment-id attention (`models/layers/segment_attention.py`)."""

    XLA = "xla"
    SPLASH = "splash"
    PALLAS_GPU = "pallas_gpu"
    EXACT = "exact"


class ExpertForm(enum.StrEnum):
    """How the experts of an MoE layer run (`models.layers.moe.expert_ffn`)."""

    RAGGED_DOT = "ragged_dot"  # tokens sorted by expert, jax.lax.ragged_dot: k expert FFNs per token
    DENSE_CAPACITY = "dense_capacity"  # every expert on every token, masked: E FFNs per token, weights read once
    REFERENCE = "reference"  # a Python loop over experts (tests)


EXPERT_FORMS = tuple(f.value for f in ExpertForm)  # model.expert_form (or "auto")
EXPERT_PHASES = ("train", "prefill", "decode")


class ExpertWeightGrad(enum.StrEnum):
    """How the ragged form's backward computes the experts' gradient dW[e] = X_e^T G_e
    (`models.layers.moe.grouped_matmul`)."""

    RAGGED_DOT = "ragged_dot"  # JAX's transpose of ragged_dot: a ragged_dot_general over the ragged rows
    TGMM = "tgmm"  # the Pallas TPU megablox kernel `tgmm` (transposed grouped matmul), one group at a time


@dataclasses.dataclass(frozen=True)
class KernelChoice:
    """A resolved kernel and the reason it runs; `fallback`: "auto" found no kernel that takes the
    model here and runs XLA's path (the reason says what the kernel could not take)."""

    kernel: DecodeAttention | TrainAttention | ExpertForm | ExpertWeightGrad
    reason: str
    fallback: bool = False


DECODE_REQUESTS = ("auto", "kernel", "xla")  # rollout.decode_attention (generate's `paged_attention`)
ATTENTION_IMPLS = ("auto", "xla", "splash", "pallas_gpu", "cudnn")  # model.attention_impl
NUMERICS = ("default", "exact")  # model.numerics: exact runs the EXACT attentions (kernels/exact.py)
TRAIN_ATTENTION_BY_PLATFORM = {"tpu": TrainAttention.SPLASH, "gpu": TrainAttention.PALLAS_GPU,
                               "cuda": TrainAttention.PALLAS_GPU, "rocm": TrainAttention.PALLAS_GPU}


# ---------------------------------------------------------------------------- what each kernel takes
def tpu_kernel_supports(head_dim: int) -> bool:
    """Whether the TPU ragged paged attention kernel takes this head size: it lays a head across
    the 128 lanes of a vector register (smaller heads fail an assertion inside the kernel), so
    other sizes use `paged_cache.paged_attention` (XLA) on TPU too. Its blocks must also fit the
    chip's scoped VMEM (`tpu_blocks.ragged_blocks`, read by `platform_decode_kernel`)."""
    return head_dim % 128 == 0


def gpu_kernel_supports(head_dim: int, dtype, page_size: int) -> bool:
    """Whether the Triton paged attention kernel takes these shapes: Triton blocks are powers of two
    (head_dim >= 16, page_size), and a 16-bit pool (a float32 dot would run in TF32 on the tensor
    cores, rounding differently from the XLA path; float32 models use `paged_cache.paged_attention`)."""
    pow2 = lambda n: n > 0 and n & (n - 1) == 0
    return pow2(head_dim) and head_dim >= 16 and pow2(page_size) and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)


def is_gpu(devices) -> bool:
    """Whether `devices` (a mesh's, or `jax.devices()`) are NVIDIA GPUs, attached or of a compile-only
    topology (`plan.gpu.gpu_topology_devices`)."""
    return {d.platform for d in devices} <= {"gpu", "cuda"} and len(devices) > 0


def mesh_devices(mesh) -> list:
    """The devices a program on `mesh` runs on (None: this process's first device)."""
    return list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]


def mesh_tensor_parallel(mesh) -> int:
    """The size of `mesh`'s "tensor" axis, over which the sampler splits the kv heads (1 without one)."""
    return int(dict(mesh.shape).get("tensor", 1)) if mesh is not None else 1


# ---------------------------------------------------------------------------- decode attention
def platform_decode_kernel(config, devices, *, cpu_kernels: bool, page_size: int,
                           tensor_parallel: int = 1) -> tuple[DecodeAttention | None, str]:
    """(the platform's paged attention kernel, why) when it takes the model's shapes, else (None, why not).
    tensor_parallel: the sampler's tensor axis, over which a device holds its share of the kv heads
    (the TPU kernel's blocks are sized for that share)."""
    platform, head_dim, dtype = devices[0].platform, config.head_dim, jnp.dtype(config.dtype)
    if platform == "tpu":
        if not tpu_kernel_supports(head_dim):
            return None, f"the TPU ragged paged attention kernel needs head_dim a multiple of 128 (this model: {head_dim})"
        tp = tensor_parallel if config.num_kv_heads % max(tensor_parallel, 1) == 0 else 1
        blocks, why = ragged_blocks(getattr(devices[0], "device_kind", None), q_heads=config.num_heads // tp,
                                    kv_heads=config.num_kv_heads // tp, head_dim=head_dim, page_size=page_size,
                                    dtype=dtype)
        if blocks is None:
            return None, why
        return DecodeAttention.TPU_RAGGED, f"TPU, head_dim {head_dim} a multiple of 128, {why}"
    if is_gpu(devices):
        if pallas_triton is None:
            return None, NO_TRITON
        if gpu_kernel_supports(head_dim, dtype, page_size):
            return DecodeAttention.GPU_TRITON, f"GPU, head_dim {head_dim}, kv_page_size {page_size}, {dtype.name}"
        return None, (f"the Triton paged attention kernel needs a power-of-two head_dim >= 16 and kv_page_size and a "
                      f"bfloat16 or float16 model (this one: head_dim {head_dim}, kv_page_size {page_size}, "
                      f"{dtype.name})")
    if platform == "cpu":
        if not cpu_kernels:
            return None, ("the C++ CPU kernels are off (they run on one CPU device when they build; "
                          "rollout.cpu_kernels)")
        if cpu_kernel_supports(dtype, dtype):
            return DecodeAttention.CPU_NATIVE, f"CPU with the C++ kernels, a {dtype.name} model"
        return None, f"the C++ paged attention kernel takes a bfloat16 or float32 model (this one: {dtype.name})"
    return None, f"no paged attention kernel on {platform}"


def require_engine_for_numerics(config, engine: str) -> None:
    """ValueError naming the fix when `engine` cannot decode `config.numerics`: exact numerics decode with
    the continuous engine (its paged cache feeds the exact attention kernel; the static engine has none)."""
    if getattr(config, "numerics", "default") == "exact" and engine == "static":
        raise ValueError("model.numerics=exact decodes with the continuous engine (its paged cache feeds the "
                         "exact attention kernel); set rollout.engine=continuous")


def decode_attention_choice(config, devices, *, cpu_kernels: bool, requested: str | None = "auto",
                            page_size: int, engine: str = "continuous", tensor_parallel: int = 1) -> KernelChoice:
    """The decode attention of a sampler on `devices` (`mesh_devices`) for the model `config`:

      requested None or "auto": the platform's kernel where it takes the model's shapes, else xla
        (the reason says what the kernel could not take); "xla": xla anywhere; "kernel" or a
        `DecodeAttention` kernel name: that kernel, a ValueError saying why when it cannot run.
      cpu_kernels: the sampler runs the C++ CPU kernels (`generate.use_cpu_kernels`).
      engine: "static" decodes without a paged cache: its attention is the C++ decode attention
        kernel (`kernels.decode_attention`) when the CPU kernels run and take the model, else XLA's
        (`models.decode.xla_decode_attention`); the request is the continuous engine's.
      tensor_parallel: the sampler mesh's tensor axis (a device's share of the kv heads: the TPU
        kernel's blocks must fit the chip's scoped VMEM at it, `tpu_blocks.ragged_blocks`).
    """
    dtype = jnp.dtype(config.dtype)
    require_engine_for_numerics(config, engine)
    if getattr(config, "numerics", "default") == "exact":
        return KernelChoice(DecodeAttention.EXACT, "model.numerics=exact: the batch-invariant C++ attention "
                            "(kernels/exact.py), the training forward's kernel")
    if engine == "static":
        if cpu_kernels and cpu_kernel_supports(dtype, dtype):
            return KernelChoice(DecodeAttention.CPU_NATIVE, "rollout.engine=static: the C++ decode attention kernel "
                                "(no paged cache; rollout.decode_attention is the continuous engine's)")
        return KernelChoice(DecodeAttention.XLA, "rollout.engine=static: XLA's decode attention (no paged cache; "
                            "rollout.decode_attention is the continuous engine's)")
    requested = "auto" if requested is None else str(requested)
    names = DECODE_REQUESTS + tuple(k.value for k in DecodeAttention)
    if requested not in names:
        raise ValueError(f"paged_attention={requested!r} (rollout.decode_attention): choose one of "
                         f"{', '.join(repr(n) for n in names)}")
    if requested == "xla":
        return KernelChoice(DecodeAttention.XLA, "rollout.decode_attention=xla")
    kernel, why = platform_decode_kernel(config, devices, cpu_kernels=cpu_kernels, page_size=page_size,
                                         tensor_parallel=tensor_parallel)
    if requested == "auto":
        if kernel is None:
            return KernelChoice(DecodeAttention.XLA, f"auto: {why}; XLA's chunks of live pages instead", fallback=True)
        return KernelChoice(kernel, f"auto: {why}")
    if kernel is not None and requested in ("kernel", kernel.value):
        return KernelChoice(kernel, f"rollout.decode_attention={requested}: {why}")
    raise ValueError(f"paged_attention={requested!r} (rollout.decode_attention): 'auto', 'xla' anywhere, "
                     f"'kernel' on TPU (head_dim a multiple of 128, blocks that fit its scoped VMEM), on GPU (a "
                     f"power-of-two head_dim >= 16 and kv_page_size, a bfloat16 or float16 model) or on CPU with "
                     f"the CPU kernels (one device, a bfloat16 or float32 model). This call: {devices[0].platform}, "
                     f"head_dim {config.head_dim}, kv_page_size {page_size}, {dtype.name}, CPU kernels "
                     f"{'on' if cpu_kernels else 'off'}"
                     + (f"; {why}" if kernel is None else f"; its kernel: {kernel.value}"))


# ---------------------------------------------------------------------------- training attention
def train_attention_choice(impl: str, platform: str, numerics: str = "default") -> KernelChoice:
    """The training attention of `model.attention_impl` = `impl` on `platform` ("cpu", "tpu", "gpu"):
    "auto" -> splash on TPU, pallas_gpu on GPU, else xla; a named kernel runs as named (a Pallas
    kernel off its platform runs in Pallas' interpreter: tests). "cudnn" (cuDNN flash attention takes
    per-row lengths, not segment ids) and unknown names are a ValueError. `model.numerics=exact`
    runs the exact kernel whatever `impl` says (the sampler runs it too)."""
    if numerics == "exact":
        return KernelChoice(TrainAttention.EXACT, "model.numerics=exact: the batch-invariant C++ attention "
                            "(kernels/exact.py), the sampler's kernel")
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention impl {impl!r} is unknown; valid: {', '.join(ATTENTION_IMPLS)} "
                         f"(model.attention_impl)")
    if impl == "cudnn":
        raise ValueError("attention impl 'cudnn' is not available: cuDNN flash attention takes per-row lengths of "
                         "right-padded rows, not segment ids (packed or left-padded rows); set "
                         "model.attention_impl=pallas_gpu (or auto) on GPU")
    if impl == TrainAttention.PALLAS_GPU and pallas_triton is None:
        raise ValueError(f"model.attention_impl=pallas_gpu: {NO_TRITON} (or set model.attention_impl=auto or xla)")
    if impl != "auto":
        return KernelChoice(TrainAttention(impl), f"model.attention_impl={impl}")
    kernel = TRAIN_ATTENTION_BY_PLATFORM.get(platform, TrainAttention.XLA)
    if kernel == TrainAttention.PALLAS_GPU and pallas_triton is None:
        return KernelChoice(TrainAttention.XLA, f"auto on {platform}: {NO_TRITON}", fallback=True)
    return KernelChoice(kernel, f"auto: the {platform} default")


# ---------------------------------------------------------------------------- mixture-of-experts feed-forward
TPU_LANES = 128  # XLA:TPU lays an array's minor dim over the 128 lanes of a vector register


def minor_dim_size(platform: str, n: int) -> int:
    """The elements a minor dim of n holds on `platform`: n rounded up to whole 128-lane rows on TPU
    (u8[.., 8] holds 128 a row), n elsewhere."""
    return -(-n // TPU_LANES) * TPU_LANES if platform == "tpu" else n


def experts_model_dim_minor(platform: str, width: int) -> bool:
    """Whether XLA lays a device's experts gate, up [E, D, I] with the model dim D minor (I: the
    device's share of an expert's width), so the dense_capacity form reads them as [E I, D] matrices
    (`layers.moe.expert_rows`) and not as [E, D, I] einsums.

    XLA:TPU's default layout keeps I minor where it fills whole 128-lane rows and else moves D minor
    (no padding): bf16[128, 2048, 192], Qwen3-30B-A3B's experts at tensor parallel 4, is D minor,
    bf16[128, 2048, 256] I minor. A form that reads the experts in another order makes XLA copy them
    into it, beside the weights for the whole sampler program: the [E, D, I] einsums on D-minor
    experts copied gate and down of every layer (and the prefill's ragged_dot, which takes I minor,
    copied all three from those), 1.9x the layer's expert weights; the [E I, D] matrices on I-minor
    experts copied gate and up twice. Other platforms lay arrays out row-major (I minor)."""
    return platform == "tpu" and width % TPU_LANES != 0


def prefill_expert_copy_width(platform: str, width: int) -> int:
    """The width of the copies of every layer's gate and up [E, D, I] that a program running the
    prefill's expert form holds beside the experts, 0 where it holds none (I: a device's share of
    an expert's width). XLA:TPU's ragged_dot kernel takes its experts [E, D, I] with I minor, so
    experts laid out D minor (`experts_model_dim_minor`) are copied with I minor, padded to whole
    128-lane rows, once for the whole program: Qwen3-30B-A3B's sampler at tensor parallel 4
    (bf16[128, 2048, 192]) holds two bf16[128, 2048, 256] a layer (v5p, libtpu 0.0.42.1). down
    [E, I, D] (D minor either way) and I-minor experts are read in place."""
    if expert_form_for(platform, "prefill").kernel != ExpertForm.RAGGED_DOT or not experts_model_dim_minor(platform,
                                                                                                           width):
        return 0
    return minor_dim_size(platform, width)


def expert_kernels(form: str, trainer_platform: str, sampler_platform: str) -> dict[str, KernelChoice]:
    """A mixture of experts' kernels in a run (`RunLayout.experts`): the expert form of the training
    forward ("train", on the trainer's platform), the sampler's "prefill" and "decode" (on its
    platform), each by `expert_form_for` unless `form` (`model.expert_form`) forces one, and the ragged
    form's "weight_grad" (`expert_weight_grad_for` the trainer's platform)."""
    def phase_form(platform: str, phase: str) -> KernelChoice:
        if form != "auto":
            return KernelChoice(ExpertForm(form), f"model.expert_form={form}")
        return expert_form_for(platform, phase)

    return {"train": phase_form(trainer_platform, "train"), "prefill": phase_form(sampler_platform, "prefill"),
            "decode": phase_form(sampler_platform, "decode"), "weight_grad": expert_weight_grad_for(trainer_platform)}


def expert_weight_grad_for(platform: str) -> KernelChoice:
    """How the ragged form's backward computes the experts' weight gradient on `platform`, and why.

    JAX transposes `ragged_dot` for the weights into a `ragged_dot_general` whose ragged dimension is
    contracted. XLA:TPU compiles the forward and the input gradient to its grouped-matmul kernel; with
    libtpu 0.0.42.1 (jax 0.10.2's) this mode became a dense dot over every group: E times the FLOPs
    (128.1x at Qwen3-30B-A3B's layer, 8192 rows x 2048 x 768, v5p: the update of a 30B-A3B step at
    24x its 6N); libtpu 0.0.50.1 (jax 0.12's) compiles it grouped. On TPU the gradient is megablox's
    `tgmm` (1.0x, a Pallas kernel: MaxText's), whatever the libtpu; elsewhere JAX's transpose.
    """
    if platform == "tpu":
        return KernelChoice(ExpertWeightGrad.TGMM, "TPU: megablox's tgmm runs each expert's rows only (XLA:TPU "
                            "compiled ragged_dot's weight gradient to a dense dot over all experts with libtpu "
                            "0.0.42.1: E times the FLOPs)")
    return KernelChoice(ExpertWeightGrad.RAGGED_DOT, f"{platform}: JAX's transpose of ragged_dot")


def expert_form_for(platform: str, phase: str) -> KernelChoice:
    """The experts' form (`ExpertForm`) for a program on `platform` ("cpu", "tpu", "gpu", "cuda",
    "rocm") in `phase` ("train": the training forward and scoring; "prefill"; "decode"), and why.

    The FLOPs of N tokens, k of E experts each, relative to the k active experts: ragged_dot 1
    where the platform has a grouped matmul; dense_capacity E/k (but each expert's weights read
    once, what bounds a decode step of few rows).
      decode: dense_capacity everywhere (a step of N rows is bandwidth-bound: it reads all E
        experts once N*k >= E, and needs no sort and no ragged kernel).
      train, prefill on TPU: ragged_dot (XLA:TPU compiles `chlo.ragged_dot` natively).
      on GPU and CPU: dense_capacity. XLA:CPU lowers ragged_dot to a dense expansion (lhs broadcast
        to [E, N*k, D], E FFNs per routed row: E*k per token, k times dense_capacity's E), and so
        does XLA:GPU (jax 0.10.2, compiled for an H100: 128.8x the useful FLOPs forward, where
        dense_capacity is 16.0x, at E 128, k 8; `scripts/gpu_check --phases moe` times both on a chip).
    """
    if phase not in EXPERT_PHASES:
        raise ValueError(f"phase={phase!r}; choose one of {', '.join(EXPERT_PHASES)}")
    if phase == "decode":
        return KernelChoice(ExpertForm.DENSE_CAPACITY, "decode: every expert's weights read once per step, "
                            "no sort (bandwidth-bound at few rows)")
    if platform == "tpu":
        return KernelChoice(ExpertForm.RAGGED_DOT, f"{phase} on TPU: XLA compiles chlo.ragged_dot natively")
    if platform in ("gpu", "cuda", "rocm"):
        return KernelChoice(ExpertForm.DENSE_CAPACITY, f"{phase} on GPU: XLA:GPU rewrites ragged_dot to a dense dot "
                            f"over all experts (k times dense_capacity's FLOPs)")
    return KernelChoice(ExpertForm.DENSE_CAPACITY, f"{phase} on {platform}: XLA lowers ragged_dot to a dense "
                        f"expansion over all experts (k times dense_capacity's FLOPs)")

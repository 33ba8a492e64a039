"""plan/compile_errors.py: a compile failure that is not an HBM shortfall is one line naming what failed
(VMEM, SMEM, the kernel, the shape) and a fix, never an HBM verdict with zeros. The errors below are
XLA's TPU compiler's and JAX's own, as they came (libtpu 0.0.42.1, jax 0.10.2, CPU compiles for
v5p, v4); no compile here."""

import dataclasses

import pytest

from jaxrl4llm.models.config import ModelConfig
from jaxrl4llm.plan.chips import TPU_CHIPS
from jaxrl4llm.plan.compile_errors import classify
from jaxrl4llm.plan.programs import ProgramPlan, RunPlan, advice, format_eval, format_plan

MiB = 2**20
V5P_VMEM = """JaxRuntimeError: RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:
Ran out of memory in memory space vmem while allocating on stack for %ragged_paged_attention_kernel.1 = bf16[64,16,128]{2,1,0:T(8,128)(2,1)} custom-call(%maximum_bitcast_fusion, %bitcast.7, %iota.1, %broadcast.0, %constant.4, /*index=5*/%bitcast.6, %bitcast.3), custom_call_target="tpu_custom_call", operand_layout_constraints={s32[64]{0}, s32[64,576]{1,0}, s32[65]{0}, s32[2]{0}, s32[1]{0}, bf16[64,16,128]{2,1,0}, bf16[4096,16,16,128]{3,2,1,0}}, frontend_attributes={kernel_metadata={}}, metadata={op_name="jit(<lambda>)/jit(ragged_paged_attention)/ragged_paged_attention_kernel/pallas_call" stack_frame_id=15}. Scoped allocation with size 16.79M and limit 16.00M exceeded scoped vmem limit by 804.0K. It should not be possible to run out of scoped vmem - 
See https://openxla.org/xla/errors/error_1001 for more details."""  # noqa: E501, W291
V4_VMEM = ("JaxRuntimeError: RESOURCE_EXHAUSTED: Allocation (size=33554432) would exceed memory (size=16777216) :: "
           "#allocation2 [shape = 'bf16[2,256,16,16,128]{4,3,2,1,0:T(8,128)(2,1)}', space=vmem, size = 0x2000000, "
           "scoped, tag = 'scratch operand'] :: ragged_paged_attention_kernel.1")
SMEM = ("JaxRuntimeError: RESOURCE_EXHAUSTED: Allocation (size=2621440) would exceed memory (size=1048576) :: "
        "#allocation9 [shape = 'u8[2621440]{0}', space=smem, size = 0x280000, scoped, tag = 'prefetched SMEM "
        "operand 1'] :: ragged_paged_attention_kernel.1")
SMEM_USED = ("JaxRuntimeError: RESOURCE_EXHAUSTED: Ran out of memory in memory space smem. Used 1.00M of 1.00M smem. "
             "Exceeded smem capacity by 2.1K.")
HBM = ("JaxRuntimeError: RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
       "temporaries (160.00G) exceeds available HBM (95.74G).")
SHAPE = ("IndivisibleError: Sharding NamedSharding(mesh=Mesh('data': 4, 'fsdp': 1, 'tensor': 1, axis_types=(Auto, "
         "Auto, Auto)), spec=P('data',), memory_kind=device) implies that array axis 0 is partitioned 4 times, but "
         "the dimension size is 6 (full shape: (6, 128), per-dimension tiling factors: [4, 1] should evenly divide "
         "the shape)")
TILING = ("ValueError: the TPU ragged paged attention kernel cannot tile 3 kv heads of bfloat16 (Not implemented: "
          "num_combined_kv_heads=6 can not be XLA fully tiled.); set rollout.decode_attention=xla")
ASSERTION = "AssertionError: "  # head_dim 64 in the ragged kernel: a bare assert inside it
ASSERTION_FRAMES = ("/work/jaxrl4llm/sampling/paged_cache.py:one_device\n"
                    "site-packages/jax/experimental/pallas/ops/tpu/ragged_paged_attention/kernel.py:flash_attention")


def test_vmem_is_named_with_xlas_figures_and_the_fix():
    f = classify(V5P_VMEM, "sampler/decode")
    assert (f.kind, f.needed, f.limit) == ("vmem", int(16.79 * MiB), 16 * MiB)
    assert f.line == ("sampler/decode: does not compile: the TPU ragged paged attention kernel's blocks need 16.79 MiB "
                      "of a TPU core's scoped VMEM, over its 16.00 MiB (XLA E1001 CompileTimeScopedVmemOom: VMEM, not "
                      "HBM): set rollout.decode_attention=xla, or smaller blocks (kernels/tpu_blocks.py chooses them)")
    v4 = classify(V4_VMEM, "sampler/decode")
    assert (v4.kind, v4.needed, v4.limit) == ("vmem", 32 * MiB, 16 * MiB) and "32.00 MiB" in v4.line


@pytest.mark.parametrize("text, needed", [(SMEM, 2621440), (SMEM_USED, None)])
def test_smem_is_named(text, needed):
    f = classify(text, "sampler/decode")
    assert (f.kind, f.needed, f.limit) == ("smem", needed, MiB)
    assert "SMEM, not HBM" in f.line and "lower rollout.slots" in f.line and "\n" not in f.line


def test_hbm_is_plans_verdict():
    f = classify(HBM, "update")
    assert (f.kind, f.needed, f.limit, f.line) == ("hbm", 160 * 2**30, int(95.74 * 2**30), "")


def test_a_shape_and_a_kernel_that_fails_to_lower():
    shape = classify(SHAPE, "logprob pass")
    assert shape.kind == "shape" and shape.line.startswith("logprob pass: does not compile: a shape the mesh cannot "
                                                           "split (IndivisibleError: Sharding")
    assert "mesh.data x mesh.fsdp" in shape.line and len(shape.line) < 400
    tiling = classify(TILING, "sampler/decode")
    assert tiling.kind == "kernel" and tiling.kernel == "the TPU ragged paged attention kernel"
    bare = classify(ASSERTION, "sampler/decode", ASSERTION_FRAMES)
    assert bare.kind == "kernel" and bare.line == ("sampler/decode: does not compile: the TPU ragged paged attention "
                                                   "kernel fails to lower at these shapes (AssertionError:): set "
                                                   "rollout.decode_attention=xla")
    assert classify("TypeError: unsupported operand", "update") is None  # a bug of ours: plan raises it
    assert classify(ASSERTION, "update") is None


def failed_plan(error: str, failure: str) -> RunPlan:
    config = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=128)
    programs = [ProgramPlan("sampler/weights", True, argument_bytes=2**30, output_bytes=2**30),
                ProgramPlan("sampler/decode", False, failure=failure, error=error, resident_bytes=int(0.83 * 2**30),
                            analytic={"page pool": 2**30})]
    return RunPlan("v5p:4x4x4", {"data": 8, "fsdp": 8, "tensor": 1}, TPU_CHIPS["v5p"], config, 1024, 1024, 8192,
                   programs, sampler=dict(engine="continuous", data_parallel=64, tensor_parallel=1, slots=1024,
                                            fitting_slots=1024, attention="tpu_ragged"))


def test_plan_prints_the_line_not_an_hbm_verdict_with_zeros():
    """The bug: a VMEM failure read as "needs 0.83 GiB per chip, over 90% of 95.74 GiB ... rollout.slots=1024"."""
    line = classify(V5P_VMEM, "sampler/decode").line
    plan = failed_plan(line, "vmem")
    assert not plan.fits and advice(plan) == [line]
    text = format_plan(plan)
    assert "DOES NOT COMPILE (not an HBM verdict):\n  " + line in text
    assert "DOES NOT FIT" not in text and "needs 0.83 GiB" not in text and "rollout.slots=1024" not in text
    assert "does not compile: vmem" in next(s for s in text.splitlines() if s.startswith("sampler/decode   "))
    assert line in format_eval(plan, 10)
    # an HBM verdict with no figures to read says so, with no zeros either
    hbm = failed_plan("RESOURCE_EXHAUSTED: Ran out of memory on HBM", "hbm")
    assert advice(hbm) == ["sampler/decode: XLA's compiler ran out of HBM (RESOURCE_EXHAUSTED: Ran out of memory on "
                           "HBM): lower what the program holds"]
    # and the HBM verdict with XLA's figures is plan's, as before
    over = failed_plan("", "hbm")
    over.programs[1] = dataclasses.replace(over.programs[1], needed_bytes=100 * 2**30)
    assert advice(over)[0].startswith("sampler/decode: needs 100.83 GiB per chip, over 90% of 95.74 GiB")

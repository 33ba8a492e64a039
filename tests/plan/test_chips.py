"""plan.chips: JAX's memory fraction, measured peaks, and the chip a plan prices and fits on."""

import dataclasses

import jax
import pytest

from jaxrl4llm.cli import build_parser
from jaxrl4llm.plan.chips import (FIT_SHARE, JAX_GPU_MEM_FRACTION, TPU_CHIPS, copy_bandwidth, jax_memory_fraction,
                                  matmul_peak, measured_peaks, read_bandwidth)
from jaxrl4llm.plan.programs import chip_spec, format_plan, memory_limit_text
from jaxrl4llm.sampling.memory import SIZING_SHARE
from jaxrl4llm.train.config import ConfigError


@pytest.mark.parametrize("env, fraction", [
    ({}, JAX_GPU_MEM_FRACTION),
    ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95"}, 0.95),
    ({"XLA_PYTHON_CLIENT_MEM_FRACTION": ".5", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, 0.5),
    ({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}, 1.0),
])
def test_a_gpu_process_gets_the_share_jax_s_allocator_takes(env, fraction):
    assert jax_memory_fraction("gpu", env) == fraction
    assert jax_memory_fraction("tpu", env) == jax_memory_fraction("cpu", env) == 1.0


@pytest.mark.parametrize("bad", ["lots", "0", "1.5"])
def test_a_bad_memory_fraction_in_the_environment_names_the_variable(bad):
    with pytest.raises(ConfigError, match="XLA_PYTHON_CLIENT_MEM_FRACTION"):
        jax_memory_fraction("gpu", {"XLA_PYTHON_CLIENT_MEM_FRACTION": bad})


def test_the_fit_check_and_the_sampler_s_sizing_take_shares_of_what_jax_hands_the_process():
    chip = TPU_CHIPS["v5e"]._replace(memory_fraction=0.75)
    assert chip.usable_bytes == pytest.approx(0.75 * chip.hbm)
    assert chip.fit_bytes == pytest.approx(FIT_SHARE * 0.75 * chip.hbm)
    assert chip.sizing_bytes == pytest.approx(SIZING_SHARE * 0.75 * chip.hbm)
    assert "0.75" in memory_limit_text(chip) and "0.75" not in memory_limit_text(TPU_CHIPS["v5e"])


def test_measured_peaks_are_this_device_s_and_say_so():
    cpu = jax.devices("cpu")[0]
    flops, bandwidth = matmul_peak(cpu, (256,), reps=2), copy_bandwidth(cpu, 16, reps=2)
    assert 1e8 < flops < 1e15 and 1e8 < bandwidth < 1e13
    assert 1e8 < read_bandwidth(cpu, 16, reps=2) < 1e13  # a bf16 sum: bytes read a second
    chip = measured_peaks(TPU_CHIPS["v5e"], cpu)
    assert chip.peak_source == f"measured on {cpu.device_kind}"
    assert chip.peak_flops != TPU_CHIPS["v5e"].peak_flops and chip.hbm == TPU_CHIPS["v5e"].hbm


def test_given_peaks_and_memory_fraction_override_the_datasheet():
    chip = chip_spec("v5e:2x2", peak_flops=1e14, hbm_bandwidth=5e11, memory_fraction=0.5)
    assert (chip.peak_flops, chip.hbm_bandwidth, chip.memory_fraction, chip.peak_source) == (1e14, 5e11, 0.5, "given")
    assert chip_spec("v5e:2x2").peak_source == "datasheet"
    with pytest.raises(ConfigError, match="--peak 'guess'"):
        chip_spec("v5e:2x2", peak="guess")
    with pytest.raises(ConfigError, match="--memory-fraction"):
        chip_spec("v5e:2x2", memory_fraction=2.0)


def test_measured_peaks_for_an_accelerator_topology_need_the_accelerator():
    """On this CPU-only machine `--peak measured` of a TPU topology has nothing to measure: a clear error."""
    with pytest.raises(ConfigError, match="--peak-flops and --hbm-bandwidth"):
        chip_spec("v5e:2x2", peak="measured")


def test_a_plan_that_fits_the_chip_does_not_fit_a_small_share_of_it(plan):
    assert plan.fits
    held = max(p.total_bytes + p.resident_bytes for p in plan.programs)
    squeezed = dataclasses.replace(plan, chip=plan.chip._replace(memory_fraction=0.5 * held / plan.chip.hbm))
    assert not squeezed.fits
    text = format_plan(squeezed)
    assert "DOES NOT FIT" in text and "XLA_PYTHON_CLIENT_MEM_FRACTION" in text and "datasheet" in text


def test_the_plan_command_takes_the_peak_flags():
    args = build_parser().parse_args(["plan", "--topology", "h100:1", "--peak-flops", "7.9e14", "--hbm-bandwidth",
                                      "3e12", "--memory-fraction", "0.9", "--peak", "measured"])
    assert (args.peak, args.peak_flops, args.hbm_bandwidth, args.memory_fraction) == ("measured", 7.9e14, 3e12, 0.9)

"""What a test's pinned float bits depend on, and the restricted instruction set under which XLA's own
CPU code is the same on every x86-64 host.

XLA:CPU compiles for the host it runs on: LLVM targets the host's instruction sets, so the width of
a vector (and with it the order in which a mean is summed) follows the CPU. Capped at AVX2
(`--xla_cpu_max_isa=AVX2`, x86-64-v3: the level every x86-64 CPU of the last decade reaches), the
code XLA generates itself is the same on the AMD EPYC host (no AVX512-BF16) that
`tests/core/test_policy_loss_pins.py` was pinned on, on an Intel host with AVX-512 FP16 and on an
emulated AVX2-only EPYC-Rome (`qemu-x86_64 -cpu EPYC-Rome`): bit for bit on all three (2026-12-06,
jax 0.10.2; jax 0.12 on the Intel host too).

The cap does not reach matrix products. XLA hands a dot to YNNPACK (or, with that off, to Eigen),
which pick their kernels and their blocking from the CPU they find at run time (vector width, cache
sizes), not from XLA's flag: a [128, 2752] x [2752, 256] float32 product gives other last bits on an
emulated AMD EPYC-Rome (qemu-x86_64 -cpu EPYC-Rome) than on the Intel host, with the cap and with
YNNPACK off alike, while a product over 64 terms agrees. A run that multiplies matrices (the quick
demo) is therefore pinned per host: `host_identity` names what the bits depend on.

This module imports no JAX: subprocess launchers read `portable_env` before any backend starts.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

from tests.subprocess_xla_flags import without_fast_compile

PORTABLE_XLA_FLAG = "--xla_cpu_max_isa=AVX2"  # XLA:CPU's code for x86-64-v3 on every host
PORTABLE_MARCH = "x86-64-v3"  # the C++ kernels for the same level (kernels/native.py, JAXRL4LLM_KERNEL_MARCH)
PORTABLE_CPU_FLAGS = ("avx", "avx2", "bmi1", "bmi2", "f16c", "fma")  # what x86-64-v3 needs of /proc/cpuinfo


def cpuinfo_field(*names: str, cpuinfo: str | None = None) -> str | None:
    """The first /proc/cpuinfo line named one of `names` (or of `cpuinfo`'s text), its value; None
    where there is none."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    for line in cpuinfo.splitlines():
        if line.split(":")[0].strip() in names:
            return line.split(":", 1)[1].strip()
    return None


def cpu_name(cpuinfo: str | None = None) -> str:
    return cpuinfo_field("model name", cpuinfo=cpuinfo) or platform.machine()


# The instruction-set flags XLA:CPU's code generation reads (LLVM targets the host's): two hosts with
# the same model name ("AMD EPYC" under a hypervisor) can differ here, and their runs with them.
ISA_PREFIXES = ("avx", "sse", "ssse", "fma", "f16c", "bmi", "amx", "vaes", "vpclmul", "gfni", "sha_ni", "adx", "asimd",
                "sve", "fphp", "bf16", "i8mm")


def cpu_isa(cpuinfo: str | None = None) -> str:
    """This host's instruction-set flags (/proc/cpuinfo's flags / Features, ISA_PREFIXES), sorted."""
    flags = (cpuinfo_field("flags", "Features", cpuinfo=cpuinfo) or "").split()
    return " ".join(sorted(f for f in flags if f.startswith(ISA_PREFIXES)))


def cpu_caches(root: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> str:
    """The first core's data and unified cache sizes ("L1d:48K L2:2048K L3:...", sysfs), which the
    matrix-product libraries block by; "" where the host does not say."""
    sizes = []
    for index in sorted(root.glob("index*")) if root.is_dir() else []:
        try:
            kind, level, size = ((index / f).read_text().strip() for f in ("type", "level", "size"))
        except OSError:
            continue
        if kind != "Instruction":
            sizes.append(f"L{level}{'d' if kind == 'Data' else ''}:{size}")
    return " ".join(sizes)


def host_identity(versions: dict[str, str] | None = None) -> dict:
    """What a per-host pin depends on: jax, jaxlib, the CPU's name, instruction sets, cache sizes and
    core count. `versions` ({"jax": ..., "jaxlib": ...}) defaults to the installed ones."""
    if versions is None:
        import jax
        import jaxlib

        versions = {"jax": jax.__version__, "jaxlib": jaxlib.__version__}
    return {**versions, "cpu": cpu_name(), "isa": cpu_isa(), "caches": cpu_caches(), "cores": str(os.cpu_count())}


def matching_pin(pins: list[dict], host: dict) -> dict | None:
    """The pin made on this host: same jax, jaxlib, CPU name and instruction sets, and the same caches
    and core count where the pin records them; None where no pin was made on such a host."""
    same = lambda pin: all(k in pin and pin[k] == host.get(k) for k in ("jax", "jaxlib", "cpu", "isa"))
    agrees = lambda pin: all(pin[k] == host.get(k) for k in ("caches", "cores") if k in pin)
    return next((pin for pin in pins if same(pin) and agrees(pin)), None)


def describe(identity: dict) -> str:
    """A host identity (or a pin) in words: jax, CPU name, instruction-set flags, caches, cores."""
    isa = identity.get("isa")
    if not isa:
        return f"jax {identity['jax']}, {identity['cpu']}, instruction sets not recorded"
    avx512 = "with" if "avx512f" in isa.split() else "without"
    extra = "".join(f", {k} {identity[k]}" for k in ("caches", "cores") if identity.get(k))
    return f"jax {identity['jax']}, {identity['cpu']}, {len(isa.split())} instruction-set flags ({avx512} avx512f){extra}"


def portable_isa_missing(machine: str | None = None, isa: str | None = None) -> str | None:
    """Why this host cannot run XLA's code capped at AVX2 (not x86-64, or a flag of x86-64-v3
    missing), in words; None where it can."""
    machine = (machine or platform.machine()).lower()
    if machine not in ("x86_64", "amd64"):
        return f"a {machine} host (the AVX2 cap is x86-64's)"
    have = set((cpu_isa() if isa is None else isa).split())
    missing = [f for f in PORTABLE_CPU_FLAGS if f not in have]
    return f"an x86-64 host without {', '.join(missing)} (x86-64-v3)" if missing else None


def portable_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """`environ` (default os.environ) for a process whose XLA:CPU code and C++ kernels target
    x86-64-v3 on any host: PORTABLE_XLA_FLAG added to XLA_FLAGS (scripts/test's fast-compile flags
    removed: pins hold at XLA's default level) and JAXRL4LLM_KERNEL_MARCH=PORTABLE_MARCH."""
    env = dict(os.environ if environ is None else environ)
    flags = [f for f in without_fast_compile(env.get("XLA_FLAGS", "")).split() if not f.startswith("--xla_cpu_max_isa")]
    env["XLA_FLAGS"] = " ".join([*flags, PORTABLE_XLA_FLAG])
    env["JAXRL4LLM_KERNEL_MARCH"] = PORTABLE_MARCH
    return env

"""Why a program of `jaxrl4llm plan` did not compile, in one line.

XLA's TPU compiler refuses a program for more than HBM: a Pallas kernel's blocks over a core's
scoped VMEM (E1001 CompileTimeScopedVmemOom), its prefetched scalars over the core's 1 MiB of SMEM,
a kernel that fails to lower (Mosaic, Triton, an assertion inside the kernel), a shape the mesh
cannot split. All of them say RESOURCE_EXHAUSTED or raise from the compile; only the first is
plan's HBM verdict (what the program needs against the chip's HBM, and what to change). The others
are a `CompileFailure` whose `line` names what failed (VMEM, SMEM, the kernel, the shape), the
figures XLA gives, and a fix; `plan` prints it in place of an HBM verdict. `classify` reads the
error's text (and the files of its traceback, where a kernel's assertion says nothing); None: an
error of another kind, which `plan` raises as it is.
"""

from __future__ import annotations

import re
import traceback
from typing import NamedTuple

KINDS = ("hbm", "vmem", "smem", "kernel", "shape")
# a kernel's names (in XLA's text or its traceback's files) -> what it is, the setting that runs XLA's path
# instead, and where its blocks are chosen
KERNELS = (
    (("ragged_paged_attention", "ragged paged attention"), "the TPU ragged paged attention kernel",
     "set rollout.decode_attention=xla", "kernels/tpu_blocks.py"),
    (("gpu_paged_attention", "triton paged attention"), "the Triton paged attention kernel",
     "set rollout.decode_attention=xla", "sampling/gpu_paged_attention.py"),
    (("splash",), "the splash attention kernel", "set model.attention_impl=xla",
     "models/layers/segment_attention.py"),
    (("flash_attention", "pallas_gpu"), "the Pallas flash attention kernel", "set model.attention_impl=xla",
     "models/layers/segment_attention.py"),
)
_SIZE = r"([\d.]+)\s*([KMGT]?)i?B?"
_SCALE = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_HBM = re.compile(r"(?:temporaries|memory)\D*\(" + _SIZE + r"\).*?available HBM\s*\(" + _SIZE + r"\)", re.S)
_SCOPED = re.compile(r"Scoped allocation with size " + _SIZE + r" and limit " + _SIZE)
_ALLOCATION = re.compile(r"Allocation \(size=(\d+)\) would exceed memory \(size=(\d+)\)")
_USED = re.compile(r"Used " + _SIZE + r" of " + _SIZE + r" (?:smem|vmem)")


class CompileFailure(NamedTuple):
    """kind: one of KINDS; needed / limit: bytes, where XLA gives them (the program's HBM, the
    kernel's VMEM or SMEM); kernel: what failed, in words (a kernel's, or None); line: the one
    line `plan` prints (empty for "hbm": plan's HBM advice says what to change)."""

    kind: str
    needed: int | None = None
    limit: int | None = None
    kernel: str | None = None
    line: str = ""


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * _SCALE[unit])


def _mib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**20:.2f} MiB"


def _kernel(text: str, frames: str, program: str) -> tuple[str, str, str | None]:
    """(the kernel in words, the setting that runs XLA's path instead, where its blocks are chosen)."""
    lower, frames = text.lower(), frames.lower()
    for keys, words, fix, blocks in KERNELS:
        if any(k in lower or k in frames for k in keys):
            return words, fix, blocks
    sampler = program.startswith("sampler")
    return ("a Pallas kernel", "set rollout.decode_attention=xla" if sampler else "set model.attention_impl=xla", None)


def _first_line(text: str, limit: int = 160) -> str:
    line = next((s.strip() for s in text.splitlines() if s.strip()), "")
    return line if len(line) <= limit else line[:limit - 3] + "..."


def classify(text: str, program: str, frames: str = "") -> CompileFailure | None:
    """What a compile error of `program` (its name in plan) says: `text` is "Type: message" of the
    exception, `frames` the files and functions of its traceback (`error_frames`). None: not a
    compile failure of the kinds above (plan raises it)."""
    lower = text.lower()
    if "resource_exhausted" in lower or "would exceed memory" in lower or "ran out of memory" in lower:
        space = "vmem" if "vmem" in lower else "smem" if "smem" in lower else "hbm"
        if space == "hbm":
            m = _HBM.search(text)
            return CompileFailure("hbm", _bytes(*m.group(1, 2)) if m else None, _bytes(*m.group(3, 4)) if m else None)
        needed = limit = None
        if m := _SCOPED.search(text):
            needed, limit = _bytes(*m.group(1, 2)), _bytes(*m.group(3, 4))
        elif m := _ALLOCATION.search(text):
            needed, limit = int(m.group(1)), int(m.group(2))
        elif m := _USED.search(text):
            limit = _bytes(*m.group(3, 4))
        kernel, fix, blocks = _kernel(text, frames, program)
        code = "E1001 CompileTimeScopedVmemOom" if "CompileTimeScopedVmemOom" in text else "RESOURCE_EXHAUSTED"
        if space == "vmem":
            line = (f"{program}: does not compile: {kernel}'s blocks need {_mib(needed)} of a TPU core's scoped VMEM, "
                    f"over its {_mib(limit)} (XLA {code}: VMEM, not HBM): {fix}"
                    + (f", or smaller blocks ({blocks} chooses them)" if blocks else ""))
        else:
            line = (f"{program}: does not compile: {kernel}'s prefetched scalars (the slots' page table) need "
                    f"{_mib(needed)} of a TPU core's {_mib(limit)} SMEM (XLA {code}: SMEM, not HBM): lower "
                    f"rollout.slots, or {fix}")
        return CompileFailure(space, needed, limit, kernel, line)
    if "indivisibleerror" in lower or "evenly divide" in lower or ("invalid_argument" in lower and "shape" in lower):
        return CompileFailure("shape", line=(
            f"{program}: does not compile: a shape the mesh cannot split ({_first_line(text)}): make the sizes "
            f"divide (rows by mesh.data x mesh.fsdp, heads and kv heads by mesh.tensor and rollout.tensor_parallel)"))
    where = frames.lower()
    if any(k in lower or k in where for k in ("pallas", "mosaic", "triton", "tpu_custom_call", "paged attention kernel")):
        kernel, fix, _ = _kernel(text, frames, program)
        return CompileFailure("kernel", kernel=kernel, line=(
            f"{program}: does not compile: {kernel} fails to lower at these shapes ({_first_line(text) or 'an assertion'}"
            f"): {fix}"))
    return None


def error_frames(e: BaseException) -> str:
    """The files and functions of `e`'s traceback, one per line (where a kernel's bare assertion was raised)."""
    return "\n".join(f"{f.filename}:{f.name}" for f in traceback.extract_tb(e.__traceback__))

"""What a compiled program costs per chip, with every loop body counted as often as it runs.

XLA's `cost_analysis()` counts the body of a `while` (every `scan`, `fori_loop`, `map`) once,
not times its trip count: a scan of 64 matmuls reports the flops of one. Here the optimized HLO
(`compiled.runtime_executable().hlo_modules()[0]`, the per-chip SPMD program) is split into
its computations; each loop body is costed on its own by XLA's generic HloCostAnalysis (run
through the CPU client on a copy of the module re-rooted at that body), and

    full(C) = cost(C) + sum_{while W in C} (trips(W) * full(body(W)) - cost(body(W)))

replaces each once-counted body by its trips (recursively, for nested loops). Trip counts come
from the loop itself: XLA:CPU writes `known_trip_count` into the while's backend config, and on
TPU/GPU the condition of a jax loop is `i < N` on a counter that starts from a constant. A loop
whose exit depends on data (the sampler's "until every row is done") has no static trip count:
the caller passes it (`dynamic_trips`, in the order the loops appear).

A `conditional` (`lax.cond`, `lax.switch`) runs one branch, but XLA's cost analysis counts the
maximum over its branches of each figure, with the branches' loops once and their collectives
not at all. Here its count is replaced by the branches' full costs, weighted by how often each
runs per run of the computation holding it (`branch_weights`, known to the caller, as trips are);
without weights, the branch with the most flops runs every time.

Collectives (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute) are read
from the same HLO with their result shapes and replica groups, weighted by the same trips, and
turned into the bytes one chip sends over its links (ring algorithms: an all-reduce of S bytes
over n chips moves 2 (n-1)/n S, an all-gather or reduce-scatter (n-1)/n S of the full array).

HBM bytes are XLA's "bytes accessed" with one correction (`off_hbm_bytes`): XLA's cost analysis
does not know memory spaces. On TPU the compiler's memory-space assignment prefetches arrays
(the decode step's weights, mostly) from HBM into on-chip memory with async copies, and the
consumer reads them there; an array's layout says where it lives (`bf16[4096,3072]{1,0:T(8,128)S(1)}`:
memory space 1, not HBM). XLA counts such a weight up to five times (the copy-start's operand and
its two tuple results, the copy-done, the consumer). The rule here: a top-level op's operands and
results outside HBM (any `S(n)`, n != 0) move no HBM bytes; a copy-start moves its HBM side once
(read from, or written to, HBM); a copy-done moves nothing more. Per op, XLA's own per-operand
counts are kept for the operands in HBM (so a fusion that reads a slice still counts the slice).

A second correction (`fusion_excess_bytes`): a fusion that touches part of an input moves that
part, not the whole buffer. Its root may write into an input in place (a `scatter` or
`dynamic-update-slice` of a fused parameter, as the sampler's KV writes into its page pool): the
update moves, written once. An input read only through gathers or dynamic slices (the sampler's
page reads): what they take moves. XLA's cost analysis knows this for the TPU's fusions, but
counts a GPU fusion as reading (and writing) the whole operand (10 writes of 32 tokens into a 134
MB pool: 2685 MB on h100, 2.0 MB on v5e).

Uses two private jaxlib entry points (`_jax.hlo_module_cost_analysis`, `_hlo.hlo_module_from_text`),
checked on jax 0.10.2 and 0.12.0.1 (`pyproject.toml` does not pin jax for them). A crash inside
them cannot be caught, so on a jaxlib not checked here a child process first runs them on a few
probe modules, once per process (`private_meter_problem`). Where they are missing, changed or
crash, `program_cost` falls back to the public `compiled.cost_analysis()` of each program
(`compiled_hlo_text` keeps it): flops and HBM
bytes then count each loop body once, without the off-HBM and fusion corrections, and
`meter_notice()` says so (plan prints it). Collectives are read from the HLO text either way.
Set JAXRL4LLM_PLAN_METER=public to take the fallback on purpose.

Kernel launches (`kernels`): on a GPU each top-level op of a computation that runs (the entry, a
loop's body and condition, a conditional's branch) is a kernel the host launches; the fused ops
inside a fusion are not. They are counted with the same trips and branch weights as the flops, and
`ChipSpec.kernel_seconds` prices each (`plan.programs.ProgramPlan.launch_seconds`): a decode step of
a 28-layer model is ~450 kernels (Qwen3-0.6B on h100:1: 454, 15 a layer, `benchmarks/decode_kernels.py`),
most of them small, each with a floor of GPU time that its bytes do not account for (docs/gpu.md,
"Results").

On jax 0.12 the HLO parser accepts the `-done` half of an async op (`slice-done`) fed by a
parameter instead of its `-start`, and then crashes the process (jax 0.10.2 rejected the text): a
probe is built only for ops that stand alone (`_can_probe`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import subprocess
import sys
from typing import Mapping, Sequence

import jax
import jaxlib

_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4, "u32": 4, "s64": 8,
                "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1,
                "f8e5m2": 1, "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "token": 0}
_ARRAY = re.compile(r"\b(" + "|".join(sorted(_DTYPE_BYTES, key=len, reverse=True)) + r")\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) [({]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str  # the result shape text, layouts included
    opcode: str
    rest: str  # operands and attributes


@dataclasses.dataclass
class Computation:
    name: str
    header: str
    lines: list[str]
    instructions: dict[str, Instruction]
    is_entry: bool = False


@dataclasses.dataclass
class Loop:
    """A while loop of the program: where it is, what it runs, and how often (None: data-dependent)."""

    name: str
    parent: str
    body: str
    condition: str
    trips: float | None


@dataclasses.dataclass
class Conditional:
    """A conditional of the program: where it is and the computations it chooses between (in its branch order)."""

    name: str
    parent: str
    branches: tuple[str, ...]


@dataclasses.dataclass
class ProgramCost:
    """Per-chip totals of one program over all its loop trips.

    flops: XLA's HloCostAnalysis flops (matmuls and elementwise), loop bodies x trips;
    hbm_bytes: its "bytes accessed" (operands + results of every top-level op and fusion: the
      traffic to the chip's main memory) less what stays on chip (`off_hbm_bytes`), weighted the same way;
    collective_bytes: bytes a chip sends for collectives (ring model, see the module docstring);
    collectives: how many collective ops run (weighted by trips);
    loops: every while loop with its trip count (static or given);
    kernels: kernel launches on a GPU (`kernel_launches`), weighted the same way.
    """

    flops: float
    hbm_bytes: float
    collective_bytes: float
    collectives: float
    loops: list[Loop]
    once_counted_flops: float  # what cost_analysis() says (each body once), for comparison
    kernels: float = 0.0  # kernel launches per run on a GPU (`kernel_launches`), loop bodies and conditions x trips


def array_bytes(shape_text: str) -> list[float]:
    """Bytes of each array in a shape text (`bf16[8,128]{1,0}` or a tuple of them)."""
    return [math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dtype]
            for dtype, dims in _ARRAY.findall(shape_text)]


def parse_module(text: str) -> dict[str, Computation]:
    """Computations of an HLO module text (`HloPrintOptions.short_parsable()` or the default form)."""
    comps: dict[str, Computation] = {}
    current = None
    for line in text.splitlines():
        if current is None:
            m = _HEADER.match(line)
            if m and line.rstrip().endswith("{") and not line.startswith("HloModule"):
                current = Computation(m.group(2), line, [], {}, is_entry=bool(m.group(1)))
            continue
        if line.startswith("}"):
            comps[current.name] = current
            current = None
            continue
        current.lines.append(line)
        m = _INSTRUCTION.match(line)
        if m:
            current.instructions[m.group(1)] = Instruction(m.group(1), m.group(2), m.group(3), m.group(4))
    return comps


def instruction_attr(rest: str, key: str) -> str | None:
    """The value of attribute `key` (`calls=%fused_computation.3` -> "fused_computation.3") in the text
    after an instruction's opcode, or None."""
    m = re.search(r"\b" + key + r"=%?([\w.\-]+)", rest)
    return m.group(1) if m else None


def instruction_operands(rest: str) -> list[str]:
    """The operands of an instruction: `rest` (`Instruction.rest`, its text inside the operand list's
    parenthesis and after) split at its top-level commas up to the list's closing parenthesis."""
    depth, out, cur = 0, [], ""
    for ch in rest:
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            if depth == 0:
                break
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return [o.split(" ")[-1].lstrip("%") for o in out]


def _constant(comp: Computation, name: str, depth: int = 0) -> int | None:
    """The integer value of `name` in `comp` if it is a constant (through copies/converts)."""
    inst = comp.instructions.get(name)
    if inst is None or depth > 4:
        return None
    if inst.opcode == "constant":
        m = re.match(r"\s*(-?\d+)\)", inst.rest)
        return int(m.group(1)) if m else None
    if inst.opcode in ("copy", "convert", "bitcast"):
        return _constant(comp, instruction_operands(inst.rest)[0], depth + 1)
    return None


def _static_trips(comps: dict[str, Computation], parent: Computation, inst: Instruction) -> float | None:
    """The trip count of a while loop when it is static (see the module docstring), else None."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', inst.rest)
    if m:
        return float(m.group(1))
    cond = comps.get(instruction_attr(inst.rest, "condition") or "")
    if cond is None:
        return None
    root_line = next((line for line in cond.lines if line.lstrip().startswith("ROOT ")), None)
    m = _INSTRUCTION.match(root_line or "")
    if not m or m.group(3) != "compare" or "direction=LT" not in m.group(4):
        return None
    lhs, rhs = instruction_operands(m.group(4))[:2]
    bound = _constant(cond, rhs)
    counter = cond.instructions.get(lhs)
    if bound is None or counter is None or counter.opcode != "get-tuple-element":
        return None
    index = int(instruction_attr(counter.rest, "index") or -1)
    init = 0
    tup = parent.instructions.get(instruction_operands(inst.rest)[0])
    if tup is not None and tup.opcode == "tuple":
        ops = instruction_operands(tup.rest)
        if 0 <= index < len(ops):
            value = _constant(parent, ops[index])
            init = value if value is not None else 0
    return float(max(bound - init, 0))


def branches(inst: Instruction) -> tuple[str, ...]:
    """The computations a conditional chooses between: `branch_computations` (index order) or (true, false)."""
    m = re.search(r"branch_computations=\{([^}]*)\}", inst.rest)
    if m:
        return tuple(name.strip().lstrip("%") for name in m.group(1).split(","))
    pair = (instruction_attr(inst.rest, "true_computation"), instruction_attr(inst.rest, "false_computation"))
    return pair if all(pair) else ()


def _walk(comps: dict[str, Computation]) -> list[tuple[Computation, Instruction]]:
    """Every (computation, instruction) in the order of a walk from the entry: a while's body, a
    call's callee and a conditional's branches right after the instruction that runs them."""
    out = []
    entry = next(c for c in comps.values() if c.is_entry)

    def walk(comp: Computation, seen: frozenset):
        for inst in comp.instructions.values():
            out.append((comp, inst))
            callees = [instruction_attr(inst.rest, "body")] if inst.opcode == "while" else []
            if inst.opcode in ("call", "conditional", "async-start"):
                callees += [instruction_attr(inst.rest, key) for key in ("to_apply", "calls")]
            if inst.opcode == "conditional":
                callees += list(branches(inst))
            for callee in callees:
                if callee in comps and callee not in seen:
                    walk(comps[callee], seen | {callee})

    walk(entry, frozenset({entry.name}))
    return out


def find_loops(comps: dict[str, Computation], dynamic_trips: Sequence[float] = ()) -> list[Loop]:
    """Every while loop, in the order of a walk from the entry; data-dependent loops take their
    trips from `dynamic_trips` in that order (None when the list runs out)."""
    loops, given = [], list(dynamic_trips)
    for comp, inst in _walk(comps):
        if inst.opcode == "while":
            trips = _static_trips(comps, comp, inst)
            if trips is None and given:
                trips = float(given.pop(0))
            loops.append(Loop(inst.name, comp.name, instruction_attr(inst.rest, "body"), instruction_attr(inst.rest, "condition"), trips))
    return loops


def find_conditionals(comps: dict[str, Computation]) -> list[Conditional]:
    """Every conditional, in the order of a walk from the entry."""
    return [Conditional(inst.name, comp.name, branches(inst)) for comp, inst in _walk(comps)
            if inst.opcode == "conditional" and branches(inst)]


def _rerooted(text: str, comps: dict[str, Computation], root: str) -> str:
    """The module text with `root` as its entry computation (the layout attribute of the old entry dropped)."""
    out = []
    for i, line in enumerate(text.splitlines()):
        if i == 0 and line.startswith("HloModule"):  # keep what the body's ops need, not the old entry's I/O
            line = _probe_header(line)
        elif line.startswith("ENTRY "):
            line = line[len("ENTRY "):]
        elif line.startswith(comps[root].header):
            line = "ENTRY " + line
        out.append(line)
    return "\n".join(out)


@functools.cache
def _cpu_client():
    return jax.devices("cpu")[0].client


# jax 0.12's GPU compiler prints `output_to_operand_aliasing` on an async collective's start
# (`all-reduce-start(...), output_to_operand_aliasing={{1}: (0, {})}`) that its own HLO parser then
# refuses for that op; the aliasing changes no flops or bytes, so the meter drops it there.
_COLLECTIVE_START_ALIASING = re.compile(r"(-start\(.*?), output_to_operand_aliasing=\{(?:\{[^{}]*\}: \(\d+, \{[^{}]*\}\)(?:, )?)*\}")


def parsable_hlo(text: str) -> str:
    """`text` as XLA's HLO parser takes it back (`_COLLECTIVE_START_ALIASING`)."""
    return _COLLECTIVE_START_ALIASING.sub(r"\1", text)


def _private_xla_cost(text: str) -> dict:
    """XLA's HloCostAnalysis of an HLO module text, through jaxlib's private entry points (unguarded)."""
    from jax._src.lib import _jax
    from jaxlib import _hlo

    module = _hlo.hlo_module_from_text(parsable_hlo(text))
    return dict(_jax.hlo_module_cost_analysis(_cpu_client(), module))


class PrivateMeterUnavailable(RuntimeError):
    """jaxlib's private cost entry points are missing or misbehave on this jax (`private_meter_problem`)."""


def _xla_cost(text: str) -> dict:
    """XLA's HloCostAnalysis of an HLO module text; PrivateMeterUnavailable where the private path is off."""
    problem = private_meter_problem()
    if problem is not None:
        raise PrivateMeterUnavailable(problem)
    return _private_xla_cost(text)


# The self-check's probes: a matmul (flops 2·64³, three 16 KiB arrays), a weight prefetched on chip
# (copy-start / copy-done, TPU layouts: what `off_hbm_bytes` probes) and a fusion.
_SELF_CHECK = {
    "dot": ("""HloModule check_dot
ENTRY %main (a: f32[64,64], b: f32[64,64]) -> f32[64,64] {
  %a = f32[64,64]{1,0} parameter(0)
  %b = f32[64,64]{1,0} parameter(1)
  ROOT %d = f32[64,64]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}""", {"flops": 2 * 64 ** 3, "bytes accessed": 3 * 64 * 64 * 4}),
    "prefetch": ("""HloModule check_prefetch, is_scheduled=true
ENTRY %main (w: f32[128,128], x: f32[128,128]) -> f32[128,128] {
  %w = f32[128,128]{1,0:T(8,128)} parameter(0)
  %x = f32[128,128]{1,0:T(8,128)} parameter(1)
  %cs = (f32[128,128]{1,0:T(8,128)S(1)}, f32[128,128]{1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%w)
  %cd = f32[128,128]{1,0:T(8,128)S(1)} copy-done(%cs)
  ROOT %y = f32[128,128]{1,0:T(8,128)} dot(%x, %cd), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}""", {"flops": 2 * 128 ** 3}),
    "fusion": ("""HloModule check_fusion
fused {
  p0 = f32[256]{0} parameter(0)
  ROOT t = f32[256]{0} tanh(p0)
}
ENTRY %main (x: f32[256]) -> f32[256] {
  %x = f32[256]{0} parameter(0)
  ROOT %f = f32[256]{0} fusion(%x), kind=kLoop, calls=fused
}""", {"bytes accessed": 2 * 256 * 4}),
}


# The child of `private_meter_problem`: reads {probe: module text} as JSON, prints {probe: XLA's
# cost}; `_private_xla_cost`'s calls, standing alone (the child imports jax, not jaxrl4llm).
_CHILD = """import json, sys
import jax
from jax._src.lib import _jax
from jaxlib import _hlo
client = jax.devices("cpu")[0].client
costs = {}
for name, text in json.load(sys.stdin).items():
    costs[name] = dict(_jax.hlo_module_cost_analysis(client, _hlo.hlo_module_from_text(text)))
print(json.dumps(costs))
"""


@functools.cache
def private_meter_problem() -> str | None:
    """None when jaxlib's private cost entry points work on this jax, else why not (one line).

    Once per process: the entry points must exist; on a jaxlib not in CHECKED_JAXLIB a child process
    (where a segmentation fault cannot take plan down) must cost `_SELF_CHECK`'s probes as they
    are by hand (`self_check_problem`)."""
    if os.environ.get("JAXRL4LLM_PLAN_METER") == "public":
        return "JAXRL4LLM_PLAN_METER=public"
    try:
        from jax._src.lib import _jax
        from jaxlib import _hlo

        missing = [n for m, n in ((_jax, "hlo_module_cost_analysis"), (_hlo, "hlo_module_from_text"),
                                  (_hlo, "HloPrintOptions")) if not hasattr(m, n)]
    except ImportError as e:
        return f"jaxlib's private modules are gone ({e})"
    if missing:
        return f"jaxlib has no {', '.join(missing)}"
    if jaxlib.__version__ in CHECKED_JAXLIB:  # the meter's tests pass there: skip the child (~3 s)
        return None
    return self_check_problem()


# jaxlib versions on which tests/plan passes with the private entry points.
CHECKED_JAXLIB = ("0.10.2", "0.12.0.1")


def self_check_problem() -> str | None:
    """`private_meter_problem`'s check in a child process: None when it costs `_SELF_CHECK`'s probes
    as they are by hand, else what went wrong."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    try:
        probes = json.dumps({name: text for name, (text, _) in _SELF_CHECK.items()})
        child = subprocess.run([sys.executable, "-c", _CHILD], input=probes, capture_output=True, text=True, env=env,
                               timeout=300)
    except subprocess.TimeoutExpired:
        return "the private cost analysis hung on a probe module"
    if child.returncode != 0:
        last = (child.stderr.strip().splitlines() or [f"exit status {child.returncode}"])[-1]
        return f"the private cost analysis failed on a probe module (exit status {child.returncode}: {last[:200]})"
    try:
        got = json.loads(child.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return "the private cost analysis printed no figures"
    for name, (_, want) in _SELF_CHECK.items():
        for key, value in want.items():
            counted = got.get(name, {}).get(key)
            if counted is None or abs(counted - value) > 1e-6 * value:
                return f"the private cost analysis counts {key} {counted} for probe {name}, not {value}"
    return None


def meter_notice() -> str | None:
    """What plan says when the meter runs on the public fallback (module docstring); None otherwise."""
    problem = private_meter_problem()
    if problem is None:
        return None
    return (f"meter: XLA's private cost analysis is unavailable on jax {jax.__version__} ({problem}); the "
            f"figures come from each program's public cost_analysis(): TFLOP and HBM GB count every loop body "
            f"once (not times its trips; too low for the decode and micro-batch loops) and HBM GB keeps XLA's "
            f"count of on-chip and partly-read buffers; coll GB is still weighted by trips.")


def _computation_cost(hlo_text: str, comps: dict[str, Computation], name: str) -> dict:
    """XLA's cost analysis of computation `name` alone, its loops once (as `cost_analysis()` counts them)."""
    return _xla_cost(hlo_text if comps[name].is_entry else _rerooted(hlo_text, comps, name))


def computation_flops(hlo_text: str, comps: dict[str, Computation], name: str) -> float:
    """XLA's flops of computation `name`, its loops once. On the public fallback (module docstring),
    a proxy that orders computations the same way for the same ops on larger arrays: the bytes of
    every result in `name` and in what it calls."""
    if private_meter_problem() is not None:
        return sum(sum(array_bytes(inst.shape)) for c in _needed(comps, name, set())
                   for inst in comps[c].instructions.values())
    return _computation_cost(hlo_text, comps, name).get("flops", 0.0)


def _group_size(rest: str, default: int) -> int:
    """Devices in one replica group: `replica_groups=mesh['a'=2,'b'=8] {'b'}` (the named axes'
    sizes multiplied; a device order may stand between: `mesh[...], device_ids=([2,2]T(1,0)) {'a'}`),
    `[groups,size]<=[n]` (iota form) or explicit `{{0,1,...},...}`."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{((?:'[^}]*)?)\}", rest)
    if m:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        return max(math.prod(sizes.get(a, 1) for a in re.findall(r"'([^']+)'", m.group(2))), 1)
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", rest)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([\d,]*)\}", rest)
    if m:
        return max(len([x for x in m.group(1).split(",") if x]), 1)
    return default


def _result_part(inst: Instruction) -> str:
    """The result shapes of a collective: an async `-start` op's shape is ((operands), (results))
    or, for one operand, (operand, result): its second half."""
    shape = inst.shape.strip()
    if not inst.opcode.endswith("-start") or not shape.startswith("("):
        return shape
    depth, parts, cur = 0, [], ""
    for ch in shape[1:-1]:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    if shape.startswith("(("):
        return parts[1] if len(parts) > 1 else parts[0]
    if inst.opcode.removesuffix("-start") == "all-reduce":
        return shape  # all-reduce-start of several operands: a tuple of results
    arrays = [p for p in parts if _ARRAY.search(p)]
    return ",".join(arrays[len(arrays) // 2:]) if len(arrays) >= 2 else shape


def collective_sent(inst: Instruction, num_devices: int) -> float | None:
    """Bytes one chip sends for a collective instruction (ring model, see the module docstring);
    None when the instruction is no collective that moves data."""
    op = inst.opcode.removesuffix("-start")
    if op not in COLLECTIVES or inst.opcode.endswith("-done"):
        return None
    sizes = array_bytes(_result_part(inst))
    if not sizes:
        return None
    if op == "collective-permute":
        return max(sizes)
    n = _group_size(inst.rest, num_devices)
    if n <= 1:
        return None
    total = sum(sizes)
    if op == "all-reduce":
        return 2 * (n - 1) / n * total
    if op == "reduce-scatter":
        return (n - 1) * total  # the result is one n-th of the reduced array
    return (n - 1) / n * total


_LAID_OUT_ARRAY = re.compile(r"\b(?:" + "|".join(sorted(_DTYPE_BYTES, key=len, reverse=True))
                             + r")\[[\d,]*\](\{[^}]*\})?")  # an array and its layout
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")
_NO_TRAFFIC = ("parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "after-all", "partition-id",
               "replica-id", "call", "conditional")
# Top-level ops that launch no kernel: bookkeeping, control flow (its computations are counted on
# their own), and the second half of an async pair (its `-start` is the launch).
_NO_KERNEL = ("parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "conditional", "call",
              "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain")


def kernel_launches(comp: Computation) -> int:
    """Kernels one run of `comp` launches on a GPU: its top-level ops less `_NO_KERNEL` and `*-done`
    (a fusion's inner ops run inside its one kernel)."""
    return sum(1 for inst in comp.instructions.values()
               if inst.opcode not in _NO_KERNEL and not inst.opcode.endswith("-done"))


_DECLARED_FLOPS = re.compile(r'"cost_estimate":\{"flops":"(\d+)"')


def declared_kernel_flops(comp: Computation) -> float:
    """FLOPs of one run of `comp`'s Pallas TPU kernels, as each declares them (`pl.CostEstimate`,
    written into its custom call's backend config: XLA:TPU's own cost analysis reads it, the generic
    one run here counts a custom call as 0 FLOPs). Kernels that declare none (ours: the attention
    kernels, priced by `plan.programs.attention_kernel_flops`) add nothing."""
    return sum(float(m.group(1)) for inst in comp.instructions.values() if inst.opcode == "custom-call"
               for m in [_DECLARED_FLOPS.search(inst.rest)] if m)


def _hbm_flags(shape_text: str) -> list[bool]:
    """For each array of a shape text: True if it lives in HBM (its layout names no memory space S(n), n != 0)."""
    return [not any(int(n) for n in _MEMORY_SPACE.findall(m.group(1) or ""))
            for m in _LAID_OUT_ARRAY.finditer(shape_text)]


def _needed(comps: dict[str, Computation], name: str, acc: set) -> set:
    """`name` and every computation it calls, transitively."""
    if name in comps and name not in acc:
        acc.add(name)
        for inst in comps[name].instructions.values():
            for key in ("calls", "to_apply", "body", "condition"):
                _needed(comps, instruction_attr(inst.rest, key) or "", acc)
            m = re.search(r"(?:called_computations|branch_computations)=\{([^}]*)\}", inst.rest)
            for callee in (m.group(1).split(",") if m else ()):
                _needed(comps, callee.strip().lstrip("%"), acc)
    return acc


def op_bytes(header: str, comps: dict[str, Computation], comp: Computation, inst: Instruction) -> dict:
    """XLA's cost analysis of one top-level instruction alone ("bytes accessed", and per operand
    "bytes accessed{i}{}" and result "bytes accessedout{...}"): a module whose entry feeds it parameters.
    ValueError for an op that cannot stand alone (`_can_probe`)."""
    if not _can_probe(inst.opcode):
        raise ValueError(f"{inst.opcode} {inst.name} is half of an async pair: no probe module without its start")
    ops = instruction_operands(inst.rest)
    close = _operand_text_end(inst.rest)
    args = ", ".join(f"%p{i}" for i in range(len(ops)))
    lines = [header]
    callees: set = set()
    for key in ("calls", "to_apply"):
        _needed(comps, instruction_attr(inst.rest, key) or "", callees)
    m = re.search(r"called_computations=\{([^}]*)\}", inst.rest)
    for callee in (m.group(1).split(",") if m else ()):
        _needed(comps, callee.strip().lstrip("%"), callees)
    for c in comps.values():  # in the module's order: a computation before its callers
        if c.name in callees:
            lines += [c.header.removeprefix("ENTRY "), *c.lines, "}"]
    lines.append("ENTRY %probe {")
    lines += [f"  %p{i} = {comp.instructions[o].shape} parameter({i})" for i, o in enumerate(ops)]
    lines += [f"  ROOT %probe.out = {inst.shape} {inst.opcode}({args}{inst.rest[close:]}", "}"]
    return _xla_cost("\n".join(lines))


# The `-done` ops with an opcode of their own, which XLA parses fed by a parameter. Any other
# `<op>-update` / `<op>-done` (async-done, slice-done, ...) is the second half of an async wrapper
# and needs its `-start` as operand: jax 0.10.2's parser rejects such a probe; jax 0.12's accepts
# it and crashes the process.
_STANDALONE_DONE = ("copy-done", "all-gather-done", "all-reduce-done", "collective-permute-done", "send-done",
                    "recv-done")


def _can_probe(opcode: str) -> bool:
    """Whether `op_bytes` may build a probe module of one `opcode` fed by parameters."""
    return opcode in _STANDALONE_DONE or not opcode.endswith(("-done", "-update"))


def _operand_text_end(rest: str) -> int:
    """Index of the parenthesis closing an instruction's operand list in its `rest` text."""
    depth = 0
    for i, ch in enumerate(rest):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            if depth == 0:
                return i
            depth -= 1
    return len(rest)


def off_hbm_bytes(hlo_text: str, comps: dict[str, Computation], name: str) -> float:
    """Bytes XLA's cost analysis counts for computation `name` (its top-level ops, its loops' bodies
    once, as XLA does) that do not touch HBM, by the module docstring's rule: subtract them from
    its "bytes accessed". TPU programs only (known by their tiled layouts, `:T(8,128)`): 0 for CPU
    and GPU ones (a GPU's memory space 1, collective buffers, is in HBM)."""
    if "S(" not in hlo_text or ":T(" not in hlo_text:
        return 0.0
    return _off_hbm(hlo_text, _probe_header(hlo_text), comps, name)


def _probe_header(hlo_text: str) -> str:
    """The module's first line as a probe or re-rooted module needs it: its ops' settings, not the old entry's I/O."""
    first = hlo_text.splitlines()[0]
    kept = re.findall(r"\b(?:is_scheduled|num_partitions|replica_count)=\w+", first)
    return ", ".join([first.split(",")[0], *kept])


_OFF_HBM_SEEN: dict = {}  # (program, computation) -> bytes: loop nests ask for a body again


def _off_hbm(hlo_text: str, header: str, comps: dict[str, Computation], name: str) -> float:
    key = (hash(hlo_text), len(hlo_text), name)
    if key not in _OFF_HBM_SEEN:
        if len(_OFF_HBM_SEEN) > 100_000:
            _OFF_HBM_SEEN.clear()
        _OFF_HBM_SEEN[key] = _off_hbm_once(hlo_text, header, comps, name)
    return _OFF_HBM_SEEN[key]


def _off_hbm_once(hlo_text: str, header: str, comps: dict[str, Computation], name: str) -> float:
    comp, out = comps[name], 0.0
    for inst in comp.instructions.values():
        if inst.opcode in ("while", "call"):
            out += sum(_off_hbm(hlo_text, header, comps, c) for c in
                       {instruction_attr(inst.rest, k) for k in ("body", "condition", "to_apply")} if c in comps)
        if inst.opcode in _NO_TRAFFIC:
            continue
        ops = [o for o in instruction_operands(inst.rest) if o in comp.instructions]
        op_flags = [_hbm_flags(comp.instructions[o].shape) for o in ops]
        out_flags = _hbm_flags(inst.shape)
        if all(all(f) for f in op_flags) and all(out_flags):
            continue
        try:
            cost = op_bytes(header, comps, comp, inst)
        except Exception:  # an op the probe cannot rebuild keeps XLA's count
            continue
        if inst.opcode == "copy-done":
            hbm = 0.0
        elif inst.opcode == "copy-start":  # (destination, source alias, context): one side in HBM, moved once
            src = comp.instructions[ops[0]].shape
            hbm = sum(array_bytes(src)) if all(op_flags[0]) else (
                array_bytes(inst.shape)[0] if out_flags and out_flags[0] else 0.0)
        else:
            hbm = sum(cost.get(f"bytes accessed{i}{{}}", 0.0) for i, f in enumerate(op_flags) if all(f))
            per_output = [cost.get(f"bytes accessedout{{{j}}}") for j in range(len(out_flags))]
            if inst.shape.startswith("(") and all(v is not None for v in per_output):
                hbm += sum(v for v, f in zip(per_output, out_flags) if f)
            else:
                sizes = array_bytes(inst.shape)
                share = sum(b for b, f in zip(sizes, out_flags) if f) / max(sum(sizes), 1.0)
                hbm += share * cost.get("bytes accessedout{}", 0.0)
        out += max(cost.get("bytes accessed", 0.0) - hbm, 0.0)
    return out


_IN_PLACE = ("scatter", "dynamic-update-slice")


def _root(comp: Computation) -> Instruction | None:
    for line in comp.lines:
        if line.lstrip().startswith("ROOT "):
            m = _INSTRUCTION.match(line)
            return comp.instructions.get(m.group(1)) if m else None
    return None


def _through_bitcasts(comp: Computation, name: str) -> Instruction | None:
    inst = comp.instructions.get(name)
    while inst is not None and inst.opcode == "bitcast":
        inst = comp.instructions.get(instruction_operands(inst.rest)[0])
    return inst


def _sliced_reads(fused: Computation, param: str) -> float | None:
    """Bytes a fused computation reads of parameter `param` when it reads it only through gathers
    or dynamic slices (as their operand 0, through bitcasts): their results' bytes; else None."""
    names, total, frontier = {param}, 0.0, [param]
    while frontier:
        name = frontier.pop()
        for inst in fused.instructions.values():
            ops = instruction_operands(inst.rest)
            if name not in ops:
                continue
            if inst.opcode == "bitcast":
                if inst.name not in names:
                    names.add(inst.name)
                    frontier.append(inst.name)
            elif inst.opcode in ("gather", "dynamic-slice") and ops.index(name) == 0 and ops.count(name) == 1:
                total += sum(array_bytes(inst.shape))
            else:
                return None
    return total


def fusion_excess_bytes(hlo_text: str, comps: dict[str, Computation], name: str) -> float:
    """Bytes XLA's cost analysis counts for computation `name`'s fusions beyond what they move
    (module docstring): a fusion whose root scatters (or dynamic-update-slices) into fused
    parameter k moves the update, written once, not operand k and the result; a parameter read
    only through gathers or dynamic slices moves what they take."""
    key = ("fusion excess", hash(hlo_text), len(hlo_text), name)
    if key in _OFF_HBM_SEEN:
        return _OFF_HBM_SEEN[key]
    header = _probe_header(hlo_text)
    comp, out = comps[name], 0.0
    for inst in comp.instructions.values():
        fused = comps.get(instruction_attr(inst.rest, "calls") or "") if inst.opcode == "fusion" else None
        if fused is None:
            continue
        params = {int(re.match(r"\s*(\d+)\)", p.rest).group(1)): p for p in fused.instructions.values()
                  if p.opcode == "parameter"}
        true, written = {}, None  # parameter -> the bytes it really moves; the in-place write's bytes
        root = _root(fused)
        if root is not None and root.opcode in _IN_PLACE:
            target = _through_bitcasts(fused, instruction_operands(root.rest)[0])
            update = fused.instructions.get(instruction_operands(root.rest)[-1 if root.opcode == "scatter" else 1])
            if target is not None and target.opcode == "parameter" and update is not None and \
                    array_bytes(target.shape) == array_bytes(root.shape):
                k = next(i for i, p in params.items() if p is target)
                true[k], written = 0.0, sum(array_bytes(update.shape))
        for k, p in params.items():
            if k not in true:
                reads = _sliced_reads(fused, p.name)
                if reads is not None and reads < sum(array_bytes(p.shape)):
                    true[k] = reads
        if not true:
            continue
        try:
            cost = op_bytes(header, comps, comp, inst)
        except Exception:  # an op the probe cannot rebuild keeps XLA's count
            continue
        counted = sum(cost.get(f"bytes accessed{k}{{}}", 0.0) for k in true)
        moved = sum(true.values())
        if written is not None:
            counted += cost.get("bytes accessedout{}", 0.0)
            moved += written
        out += max(counted - moved, 0.0)
    _OFF_HBM_SEEN[key] = out
    return out


def collective_bytes(comps: dict[str, Computation], name: str, num_devices: int) -> tuple[float, float]:
    """(bytes one chip sends, number of collective ops) of the collectives in computation `name`
    and in what it calls (fusions, async wrappers), not in its loops."""
    sent, count = 0.0, 0
    for inst in comps[name].instructions.values():
        callee = instruction_attr(inst.rest, "calls")
        if callee in comps and inst.opcode != "while":
            s, c = collective_bytes(comps, callee, num_devices)
            sent, count = sent + s, count + c
        one = collective_sent(inst, num_devices)
        if one is not None:
            sent, count = sent + one, count + 1
    return sent, count


def program_cost(hlo_text: str, *, num_devices: int, dynamic_trips: Sequence[float] = (),
                 branch_weights: Mapping[str, Sequence[float]] | None = None) -> ProgramCost:
    """Per-chip flops, HBM bytes and collective bytes of one compiled program, loops weighted by trips.

    Args:
      hlo_text: the optimized per-chip HLO (`compiled_hlo_text(compiled)`).
      num_devices: chips of the program (collectives without replica groups span all of them).
      dynamic_trips: trip counts of the data-dependent loops, in the order `find_loops` walks them.
      branch_weights: {conditional's name: how often each branch runs per run of the computation
        holding it, in branch order} (`find_conditionals`); a conditional not named runs its branch
        with the most flops every time.
    """
    comps = parse_module(hlo_text)
    loops = find_loops(comps, dynamic_trips)
    if private_meter_problem() is not None:
        return _public_program_cost(hlo_text, comps, loops, num_devices)
    by_body: dict[str, list[Loop]] = {}
    for loop in loops:
        by_body.setdefault(loop.parent, []).append(loop)
    conds: dict[str, list[Conditional]] = {}
    for c in find_conditionals(comps):
        conds.setdefault(c.parent, []).append(c)
    unknown = set(branch_weights or {}) - {c.name for cs in conds.values() for c in cs}
    if unknown:
        raise ValueError(f"branch_weights names no conditional of the program: {sorted(unknown)}")
    once: dict[str, dict] = {}

    def cost(name: str) -> dict:
        if name not in once:
            c = _computation_cost(hlo_text, comps, name)
            raw = c.get("bytes accessed", 0.0)
            once[name] = {"flops": c.get("flops", 0.0) + declared_kernel_flops(comps[name]), "raw_bytes": raw,
                          "bytes": raw - off_hbm_bytes(hlo_text, comps, name)
                          - fusion_excess_bytes(hlo_text, comps, name)}
        return once[name]

    @functools.cache
    def full(name: str) -> tuple[float, float, float, float, float]:
        """(flops, HBM bytes, collective bytes, collectives, kernels) of `name`, its loops x their trips."""
        c = cost(name)
        totals = [c["flops"], c["bytes"], *collective_bytes(comps, name, num_devices), kernel_launches(comps[name])]
        for loop in by_body.get(name, []):
            if loop.body not in comps:
                continue
            trips = 1.0 if loop.trips is None else loop.trips
            inner, once_body = full(loop.body), cost(loop.body)
            totals[0] += trips * inner[0] - once_body["flops"]
            totals[1] += trips * inner[1] - once_body["bytes"]
            totals[2] += trips * inner[2]  # collectives are read per computation, not from XLA's once-count
            totals[3] += trips * inner[3]
            totals[4] += trips * (inner[4] + _condition_kernels(comps, loop))
        for cond in conds.get(name, []):  # XLA counted each figure's max over the branches
            onces = [cost(b) for b in cond.branches]
            weights = (branch_weights or {}).get(cond.name)
            if weights is None:
                heaviest = max(range(len(onces)), key=lambda i: onces[i]["flops"])
                weights = [float(i == heaviest) for i in range(len(onces))]
            if len(weights) != len(cond.branches):
                raise ValueError(f"conditional {cond.name} has {len(cond.branches)} branches, "
                                 f"branch_weights gives {len(weights)}")
            totals[0] -= max(o["flops"] for o in onces)
            totals[1] -= max(o["raw_bytes"] for o in onces)
            for w, branch in zip(weights, cond.branches):
                inner = full(branch)
                for i in range(5):
                    totals[i] += w * inner[i]
        return tuple(totals)

    entry = next(c.name for c in comps.values() if c.is_entry)
    flops, hbm, coll, count, kernels = full(entry)
    return ProgramCost(flops=flops, hbm_bytes=hbm, collective_bytes=coll, collectives=count, loops=loops,
                       once_counted_flops=cost(entry)["flops"], kernels=kernels)


def _condition_kernels(comps: dict[str, Computation], loop: Loop) -> int:
    """Kernels of one evaluation of `loop`'s condition (it runs once per trip, beside the body)."""
    return kernel_launches(comps[loop.condition]) if loop.condition in comps else 0


def _public_program_cost(hlo_text: str, comps: dict[str, Computation], loops: list[Loop],
                         num_devices: int) -> ProgramCost:
    """`program_cost` on the public fallback (module docstring): flops and HBM bytes as the program's
    `cost_analysis()` counts them (loop bodies once; 0 when XLA gives none, as for GPU programs),
    collectives from the HLO weighted by trips."""
    public = _PUBLIC_COST.get(_text_key(hlo_text), {})
    weight = {next(c.name for c in comps.values() if c.is_entry): 1.0}
    for loop in loops:  # walk order: a parent's weight is known before its loops
        weight[loop.body] = weight.get(loop.parent, 1.0) * (1.0 if loop.trips is None else loop.trips)
    sent = count = kernels = 0.0
    for body, w in weight.items():
        if body in comps:
            s, c = collective_bytes(comps, body, num_devices)
            sent, count, kernels = sent + w * s, count + w * c, kernels + w * kernel_launches(comps[body])
    for loop in loops:  # a loop's condition runs as often as its body
        kernels += weight[loop.body] * _condition_kernels(comps, loop)
    flops = float(public.get("flops", 0.0))
    return ProgramCost(flops=flops, hbm_bytes=float(public.get("bytes accessed", 0.0)), collective_bytes=sent,
                       collectives=count, loops=loops, once_counted_flops=flops, kernels=kernels)


_PUBLIC_COST: dict = {}  # hash of a program's HLO text -> its public cost_analysis() (the fallback's figures)


def _text_key(hlo_text: str) -> tuple:
    return hash(hlo_text), len(hlo_text)


def compiled_hlo_text(compiled) -> str:
    """The optimized per-chip HLO of a compiled program, in a form `hlo_module_from_text` parses
    (on the public fallback, `compiled.as_text()`, and its `cost_analysis()` is kept for `program_cost`)."""
    if private_meter_problem() is not None:
        text = compiled.as_text()
        if len(_PUBLIC_COST) > 10_000:
            _PUBLIC_COST.clear()
        cost = compiled.cost_analysis()
        _PUBLIC_COST[_text_key(text)] = dict((cost[0] if isinstance(cost, (list, tuple)) else cost) or {})
        return text
    from jaxlib import _hlo

    modules = compiled.runtime_executable().hlo_modules()
    return modules[0].to_string(_hlo.HloPrintOptions.short_parsable())


def collective_breakdown(hlo_text: str, *, num_devices: int, dynamic_trips: Sequence[float] = (),
                         root: str | None = None) -> dict:
    """{(op, group size, result shape): [count, bytes sent]} over the program, loops weighted by
    trips: which collectives a program's `collective_bytes` comes from. `root`: a loop body's
    computation, to count one trip of that loop instead (e.g. one decode step; loops inside it
    weighted by their trips)."""
    comps = parse_module(hlo_text)
    loops = find_loops(comps, dynamic_trips)
    weight = {root or next(c.name for c in comps.values() if c.is_entry): 1.0}
    for loop in loops:  # walk order: a parent's weight is known before its loops
        if root is None or loop.parent in weight:
            weight[loop.body] = weight.get(loop.parent, 1.0) * (1.0 if loop.trips is None else loop.trips)
    out: dict = {}

    def visit(name: str, w: float, seen: frozenset):
        for inst in comps[name].instructions.values():
            callee = instruction_attr(inst.rest, "calls")
            if callee in comps and inst.opcode != "while" and callee not in seen:
                visit(callee, w, seen | {callee})
            sent = collective_sent(inst, num_devices)
            if sent is not None:
                key = (inst.opcode.removesuffix("-start"), _group_size(inst.rest, num_devices),
                       inst.shape.split("{")[0][:60])
                entry = out.setdefault(key, [0.0, 0.0])
                entry[0] += w
                entry[1] += w * sent

    for body, w in weight.items():
        if body in comps:
            visit(body, w, frozenset({body}))
    return out

"""How many GPU kernels does one decode step of the continuous sampler launch, per transformer layer and of what kinds?

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/decode_kernels.py [--model qwen3-0.6b] [--topology h100:1]
        [--json PATH] [--save-hlo PATH | --load-hlo PATH] [--verbose]

Needs the `gpu` extra (jax-cuda12-plugin): XLA's CUDA compiler runs ahead of time on this CPU for an
abstract GPU (`jaxrl4llm.plan.gpu`); no GPU is used. About a minute for Qwen3-0.6B on two cores.

The run is gpu_check.py's step run (`gpu_check.step_overrides("gpu", model)` on plan_accuracy's
CONFIG_FILES, the study's recipe): Qwen3 of the model's shape (random weights), 8 prompts x 8 samples =
64 rows on rollout.slots=64 slots, 1024 new tokens. `plan.programs.plan_run(cfg, topology,
sampler_only=True)` compiles the sampler's programs as `jaxrl4llm plan` does; its "sampler/decode"
program keeps the optimized per-chip HLO (`plan.hlo_cost.compiled_hlo_text`).

One decode step is one trip of the continuous engine's burst loop, found as the planner finds it
(`plan.programs.decode_loops`: the last data-dependent loop inside the outer refill loop). Every
top-level op of its body that is not bookkeeping is a kernel (`plan.hlo_cost.kernel_launches`); loops
nested in the body count their trips (a data-dependent one once, flagged). Layers:
  - a loop nested in the step with num_layers trips is a layer scan: a layer is one trip of it;
  - otherwise the layers are unrolled: the step's anchors (an op signature, preferably a custom call,
    that occurs exactly num_layers times in a chain: the paged attention kernel) cut the body into
    num_layers + 1 segments by how many anchors each kernel depends on. A segment between two anchors
    holds one layer's kernels (the post-attention half of layer l and the pre-attention half of l+1,
    with one attention call); the interior segments are checked to be identical, and one of them is
    "per layer". What is left (the first and last segments less one layer: embedding, sampling,
    bookkeeping, and how the first and last layers fuse differently) is "non-layer"; a negative
    count there means an end layer launches fewer kernels of that kind than an interior one.
Kinds come from the opcode, the fusion kind (kLoop/kInput/kOutput/kCustom), the fusion's backend kind
(`__triton_nested_gemm_fusion`, `__triton`) or custom_call_target, and the root of the fused
computation (scatter, dynamic-update-slice). Each kernel of one layer is listed with the ops inside
its fused computation and a guessed role (a heuristic on those ops and the shapes: check it against
the inner ops printed beside it).
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))  # gpu_check, plan_accuracy
sys.path.insert(0, str(REPO))

from jaxrl4llm.plan.hlo_cost import (COLLECTIVES, Computation, Instruction, instruction_attr, instruction_operands,
                                     kernel_launches)

_NOT_INNER = ("parameter", "bitcast", "constant", "get-tuple-element", "tuple", "fusion")
_GEMM_BACKEND = ("__triton_gemm", "__triton_nested_gemm_fusion", "__cublas", "__cudnn")
_DIMS = re.compile(r"\b[a-z]+\d*\[([\d,]*)\]")


# ---------------------------------------------------------------------------- the program
def build_config(model: str, root: Path):
    """gpu_check's step run of `model` (a key of gpu_check.MODELS["gpu"]) on the study's recipe."""
    from gpu_check import step_overrides
    from plan_accuracy import CONFIG_FILES

    from jaxrl4llm.train.config import load_config

    return load_config(CONFIG_FILES, step_overrides("gpu", model, root))


def decode_hlo(cfg, topology: str) -> tuple[str, dict]:
    """The optimized HLO of the sampler's decode program of `cfg` compiled for `topology`, and the
    sampler's settings (slots, burst, attention kernel)."""
    from jaxrl4llm.plan.programs import plan_run

    plan = plan_run(cfg, topology, sampler_only=True, log=lambda line: print(line, file=sys.stderr, flush=True))
    program = next(p for p in plan.programs if p.name == "sampler/decode")
    if not program.fits or not program.hlo:
        raise SystemExit(f"sampler/decode did not compile for {topology}: {program.failure or 'no HLO'} {program.error}")
    decode = plan.decode or {}
    return program.hlo, {k: str(getattr(v, "value", v)) for k, v in decode.items() if k in ("engine", "slots", "burst", "attention",
                                                                        "page_size", "q_heads", "kv_heads")}


# ---------------------------------------------------------------------------- kernels
def dims(shape: str) -> list[list[int]]:
    return [[int(d) for d in m.split(",") if d] for m in _DIMS.findall(shape)]


def short_shape(shape: str) -> str:
    return re.sub(r"\{[^}]*\}", "", shape)[:48]


def call_target(inst: Instruction) -> str:
    m = re.search(r'custom_call_target="([^"]*)"', inst.rest)
    return m.group(1) if m else ""


def backend_kind(inst: Instruction) -> str:
    m = re.search(r'"fusion_backend_config":\{"kind":"([^"]+)"', inst.rest)
    return m.group(1) if m else ""


def fused(comps: dict[str, Computation], inst: Instruction) -> Computation | None:
    return comps.get(instruction_attr(inst.rest, "calls") or "") if inst.opcode == "fusion" else None


def inner_ops(comps: dict[str, Computation], comp: Computation | None, depth: int = 0) -> collections.Counter:
    """The ops of a fused computation (nested fusions included), bookkeeping left out."""
    out = collections.Counter()
    if comp is None or depth > 4:
        return out
    for inst in comp.instructions.values():
        if inst.opcode == "fusion":
            out += inner_ops(comps, fused(comps, inst), depth + 1)
        elif inst.opcode not in _NOT_INNER:
            out[inst.opcode] += 1
    return out


def root_ops(comp: Computation | None) -> set[str]:
    """Opcodes of a fused computation's root (each output of a multi-output fusion), through bitcasts."""
    if comp is None:
        return set()
    root = next((line for line in comp.lines if line.lstrip().startswith("ROOT ")), "")
    m = re.match(r"\s*ROOT %?([\w.\-]+) =", root)
    names = [m.group(1)] if m else []
    if names and comp.instructions[names[0]].opcode == "tuple":
        names = instruction_operands(comp.instructions[names[0]].rest)
    out = set()
    for name in names:
        inst = comp.instructions.get(name)
        while inst is not None and inst.opcode == "bitcast":
            inst = comp.instructions.get(instruction_operands(inst.rest)[0])
        if inst is not None:
            out.add(inst.opcode)
    return out


def kind_of(comps: dict[str, Computation], inst: Instruction) -> str:
    op, target = inst.opcode, call_target(inst)
    if op.removesuffix("-start") in COLLECTIVES:
        return "collective"
    if op == "custom-call":
        if any(k in target.lower() for k in ("cublas", "gemm", "matmul")):
            return "gemm (cublas custom call)"
        if "triton" in target:
            return "triton custom call (attention)"
        return f"custom call {target}"
    if op == "fusion":
        comp, fkind, bkind = fused(comps, inst), instruction_attr(inst.rest, "kind") or "", backend_kind(inst)
        ops, roots = inner_ops(comps, comp), root_ops(comp)
        if bkind.startswith(_GEMM_BACKEND) or "dot" in ops and (instruction_attr(inst.rest, "calls") or "").startswith("gemm"):
            return "gemm fusion"
        if "scatter" in roots:
            return "scatter fusion"
        if "dynamic-update-slice" in roots:
            return "dynamic-update-slice fusion"
        if ops and set(ops) <= {"copy", "transpose", "reshape"}:
            return "copy/transpose fusion"
        if "convert" in ops and set(ops) <= {"convert", "reshape", "broadcast"}:
            return "convert fusion"
        if fkind == "kCustom":
            return f"triton fusion ({bkind or 'custom'})" if "triton" in bkind else f"custom fusion ({bkind})"
        return {"kLoop": "loop fusion", "kInput": "input (reduction) fusion",
                "kOutput": "output fusion"}.get(fkind, f"fusion {fkind}")
    if op in ("dot", "convolution"):
        return "gemm (unfused dot)"
    if op in ("copy", "copy-start"):
        return "copy"
    if op in ("convert", "scatter", "dynamic-update-slice"):
        return op
    return f"other ({op})"


def gemm_role(comps, inst, config, rows: int) -> str:
    """q/k/v, o, gate/up, down or LM-head projection, read from the dot's contraction and output sizes."""
    comp = fused(comps, inst)
    dot = None
    stack = [comp] if comp else []
    while stack and dot is None:
        c = stack.pop()
        for i in c.instructions.values():
            if i.opcode == "dot":
                dot = (c, i)
                break
            if i.opcode == "fusion" and fused(comps, i):
                stack.append(fused(comps, i))
    if dot is None:
        return "GEMM"
    c, d = dot
    lhs = c.instructions.get(instruction_operands(d.rest)[0])
    ldims = dims(lhs.shape)[0] if lhs is not None and dims(lhs.shape) else []

    def indices(key):
        m = re.search(key + r"=\{([\d,]*)\}", d.rest)
        return [int(x) for x in m.group(1).split(",") if x] if m else []

    k = math.prod(ldims[i] for i in indices("lhs_contracting_dims") if i < len(ldims))
    b = math.prod(ldims[i] for i in indices("lhs_batch_dims") if i < len(ldims))
    out = math.prod(dims(inst.shape)[0]) if dims(inst.shape) else 0
    n = out // max(rows * b, 1)
    splits = f", {b} f32 partials summed by the next kernel" if b > 1 else ""
    names = {((config.num_heads + 2 * config.num_kv_heads) * config.head_dim, config.hidden_size): "q/k/v projection",
             (config.hidden_size, config.num_heads * config.head_dim): "o projection",
             (2 * config.intermediate_size, config.hidden_size): "gate/up projection",
             (config.hidden_size, config.intermediate_size): "down projection",
             (config.vocab_size, config.hidden_size): "LM head"}
    role = names.get((n, k * b), "GEMM")
    return f"{role} ({k * b} -> {n}{splits})"


def describe(comps, inst, kind: str, config, rows: int, in_layer: bool = True) -> str:
    """A guess at what a kernel does, from its kind, result shape and the ops inside it (the rules
    for the attention combine, SiLU, q's RoPE and the residual add only for a layer's kernels)."""
    if kind.startswith("gemm"):
        return gemm_role(comps, inst, config, rows)
    if kind.startswith("triton custom call"):
        parts = dims(inst.shape)
        splits = f", {parts[0][0]} KV splits" if len(parts) == 3 and parts[0] else ""
        return f"paged decode attention (partial O, max, sum per split{splits})"
    ops = inner_ops(comps, fused(comps, inst))
    shape = dims(inst.shape)[0] if dims(inst.shape) else []
    rope = {"negate", "concatenate", "multiply", "slice"} <= set(ops)
    if kind == "scatter fusion":
        size = math.prod(shape) if shape else 0
        if size >= rows * config.head_dim * config.num_kv_heads * 16:
            return "KV write: scatter of this step's k, v into the page pool" + (" (RoPE on k inside)" if rope else "")
        return f"scatter (sampler bookkeeping, {short_shape(inst.shape)})"
    if "rsqrt" in ops:
        what = "RMSNorm"
        if len(shape) >= 2 and shape[-1] == config.head_dim:
            what = {config.num_heads: "q RMSNorm", config.num_kv_heads: "k RMSNorm"}.get(shape[-2], "per-head RMSNorm")
        extra_reduce, extra_add = ops["reduce"] - 1, ops["add"] - 1
        pre = []
        if extra_add > 0 and (not shape or shape[-1] == config.hidden_size):
            pre.append("residual add")
        if extra_reduce > 0:
            pre.append("sum of split-K partials")
        convert = " -> bf16" if "convert" in ops else ""
        return " + ".join(pre + [what]) + convert
    if {"sine", "cosine"} & set(ops):
        return "RoPE table (cos/sin of positions)"
    if kind in ("convert fusion", "convert"):
        return "convert"
    if kind.startswith("copy"):
        return "copy"
    if not in_layer:
        if "gather" in ops and shape and shape[-1] == config.hidden_size:
            return "embedding gather"
        return "ops: " + " ".join(sorted(ops))[:60]
    if ("logistic" in ops or {"negate", "exponential", "divide"} <= set(ops)) and "multiply" in ops:
        return "SiLU(gate) * up" + (" -> bf16" if "convert" in ops else "")
    if "pad" in ops and rope:
        return "RoPE on q + pad of the query group to the kernel's rows" + (" -> bf16" if "convert" in ops else "")
    if "exponential" in ops and "reduce" in ops and "divide" not in ops:
        return "split-KV combine: max over splits, exp rescale weights"
    if "divide" in ops and "reduce" in ops and "convert" in ops:
        return "split-KV combine: weighted sum / normalizer -> bf16"
    if set(ops) <= {"reduce", "add", "broadcast", "reshape"} and "reduce" in ops and shape and \
            shape[-1] == config.hidden_size:
        return "residual add (x + split-K sums of o and down)"
    return "ops: " + " ".join(sorted(ops))[:60]


def kernels_of(comp: Computation) -> list[Instruction]:
    """The top-level ops of `comp` that launch a kernel (`hlo_cost.kernel_launches`' rule)."""
    from jaxrl4llm.plan.hlo_cost import _NO_KERNEL

    return [i for i in comp.instructions.values() if i.opcode not in _NO_KERNEL and not i.opcode.endswith("-done")]


def signature(comps, inst: Instruction) -> tuple:
    """What identifies a kernel across layers: op, fusion and backend kinds, shapes in and out, inner ops."""
    comp = fused(comps, inst)
    ops = inner_ops(comps, comp)
    params = tuple(sorted((i.rest, short_shape(i.shape)) for i in comp.instructions.values()
                          if i.opcode == "parameter")) if comp else ()
    return (inst.opcode, instruction_attr(inst.rest, "kind") or "", backend_kind(inst),
            call_target(inst), short_shape(inst.shape), params, tuple(sorted(ops.items())))


def base_name(inst: Instruction) -> str:
    name = instruction_attr(inst.rest, "calls") or call_target(inst) or inst.opcode
    return re.sub(r"(\.\d+)+(_computation)?$", "", name)


# ---------------------------------------------------------------------------- layers
def anchor_depths(comps, body: Computation, num_layers: int):
    """(anchor signature, {instruction: how many anchors it depends on}): the anchors are the ops of a
    signature that occurs num_layers times in the body in a chain (a custom call preferred)."""
    kernels = kernels_of(body)
    counts = collections.Counter(signature(comps, i) for i in kernels)
    candidates = sorted((sig for sig, n in counts.items() if n == num_layers),
                        key=lambda sig: (sig[0] != "custom-call", sig[0] != "fusion"))
    for sig in candidates:
        anchors = {i.name for i in kernels if signature(comps, i) == sig}
        depth = {}
        for inst in body.instructions.values():  # definition order: operands first
            depth[inst.name] = max([depth[o] + (o in anchors) for o in instruction_operands(inst.rest) if o in depth] or [0])
        if sorted(depth[a] for a in anchors) == list(range(num_layers)):  # a chain: anchor l depends on l anchors
            return sig, anchors, depth
    return None, set(), {}


def add(counter: collections.Counter, kernels, key) -> collections.Counter:
    for inst in kernels:
        counter[key(inst)] += 1
    return counter


def analyze(hlo: str, config, rows: int) -> dict:
    from jaxrl4llm.plan.programs import decode_loops

    comps, loops, _, inner = decode_loops(hlo)
    if not inner:
        raise SystemExit("no burst loop inside a refill loop: not the continuous engine's decode program?")
    step = inner[-1]
    body = comps[step.body]
    nl = config.num_layers
    kind = lambda inst: kind_of(comps, inst)
    nested = []  # loops run inside one decode step: (loop, trips counted, kernels of a trip)
    under = {step.body}
    for loop in loops:
        if loop.parent in under:
            under.add(loop.body)
            trips = loop.trips if loop.trips is not None else 1.0
            nested.append((loop, trips, kernel_launches(comps[loop.body]) + kernel_launches(comps[loop.condition])))
    layer_loop = next((loop for loop, trips, _ in nested if loop.parent == step.body and loop.trips == nl), None)

    step_kinds = add(collections.Counter(), kernels_of(body), kind)
    for loop, trips, _ in nested:
        for comp in (comps[loop.body], comps[loop.condition]):
            for k, v in add(collections.Counter(), kernels_of(comp), kind).items():
                step_kinds[k] += trips * v
    result = dict(step_loop=dict(name=step.name, body=step.body, condition=step.condition,
                                 condition_kernels=kernel_launches(comps[step.condition])),
                  nested_loops=[dict(name=loop.name, parent=loop.parent, trips=loop.trips, kernels_per_trip=k)
                                for loop, _, k in nested],
                  hlo_cost_kernel_launches_of_body=kernel_launches(body))
    if layer_loop is not None:  # a layer scan: one trip is one layer
        layer_comps = [comps[layer_loop.body], comps[layer_loop.condition]]
        layer_kernels = [i for c in layer_comps for i in kernels_of(c)]
        result["layers"] = f"scanned: loop {layer_loop.name} runs {nl} trips, one per layer"
        identical = True
    else:
        sig, anchors, depth = anchor_depths(comps, body, nl)
        if sig is None:
            raise SystemExit(f"no op occurs {nl} times in a chain in the step body: cannot cut it into layers")
        segments = collections.defaultdict(list)
        for inst in kernels_of(body):
            segments[depth[inst.name]].append(inst)
        interior = [segments[s] for s in range(1, nl)]
        multisets = [collections.Counter(signature(comps, i) for i in seg) for seg in interior]
        identical = all(m == multisets[0] for m in multisets)
        layer_kernels = interior[len(interior) // 2] if interior else []
        result["layers"] = (f"unrolled: no loop over layers in the step; the body is cut at its {nl} "
                            f"'{base_name(next(i for i in kernels_of(body) if i.name in anchors))}' ops "
                            f"({sig[0]}); segment sizes {[len(segments[s]) for s in range(nl + 1)]}; "
                            f"the {nl - 1} interior segments {'are' if identical else 'are NOT'} identical")
        roles = {signature(comps, i): describe(comps, i, kind(i), config, rows) for i in layer_kernels}
        result["end_segments"] = [dict(name=i.name, kind=kind(i), fused=base_name(i), shape=short_shape(i.shape),
                                       inner=dict(inner_ops(comps, fused(comps, i))),
                                       role=(f"(layer {0 if s == 0 else nl - 1}) " + roles[signature(comps, i)])
                                       if signature(comps, i) in roles else
                                       describe(comps, i, kind(i), config, rows, in_layer=False))
                                  for s in (0, nl) for i in segments[s]]
    layer_kinds = add(collections.Counter(), layer_kernels, kind)
    shown = ("copy", "convert", "dynamic-update-slice fusion", "collective")  # listed even at 0: their absence is news
    kinds = sorted(set(step_kinds) | set(layer_kinds) | set(shown), key=lambda k: (-step_kinds[k], k))
    table = [dict(kind=k, per_step=step_kinds[k], per_layer=layer_kinds[k], non_layer=step_kinds[k] - nl * layer_kinds[k])
             for k in kinds]
    total = sum(step_kinds.values())
    result.update(
        num_layers=nl, interior_layers_identical=identical, kernels_per_step=total,
        kernels_per_layer=len(layer_kernels), non_layer_kernels=total - nl * len(layer_kernels), table=table,
        layer_fused_computations=dict(collections.Counter(base_name(i) for i in layer_kernels).most_common()),
        layer_kernels=[dict(name=i.name, kind=kind(i), fused=base_name(i), shape=short_shape(i.shape),
                            inner=dict(inner_ops(comps, fused(comps, i))),
                            role=describe(comps, i, kind(i), config, rows)) for i in layer_kernels],
        checks=dict(
            kinds_times_layers_plus_non_layer=sum(r["per_layer"] * nl + r["non_layer"] for r in table) == total,
            total_equals_hlo_cost_kernel_launches=(total == kernel_launches(body) + sum(t * k for _, t, k in nested)),
            data_dependent_nested_loops_counted_once=[loop.name for loop, _, _ in nested if loop.trips is None]))
    return result


# ---------------------------------------------------------------------------- report
def report(r: dict, meta: dict) -> str:
    nl = r["num_layers"]
    lines = [f"{meta['model']} on {meta['topology']}: {meta['rows']} rows on {meta['sampler'].get('slots')} slots, "
             f"response {meta['response']}, attention {meta['sampler'].get('attention')}",
             f"decode step = one trip of {r['step_loop']['name']} (body {r['step_loop']['body']}); "
             f"+{r['step_loop']['condition_kernels']} kernels in its condition per step (not below)",
             f"nested loops in the step: {r['nested_loops'] or 'none'}", f"layers: {r['layers']}", "",
             f"{'kind':<36} {'per step':>9} {'per layer':>9} {'non-layer':>9}"]
    for row in r["table"]:
        lines.append(f"{row['kind']:<36} {row['per_step']:>9g} {row['per_layer']:>9g} {row['non_layer']:>9g}")
    lines += [f"{'total':<36} {r['kernels_per_step']:>9g} {r['kernels_per_layer']:>9g} {r['non_layer_kernels']:>9g}"
              f"   ({r['kernels_per_layer']} x {nl} + {r['non_layer_kernels']}; hlo_cost.kernel_launches(body) "
              f"= {r['hlo_cost_kernel_launches_of_body']})",
              f"checks: {r['checks']}", "", "one layer's kernels (an interior segment: attention, then the rest of "
              "that layer and the pre-attention part of the next):"]
    for k in r["layer_kernels"]:
        inner = " ".join(f"{op}{'x' + str(n) if n > 1 else ''}" for op, n in k["inner"].items())
        lines.append(f"  {k['kind']:<28} {k['fused']:<26} {k['shape']:<30} {k['role']}")
        if inner:
            lines.append(f"      inner: {inner[:150]}")
    lines.append("fused computations per layer: " + ", ".join(f"{n} x{c}" for n, c in r["layer_fused_computations"].items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    from gpu_check import MODELS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b", choices=sorted(MODELS["gpu"]))
    parser.add_argument("--topology", default="h100:1")
    parser.add_argument("--json", type=Path, help="write the table and the layer's kernels here")
    parser.add_argument("--save-hlo", type=Path, help="write the decode program's optimized HLO here")
    parser.add_argument("--load-hlo", type=Path, help="analyze this HLO instead of compiling (a --save-hlo file)")
    parser.add_argument("--verbose", action="store_true", help="also list the first and last segments' kernels")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = build_config(args.model, Path(tmp) / "run")
        from jaxrl4llm.plan.programs import plan_model_config

        config = plan_model_config(cfg)
        if args.load_hlo:
            hlo, sampler = args.load_hlo.read_text(), {"slots": cfg.rollout.slots}
        else:
            hlo, sampler = decode_hlo(cfg, args.topology)
    if args.save_hlo:
        args.save_hlo.write_text(hlo)
    rows = cfg.rollout.prompts_per_step * cfg.rollout.samples_per_prompt
    meta = dict(model=args.model, topology=args.topology, rows=rows, response=cfg.rollout.max_new_tokens,
                sampler=sampler, compile_and_analysis_s=None)
    r = analyze(hlo, config, int(cfg.rollout.slots) if str(cfg.rollout.slots).isdigit() else rows)
    meta["compile_and_analysis_s"] = round(time.perf_counter() - start, 1)
    print(report(r, meta))
    if args.verbose:
        print("first and last segments (embedding, layer 0's pre-attention, layer L-1's post-attention, sampling):")
        for k in r.get("end_segments", []):
            print(f"  {k['kind']:<28} {k['fused']:<30} {k['shape']:<34} {k['role']}")
    print(f"wall {meta['compile_and_analysis_s']} s")
    if args.json:
        args.json.write_text(json.dumps(dict(meta, **r), indent=1, default=str))
    ok = all(v is True for k, v in r["checks"].items() if k != "data_dependent_nested_loops_counted_once")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""The meter: XLA's HLO cost with every loop trip counted (`plan.hlo_cost`), the length
distribution as an input (`train.response_lengths`, `plan.decode_work`), and a step model that
scales as the programs do."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxrl4llm.plan import hlo_cost
from jaxrl4llm.plan.chips import ChipSpec
from jaxrl4llm.plan.hlo_cost import (_xla_cost, compiled_hlo_text, find_conditionals, kernel_launches, meter_notice,
                                     op_bytes, parsable_hlo, parse_module, private_meter_problem, program_cost)
from jaxrl4llm.plan.decode_work import decode_block_trips, static_decode_work
from jaxrl4llm.plan.programs import ProgramPlan, plan_run, topology_mesh, with_lengths
from jaxrl4llm.train.config import ConfigError, load_config
from jaxrl4llm.train.metrics import write_lengths
from jaxrl4llm.train.response_lengths import LengthDistribution, parse_lengths

from tests.plan.conftest import TINY


def _chain(n: int, unrolled: bool):
    """n matmul + tanh layers (scanned, or a Python loop XLA sees whole), and the gradient."""
    def forward(x, w):
        if unrolled:
            for i in range(n):
                x = jnp.tanh(x @ w[i])
            return x.sum()
        return jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)[0].sum()

    return jax.jit(jax.grad(forward, argnums=(0, 1)))


_PREFETCHED = """HloModule prefetched, is_scheduled=true

ENTRY %main (w: f32[128,128], x: f32[128,128]) -> f32[128,128] {
  %w = f32[128,128]{1,0:T(8,128)} parameter(0)
  %x = f32[128,128]{1,0:T(8,128)} parameter(1)
  %cs = (f32[128,128]{1,0:T(8,128)S(1)}, f32[128,128]{1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%w)
  %cd = f32[128,128]{1,0:T(8,128)S(1)} copy-done(%cs)
  ROOT %y = f32[128,128]{1,0:T(8,128)} dot(%x, %cd), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_a_weight_prefetched_on_chip_is_read_from_hbm_once():
    """y = x w with w first copied into on-chip memory (S(1), as TPU memory-space assignment
    does; T(8,128): TPU tiles): XLA's cost analysis counts w's 64 KiB seven times over (copy-start operand and
    results, copy-done, the dot); the meter counts what moves to and from HBM: read w once (the
    copy), read x, write y = 3 arrays, the same as the dot reading w from HBM directly."""
    plain = _PREFETCHED.replace("%cd)", "%w)").replace("prefetched", "plain")
    plain = "\n".join(line for line in plain.splitlines() if "copy-" not in line)
    array = 128 * 128 * 4
    assert _xla_cost(_PREFETCHED)["bytes accessed"] == pytest.approx(7 * array, rel=1e-3)
    assert program_cost(_PREFETCHED, num_devices=1).hbm_bytes == pytest.approx(3 * array, rel=1e-3)
    assert program_cost(plain, num_devices=1).hbm_bytes == pytest.approx(3 * array)


@pytest.mark.parametrize("n", [1, 6])
def test_a_scan_costs_what_the_unrolled_program_costs(n):
    """XLA's own cost_analysis counts a scan body once (the same flops for n = 1 and 6): the meter
    counts it n times and agrees with the unrolled program, where XLA sees every layer."""
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    w = jax.ShapeDtypeStruct((n, 256, 256), jnp.float32)
    scanned = _chain(n, unrolled=False).lower(x, w).compile()
    unrolled = _chain(n, unrolled=True).lower(x, w).compile()
    cost = program_cost(compiled_hlo_text(scanned), num_devices=1)
    truth = unrolled.cost_analysis()
    assert cost.flops == pytest.approx(truth["flops"], rel=0.02)
    matmuls = 3 * n  # forward, weight gradient, input gradient
    assert matmuls * 2 * 64 * 256 * 256 <= cost.flops <= 1.1 * matmuls * 2 * 64 * 256 * 256
    if n > 1:
        assert cost.once_counted_flops < cost.flops / 2  # what cost_analysis() alone reports
        assert sorted(loop.trips for loop in cost.loops) == [n, n]  # the forward and backward scans


def test_tpu_loops_are_counted_from_their_condition():
    """XLA's TPU HLO carries no known_trip_count: the meter reads `i < N` from the condition,
    nested loops multiply, and a sharded matmul's all-reduce is counted per trip."""
    mesh = topology_mesh("v5e:2x2", 1, 4, 1)

    def f(x, w):
        def layer(c, wi):
            return jax.lax.scan(lambda c2, _: (jnp.tanh(c2 @ wi), None), c, None, length=3)[0], None
        return jax.lax.scan(layer, x, w)[0].sum()

    costs = {}
    for n in (1, 2, 4):
        x = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "fsdp")))
        w = jax.ShapeDtypeStruct((n, 1024, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "fsdp")))
        with jax.set_mesh(mesh):
            compiled = jax.jit(f).lower(x, w).compile()
        costs[n] = program_cost(compiled_hlo_text(compiled), num_devices=4)
    matmul = 2 * 512 * 1024 * 1024 / 4 * 3  # per chip, 3 inner steps
    assert costs[1].flops == pytest.approx(matmul, rel=0.05)
    assert costs[4].flops == pytest.approx(4 * costs[1].flops, rel=0.02)
    for key in ("collectives", "collective_bytes"):  # linear in the trips: c(4) - c(2) = 2 (c(2) - c(1)) > 0
        c = {n: getattr(cost, key) for n, cost in costs.items()}
        assert c[4] - c[2] == pytest.approx(2 * (c[2] - c[1]), rel=0.02) and c[2] - c[1] > 0, key


@pytest.mark.parametrize("weight_grad", ["auto", "ragged_dot"])
def test_the_moe_backward_on_tpu_runs_each_experts_rows_once(weight_grad):
    """The ragged form's forward and backward compiled for TPU (one v5e chip). XLA:TPU's grouped
    matmuls and megablox's tgmm are custom calls that declare their FLOPs (XLA's generic cost
    analysis counts them as 0): the meter reads them and agrees with XLA:TPU's own count. With the
    weight gradient on TPU's choice (tgmm) the program costs its 8-9 useful matmuls (input gradients
    of gate and up may merge). JAX's transpose of ragged_dot, forced, is a dense dot over all E
    experts with libtpu 0.0.42.1 (jax 0.10.2's: E/3 x the FLOPs and more); libtpu 0.0.50.1 (jax
    0.12's) compiles it as a grouped matmul too."""
    from jax.sharding import Mesh

    from jaxrl4llm.models.layers.moe import Experts, expert_ffn, grouped_matmul
    from jaxrl4llm.plan.programs import topology_devices

    mesh = Mesh(np.array(topology_devices("v5e:2x2")[:1]).reshape(1), ("data",))
    tokens, k, experts, d, width = 256, 2, 16, 256, 128
    sds = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))

    def loss(x, weights, ids, w):
        if weight_grad == "auto":
            return jnp.sum(expert_ffn(x, ids, w, weights, "ragged_dot", jnp.bfloat16))
        sizes = jnp.bincount(ids.reshape(-1), length=experts).astype(jnp.int32)  # as if the rows were sorted
        xs = jnp.repeat(x, k, axis=0)
        mm = lambda a, b: grouped_matmul(a, b, sizes, jnp.bfloat16, "ragged_dot")
        return jnp.sum(mm(jax.nn.silu(mm(xs, weights.gate)) * mm(xs, weights.up), weights.down))

    args = (sds(tokens, d), Experts(sds(experts, d, width), sds(experts, d, width), sds(experts, width, d)),
            sds(tokens, k, dtype=jnp.int32), sds(tokens, k, dtype=jnp.float32))
    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
    text = compiled_hlo_text(compiled)
    matmul = 2 * tokens * k * d * width  # one expert matmul over the routed rows
    flops = program_cost(text, num_devices=1).flops
    assert flops == pytest.approx(compiled.cost_analysis()["flops"], rel=1e-3)
    if weight_grad == "auto":
        assert text.count("jit_tgmm") >= 3  # one tgmm a weight
        assert 8 * matmul <= flops <= 9.5 * matmul
    else:
        dense = flops > experts / 3 * 9 * matmul
        assert dense if jax.__version__.startswith("0.10.") else (dense or flops <= 9.5 * matmul), flops / matmul


def test_a_conditional_costs_the_branch_it_runs_as_often_as_it_runs():
    """XLA's cost analysis counts a conditional as the max over its branches, a loop inside a branch
    once and its collectives not at all. The meter weights each branch by how often it runs
    (`branch_weights`), its loops by their trips, and counts its collectives (TPU compile)."""
    mesh = topology_mesh("v5e:2x2", 1, 4, 1)

    def f(p, n, x, w):
        heavy = lambda x: jax.lax.fori_loop(0, n, lambda i, c: jnp.tanh(c @ w), x)
        return jax.lax.cond(p, heavy, lambda x: x + 1, x).sum()

    x = jax.ShapeDtypeStruct((512, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "fsdp")))
    w = jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("fsdp", None)))
    with jax.set_mesh(mesh):
        hlo = compiled_hlo_text(jax.jit(f).lower(True, 3, x, w).compile())
    [cond] = find_conditionals(parse_module(hlo))
    assert len(cond.branches) == 2
    cost = lambda trips, weights=None: program_cost(hlo, num_devices=4, dynamic_trips=[trips],
                                                    branch_weights=None if weights is None else {cond.name: weights})
    by_flops = sorted((cost(1.0, [1.0 * (i == j) for j in range(2)]).flops, i) for i in range(2))
    light, heavy = by_flops[0][1], by_flops[1][1]
    runs = lambda share: [share if i == heavy else 1 - share for i in range(2)]
    matmul = 2 * 512 * 1024 * 1024 / 4  # per chip
    assert cost(1.0).flops == cost(1.0, runs(1.0)).flops  # unnamed: the heaviest branch, every time
    assert cost(1.0).flops == pytest.approx(matmul, rel=0.05)
    assert cost(3.0, runs(1.0)).flops == pytest.approx(3 * matmul, rel=0.05)  # the loop's trips inside the branch
    assert cost(3.0, runs(0.0)).flops < matmul / 100  # the light branch every time
    mixed = cost(3.0, runs(0.25))  # a quarter of the runs take the heavy branch: linear in the shares
    for key in ("flops", "hbm_bytes", "collective_bytes", "collectives"):
        want = 0.25 * getattr(cost(3.0, runs(1.0)), key) + 0.75 * getattr(cost(3.0, runs(0.0)), key)
        assert getattr(mixed, key) == pytest.approx(want, rel=1e-9), key
    c = {n: cost(n, runs(1.0)).collectives for n in (1.0, 3.0)}  # one per matmul, in the branch's loop
    assert c[3.0] - c[1.0] == pytest.approx(2 * (c[1.0] - cost(1.0, runs(0.0)).collectives)) and c[3.0] > c[1.0]
    with pytest.raises(ValueError, match="names no conditional"):
        program_cost(hlo, num_devices=4, branch_weights={"no-such-conditional": [1.0, 0.0]})


_LOOP = """HloModule loop, is_scheduled=true

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  %y = f32[8]{0} exponential(%x)
  %z = f32[8]{0} tanh(%y)
  ROOT %t = (s32[], f32[8]{0}) tuple(%j, %z)
}

%cond (q: (s32[], f32[8])) -> pred[] {
  %q = (s32[], f32[8]{0}) parameter(0)
  %k = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%k, %n), direction=LT
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %b = f32[8]{0} negate(%a)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%zero, %b)
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[8]{0} get-tuple-element(%w), index=1
}
"""


def test_kernel_launches_count_every_top_level_op_as_often_as_it_runs():
    """A GPU launches each top-level op of the entry, and of a loop's body and condition on every
    trip (bookkeeping ops and control flow launch nothing; an async pair launches once): here 1 +
    5 x (3 + 1), on the private meter and on the public fallback alike."""
    comps = parse_module(_LOOP)
    assert [kernel_launches(comps[c]) for c in ("main", "body", "cond")] == [1, 3, 1]
    assert kernel_launches(parse_module(_ASYNC_HALF)["main"]) == 1  # slice-start launches, slice-done does not
    assert program_cost(_LOOP, num_devices=1).kernels == 1 + 5 * (3 + 1)


def test_kernel_launches_price_a_gpu_program_and_can_bind_it():
    """`ChipSpec.kernel_seconds` x kernels adds to a program's time (0 on TPU and CPU chips), and a
    program whose launches outweigh its compute and HBM time is launch-bound (docs/gpu.md, a decode step)."""
    cost = program_cost(_LOOP, num_devices=1)
    for kernel_seconds, binding in ((0.0, "HBM"), (1e-3, "launches")):
        program = ProgramPlan("loop", True)
        program.price(cost, ChipSpec(1e9, 1e12, 1e9, 1e9, kernel_seconds=kernel_seconds))
        assert program.launch_seconds == pytest.approx(21 * kernel_seconds)
        assert program.seconds == pytest.approx(max(program.compute_seconds, program.memory_seconds)
                                                + program.launch_seconds)
        assert program.binding == binding


@pytest.fixture(scope="module")
def plans():
    """The tiny run with padded trainer rows (2 layers, 4 prompts) and the trainer of one with 8 layers
    and 8 prompts (twice the micro-batches; its sampler is not compared)."""
    padded = TINY + ["trainer.packing=false"]  # [P + R - 1] positions a row: the meter's scaling is exact there
    small = plan_run(load_config(None, padded), "v5e:2x2", lengths="fixed")
    big = plan_run(load_config(None, padded + ["model.num_layers=8", "rollout.prompts_per_step=8"]), "v5e:2x2",
                   lengths="fixed", trainer_only=True)
    return small, big


def _program(plan, name):
    return next(p for p in plan.programs if p.name == name)


def test_layers_and_micro_batches_scale_the_trainer_programs(plans):
    """4x the layers and 2x the micro-batches: 8x the update's and the log-prob pass's flops
    (within 10%), and each within 20% of our 2N / 6N count."""
    small, big = plans
    for name in ("update", "logprob pass"):
        s, b = _program(small, name), _program(big, name)
        assert b.flops == pytest.approx(8 * s.flops, rel=0.1), name
        for p in (s, b):
            # XLA's count (the attention kernel's blocks, T padded to the kernel's block, are added apart)
            assert p.flops - p.kernel_flops == pytest.approx(p.model_flops, rel=0.2), (name, p.flops, p.model_flops)
            assert p.once_counted_flops < 0.6 * p.flops  # the layer and micro-batch loops count once there


def test_decode_steps_scale_the_sampler_and_the_step_figures_follow(plans):
    """Twice the decode steps: twice the decode loop's cost (re-priced without a compile); the
    step time, tokens/s/chip, useful MFU and padding follow from the programs."""
    small, _ = plans
    at = {n: with_lengths(small, f"fixed:{n}") for n in (1, 17, 33)}
    decode = {n: _program(p, "sampler/decode") for n, p in at.items()}
    loop_17, loop_33 = decode[17].flops - decode[1].flops, decode[33].flops - decode[1].flops
    assert loop_33 == pytest.approx(2 * loop_17, rel=0.1)
    assert decode[33].hbm_bytes - decode[1].hbm_bytes == pytest.approx(2 * (decode[17].hbm_bytes - decode[1].hbm_bytes),
                                                                       rel=0.1)
    assert decode[17].loops and all(trips is not None for _, trips in decode[17].loops)  # every block loop priced
    assert decode[17].padding_fraction == pytest.approx(0)
    plan = at[33]
    assert plan.step_seconds == pytest.approx(sum(p.seconds * p.runs for p in plan.programs))
    assert plan.generated_tokens_per_second_per_chip == pytest.approx(plan.rows * 33 / plan.step_seconds / 4)
    assert 0 < plan.useful_mfu < 1
    # the trainer runs [P + R - 1] positions a row whatever the lengths: shorter responses are padding
    assert _program(at[1], "update").padding_fraction > _program(at[33], "update").padding_fraction > 0
    assert _program(at[1], "update").seconds == _program(at[33], "update").seconds


def test_plan_json_holds_the_meter_figures(capsys, tmp_path):
    from jaxrl4llm.cli import main as cli_main

    write_lengths(tmp_path, 1, [5, 9, 64, 12], [20, 20, 20, 20])
    write_lengths(tmp_path, 1, [7, 7, 7, 7])  # a resumed step's line replaces the earlier one
    assert cli_main(["plan", "--topology", "v5e:2x2", "--json", "--response-lengths", str(tmp_path), *TINY]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("step_seconds", "generated_tokens_per_second_per_chip", "useful_mfu", "padding_fraction"):
        assert out[key] > 0, key
    assert out["mean_response_tokens"] == pytest.approx(7)
    for p in out["programs"]:
        assert {"flops", "hbm_bytes", "collective_bytes", "seconds", "binding"} <= p.keys()
        assert p["binding"] in ("compute", "HBM", "collectives", "launches") and p["seconds"] > 0
        assert p["kernels"] > 0 and p["launch_seconds"] == 0  # counted; a TPU chip prices no launches
    assert "xla_mfu" not in json.dumps(out)
    assert out["meter"].startswith("hlo_cost:")  # the private path, not the coarser fallback


def test_the_private_entry_points_pass_their_self_check():
    """jaxlib's private cost analysis works on the jax of this interpreter, also when checked in a
    child process (what a jaxlib outside CHECKED_JAXLIB gets)."""
    assert private_meter_problem() is None and meter_notice() is None
    assert hlo_cost.self_check_problem() is None


_ASYNC_HALF = """HloModule dispatch, is_scheduled=true, num_partitions=4

ENTRY %main (p: f32[513,16,64]) -> f32[129,16,64] {
  %p = f32[513,16,64]{2,1,0:T(8,128)} parameter(0)
  %ss = ((f32[513,16,64]{2,1,0:T(8,128)}), f32[129,16,64]{2,1,0:T(8,128)S(1)}, s32[]{:S(2)}) slice-start(%p), slice={[0:129], [0:16], [0:64]}
  ROOT %sd = f32[129,16,64]{2,1,0:T(8,128)S(1)} slice-done(%ss)
}
"""


def test_the_done_half_of_an_async_op_is_never_probed_alone():
    """A `slice-done` fed by a parameter (not its slice-start) made jax 0.12's HLO parser crash the
    process (0.10.2 refused the text): op_bytes refuses to build that probe, the meter keeps XLA's count."""
    comps = parse_module(_ASYNC_HALF)
    comp = comps["main"]
    with pytest.raises(ValueError, match="async pair"):
        op_bytes("HloModule probe, is_scheduled=true", comps, comp, comp.instructions["sd"])


def test_an_async_collectives_aliasing_is_dropped_for_the_hlo_parser():
    """jax 0.12's GPU compiler prints `output_to_operand_aliasing` on an all-reduce-start that its
    own parser refuses (a tensor-parallel sampler on h100:2 failed to meter): the meter drops it
    there, and only there (a custom call keeps its aliasing)."""
    start = ("  %ars = ((f32[88]{0}), f32[88]{0}) all-reduce-start(%x), channel_id=9, to_apply=%add, "
             "output_to_operand_aliasing={{1}: (0, {})}, frontend_attributes={is_spmd_generated=\"true\"}")
    assert parsable_hlo(start) == start.replace(" output_to_operand_aliasing={{1}: (0, {})},", "")
    call = '  %c = f32[8]{0} custom-call(%x), custom_call_target="k", output_to_operand_aliasing={{}: (0, {})}'
    assert parsable_hlo(call) == call


def test_without_the_private_entry_points_the_meter_falls_back_to_cost_analysis(monkeypatch):
    """JAXRL4LLM_PLAN_METER=public (what a jax without working private entry points gets): the
    figures are the public cost_analysis() of the program (its scan body once), and the notice says so."""
    monkeypatch.setenv("JAXRL4LLM_PLAN_METER", "public")
    private_meter_problem.cache_clear()
    try:
        x = jax.ShapeDtypeStruct((64, 256), jnp.float32)
        compiled = _chain(4, unrolled=False).lower(x, jax.ShapeDtypeStruct((4, 256, 256), jnp.float32)).compile()
        cost = program_cost(compiled_hlo_text(compiled), num_devices=1)
        assert cost.flops == pytest.approx(compiled.cost_analysis()["flops"]) and cost.flops > 0
        assert sorted(loop.trips for loop in cost.loops) == [4, 4]
        assert program_cost(_LOOP, num_devices=1).kernels == 1 + 5 * (3 + 1)  # counted from the HLO either way
        assert "once" in meter_notice() and "JAXRL4LLM_PLAN_METER=public" in meter_notice()
        with pytest.raises(hlo_cost.PrivateMeterUnavailable):
            _xla_cost(_PREFETCHED)
    finally:
        monkeypatch.delenv("JAXRL4LLM_PLAN_METER")
        private_meter_problem.cache_clear()


def test_length_distributions():
    budget = 1000
    rng = np.random.default_rng(0)
    default = parse_lengths(None, budget)
    assert default.kind == "lognormal" and default.mean == 250
    draws = parse_lengths("lognormal:mean=100,sigma=0.5", budget).sample(200_000, budget, rng)
    assert draws.mean() == pytest.approx(100, rel=0.02) and draws.max() <= budget
    assert (parse_lengths("fixed", budget).sample(3, budget, rng) == budget).all()
    assert (parse_lengths("fixed:40", budget).sample(3, budget, rng) == 40).all()
    for bad, match in [("lognormal:mu=3", "unknown field 'mu'"), ("fixed:abc", "not a number"),
                       ("lognormal:mean=-1", "mean must be > 0"), ("/no/such/run", "not a distribution nor a run")]:
        with pytest.raises(ConfigError, match=match):
            parse_lengths(bad, budget)
    # a static batch runs until its longest row: 64 rows of mean 100 run far longer than 100 steps
    work = static_decode_work(parse_lengths("lognormal:mean=100,sigma=0.8", budget), 64, budget)
    assert work.steps > 2.5 * work.mean_length and 0.5 < work.idle_fraction < 0.9
    assert static_decode_work(LengthDistribution("fixed"), 8, budget).idle_fraction == 0
    trips = decode_block_trips([budget] * 3, 256, budget)
    assert trips == [256, 256, 256, 231] and sum(trips) == budget - 1
    assert decode_block_trips([100, 300], 256, budget) == [(99 + 256) / 2, 43 / 2, 0, 0]


def test_plan_for_this_cpu_measures_the_machine_and_adds_compute_and_memory():
    """`--topology cpu`: the same programs compiled for this machine, priced at its matmul peak and
    memory bandwidth measured now; compute and memory add up (XLA:CPU runs one op at a time).
    benchmarks/plan_accuracy.py checks the prediction against the measured 48M step."""
    plan = plan_run(load_config(None, TINY + ["mesh.fsdp=1", "trainer.packing=false"]), "cpu", lengths="fixed:40")
    assert plan.chip.peak_flops > 1e9 and plan.chip.hbm_bandwidth > 1e8 and not plan.chip.overlap
    for p in plan.programs:
        assert p.fits and p.seconds == pytest.approx(p.compute_seconds + p.memory_seconds)
    update = _program(plan, "update")
    assert update.flops == pytest.approx(update.model_flops, rel=0.2)

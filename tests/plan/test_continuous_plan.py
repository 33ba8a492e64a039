"""`plan` with the continuous sampler: its program compiled for a TPU target with the ragged paged
attention kernel, its data-dependent loops priced by the slot schedule at a length distribution,
the kernel's FLOPs and KV bytes added, the decode step's collectives reported; and the eval."""

import json
import re

import numpy as np
import pytest

from jaxrl4llm.models import ModelConfig
from jaxrl4llm.plan.decode_work import ContinuousWork, continuous_decode_work, static_decode_work
from jaxrl4llm.plan.programs import format_plan, plan_eval, plan_run, plan_to_dict, with_lengths
from jaxrl4llm.sampling.memory import tpu_moe_pool_copies
from jaxrl4llm.train.config import load_config
from jaxrl4llm.train.response_lengths import parse_lengths

from tests.plan.conftest import TINY  # noqa: E402


@pytest.fixture(scope="module")
def eval_plan():
    """The tiny run's evaluation (8 problems x 4 samples) on 16 slots of the continuous engine, compiled
    for v5e:2x2 with the sampler 2-way tensor parallel (head_dim 128: the kernel's lane width), top-k 10.
    Rows outnumber slots: each of the 2 row shards admits 2 prompts a batched prefill round (8 slots / 4
    samples), so a refill chooses between that and one-prompt rounds (`continuous.prefill_batch`)."""
    cfg = load_config(None, TINY + ["rollout.engine=continuous", "model.head_dim=128", "rollout.tensor_parallel=2",
                                    "trainer.eval_samples=4", "trainer.eval_temperature=0.6", "rollout.top_k=10",
                                    "rollout.slots=16"])
    return plan_eval(cfg, "v5e:2x2", problems=8)


def test_continuous_sampler_runs_the_paged_kernel_and_is_priced_by_its_schedule(eval_plan):
    decode = next(p for p in eval_plan.programs if p.name == "sampler/decode")
    assert [p.name for p in eval_plan.programs] == ["sampler/weights", "sampler/decode"] and decode.fits
    sm = eval_plan.sampler
    assert sm["engine"] == "continuous" and sm["attention"] == "tpu_ragged" and sm["slots"] == 16 <= sm["fitting_slots"]
    assert "ragged_paged_attention" in decode.hlo and decode.runs == 1
    # XLA counts the Pallas call as nothing: the meter adds its attention FLOPs and the pages it reads
    assert 0 < decode.kernel_flops < decode.flops and 0 < decode.kernel_bytes < decode.hbm_bytes
    # every row at 64 tokens, 32 rows on 16 slots: two waves of 63 decode steps in bursts of 16
    full = with_lengths(eval_plan, "fixed:64")
    work = full.decode["work"]
    assert work["steps"] == 126 and work["bursts"] == 8 and work["useful_fraction"] == 1.0
    trips = dict(next(p for p in full.programs if p.name == "sampler/decode").loops)
    assert sorted(t for t in trips.values() if t in (8.0, 126 / 8)) == [8.0, 126 / 8]
    short = with_lengths(eval_plan, "fixed:8")
    seconds = {name: next(p for p in plan.programs if p.name == "sampler/decode").seconds
               for name, plan in (("short", short), ("full", full))}
    assert seconds["short"] < seconds["full"] / 4
    assert short.decode["work"]["steps"] == 14


def test_a_refill_is_priced_by_the_prefill_loop_it_runs(eval_plan):
    """A refill prefills in batched rounds or in one-prompt rounds: two loops one after the other,
    one of them with no trips (a `lax.cond` between them made XLA:TPU copy the page pool). The
    meter runs the batched loop on the refills that admit a wave (2 of 8 at fixed lengths, one
    2-prompt round each) and the one-prompt loop on the others (none here: no trips)."""
    from jaxrl4llm.plan.hlo_cost import find_conditionals, parse_module
    from jaxrl4llm.plan.programs import decode_loops, continuous_trips

    full = with_lengths(eval_plan, "fixed:64")
    work = full.decode["work"]
    assert (work["prefill_batch"], work["batched_refills"], work["batched_rounds"], work["single_rounds"]) == (
        2, 2, 1, 0)
    decode = next(p for p in full.programs if p.name == "sampler/decode")
    comps, loops, top, inner = decode_loops(decode.hlo)
    assert not [c for c in find_conditionals(parse_module(decode.hlo)) if c.parent == top[0].body]
    trips = continuous_trips(decode.hlo, ContinuousWork(**work))
    dynamic = [loop for loop in loops if loop.trips is None]
    admissions = [t for loop, t in zip(dynamic, trips) if loop.parent == top[0].body and loop is not inner[-1]]
    assert sorted(admissions) == [0.0, 2 / 8]
    # the model's work: 2 n (8 prompts x the bucket + 126 steps x 16 slots), over the 4 chips
    n, xla = eval_plan.model.num_params, decode.flops - decode.kernel_flops
    assert decode.model_flops == pytest.approx(2 * n * (8 * eval_plan.prompt_len + 126 * 16) / decode.devices)
    assert xla < 1.12 * decode.model_flops


def test_decode_step_collectives_are_reported(eval_plan, plan):
    """Per decode step: the tensor-parallel sampler's activation all-reduces (one per attention
    output and MLP output a layer, at least), in the text and the JSON; the static sampler too.
    The top-k over the vocab-split logits is one all-gather of the shards' candidates
    (`filters.split_vocab_top_k`): no all-to-all, permute or small all-reduce (XLA's resharding)."""
    coll = eval_plan.decode["step_collectives"]
    # the attention output's and the MLP's partial sums of every layer are summed across the
    # tensor axis in bf16 (`DecodeBackend.split_matmul`), [slots a shard, hidden]
    activations = [k for k in coll["kinds"] if k["op"] == "all-reduce" and k["shape"].startswith("bf16[8,128]")]
    assert sum(k["count"] for k in activations) == 2 * eval_plan.model.num_layers
    assert not [k for k in coll["kinds"] if k["op"] == "all-reduce" and k["shape"].startswith("f32[8,128]")]
    assert [(k["op"], k["shape"], k["count"]) for k in coll["kinds"] if k["op"] != "all-reduce"] == [
        ("all-gather", "s32[2,22,8]", 1.0)]  # 2 shards x (10 values, 10 ids, max, sum) x 8 rows
    assert all(k["shape"].endswith(",128]") for k in coll["kinds"] if k["op"] == "all-reduce")  # [rows, (1,) D]
    assert {k["group"] for k in coll["kinds"]} == {2}  # the tensor pair: a step never reaches across row shards
    assert coll["bytes"] == pytest.approx(sum(k["bytes"] for k in coll["kinds"])) and coll["bytes"] > 0
    assert "decode step collectives (one step, per chip)" in format_plan(eval_plan)
    out = json.loads(json.dumps(plan_to_dict(eval_plan)))
    assert out["decode"]["step_collectives"]["count"] == coll["count"] and out["decode"]["work"]["steps"] > 0
    assert "step_collectives" in plan.decode and plan.sampler["engine"] == "static"


def test_continuous_schedule_counts_every_row_step_once():
    """The schedule's live slot-steps are the rows' decode steps (L - 1 a row); the steps are at
    least the makespan bounds (the longest row; the row-steps over the slots); fewer slots than
    rows run longer but waste less than a static batch."""
    budget, rows = 512, 64
    lognormal = parse_lengths("lognormal:mean=128,sigma=0.8", budget)
    for slots, shards in ((64, 1), (16, 1), (16, 4)):
        work = continuous_decode_work(lognormal, rows, slots, budget, shards=shards, samples=4, burst=8)
        live = work.useful_fraction * work.steps * slots
        assert live == pytest.approx(rows * (work.mean_length - 1), rel=1e-9)
        assert work.steps >= live / slots and work.bursts >= work.steps / 8
    static = static_decode_work(lognormal, rows, budget)
    few = continuous_decode_work(lognormal, rows, 16, budget, samples=4, burst=8)
    assert few.useful_fraction > 1 - static.idle_fraction
    fixed = continuous_decode_work(parse_lengths("fixed:9", budget), 8, 2, budget, samples=2, burst=4)
    assert (fixed.steps, fixed.bursts, fixed.prefill_rounds) == (32, 8, 0.5)  # 4 pairs x 8 steps, 2 bursts a pair
    assert fixed.kv_tokens == pytest.approx(2 * np.mean(np.arange(1, 9)))  # no prompt: a slot attends to 1..8 keys
    # partial rollouts: the next rollout's rows fill the tail, so a segment takes fewer steps than a call,
    # at least the row-steps of a rollout over the slots, and the slots waste less
    for slots in (64, 16):
        call = continuous_decode_work(lognormal, rows, slots, budget, samples=4, burst=8, draws=6)
        seg = continuous_decode_work(lognormal, rows, slots, budget, samples=4, burst=8, draws=6, partial=True)
        assert rows * (seg.mean_length - 1) / slots * 0.8 <= seg.steps < call.steps
        assert seg.useful_fraction > call.useful_fraction
    same = continuous_decode_work(parse_lengths("fixed:9", budget), 8, 2, budget, samples=2, burst=4, partial=True)
    assert (same.steps, same.bursts) == (fixed.steps, fixed.bursts)  # equal lengths: no tail to fill


def test_partial_rollouts_price_a_segment_of_the_stream(eval_plan):
    """rollout.partial: the same compiled program priced by the steady-state segment (the next
    rollout's rows fill the tail): fewer decode steps and less time than a whole call, said in the report."""
    import dataclasses

    lognormal = "lognormal:mean=12,sigma=0.8"
    call = with_lengths(eval_plan, lognormal)
    seg = with_lengths(dataclasses.replace(eval_plan, decode=dict(eval_plan.decode, partial=True)), lognormal)
    assert seg.decode["work"]["steps"] < call.decode["work"]["steps"]
    time = lambda p: next(q for q in p.programs if q.name == "sampler/decode").seconds
    assert time(seg) < time(call)
    assert "rollout.partial" in format_plan(seg) and "rollout.partial" not in format_plan(call)


def test_the_eval_report_says_no_when_the_sampler_and_the_state_overflow_the_chip(eval_plan):
    """`fits` in the eval report is the plan's rule (compiled, and with the state under 90% of HBM),
    not only that XLA compiled it."""
    import dataclasses

    from jaxrl4llm.plan.programs import format_eval

    assert "fits NO" not in format_eval(eval_plan, 4)
    decode = next(p for p in eval_plan.programs if p.name == "sampler/decode")
    small = dataclasses.replace(eval_plan, chip=eval_plan.chip._replace(hbm=decode.total_bytes))
    assert "fits NO" in format_eval(small, 4) and "lower rollout.slots" in format_eval(small, 4)


def test_the_decode_program_holds_the_page_pool_once():
    """XLA's temporaries are the page pool once plus the small rest (`continuous_memory`), on a
    pool too large for on-chip memory (262 MiB a chip, one layer) with fewer slots than rows, so
    refills prefill prompts in rounds. The refill's prefill was a `lax.cond` between two loops,
    and XLA:TPU copied the pool into and out of the loop in each branch on every round: 3.0x the
    pool in temporaries."""
    cfg = load_config(None, TINY + ["rollout.engine=continuous", "model.head_dim=128", "rollout.tensor_parallel=2",
                                    "model.num_layers=1", "model.num_heads=32", "model.num_kv_heads=8",
                                    "rollout.max_new_tokens=2048", "rollout.slots=128", "trainer.eval_samples=4",
                                    "trainer.eval_temperature=0.6", "rollout.top_k=10"])
    plan = plan_eval(cfg, "v5e:2x2", problems=64)  # 256 rows on 128 slots: 16 of a shard's 32 prompts a round
    decode = next(p for p in plan.programs if p.name == "sampler/decode")
    pool, rest = decode.analytic["page pool"], decode.analytic_total - decode.analytic["decode weights"]
    assert plan.sampler["slots"] == 128 and pool > 2**28
    assert pool <= decode.temp_bytes <= 1.1 * rest  # the pool in HBM, once
    assert 0.85 < decode.analytic_total / decode.total_bytes < 1.15


@pytest.mark.parametrize("width", [256, 384])
def test_a_mixture_of_experts_decode_step_gathers_no_expert_weights(width):
    """Qwen3-MoE on the 2-way tensor-parallel sampler, recording routes: each chip holds half of every
    expert's width, so a decode step sums the experts' partial outputs (all-reduces within the tensor
    pair) and never gathers an expert's weights: its only all-gather is the top-k's integer
    candidates. The recorded routes are in the sampler's memory. The program copies no expert
    weights but, where a chip's width (192) is not a multiple of 128 lanes, the prefill's gate and up
    of each layer (I minor, as its ragged_dot takes them), which our count holds."""
    moe = ["model.architecture=qwen3_moe", "model.num_experts=8",
           "model.num_experts_per_tok=2", f"model.moe_intermediate_size={width}", "trainer.router_replay=rollout"]
    cfg = load_config(None, TINY + moe + ["rollout.engine=continuous", "model.head_dim=128",
                                          "rollout.tensor_parallel=2", "rollout.top_k=10", "rollout.slots=16"])
    plan = plan_run(cfg, "v5e:2x2", sampler_only=True)
    coll = plan.decode["step_collectives"]
    gathers = [k for k in coll["kinds"] if k["op"] == "all-gather"]
    assert [k["dtype"] for k in gathers] == ["s32"], coll["kinds"]  # the top-k's candidates, no float weights
    reduces = [k for k in coll["kinds"] if k["op"] == "all-reduce"]
    assert sum(k["count"] for k in reduces) >= 2 * plan.model.num_layers  # attention and experts, a layer each
    assert {k["group"] for k in coll["kinds"]} == {2}  # within the tensor pair
    decode = next(p for p in plan.programs if p.name == "sampler/decode")
    assert decode.fits and decode.analytic["routes"] > 0
    local = width // 2
    copies = re.findall(rf"= bf16\[8,(?:128,{local}|{local},128)\]\S* copy\(", decode.hlo)
    layers, lanes = plan.model.num_layers, 0 if local % 128 == 0 else 256
    assert len(copies) == (2 * layers if lanes else 0), copies
    assert decode.analytic["expert copies"] == 2 * layers * 8 * 128 * lanes * 2  # bf16[8, 128, 256] each
    # XLA:TPU's MoE decode program holds about a second page pool (`sampling.memory.tpu_moe_pool_copies`)
    assert decode.analytic["page pool copy"] == decode.analytic["page pool"] > 0
    assert tpu_moe_pool_copies("gpu", plan.model) == 0 == tpu_moe_pool_copies("tpu", ModelConfig())

"""`scripts/gpu_check --dry-run`: every phase of the GPU check (benchmarks/gpu_check.py) runs on this
CPU at toy sizes and reports "ok" with finite figures, into the four files the check writes (OUT_FILES).
The one dry run takes the default phases but agreement, moe and tools (each tested alone below), with
the baseline and tests phases (a few minutes: each phase compiles its own programs); the demo phase's
own code is tested on a stand-in demo (`jaxrl4llm demo --quick` itself runs in tests/train/test_demo.py)."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.subprocess_xla_flags import FAST_COMPILE

REPO = Path(__file__).resolve().parents[1]


def _gpu_check():
    """benchmarks/gpu_check.py as a module (for its tables), sys.path and sys.modules as they were."""
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    path = list(sys.path)
    sys.modules["gpu_check"] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
        del sys.modules["gpu_check"]
    return module


def _numbers(x, path=""):
    """(path, value) of every number and None in a JSON tree."""
    if isinstance(x, dict):
        return [n for k, v in x.items() for n in _numbers(v, f"{path}/{k}")]
    if isinstance(x, list):
        return [n for i, v in enumerate(x) for n in _numbers(v, f"{path}/{i}")]
    return [(path, x)] if x is None or (isinstance(x, (int, float)) and not isinstance(x, bool)) else []


@pytest.mark.slow
def test_dry_run_reports_every_phase_ok_with_finite_figures(tmp_path, monkeypatch):
    gc = _gpu_check()
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # its sibling modules (the workload's lengths)
    out = tmp_path / "out"
    # every phase compiles its own programs: unoptimised by LLVM (tests/subprocess_xla_flags.py), they compile
    # sooner; the dry run checks that each phase runs and reports, against no pinned figure
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHON=sys.executable, XLA_FLAGS=FAST_COMPILE)
    # the default phases but agreement, moe and tools (each has its own test below), and the baseline: the
    # attention phase's choice read by the step, plan and baseline phases of the same check
    phases = [q.name for q in gc.PHASES if not q.optional and q.name not in ("setup", "agreement", "moe", "tools")]
    phases += ["baseline", "tests"]
    done = subprocess.run([str(REPO / "scripts" / "gpu_check"), "--dry-run", "--phases", ",".join(phases), str(out)],
                          env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == sorted(gc.OUT_FILES)  # the check's output files, one folder level
    report = json.loads((out / "gpu_check.json").read_text())
    ran = [q for q in phases if q != "step"] + ["setup"] + [f"step:{m}" for m in gc.MODELS["dry"]]
    assert sorted(report["phases"]) == sorted(ran)
    for name, record in report["phases"].items():
        assert record["status"] == "ok", (name, record.get("error"))
    # every figure finite (None stands for a non-finite one), but a CPU's interconnect: none
    missing = [p for p, v in _numbers(report["phases"]) if v is None or not math.isfinite(v)]
    assert all(p.endswith("/chip/ici_bandwidth") for p in missing), missing
    kernels = report["phases"]["kernels"]["figures"]
    kinds = ("paged", "paged per_slot", "paged length/live", "paged per_slot length/live", "flash forward",
             "flash backward")
    assert {k for k in kernels if k != "interpret"} == {f"{kind} {h}:{kv}" for kind in kinds
                                                       for h, kv in gc.KERNEL_SHAPES["dry"]["heads"]}
    assert all(v["pass"] for k, v in kernels.items() if k != "interpret")
    comparison = report["phases"]["plan"]["figures"]["comparison"]
    for model in gc.MODELS["dry"]:
        assert comparison[model]["step (3 programs)"]["measured_over_predicted"] > 0
    table = (out / "gpu_check.md").read_text()
    assert "| kernels | ok |" in table and "measured / predicted" in table
    # the attention sweep: the default first, every output within bf16 tolerance of it (one splits a slot's
    # pages 8 ways by its length and stores live partials only; two run a program per slot), the best named
    attention = report["phases"]["attention"]["figures"]
    rows = attention["rows"]
    assert rows[0]["config"].endswith("(default)") and rows[0]["rel_to_default"] == 0
    assert (rows[1]["k_splits"], rows[1]["split_rule"], rows[1]["store"]) == (8, "length", "live")
    assert all(r["rel_to_default"] <= 2e-2 for r in rows)
    assert [r["layout"] for r in rows] == ["per_kv_head", "per_kv_head", "per_slot", "per_slot"]
    assert all(math.isfinite(r["rollout_attention_s"]) and r["rollout_attention_s"] > 0 for r in rows)
    assert rows[0]["default_over_this"] == 1 and all(math.isfinite(r["default_over_this"]) for r in rows)
    assert attention["best"] in {r["config"] for r in rows} and attention["snapshots"] >= 2
    lengths = gc.attention_snapshots("dry", 16)[0]
    assert lengths[0].min() > 0 and (lengths == 0).any()  # every row live at step 0, some done by the last
    # ... its choice, read by the later phases that decode (the step, plan and baseline's rollout is the default's)
    for name in ("plan", *(f"step:{m}" for m in gc.MODELS["dry"])):
        assert report["phases"][name]["attention_choice"] == attention["best"], name
    assert "attention_choice" not in report["phases"]["baseline"] and "decode" in report["phases"]
    baseline = report["phases"]["baseline"]["figures"]
    if attention["best"] != rows[0]["config"]:
        assert baseline["config"] == rows[0]["config"] and baseline["chosen"] == attention["best"]
        assert baseline["default_over_chosen"] > 0 and "| the choice (the step phase's) |" in table
    # the step phases profile what they timed: the first model's rollout, the last model's trainer programs
    first, last = (report["phases"][f"step:{m}"]["figures"] for m in (list(gc.MODELS["dry"])[0], list(gc.MODELS["dry"])[-1]))
    assert first["profile"]["kernels"] > 0 and 0 < first["profile"]["busy_share"] <= 1
    for program in ("logprob pass", "update"):
        f = last["trainer_profile"][program]
        assert f["seconds"] > 0 and f["kernels"] > 0 and 0 < f["busy_share"] <= 1 and f["top"], (program, f)
        assert f"## profile (the {last['model']} {program}" in table
    assert f"## profile (the {first['model']} rollout" in table


def test_demo_phase_reports_the_held_out_accuracy_before_and_after(tmp_path, monkeypatch):
    """The demo phase on a stand-in `run_demo`: the dry run asks for the quick demo with an evaluation
    before and after; its figures are the two accuracies and the seconds; a demo that did not evaluate
    fails the phase."""
    import jaxrl4llm.train.demo as demo

    gc = _gpu_check()
    asked = {}

    def run_demo(**kwargs):
        asked.update(kwargs)
        return {"eval_before": {"accuracy": 0.25}, "eval_after": {"accuracy": 0.5}, "total_seconds": 3.0}

    monkeypatch.setattr(demo, "run_demo", run_demo)
    assert gc.phase_demo("dry", tmp_path, lambda line: None) == {"quick": True, "accuracy_before": 0.25,
                                                                  "accuracy_after": 0.5, "seconds": 3.0}
    assert asked["quick"] and "trainer.steps=1" in asked["overrides"] and asked["sft_steps"] == 5
    monkeypatch.setattr(demo, "run_demo", lambda **kwargs: {"eval_before": {}, "total_seconds": 1.0})
    with pytest.raises(gc.PhaseFailed, match="held-out accuracy"):
        gc.phase_demo("dry", tmp_path, lambda line: None)


def test_phases_selects_phases_by_name_and_refuses_an_unknown_one(tmp_path, capsys):
    """`--phases launches` runs that optional phase (and the setup) alone; a misspelt phase is an
    error that lists the known ones, before any work."""
    gc = _gpu_check()
    assert [p.name for p in gc.PHASES if p.optional] == ["baseline", "tests", "demo", "exact", "profile", "trainer",
                                                        "launches"]
    budget = sum(p.gpu_seconds for p in gc.PHASES if not p.optional and not p.collect_after)
    assert budget <= gc.TOTAL_SECONDS["gpu"] == 540  # the default phases in one call of 9 minutes
    assert set(gc.LAUNCH_VARIANTS) >= {"default", "no_command_buffers"}  # the peer and the control
    assert {"cublas_gemm", "cublaslt", "exhaustive_tiling"} <= set(gc.LAUNCH_VARIANTS)  # the GEMM variants
    with pytest.raises(SystemExit):
        gc.main(["--dry-run", "--phases", "launches,lanuches", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "unknown phase(s) lanuches" in err and "known: peaks, kernels, attention, plan" in err
    assert not (tmp_path / "out").exists()


def test_exact_phase_checks_the_pallas_kernels_invariance(tmp_path):
    """The optional exact phase (in Pallas' interpreter here): every kernel's rows keep their bits."""
    figures = _gpu_check().phase_exact("dry", tmp_path, lambda line: None)
    assert all(f["invariant"] for f in figures.values())
    assert figures["attention"]["max_err"] < 1e-5 and figures["matmul"]["max_err"] < 1e-4


def test_agreement_phase_runs_exact_numerics_end_to_end_and_reports_its_cost(tmp_path, monkeypatch):
    """The optional agreement phase (the CPU's exact kernels here): no sampled token's log-prob differs
    from the trainer's in exact mode, both modes' tokens/s are reported, and the markdown shows them.
    Under the suite's fast-compile flags (sampler and trainer compiled alike, so exact mode's bits still
    agree); the same promise at XLA's default level, as users run: tests/train/test_loop.py's exact run
    and tests/kernels/test_exact.py."""
    gc = _gpu_check()
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # its sibling module (numerics)
    figures = gc.phase_agreement("dry", tmp_path, lambda line: None)
    assert figures["exact"]["differing"] == 0 and figures["exact"]["tokens"] > 0
    assert figures["default"]["tokens"] == figures["exact"]["tokens"]
    assert all(math.isfinite(figures[m][k]) and figures[m][k] > 0 for m in ("default", "exact")
               for k in ("rollout_tokens_per_s", "update_tokens_per_s"))
    text = gc.markdown({"mode": "dry", "python": "3", "date": "today", "phases": {
        "agreement": {"status": "ok", "seconds": 1.0, "figures": figures}}})
    assert "| exact | " in text and f"0 of {figures['exact']['tokens']} |" in text


def test_trace_summary_reads_a_profile_of_xla_ops(tmp_path):
    """The profile phase's reader on a CPU trace (the XLA client's threads stand in for a GPU's
    streams): the ops it ran, busy time within the span, names without their numeric suffix."""
    import jax
    import jax.numpy as jnp

    step = jax.jit(lambda x: jax.lax.fori_loop(0, 20, lambda i, y: jnp.tanh(y @ y), x))
    x = jnp.ones((128, 128))
    step(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path / "trace")):
        step(x).block_until_ready()
    summary = _gpu_check().trace_summary(tmp_path / "trace")
    assert summary["source"] == "CPU XLA threads" and summary["kernels"] >= 20
    assert 0 < summary["busy_s"] <= summary["span_s"] + 1e-9 and 0 < summary["busy_share"] <= 1
    names = [k["name"] for k in summary["top"]]
    assert names and not any(n[-1].isdigit() for n in names), names
    assert sum(k["count"] for k in summary["top"]) <= summary["kernels"]


def test_trainer_phase_profiles_the_logprob_pass_and_the_update(tmp_path, monkeypatch):
    """The optional trainer phase (the dry run's model on the CPU): the log-prob pass and the update,
    each timed and traced, their device time summarised, and their profile sections in the report."""
    gc = _gpu_check()
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))  # its sibling modules (plan_accuracy)
    figures = gc.phase_trainer("dry", tmp_path, lambda line: None)
    for program in ("logprob pass", "update"):
        f = figures[program]
        assert f["seconds"] > 0 and f["kernels"] > 0 and 0 < f["busy_share"] <= 1 and f["top"], (program, f)
    text = gc.markdown({"mode": "dry", "python": "3", "date": "today", "phases": {
        "trainer": {"status": "ok", "seconds": 1.0, "figures": figures}}})
    assert f"## profile (the {figures['model']} logprob pass" in text and f"the {figures['model']} update" in text


def test_moe_verdict_and_the_moe_and_tools_tables():
    """The moe phase's verdict on ragged_dot (its time over dense_capacity's, in useful FLOPs at
    dense_capacity's rate: 128 experts, top 8, a dense expansion is 16x), and the markdown sections of
    the moe and tools phases' figures (a form that ran out of memory is its row's error)."""
    gc = _gpu_check()
    assert gc.moe_verdict(0.1, 1.0, 128, 8) == ("grouped matmul", 1.6)
    assert gc.moe_verdict(1.0, 1.0, 128, 8) == ("dense expansion", 16.0)
    assert gc.moe_verdict(0.3, 1.0, 128, 8)[0] == "between"
    row = {"tokens": 4096, "fwd_s": 0.01, "fwd_bwd_s": 0.03, "fwd_flops": 1e12, "fwd_bwd_flops": 3e12,
           "xla_over_useful": 16.0, "temp_gib_fwd_bwd": 12.0, "useful_tflops_fwd": 100.0, "useful_tflops_fwd_bwd": 100.0}
    moe = {"shapes": {"hidden": 2048, "width": 768, "experts": 128, "k": 8, "dtype": "bfloat16"}, "rows": [
        {**row, "form": "dense_capacity", "fwd_over_dense": 1.0, "fwd_bwd_over_dense": 1.0},
        {**row, "form": "ragged_dot", "fwd_over_dense": 1.0, "fwd_bwd_over_dense": 1.0},
        {"tokens": 16384, "form": "ragged_dot", "error": "XlaRuntimeError: RESOURCE_EXHAUSTED"}],
        "verdicts": {"4096": {"verdict": "dense expansion", "multiple_fwd_bwd": 16.0, "multiple_fwd": 16.0,
                              "temp_over_dense": 1.0}, "16384": {"verdict": "out of memory where dense_capacity ran"}},
        "skipped": "reference: not timed here"}
    arm = {"seconds": 2.0, "tokens_per_s": 5000.0, "vs_plain": 1.0, "calls_per_row": 1.5, "tool_token_share": 0.2,
           "decode_steps": 300, "segments": 20, "tool_s": 0.4, "hidden_share": 0.9, "wait_s": 0.04, "parked_share": 0.1}
    tools = {"workload": {"size": "qwen3-0.6b", "dtype": "bfloat16", "prompts": 8, "samples": 8, "slots": 64,
                          "repeats": 2}, "vocab": 151936, "tokens": 10000, "runs": {"20": {"trigger_share": 0.016, "arms": {
                              "plain": {"seconds": 1.0, "tokens_per_s": 10000.0, "vs_plain": 0.0},
                              "segments": {**arm, "calls_per_row": 0.0, "tool_token_share": 0.0, "tool_s": 0.0,
                                           "hidden_share": 1.0},
                              "tools": arm}}}}
    text = gc.markdown({"mode": "gpu", "python": "3", "date": "today", "phases": {
        "moe": {"status": "ok", "seconds": 60.0, "figures": moe}, "tools": {"status": "ok", "seconds": 90.0,
                                                                              "figures": tools}}})
    assert "| 4096 | ragged_dot | 10 | 30 | 3000 | 16 | 12 | 100 | 100 | 1 | 1 |" in text
    assert "| 16384 | ragged_dot | error: XlaRuntimeError: RESOURCE_EXHAUSTED |" in text
    assert "- 4096 tokens: ragged_dot's time is 16x" in text and "**dense expansion**" in text
    assert "- 16384 tokens: ragged_dot **out of memory where dense_capacity ran**" in text
    assert "| 20 | plain | 10000 | 1 |  |" in text
    assert "| 20 | segments | 5000 | 2 | +100.0% | 300 | 20 | 0 | 0% | 0 |  | 10% |" in text
    assert "| 20 | tools | 5000 | 2 | +100.0% | 300 | 20 | 1.5 | 20% | 0.4 | 90% | 10% |" in text

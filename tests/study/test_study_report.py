"""Study report from hand-written run folders: arms, curves over seeds, accuracy tables and
comparisons against hand-computed statistics."""

import json
import math
from pathlib import Path

import pytest

from jaxrl4llm.cli import main as cli_main
from jaxrl4llm.study.study_report import (
    benchmarks, curve, find_run_dirs, group_arms, load_run, significance_words, tail_mean, write_report,
)


def make_run(path: Path, *, preset="lite_ppo", seed=0, final=None, steps=4, labels=None, index=None, lr=1e-3,
             reward=lambda step, seed: 0.1 * step + 0.01 * seed, sets=("test",)) -> Path:
    """A run folder as `jaxrl4llm train` leaves it: config.json, metrics.jsonl with step-0 and
    final held-out accuracy per set (`final`: {set: accuracy}); cell.json when `labels` are given."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "algorithm": {"preset": preset, "overrides": {}}, "optim": {"lr": lr},
        "trainer": {"seed": seed, "steps": steps, "out_dir": str(path), "overwrite": False}}))
    final = final or {s: 0.5 for s in sets}
    records = [{"step": 0, **{f"eval/{s}/accuracy": 0.4 for s in final}, "eval/accuracy": 0.4}]
    for step in range(1, steps + 1):
        records.append({"step": step, "reward": reward(step, seed), "entropy": 1.0 / step, "response_length": 10.0 + step,
                        "clip_frac_high": 0.01, "clip_frac_low": 0.03, "most_clipped_tokens": [["x", 2]]})
    records[-1].update({f"eval/{s}/accuracy": v for s, v in final.items()})
    records[-1]["eval/accuracy"] = sum(final.values()) / len(final)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if labels is not None:
        (path / "cell.json").write_text(json.dumps({"labels": {**labels, "seed": seed}, "index": index}))
    return path


@pytest.fixture
def sweep_runs(tmp_path):
    """Three arms from a sweep (grid order lite_ppo, grpo, dapo); dapo has one seed."""
    accs = {"lite_ppo": [0.70, 0.72, 0.69], "grpo": [0.75, 0.80, 0.74], "dapo": [0.71]}
    for i, (arm, values) in enumerate(accs.items()):
        for seed, acc in enumerate(values):
            make_run(tmp_path / "sweep" / arm / f"seed{seed}", preset=arm, seed=seed, labels={"recipe": arm},
                     index=3 * i + seed, final={"math": acc, "aime": acc / 2})
    return tmp_path / "sweep"


def test_arms_follow_sweep_labels_in_grid_order(sweep_runs):
    runs = [load_run(p) for p in find_run_dirs([sweep_runs])]  # found alphabetically: dapo, grpo, lite_ppo
    arms = group_arms(runs)
    assert [(a.label, [r.seed for r in a.runs]) for a in arms] == [("lite_ppo", [0, 1, 2]), ("grpo", [0, 1, 2]),
                                                                    ("dapo", [0])]


def test_plain_runs_group_by_config_but_seed_and_are_labelled_by_what_differs(tmp_path):
    dirs = [make_run(tmp_path / "a", seed=0), make_run(tmp_path / "b", seed=1),
            make_run(tmp_path / "c", seed=0, lr=5e-4), make_run(tmp_path / "d", preset="grpo", seed=3)]
    arms = group_arms([load_run(d) for d in dirs])
    assert [(a.label, len(a.runs)) for a in arms] == [
        ("algorithm.preset=lite_ppo, optim.lr=0.001", 2), ("algorithm.preset=lite_ppo, optim.lr=0.0005", 1),
        ("algorithm.preset=grpo, optim.lr=0.001", 1)]
    single = group_arms([load_run(make_run(tmp_path / "demo" / "seed0"))])
    assert single[0].label == "demo"


def test_curve_is_the_mean_and_t_interval_over_seeds_per_step(tmp_path):
    dirs = [make_run(tmp_path / f"s{k}", seed=k, reward=lambda step, seed: [0.1, 0.2, 0.6][seed] * step)
            for k in range(3)]
    arm = group_arms([load_run(d) for d in dirs])[0]
    steps, ivs = curve(arm, "reward")
    assert steps == [1, 2, 3, 4]
    # step 2: values 0.2, 0.4, 1.2 -> mean 0.6, s = sqrt(((-.4)^2 + (-.2)^2 + .6^2) / 2) = sqrt(0.28)
    assert ivs[1].mean == pytest.approx(0.6) and ivs[1].n == 3
    assert ivs[1].high - 0.6 == pytest.approx(4.302652730 * math.sqrt(0.28) / math.sqrt(3), rel=1e-8)
    steps, ivs = curve(arm, "eval/accuracy")
    assert steps == [0, 4] and ivs[0].low == pytest.approx(0.4) and ivs[0].high == pytest.approx(0.4)


def test_tail_mean_and_benchmarks(tmp_path):
    run = load_run(make_run(tmp_path / "r", steps=20, reward=lambda step, seed: float(step)))
    assert tail_mean(run, "reward") == pytest.approx(19.5)  # the last 10% of 20 steps: 19 and 20
    assert tail_mean(run, "kl") is None
    assert benchmarks([run]) == ["eval/test/accuracy"]  # one set: its mean is the same number
    two = load_run(make_run(tmp_path / "two", final={"math": 0.5, "aime": 0.1}))
    assert benchmarks([two]) == ["eval/aime/accuracy", "eval/math/accuracy", "eval/accuracy"]


def test_significance_words():
    assert significance_words(3, 3, 0.01) == "yes, p < 0.05"
    assert significance_words(3, 3, 0.2) == "no: not detectable at these seeds"
    assert significance_words(2, 3, 0.01).endswith("(only 2 seeds: low power)")
    assert significance_words(1, 3, math.nan).startswith("n too small to test (n=1 vs 3")


def test_report_tables_and_comparisons(sweep_runs, tmp_path):
    path = write_report([sweep_runs], tmp_path / "report")
    text = path.read_text()
    assert "7 runs in 3 arms" in text and "Baseline arm: **lite_ppo**" in text
    math_section = text[text.index("### math"):text.index("### all eval sets")]
    # lite_ppo: mean 70.33%, s = 1.5275%, half-width t(0.975, 2) * s / sqrt(3) = 3.79 pp
    assert "| lite_ppo | 3 | 70.3% [66.5%, 74.1%] | 40.0% [40.0%, 40.0%] | 4 | 70.0% (seed 0), 72.0% (seed 1), 69.0% (seed 2) |" in math_section
    assert "| dapo | 1 | 71.0% (n=1, no interval) |" in math_section
    # grpo - lite_ppo: +6.0 pp, Welch t = 2.920 on 2.859 df, p = 0.0652 (scipy: 0.06520573938)
    assert "| grpo | 3 vs 3 | +6.0 | [-0.7, +12.7] | 0.0652 | no: not detectable at these seeds |" in math_section
    assert "| dapo | 1 vs 3 | +0.7 | n/a | n/a | n too small to test (n=1 vs 3; needs >= 2 seeds per arm) |" in math_section
    assert "### aime" in text and "p-values are not corrected for multiple comparisons (6 here)" in text
    # tail means = step 4: reward 0.4 + 0.01 seed -> 0.41 +- 4.302653 * 0.01 / sqrt(3) = 0.41 +- 0.0248
    assert "| lite_ppo | 3 | 0.41 [0.3852, 0.4348] | 0.25 [0.25, 0.25] | 14 [14, 14] | 0.01 [0.01, 0.01] |" in text
    for png in ("reward", "eval_accuracy", "eval_math_accuracy", "entropy", "response_length", "clip_frac_high",
                "clip_frac_low"):
        assert f"]({png}.png)" in text and (tmp_path / "report" / f"{png}.png").is_file()
    assert "truncation_rate.png" not in text  # not logged by these runs: no empty plot


def test_baseline_option_and_unknown_baseline(sweep_runs, tmp_path, capsys):
    assert cli_main(["report", str(sweep_runs), "-o", str(tmp_path / "r"), "--baseline", "grpo", "--no-plots"]) == 0
    text = (tmp_path / "r" / "report.md").read_text()
    assert "## Curves" not in text and not list((tmp_path / "r").glob("*.png"))
    assert "Baseline arm: **grpo**" in text and "| lite_ppo | 3 vs 3 | -6.0 | [-12.7, +0.7] | 0.0652 |" in text
    assert cli_main(["report", str(sweep_runs), "-o", str(tmp_path / "r"), "--baseline", "ppo"]) == 2
    assert "--baseline 'ppo' is not an arm; the arms are: lite_ppo, grpo, dapo" in capsys.readouterr().err


def test_significant_difference_and_clipped_accuracy_interval(tmp_path):
    for seed, (a, b) in enumerate([(0.50, 0.90), (0.52, 0.91), (0.51, 0.92)]):
        make_run(tmp_path / "a" / f"seed{seed}", seed=seed, labels={"recipe": "a"}, index=seed, final={"t": a})
        make_run(tmp_path / "b" / f"seed{seed}", seed=seed, labels={"recipe": "b"}, index=3 + seed, final={"t": b})
    make_run(tmp_path / "c" / "seed0", seed=0, labels={"recipe": "c"}, index=6, final={"t": 0.98})
    make_run(tmp_path / "c" / "seed1", seed=1, labels={"recipe": "c"}, index=7, final={"t": 0.70})
    text = write_report([tmp_path], tmp_path / "out", plots=False).read_text()
    # s = 1 pp in both arms: se = sqrt(2/3) pp, t = 40 / 0.8165 = 48.99 on 4 df, half-width 2.7764 * 0.8165 = 2.27 pp
    assert "| b | 3 vs 3 | +40.0 | [+37.7, +42.3] | 1.04e-06 | yes, p < 0.05 |" in text
    assert "| c | 2 | 84.0% [0.0%, 100.0%] |" in text  # t(0.975, 1) * 14 pp: clipped to [0, 100%]


def test_unfinished_runs_are_flagged(tmp_path):
    make_run(tmp_path / "a", seed=0, steps=4)
    run = make_run(tmp_path / "b", seed=1, steps=4)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines[:3]) + "\n")  # stopped after step 2, before the final eval
    text = write_report([tmp_path / "a", tmp_path / "b"], tmp_path / "out", plots=False).read_text()
    assert "1 run(s) stopped before their last step" in text and "| 2 / 4 |" in text
    assert "| 1 | 50.0% (n=1, no interval) |" in text  # only the finished run has a final accuracy


def test_no_runs_is_a_clear_error(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path), "-o", str(tmp_path / "out")]) == 2
    assert "is not a run folder (no metrics.jsonl) and holds none" in capsys.readouterr().err


def test_the_report_sums_the_most_clipped_tokens_of_an_arm(sweep_runs, tmp_path):
    from jaxrl4llm.study.study_report import most_clipped

    arms = group_arms([load_run(p) for p in find_run_dirs([sweep_runs])])
    assert most_clipped(arms[0]) == [("x", 2 * 4 * 3)]  # 2 a step, 4 steps, 3 seeds
    text = write_report([sweep_runs], tmp_path / "rep", plots=False).read_text()
    assert '| lite_ppo | "x" (24) |' in text

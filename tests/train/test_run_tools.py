"""Around a finished run: plot, convert to HF, eval and sample commands, interrupted checkpoint writes."""

import json

import numpy as np
import pytest

from jaxrl4llm.cli import main as cli_main
from jaxrl4llm.train.config import load_config
from jaxrl4llm.train.loop import train

from tests.train.conftest import tiny_overrides


@pytest.fixture(scope="module")
def finished_run(demo_assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    cfg = load_config(None, tiny_overrides(demo_assets, out, **{"trainer.checkpoint_every": 2, "trainer.export_hf": True,
                                                                 "trainer.eval_every": 2}))
    summary = train(cfg, log=lambda s: None)
    return out, summary


def test_run_directory_has_metrics_tensorboard_checkpoint_and_export(finished_run):
    out, summary = finished_run
    assert (out / "metrics.jsonl").is_file() and any((out / "tb").iterdir())
    assert (out / "checkpoints" / "2").is_dir()
    assert (out / "hf_export" / "config.json").is_file() and (out / "hf_export" / "tokenizer.json").is_file()
    assert summary["eval_before"] is not None and "accuracy" in summary["eval_after"]


def test_plot_overlays_runs(finished_run, tmp_path, capsys):
    out, _ = finished_run
    png = tmp_path / "curves.png"
    assert cli_main(["plot", str(out), str(out), "-o", str(png)]) == 0
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_convert_checkpoint_to_hf_matches_export(finished_run, tmp_path):
    from safetensors.numpy import load_file

    out, _ = finished_run
    assert cli_main(["convert", str(out), "--out", str(tmp_path / "hf")]) == 0
    a = load_file(str(tmp_path / "hf" / "model.safetensors"))
    b = load_file(str(out / "hf_export" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_convert_restores_the_parameters_only(finished_run, monkeypatch):
    """An export needs the parameters, not the optimizer state (twice their size): convert reads
    the parameters alone, and they equal those of a full restore."""
    import jax

    from jaxrl4llm.train import checkpointing
    from jaxrl4llm.train.export import export_checkpoint

    out, summary = finished_run
    full_restores = []
    monkeypatch.setattr(checkpointing.RunCheckpointer, "restore",
                        lambda self, *a, **k: full_restores.append(1) or pytest.fail("full train state restored"))
    export_checkpoint(out, out / "hf_params_only")
    assert not full_restores
    params, step = checkpointing.RunCheckpointer(out).restore_params(summary["state"].params)
    assert step == 2 and jax.tree.structure(params) == jax.tree.structure(summary["state"].params)


def test_eval_and_sample_commands(finished_run, demo_assets, capsys):
    out, _ = finished_run
    model = [f"model.path={out / 'hf_export'}", "model.dtype=float32", "data.template=demo",
             f"data.eval_files=[{demo_assets['test']}]", "rollout.prompts_per_step=2", "rollout.max_new_tokens=8",
             "reward.fn=tests.train.custom_parts:contains_one_reward", "reward.batched=false"]
    assert cli_main(["eval"] + model) == 0
    result = json.loads(capsys.readouterr().out)
    assert 0.0 <= result["accuracy"] <= 1.0 and "test/pass@1" in result
    assert cli_main(["sample", "--prompt", "Ann has 3 pens. Gets 4 more. How many?", "--template", "demo", "-n", "2"] + model) == 0
    assert capsys.readouterr().out.count("--- prompt 0 sample") == 2


def test_interrupted_checkpoint_write_leaves_previous_usable(finished_run, demo_assets, tmp_path):
    import shutil

    out, _ = finished_run
    run = tmp_path / "run"
    shutil.copytree(out, run)
    # What a kill during orbax's write of step 4 leaves behind: a temporary folder, never renamed.
    partial = run / "checkpoints" / "4.orbax-checkpoint-tmp-1234"
    (partial / "state").mkdir(parents=True)
    (partial / "state" / "garbage").write_bytes(b"\0" * 100)
    cfg = load_config(None, tiny_overrides(demo_assets, run, **{"trainer.steps": 3, "trainer.checkpoint_every": 0}))
    summary = train(cfg, resume=True, log=lambda s: None)
    assert [r for r in summary["history"]] and len(summary["history"]) == 1  # resumed at step 2, ran step 3


def test_bin_difficulty_command(finished_run, demo_assets, tmp_path):
    out, _ = finished_run
    bins = tmp_path / "bins"
    code = cli_main(["bin-difficulty", "--model", str(out / "hf_export"), "--data", demo_assets["test"], "--rollouts", "4",
                     "--out", str(bins), "--template", "demo", "--max-new-tokens", "8", "--batch-prompts", "2",
                     "--limit", "4", "--temperature", "1.0", "--top-p", "1.0", "--top-k", "0"])
    assert code == 0
    counts = sum(len((bins / f"{name}.jsonl").read_text().splitlines()) for name in ("easy", "medium", "hard"))
    assert counts == 4 and (bins / "histogram.png").is_file()

"""On-policy distillation in the trainer (train/teacher.py, the teacher pass of train/programs.py,
train/step.py `distill_batch`): a teacher that is the student reads teacher_kl = 0 exactly and leaves
a mixed update bit for bit the plain one; a teacher of another shape runs; the packed teacher pass
equals the padded one; a missing folder and another tokenizer are one-line errors."""

import json

import jax
import numpy as np
import pytest

from jaxrl4llm.models import load_tokenizer
from jaxrl4llm.train.config import ConfigError, load_config
from jaxrl4llm.train.loop import train
from tests.train.conftest import teacher_folder, tiny_overrides


def records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def student_run(demo_assets, finished_run, out, **extra):
    """The finished tiny run's export as the student (model.path), 2 steps, padded rows."""
    student = finished_run["out"] / "hf_export"
    base = {"model.path": student, "trainer.packing": "false", "trainer.share_prompt": "false"}
    return load_config(None, tiny_overrides(demo_assets, out, **{**base, **extra}))


def test_a_teacher_that_is_the_student_reads_zero_and_leaves_the_mixed_update_as_the_plain_one(
        demo_assets, finished_run, tmp_path):
    """One step (after it the student is no longer its teacher) of two mini-batches: both runs take
    pi_old from the log-prob pass (a single optimizer step without a teacher scores it in the update)."""
    student = finished_run["out"] / "hf_export"
    one = {"trainer.steps": 1, "trainer.mini_batches": 2}
    plain = train(student_run(demo_assets, finished_run, tmp_path / "plain", **one), log=lambda s: None)
    mixed = train(student_run(demo_assets, finished_run, tmp_path / "mixed", **{
        "algorithm.preset": "lite_ppo_opd", "teacher.model": student, "teacher.dtype": "float32", **one}),
        log=lambda s: None)
    for r in records(tmp_path / "mixed"):
        assert r["teacher_kl"] == 0.0 and r["time_teacher"] > 0
        assert all(r[f"teacher_kl_by_position/{k}"] == 0.0 for k in range(10))
        assert sum(r[f"teacher_tokens_by_position/{k}"] for k in range(10)) == pytest.approx(1.0)
    # the two update programs differ (the mixed one computes d_t and [B, T] advantages) and XLA:CPU fuses
    # them differently: the same values to float32 rounding here; bit for bit on the update function
    # itself (tests/train/test_step.py::test_a_zero_teacher_signal_leaves_the_update_bit_for_bit)
    a, b = records(tmp_path / "plain")[0], records(tmp_path / "mixed")[0]
    for key in ("loss", "grad_norm", "approx_kl", "reward"):
        assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-7), key
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7),
                 plain["state"].params, mixed["state"].params)


def test_a_larger_teacher_runs_and_packed_and_shared_prompt_rows_give_the_padded_teacher_logp(demo_assets, finished_run, tmp_path):
    """A 2-layer, 48-wide teacher for the 1-layer, 32-wide student: pure distillation runs, its
    teacher_kl is positive; the packed and the shared-prompt teacher passes give the padded one's log-probs."""
    from jaxrl4llm.train.layout import packing_layout_for
    from jaxrl4llm.train.loop import PromptStream, _prompt_lengths, build_batch, run_meshes, sample_groups, setup_run
    from jaxrl4llm.train.packing import pack_plan, to_padded

    teacher = teacher_folder(tmp_path / "teacher", demo_assets["tokenizer"])
    cfg = student_run(demo_assets, finished_run, tmp_path / "opd", **{
        "algorithm.preset": "opd", "teacher.model": teacher, "teacher.dtype": "float32"})
    history = train(cfg, log=lambda s: None)["history"]
    assert all(np.isfinite(r["teacher_kl"]) and r["teacher_kl"] > 0 for r in history)

    got = {}
    forms = {"padded": {"trainer.packing": "false"}, "packed": {"trainer.packing": "true"},
             "shared": {"trainer.packing": "false", "trainer.share_prompt": "true"}}
    for form, rows in forms.items():
        cfg = student_run(demo_assets, finished_run, tmp_path / form, **{
            "algorithm.preset": "opd", "teacher.model": teacher, "teacher.dtype": "float32", **rows})
        mesh, _ = run_meshes(cfg)
        run, state = setup_run(cfg, mesh, lambda s: None)
        assert (run.settings.packing is not None) == (form == "packed")
        assert (run.settings.prompt_group is not None) == (form == "shared")
        stream = PromptStream(len(run.train_set), seed=0, shuffle=False)
        rollout, scores, _ = sample_groups(run.policy.with_state(state), run.train_set, stream, cfg,
                                           jax.random.PRNGKey(0), run.reward_fn, run.recipe)
        batch, _, extra = build_batch(run, state, rollout, scores.rewards, 0)
        assert extra["time_teacher"] > 0
        got[form] = np.asarray(batch.teacher_logp)
        if form == "packed":
            rows_, width = rollout.prompt_tokens.shape
            layout = packing_layout_for(cfg, rows_, run.settings.packing.shards, width)
            plan = pack_plan(np.asarray(_prompt_lengths(rollout.prompt_mask)), np.asarray(rollout.lengths), layout,
                             width)
            got[form] = to_padded(got[form], plan, rows_, width + rollout.response_tokens.shape[1] - 1)
    for form in ("packed", "shared"):
        np.testing.assert_allclose(got[form], got["padded"], atol=2e-5, err_msg=form)
    assert np.abs(got["padded"]).sum() > 0


def test_a_missing_teacher_folder_is_one_line_naming_the_fix(demo_assets, finished_run, tmp_path):
    cfg = student_run(demo_assets, finished_run, tmp_path / "run", **{
        "algorithm.preset": "opd", "teacher.model": tmp_path / "no_such_teacher"})
    with pytest.raises(ConfigError, match=r"teacher.model=.*no_such_teacher.* is not a folder; point it at") as e:
        train(cfg, log=lambda s: None)
    assert "\n" not in str(e.value)


def test_a_teacher_of_another_tokenizer_is_one_line_naming_both(demo_assets, finished_run, tmp_path):
    teacher = teacher_folder(tmp_path / "teacher", demo_assets["tokenizer"])
    tok = load_tokenizer(teacher)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(str(teacher))
    cfg = student_run(demo_assets, finished_run, tmp_path / "run", **{
        "algorithm.preset": "opd", "teacher.model": teacher})
    with pytest.raises(ConfigError, match=r"has another tokenizer than the student's .*1 of .* token ids differ "
                                          r"\(e.g. '<extra>'") as e:
        train(cfg, log=lambda s: None)
    assert "\n" not in str(e.value) and str(teacher) in str(e.value) and str(demo_assets["tokenizer"]) in str(e.value)


def test_a_distilling_recipe_without_a_teacher_is_a_config_error(demo_assets, tmp_path):
    cfg = load_config(None, tiny_overrides(demo_assets, tmp_path, **{"algorithm.preset": "opd"}))
    with pytest.raises(ConfigError, match="teacher.model is not set; set teacher.model"):
        train(cfg, log=lambda s: None)

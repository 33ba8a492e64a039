"""The run folder: a run writes only into a folder it owns, removes only its own outputs, a
refused start or --resume writes nothing, and an unreadable checkpoint names its step folder and
the newest readable earlier one."""

import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl4llm.cli import main as cli_main
from jaxrl4llm.train.checkpointing import CheckpointError, RunCheckpointer
from jaxrl4llm.train.config import ConfigError, config_to_dict, load_config
from jaxrl4llm.train.loop import prepare_out_dir, train
from jaxrl4llm.train.run_folder import MARKER, check_resumable, is_run_folder, mark_finished, mark_run_folder
from jaxrl4llm.train.step import init_train_state

from tests.train.conftest import tiny_overrides

HF_CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896}


def _cfg(out, *extra):
    return load_config(None, [f"trainer.out_dir={out}", *extra])


def _tree(folder):
    """Every path under `folder` with the content of its files: what a refused start must leave as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def _hf_folder(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(HF_CONFIG))
    (path / "model.safetensors").write_bytes(b"\0" * 16)
    return path


def _run_folder(path, *, checkpoint=None, finished=False, marker=True):
    """A run folder as a run leaves it: outputs, a note of the user's, a checkpoint if asked."""
    path.mkdir(parents=True)
    if marker:
        mark_run_folder(path)
    (path / "config.json").write_text(json.dumps(config_to_dict(_cfg(path))))
    (path / "metrics.jsonl").write_text('{"step": 1}\n')
    (path / "tb").mkdir()
    (path / "checkpoints").mkdir()
    (path / "checkpoints" / "3.orbax-checkpoint-tmp-7").mkdir()  # a half-written step: not a checkpoint
    if checkpoint is not None:
        (path / "checkpoints" / str(checkpoint)).mkdir()
    if finished:
        mark_finished(path)
    (path / "notes.txt").write_text("mine")
    return path


def test_a_folder_that_is_not_a_run_is_refused_and_left_as_it_was(tmp_path):
    hf = _hf_folder(tmp_path / "Qwen2-0.5B")
    before = _tree(hf)
    assert not is_run_folder(hf)
    with pytest.raises(ConfigError, match=r"trainer.out_dir=.*Qwen2-0.5B.* is not empty \(config.json, model.safetensors\) "
                                          r"and is not a jaxrl4llm run folder.*config.json is not a run's.*choose a new"):
        prepare_out_dir(_cfg(hf), resume=False)
    # trainer.overwrite removes a run's own outputs only: a folder that is not a run stays refused
    with pytest.raises(ConfigError, match=r"trainer.overwrite=true removes only a run's own outputs"):
        prepare_out_dir(_cfg(hf, "trainer.overwrite=true"), resume=False)
    with pytest.raises(ConfigError, match=r"--resume: trainer.out_dir=.* is not a jaxrl4llm run folder.*nothing to resume"):
        prepare_out_dir(_cfg(hf), resume=True)
    assert _tree(hf) == before
    # any other non-empty folder too, e.g. one holding outputs named like a run's but no config of ours
    other = tmp_path / "other"
    (other / "checkpoints").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"is not empty \(checkpoints\) and is not a jaxrl4llm run folder"):
        prepare_out_dir(_cfg(other, "trainer.overwrite=true"), resume=False)
    assert (other / "checkpoints").is_dir() and not (other / MARKER).exists()


def test_a_failed_resume_writes_nothing(tmp_path, capsys):
    missing = tmp_path / "runs" / "nope"
    with pytest.raises(ConfigError, match=r"--resume: trainer.out_dir=.*nope.* does not exist: nothing to resume"):
        train(_cfg(missing), resume=True, log=lambda s: None)
    assert cli_main(["train", "--resume", f"trainer.out_dir={missing}"]) == 2
    assert "does not exist: nothing to resume" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its parent created
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"is not a jaxrl4llm run folder"):
        train(_cfg(empty), resume=True, log=lambda s: None)
    assert list(empty.iterdir()) == []
    run = _run_folder(tmp_path / "run")  # a run without a complete checkpoint
    before = _tree(run)
    with pytest.raises(ConfigError, match=r"holds no complete checkpoint.*nothing to resume.*starts over by itself"):
        train(_cfg(run), resume=True, log=lambda s: None)
    assert _tree(run) == before


def test_a_fresh_run_creates_and_marks_its_folder_first(tmp_path):
    out = prepare_out_dir(_cfg(tmp_path / "runs" / "a"), resume=False)
    assert out == tmp_path / "runs" / "a" and [p.name for p in out.iterdir()] == [MARKER]
    marker = json.loads((out / MARKER).read_text())
    assert marker["version"] and re.match(r"\d{4}-\d\d-\d\dT", marker["created"]) and marker["finished"] is None
    empty = tmp_path / "empty"
    empty.mkdir()
    prepare_out_dir(_cfg(empty), resume=False)
    assert [p.name for p in empty.iterdir()] == [MARKER]


def test_a_run_that_stopped_before_its_first_checkpoint_starts_over_by_itself(tmp_path):
    run = _run_folder(tmp_path / "run")
    messages = []
    prepare_out_dir(_cfg(run), resume=False, log=messages.append)
    assert sorted(p.name for p in run.iterdir()) == [MARKER, "notes.txt"]
    assert messages == [f"no checkpoint to resume (the earlier run stopped before its first one): removed the earlier "
                        f"run's checkpoints, metrics.jsonl, tb, config.json from {run}"]


def test_a_run_to_resume_or_a_finished_one_is_kept_without_overwrite(tmp_path):
    cases = {"checkpointed": (dict(checkpoint=2), r"Pass --resume to continue it from step 2, trainer.overwrite=true"),
             "finished": (dict(finished=True), r"It has no checkpoint to resume \(it finished\)\. Pass trainer.overwrite"),
             # a run folder of a version before the marker: recognised by its config.json
             "earlier_version": (dict(marker=False), r"It has no checkpoint to resume\. Pass trainer.overwrite=true")}
    for name, (kind, message) in cases.items():
        run = _run_folder(tmp_path / name, **kind)
        before = _tree(run)
        with pytest.raises(ConfigError, match=r"already holds a run \(checkpoints, metrics.jsonl, tb, config.json\)\. "
                                              + message):
            prepare_out_dir(_cfg(run), resume=False)
        assert _tree(run) == before, name
        messages = []
        prepare_out_dir(_cfg(run, "trainer.overwrite=true"), resume=False, log=messages.append)
        assert sorted(p.name for p in run.iterdir()) == [MARKER, "notes.txt"], name
        assert messages == [f"trainer.overwrite: removed the earlier run's checkpoints, metrics.jsonl, tb, config.json "
                            f"from {run}"], name
        assert json.loads((run / MARKER).read_text())["finished"] is None  # a new run


def test_resume_finds_the_newest_complete_checkpoint_also_in_a_folder_without_marker(tmp_path):
    run = _run_folder(tmp_path / "run", checkpoint=2, marker=False)
    (run / "checkpoints" / "4").mkdir()
    assert is_run_folder(run) and check_resumable(run) == 4
    assert prepare_out_dir(_cfg(run), resume=True) == run and not (run / MARKER).exists()  # resume checks only


def test_a_reward_that_raises_leaves_a_folder_a_plain_rerun_starts_over(demo_assets, tmp_path):
    """The one run end to end: the failed run's checkpoints/, tb/ and config.json do not block
    a rerun (of no steps: its update would only add compile time), the finished rerun does, and
    nothing is written beside the run folder."""
    run = tmp_path / "run"
    tiny = {"trainer.steps": 1, "trainer.eval_every": -1, "trainer.clipped_tokens_every": 0}
    with pytest.raises(RuntimeError, match="reward server down"):
        train(load_config(None, tiny_overrides(demo_assets, run, **tiny,
                                               **{"reward.fn": "tests.train.test_run_folder:raising_reward",
                                                  "reward.on_error": "raise"})),
              log=lambda s: None)
    assert (run / "checkpoints").is_dir() and (run / "config.json").is_file()
    messages = []
    summary = train(load_config(None, tiny_overrides(demo_assets, run, **{**tiny, "trainer.steps": 0})),
                    log=messages.append)
    assert summary["history"] == [] and (run / "config.json").is_file()
    layout = json.loads((run / "layout.json").read_text())  # what the config resolved to (train/layout.py)
    assert layout["rows"] == 8 and layout["model"]["hidden_size"] == 32 and layout["update"]["micro_batches"] == 1
    # the attention kernels the run resolved once (kernels/choice.py), each with why
    assert layout["train_attention"]["kernel"] == "xla" and layout["decode_attention"]["kernel"] in ("xla", "cpu_native")
    assert layout["decode_attention"]["reason"].startswith("auto: ") and layout["train_attention"]["reason"]
    assert [m for m in messages if "removed the earlier run's" in m] == [
        f"no checkpoint to resume (the earlier run stopped before its first one): removed the earlier run's "
        f"checkpoints, tb, config.json, layout.json from {run}"]
    assert json.loads((run / MARKER).read_text())["finished"]
    with pytest.raises(ConfigError, match=r"already holds a run .*\(it finished\)"):
        train(load_config(None, tiny_overrides(demo_assets, run, **tiny)), log=lambda s: None)
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


def raising_reward(response: str, gold: str) -> float:
    raise RuntimeError("reward server down")


# ----------------------------------------------------------------------------- unreadable checkpoints


# a train state as the loop saves it (a TrainState pytree node: without its tree metadata orbax
# reads plain dicts and fails on the node type)
STATE = init_train_state({"w": jnp.arange(600.0).reshape(6, 100), "b": jnp.ones(3)}, optax.adam(1e-3))


def _saved(out, steps=(2, 4)):
    ckpt = RunCheckpointer(out, keep=len(steps))
    for step in steps:
        ckpt.save(step, jax.tree.map(lambda x: x + step, STATE), {"data_cursor": step})
    ckpt.close()
    return out / "checkpoints"


def _truncate_largest_shard(step_dir):
    shard = max((p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"),
                key=lambda p: p.stat().st_size)
    shard.write_bytes(shard.read_bytes()[:100])


def test_a_truncated_shard_names_its_step_and_the_newest_readable_one(tmp_path):
    ckpts = _saved(tmp_path)
    _truncate_largest_shard(ckpts / "4")
    with pytest.raises(CheckpointError) as e:
        RunCheckpointer(tmp_path).restore(STATE)
    message = str(e.value)
    assert message.startswith(f"checkpoint step 4 at {ckpts / '4'} cannot be read (")
    assert message.endswith(f"); the newest readable earlier one is step 2: delete {ckpts / '4'} to resume from it.")
    assert "\n" not in message and "tensorstore_spec" not in message and len(message) < 600
    # the advice holds: without step 4, step 2 restores
    shutil.rmtree(ckpts / "4")
    state, meta, step = RunCheckpointer(tmp_path).restore(STATE)
    assert step == 2 and meta == {"data_cursor": 2}
    np.testing.assert_array_equal(state.params["w"], np.asarray(STATE.params["w"]) + 2)


def test_missing_metadata_names_the_file_and_with_no_readable_one_says_so(tmp_path):
    ckpts = _saved(tmp_path)
    (ckpts / "4" / "state" / "_METADATA").unlink()
    with pytest.raises(CheckpointError, match=r"step 4 at .*/checkpoints/4 cannot be read \(state/_METADATA missing; "
                                              r"orbax: .*\); the newest readable earlier one is step 2"):
        RunCheckpointer(tmp_path).restore(STATE)
    (ckpts / "2" / "meta" / "metadata").unlink()
    with pytest.raises(CheckpointError, match=r"step 4 .* cannot be read .*; none of the earlier ones \(2\) can be read "
                                              r"either"):
        RunCheckpointer(tmp_path).restore(STATE)
    only = _saved(tmp_path / "one", steps=(2,))
    _truncate_largest_shard(only / "2")
    with pytest.raises(CheckpointError, match=r"step 2 .* cannot be read .*; there is no earlier one"):
        RunCheckpointer(tmp_path / "one").restore(STATE)


def test_the_cli_prints_a_checkpoint_error_without_a_traceback(tmp_path, monkeypatch, capsys):
    from jaxrl4llm.train import loop

    def unreadable(cfg, **kwargs):
        raise CheckpointError("checkpoint step 4 at /x/checkpoints/4 cannot be read (truncated)")

    monkeypatch.setattr(loop, "train", unreadable)
    assert cli_main(["train", "--resume", f"trainer.out_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err
    assert err == "jaxrl4llm train: error: checkpoint step 4 at /x/checkpoints/4 cannot be read (truncated)\n"

"""gs:// paths against a local GCS emulator (gcp-storage-emulator, in memory, on 127.0.0.1; no
network): a run's checkpoints saved and resumed on gs://, exported from gs:// to gs://, and the
export loaded back as model.path. STORAGE_EMULATOR_HOST alone points every layer at it."""

import importlib
import importlib.util
import json
import os
import socket
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxrl4llm import storage
from tests.train.conftest import tiny_overrides


def _need(module: str) -> None:
    if importlib.util.find_spec(module.split(".")[0]) is None:
        if os.environ.get("CI") == "1":
            pytest.fail(f"{module} not installed; pip install -e '.[test]'")
        pytest.skip(f"{module} not installed (the test extra has it)")


def _serialized_handlers(server_module) -> None:
    """The emulator, made to answer as GCS does under concurrent requests: one request at a time
    (its in-memory store is read and rewritten without a lock: a download read an object's bytes
    and its metadata apart while tensorstore rewrote an OCDBT manifest, and tensorstore then
    failed with "Malformed StorageGeneration" once in a loaded CI run), and media downloads carry
    the object's x-goog-generation / x-goog-metageneration headers, as GCS's do: both routes,
    /download/... and tensorstore's GET .../o/NAME?alt=media (the emulator answers the latter
    without them; tensorstore then reads generation 0 and refuses its next conditional write with
    "Malformed StorageGeneration": `test_a_read_object_s_generation_conditions_the_next_write`)."""
    import threading

    if getattr(server_module, "_jaxrl4llm_serialized", False):
        return
    lock = threading.Lock()
    objects = importlib.import_module("gcp_storage_emulator.handlers.objects")

    def wrap(fn):
        def handler(request, response, storage, *args, **kwargs):
            with lock:
                fn(request, response, storage, *args, **kwargs)
                media = fn is objects.download or (fn is objects.get and request.query.get("alt") == ["media"])
                if media and response.status < 300:
                    try:
                        obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
                    except Exception:  # noqa: BLE001 (not found: the handler answered already)
                        return
                    response["x-goog-generation"] = str(obj.get("generation") or "1")
                    response["x-goog-metageneration"] = str(obj.get("metageneration") or "1")
        return handler

    server_module.HANDLERS = tuple((regex, {method: wrap(fn) for method, fn in handlers.items()})
                                   for regex, handlers in server_module.HANDLERS)
    server_module._jaxrl4llm_serialized = True


@pytest.fixture(scope="module")
def bucket():
    """gs://jaxrl4llm-test on an in-memory emulator; STORAGE_EMULATOR_HOST set for the module."""
    _need("gcsfs")
    _need("gcp_storage_emulator")
    server_module = importlib.import_module("gcp_storage_emulator.server")
    _serialized_handlers(server_module)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = server_module.create_server("127.0.0.1", port, in_memory=True, default_bucket="jaxrl4llm-test")
    server.start()
    saved = {k: os.environ.get(k) for k in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL",
                                            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")}
    os.environ["STORAGE_EMULATOR_HOST"] = f"127.0.0.1:{port}"
    assert storage.use_storage_emulator() == f"http://127.0.0.1:{port}"
    assert os.environ["TENSORSTORE_GCS_HTTP_URL"] == f"http://127.0.0.1:{port}"
    try:
        yield "gs://jaxrl4llm-test"
    finally:
        server.stop()
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def test_a_read_object_s_generation_conditions_the_next_write(bucket):
    """What orbax's OCDBT manifest writes rely on: tensorstore reads an object (a fresh context: no
    cache) and writes it back on the condition that it is unchanged. The emulator must give the read
    the object's generation, as GCS does; with generation 0 the write fails "Malformed
    StorageGeneration" (it did, now and then, in CI's gs:// training run)."""
    import tensorstore as ts

    spec = {"driver": "gcs", "bucket": bucket.removeprefix("gs://"), "path": "generations/"}
    written = ts.KvStore.open(spec, context=ts.Context()).result().write("x", b"one").result()
    store = ts.KvStore.open(spec, context=ts.Context()).result()
    read = store.read("x").result()
    assert read.value == b"one" and read.stamp.generation == written.generation
    store.write("x", b"two", if_equal=read.stamp.generation).result()
    assert ts.KvStore.open(spec, context=ts.Context()).result().read("x").result().value == b"two"


def test_run_path_keeps_local_paths_and_opens_gs_urls(tmp_path):
    assert storage.run_path("runs/x") == Path("runs/x").absolute() and not storage.is_remote("runs/x")
    assert storage.is_remote("gs://b/runs/x")
    assert storage.local_copy(tmp_path) == tmp_path  # a local folder is used in place


def _steps(lines: str) -> list[dict]:
    return [r for r in map(json.loads, lines.splitlines()) if "loss" in r]


def test_train_on_gcs_resumes_to_a_local_runs_metrics(bucket, demo_assets, tmp_path, monkeypatch,
                                                      session_compile_cache):
    """trainer.out_dir=gs:// and gs:// data files: 2 steps, then (the staging folder gone: another VM) --resume to 4;
    the metrics equal a local 4-step run's, once each, in the bucket; the run folder's marker
    refuses a fresh start there; the run exports."""
    from jaxrl4llm.train.config import ConfigError, load_config
    from jaxrl4llm.train.export import export_checkpoint
    from jaxrl4llm.train.loop import train
    from jaxrl4llm.train.run_files import staging_folder
    from jaxrl4llm.train.run_folder import prepare_out_dir, read_marker

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    common = {"trainer.checkpoint_every": 2, "trainer.compile_cache": str(session_compile_cache)}  # the session's
    local = tmp_path / "local"
    train(load_config(None, tiny_overrides(demo_assets, local, **common, **{"trainer.steps": 4})), log=lambda s: None)

    for name in ("train", "test"):  # the run on gs:// reads its data files from gs:// too
        (storage.run_path(bucket) / "data" / f"{name}.jsonl").write_text(Path(demo_assets[name]).read_text())
    common.update({"data.train_files": f"[{bucket}/data/train.jsonl]", "data.eval_files": f"[{bucket}/data/test.jsonl]"})
    run = f"{bucket}/runs/train"
    train(load_config(None, tiny_overrides(demo_assets, run, **common)), log=lambda s: None)
    assert (tmp_path / "cache" / "jaxrl4llm" / "gcs" / "jaxrl4llm-test" / "data" / "train.jsonl").is_file()
    remote = storage.run_path(run)
    assert [r["step"] for r in _steps((remote / "metrics.jsonl").read_text())] == [1, 2]
    assert any((remote / "tb").iterdir()) and read_marker(run)["finished"]
    import shutil

    shutil.rmtree(staging_folder(run))  # the resume runs on another VM: all it has is the bucket
    resumed = train(load_config(None, tiny_overrides(demo_assets, run, **common, **{"trainer.steps": 4})),
                    resume=True, log=lambda s: None)
    assert resumed["start_step"] == 2
    got, want = _steps((remote / "metrics.jsonl").read_text()), _steps((local / "metrics.jsonl").read_text())
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for a, b in zip(got, want):
        for k in ("loss", "grad_norm", "reward", "entropy", "response_length", "approx_kl"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (a["step"], k)
    lengths = [json.loads(line)["step"] for line in (remote / "response_lengths.jsonl").read_text().splitlines()]
    assert lengths == [1, 2, 3, 4]
    with pytest.raises(ConfigError, match="already holds a run"):  # the marker, read on gs://
        train(load_config(None, tiny_overrides(demo_assets, run, **common, **{"trainer.steps": 6})))
    out = export_checkpoint(run, tmp_path / "export")
    assert json.loads((out / "jaxrl4llm_source.json").read_text())["step"] == 4
    # trainer.overwrite on gs:// removes the run's outputs there (only those) and marks it anew
    (remote / "notes.txt").write_text("kept")
    prepare_out_dir(load_config(None, tiny_overrides(demo_assets, run, **common, **{"trainer.overwrite": True})),
                    resume=False, log=lambda s: None)
    assert sorted(p.name for p in remote.iterdir()) == [".jaxrl4llm-run", "notes.txt"]
    assert read_marker(run)["finished"] is None


def test_run_files_copy_changed_files_whole_and_a_pull_replaces_a_stale_staging_folder(bucket, tmp_path, monkeypatch):
    from jaxrl4llm.train.run_files import RunFiles, staging_folder

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    run = f"{bucket}/runs/files"
    files = RunFiles(run)
    assert files.dir == staging_folder(run) == tmp_path / "cache" / "jaxrl4llm" / "runs" / "jaxrl4llm-test" / "runs" / "files"
    files.pull()  # nothing in the bucket yet
    (files.dir / "tb").mkdir()
    (files.dir / "tb" / "events.1").write_text("e1")
    (files.dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (files.dir / "scratch.txt").write_text("not a run output")
    assert sorted(files.sync()) == ["metrics.jsonl", "tb/events.1"]
    assert files.sync() == []  # nothing changed
    with open(files.dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 2}\n')
    assert files.sync() == ["metrics.jsonl"]
    remote = storage.run_path(run)
    assert (remote / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n' and not (remote / "scratch.txt").exists()
    (files.dir / "response_lengths.jsonl").write_text("stale, from another run on this machine\n")
    again = RunFiles(run)
    again.pull()
    assert sorted(str(p.relative_to(again.dir)) for p in again.dir.rglob("*") if p.is_file()) == [
        "metrics.jsonl", "scratch.txt", "tb/events.1"]
    assert again.sync() == []  # what was pulled is what the bucket holds
    assert RunFiles(tmp_path / "local").dir == tmp_path / "local" and RunFiles(tmp_path / "local").sync() == []
    assert RunFiles(run, enabled=False).sync() == []  # a process other than the first copies nothing


def test_a_missing_gs_data_file_names_its_setting(bucket, demo_assets, tmp_path, monkeypatch):
    from jaxrl4llm.train.config import ConfigError, load_config
    from jaxrl4llm.train.prompts import load_prompt_sets

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cfg = load_config(None, tiny_overrides(demo_assets, tmp_path / "run", **{
        "data.train_files": f"[{demo_assets['train']}]", "data.eval_files": f"[{bucket}/data/missing.jsonl]"}))
    with pytest.raises(ConfigError, match=rf"data.eval_files\[0\]='{bucket}/data/missing.jsonl': .*does not exist"):
        load_prompt_sets(cfg)


def test_checkpoints_export_and_load_on_gcs(bucket, demo_assets, tmp_path, monkeypatch):
    from jaxrl4llm.train.checkpointing import RunCheckpointer
    from jaxrl4llm.train.config import config_to_dict, load_config
    from jaxrl4llm.train.export import export_checkpoint
    from jaxrl4llm.train.policy import load_policy
    from jaxrl4llm.train.run_folder import checkpoint_steps

    run = f"{bucket}/runs/a"
    cfg = load_config(None, tiny_overrides(demo_assets, run))
    policy = load_policy(cfg, None)
    storage.run_path(run).mkdir(parents=True, exist_ok=True)
    (storage.run_path(run) / "config.json").write_text(json.dumps(config_to_dict(cfg)))
    # save: asynchronous, straight to gs:// (tensorstore's GCS driver); a step counts once committed
    ckpt = RunCheckpointer(run, keep=3)
    moved = jax.tree.map(lambda x: x + 1, policy.params)
    for step, params in ((1, policy.params), (2, moved)):
        ckpt.save(step, {"params": params}, {"step": step})
    ckpt.close()
    assert checkpoint_steps(run) == [1, 2]
    assert (storage.run_path(run) / "checkpoints" / "2" / "commit_success.txt").exists()
    # resume: the latest step restores from gs://
    state, meta, step = RunCheckpointer(run).restore({"params": policy.params})
    assert step == 2 and meta == {"step": 2}
    for a, b in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(moved)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # export: gs:// run -> gs:// Hugging Face folder
    out = export_checkpoint(run, f"{bucket}/exports/a")
    assert str(out) == f"{bucket}/exports/a" and (out / "model.safetensors").exists()
    assert json.loads((out / "jaxrl4llm_source.json").read_text())["step"] == 2
    # load: model.path=gs://... is copied once into a local cache and loaded
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    loaded = load_policy(load_config(None, tiny_overrides(demo_assets, tmp_path / "b", **{
        "model.path": f"{bucket}/exports/a", "model.tokenizer": "null"})), None)
    assert (tmp_path / "cache" / "jaxrl4llm" / "gcs" / "jaxrl4llm-test" / "exports" / "a" / "model.safetensors").is_file()
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(moved)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)

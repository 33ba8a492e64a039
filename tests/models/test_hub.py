"""jaxrl4llm.models.hub: a model named by its Hub id resolves through huggingface_hub's cache
(written here as the library lays it out, read offline), a local folder wins, an absent one names
the `hf download` command, and several processes download once."""

import jax
import numpy as np
import pytest

from jaxrl4llm.data import build_char_tokenizer
from jaxrl4llm.models import ModelConfig, abstract_model, save_pretrained
from jaxrl4llm.models import hub
from jaxrl4llm.models.hub import HubFilesMissing, download_command, parse_hub_id, resolve_model
from tests.hub_cache import COMMIT, folder_files, offline_hub, write_hub_repo  # noqa: F401 (a fixture)


@pytest.mark.parametrize("spec, parsed", [
    ("Qwen/Qwen3-4B-Base", ("Qwen/Qwen3-4B-Base", None)),
    ("Qwen/Qwen3-4B-Base@main", ("Qwen/Qwen3-4B-Base", "main")),
    ("org/name.v2@" + COMMIT, ("org/name.v2", COMMIT)),
    ("/data/Qwen3-4B-Base", None), ("./org/name", None), ("runs/x/hf_export", None), ("gs://b/m", None),
    ("name", None), ("~/org", None),
])
def test_parse_hub_id(spec, parsed):
    assert parse_hub_id(spec) == parsed


def test_download_command_is_the_hf_cli():
    assert download_command("Qwen/Qwen3-4B-Base", revision="v1", files=("*.json", "*.safetensors")) == \
        "hf download Qwen/Qwen3-4B-Base --revision v1 --include '*.json' --include '*.safetensors'"
    assert download_command("openai/gsm8k", repo_type="dataset", files=("*.parquet",)) == \
        "hf download openai/gsm8k --repo-type dataset --include '*.parquet'"


@pytest.fixture(scope="module")
def tiny_model_files(tmp_path_factory):
    """{path: bytes} of a tiny Qwen3 checkpoint folder with the char tokenizer (chat template)."""
    folder = tmp_path_factory.mktemp("tiny_hub_model")
    config = ModelConfig(vocab_size=128, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                         num_kv_heads=1, head_dim=8, dtype="float32", param_dtype="float32")
    graphdef, shapes = abstract_model(config)  # random numpy weights: no compile (init_model's takes seconds)
    rng = np.random.default_rng(0)
    save_pretrained((graphdef, jax.tree.map(lambda x: (0.02 * rng.standard_normal(x.shape)).astype(x.dtype), shapes)),
                    folder)
    build_char_tokenizer(folder)
    return folder_files(folder)


def test_a_hub_id_resolves_offline_from_the_cache(offline_hub, tiny_model_files, tmp_path, monkeypatch):
    from jaxrl4llm.train.config import load_config
    from jaxrl4llm.train.policy import load_policy
    from jaxrl4llm.train.prompts import run_tokenizer

    snapshot = write_hub_repo(offline_hub, "org/tiny", tiny_model_files)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("org/tiny") == snapshot
    assert resolve_model(f"org/tiny@{COMMIT}") == snapshot
    cfg = load_config(None, ["model.path=org/tiny@main", "model.dtype=float32"])
    policy = load_policy(cfg, None)
    assert (policy.config.hidden_size, policy.config.vocab_size) == (16, 128)
    assert policy.tokenizer.chat_template and run_tokenizer(cfg).get_vocab() == policy.tokenizer.get_vocab()


def test_a_local_folder_wins_over_the_same_hub_id(offline_hub, tmp_path, monkeypatch):
    write_hub_repo(offline_hub, "org/tiny", {"config.json": b"{}"})
    (tmp_path / "org" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_model("org/tiny").resolve() == (tmp_path / "org" / "tiny").resolve()


def test_an_absent_hub_model_names_the_command_that_fetches_it(offline_hub, tmp_path, monkeypatch):
    from jaxrl4llm.train.config import ConfigError, load_config
    from jaxrl4llm.train.policy import load_policy
    from jaxrl4llm.train.prompts import run_tokenizer

    monkeypatch.chdir(tmp_path)
    with pytest.raises(HubFilesMissing, match=r"'org/absent' is no local folder .* not in the Hugging Face cache .*"
                                              r"hf download org/absent --include '\*.json' --include '\*.safetensors'"):
        resolve_model("org/absent")
    with pytest.raises(ConfigError, match=r"model.path='Qwen/Qwen3-4B-Base@v2': .*hf download Qwen/Qwen3-4B-Base "
                                          r"--revision v2 --include"):
        run_tokenizer(load_config(None, ["model.path=Qwen/Qwen3-4B-Base@v2"]))
    with pytest.raises(ConfigError, match=r"model.tokenizer='org/absent': .*hf download org/absent --include '\*.json' "
                                          r"--include tokenizer.model"):
        load_policy(load_config(None, ["model.tokenizer=org/absent"]), None)


def test_several_processes_download_once(monkeypatch, tmp_path):
    """Process 0 downloads, then every process meets at the broadcast of its outcome; the others read
    the cache only (a host whose own cache lacks the files downloads them there). A failure on
    process 0 reaches the broadcast first (no process waits forever), then every process raises."""
    from huggingface_hub.errors import LocalEntryNotFoundError
    from jax.experimental import multihost_utils

    calls, barrier, cached = [], [], {"org/tiny"}
    outcome = {}

    def broadcast(value):
        barrier.append(len(calls))
        return outcome.get("process 0", value)

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(multihost_utils, "broadcast_one_to_all", broadcast)

    def snapshot_download(repo_id, local_files_only, **kwargs):
        calls.append((repo_id, local_files_only, kwargs["allow_patterns"]))
        if repo_id == "org/broken" or (local_files_only and repo_id not in cached):
            raise LocalEntryNotFoundError("offline")
        return str(tmp_path)

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    for index, local_only in ((0, False), (1, True)):
        calls.clear(), barrier.clear()
        monkeypatch.setattr(jax, "process_index", lambda index=index: index)
        assert hub.resolve_hub_repo("org/tiny", files=hub.MODEL_FILES) == tmp_path
        assert calls == [("org/tiny", local_only, list(hub.MODEL_FILES))]
        assert barrier == [1 - index]  # process 0: after its download; the others: before reading
    calls.clear()
    assert hub.resolve_hub_repo("org/unshared") == tmp_path  # process 1, its own cache: it downloads
    assert [c[:2] for c in calls] == [("org/unshared", True), ("org/unshared", False)]
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    barrier.clear()
    with pytest.raises(HubFilesMissing, match="hf download org/broken"):
        hub.resolve_hub_repo("org/broken")
    assert len(barrier) == 1
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    outcome["process 0"] = 0
    with pytest.raises(HubFilesMissing, match="process 0 could not fetch the model 'org/broken'"):
        hub.resolve_hub_repo("org/broken")

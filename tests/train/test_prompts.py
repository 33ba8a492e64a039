"""train/prompts.py on the peers' data: a verl parquet named as a Hub dataset and a TRL jsonl of
chat prompts train a tiny run, a system prompt reaches the chat, and rows without a gold answer
are kept for a reward that needs none (and refused, naming data.answer_key, for the verifier)."""

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxrl4llm.train.config import ConfigError, load_config
from jaxrl4llm.train.prompts import load_prompt_sets
from tests.hub_cache import offline_hub, write_hub_repo  # noqa: F401 (a fixture)
from tests.train.conftest import tiny_overrides


@pytest.fixture()
def peer_data(offline_hub, tmp_path):
    """hf://org/verl_math (verl's parquet layout, in the offline Hub cache) and a TRL jsonl."""
    rows = [{"data_source": "gsm8k", "prompt": [{"role": "user", "content": f"What is {i}+1?"}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)}, "extra_info": {"index": i}}
            for i in range(4)]
    buffer = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buffer)
    write_hub_repo(offline_hub, "org/verl_math", {"data/train.parquet": buffer.getvalue()}, repo_type="dataset")
    trl = tmp_path / "trl.jsonl"
    trl.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {i}+2?"}],
                                       "solution": str(i + 2)}) + "\n" for i in range(4)))
    return {"verl": "hf://org/verl_math@train", "trl": str(trl)}


def test_verl_and_trl_data_train_a_tiny_run(demo_assets, peer_data, tmp_path):
    from jaxrl4llm.train.loop import train

    overrides = tiny_overrides(demo_assets, tmp_path / "run", **{
        "data.train_files": f"[{peer_data['verl']},{peer_data['trl']}]", "data.eval_files": "[]",
        "data.system_prompt": "Be brief.", "trainer.steps": 1})
    cfg = load_config(None, overrides)
    train_set, _ = load_prompt_sets(cfg)
    assert train_set.answers == ["1", "2", "3", "4", "2", "3", "4", "5"]
    assert train_set.texts[0] == "system: Be brief.\nuser: What is 0+1?\nassistant:"
    assert train_set.problems[4] == "What is 0+2?" and train_set.metadata[0]["extra_info"] == {"index": 0}
    summary = train(cfg, log=lambda line: None)
    assert len(summary["history"]) == 1


def test_rows_without_a_gold_answer(demo_assets, tmp_path):
    open_rows = tmp_path / "open.jsonl"
    open_rows.write_text(json.dumps({"prompt": [{"role": "user", "content": "Say 1."}]}) + "\n")
    base = tiny_overrides(demo_assets, tmp_path / "run", **{"data.train_files": f"[{open_rows}]",
                                                            "data.eval_files": "[]"})
    no_gold = "reward.fn=tests.train.custom_parts:needs_no_gold_reward"
    train_set, _ = load_prompt_sets(load_config(None, base + [no_gold]))
    assert train_set.answers == [""] and train_set.texts == ["user: Say 1.\nassistant:"]
    with pytest.raises(ConfigError, match=r"data.answer_key is unset and none of the usual names .* Set "
                                          r"data.answer_key to the field that holds the gold answer.*; or, with a "
                                          r"reward.fn that needs no gold answer, give its second parameter a default"):
        load_prompt_sets(load_config(None, base + ["reward.fn=jaxrl4llm.rewards:batch_math_reward"]))

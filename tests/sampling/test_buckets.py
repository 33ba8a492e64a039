"""Buckets, left padding, Rollout host helpers and generate()'s input errors (no compiles)."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl4llm.models import ModelConfig, abstract_model
from jaxrl4llm.sampling import Rollout, bucket, decode_responses, generate, group_rows, left_pad_prompts
from jaxrl4llm.sampling.decode_loop import block_size_for
from jaxrl4llm.sampling.rollout import prompt_token_lists, response_token_lists


def test_bucket_rounds_up_and_respects_multiples():
    assert bucket(1, (16, 32)) == 16
    assert bucket(17, (16, 32)) == 32
    assert bucket(33, (16, 32)) == 64  # past the last bucket: next multiple of it
    assert bucket(3, (1, 2, 4, 8), multiple_of=4) == 4
    assert bucket(1, (1, 2, 4, 8), multiple_of=4) == 4
    assert bucket(9, (1, 2, 4, 8), multiple_of=4) == 16
    with pytest.raises(ValueError):
        bucket(0, (1, 2))


def test_left_pad_prompts_right_aligns_and_marks_filler_rows():
    padded = left_pad_prompts([[5, 6, 7], [8]], pad_token_id=0, length=4, num_rows=4)
    np.testing.assert_array_equal(padded.tokens, [[0, 5, 6, 7], [0, 0, 0, 8], [0, 5, 6, 7], [0, 5, 6, 7]])
    np.testing.assert_array_equal(padded.mask, [[0, 1, 1, 1], [0, 0, 0, 1], [0, 1, 1, 1], [0, 1, 1, 1]])
    np.testing.assert_array_equal(padded.row_valid, [True, True, False, False])
    # positions = cumsum(mask) - 1 put each prompt's first real token at 0
    assert (np.cumsum(padded.mask, 1) - 1)[1, 3] == 0


def test_left_pad_prompts_names_the_offending_prompt():
    with pytest.raises(ValueError, match=r"prompt 1 has 5 tokens, more than the prompt budget of 4"):
        left_pad_prompts([[1], [1, 2, 3, 4, 5]], pad_token_id=0, length=4, num_rows=2)
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        left_pad_prompts([[]], pad_token_id=0, length=4, num_rows=1)


TINY = ModelConfig(architecture="qwen3", vocab_size=50, hidden_size=16, intermediate_size=32, num_layers=1,
                   num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=64)


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_prompt_length=3), r"prompt 1 has 5 tokens, more than max_prompt_length=3; raise max_prompt_length"),
    (dict(max_new_tokens=60), r"exceeds the model's max_position_embeddings=64; lower max_new_tokens"),
    (dict(temperature=0.0), r"temperature must be > 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), r"top_k must be >= 0"),
    (dict(num_samples=0), r"num_samples must be >= 1"),
    (dict(eos_token_ids=[50]), r"eos_token_ids contains 50, outside the vocabulary"),
    (dict(prompts=[[1], [2, 99]]), r"prompt 1 holds token ids outside the vocabulary"),
])
def test_generate_rejects_bad_input_with_a_clear_message(kwargs, message):
    args = dict(prompts=[[1, 2], [1, 2, 3, 4, 5]], num_samples=2, max_new_tokens=8, eos_token_ids=[2], pad_token_id=0,
                rng=jax.random.key(0))
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        generate(*abstract_model(TINY), args.pop("prompts"), **args)  # shapes only: fails before any compile


class _Tokenizer:
    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(f"t{t}" for t in row) for row in rows]


def test_rollout_host_helpers_drop_padding():
    rollout = Rollout(
        prompt_tokens=np.array([[0, 4, 5], [0, 4, 5]]), prompt_mask=np.array([[0, 1, 1], [0, 1, 1]], np.float32),
        response_tokens=np.array([[7, 2, 0], [8, 9, 3]]), response_mask=np.array([[1, 1, 0], [1, 1, 1]], np.float32),
        logprobs=np.zeros((2, 3), np.float32), logprobs_untruncated=np.zeros((2, 3), np.float32),
        lengths=np.array([2, 3], np.int32), truncated=np.array([False, True]))
    assert response_token_lists(rollout) == [[7, 2], [8, 9, 3]]
    assert prompt_token_lists(rollout) == [[4, 5], [4, 5]]
    assert decode_responses(rollout, _Tokenizer()) == ["t7 t2", "t8 t9 t3"]
    assert group_rows(["a", "b", "c", "d"], 2) == [["a", "b"], ["c", "d"]]
    assert jax.tree.structure(rollout).num_leaves == 8  # a pytree of arrays


@settings(max_examples=50, deadline=None)
@given(new_tokens=st.integers(1, 4096), kv_width=st.sampled_from([16, 64, 128, 256, 1024]))
def test_kv_block_size_covers_the_response_in_few_blocks_of_enough_keys(new_tokens, kv_width):
    """At most 4 blocks hold the R-1 fed-back tokens; a block has >= 32 slots and >= 4096 keys per row."""
    blk = block_size_for(new_tokens, kv_width)
    assert blk % 8 == 0 and blk >= 32
    assert blk * kv_width >= 4096
    assert -(-max(new_tokens - 1, 1) // blk) <= 4
    assert blk - 8 < max(32, -(-4096 // kv_width), -(-(new_tokens - 1) // 4))  # the smallest such multiple of 8

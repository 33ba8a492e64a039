"""rollout_to_batch: which sampler log-prob the corrections see (Recipe.sampler_logp_kind)."""

import numpy as np

from jaxrl4llm.core import LITE_PPO, compute_advantages
from jaxrl4llm.sampling import Rollout
from jaxrl4llm.train.batching import merge_groups, rollout_to_batch


def _rollout():
    return Rollout(
        prompt_tokens=np.array([[0, 4, 5], [0, 4, 5]]), prompt_mask=np.array([[0, 1, 1], [0, 1, 1]], np.float32),
        response_tokens=np.array([[7, 2, 0], [8, 9, 3]]), response_mask=np.array([[1, 1, 0], [1, 1, 1]], np.float32),
        logprobs=np.full((2, 3), -0.5, np.float32), logprobs_untruncated=np.full((2, 3), -0.9, np.float32),
        lengths=np.array([2, 3], np.int32), truncated=np.array([False, True]))


def test_old_logp_is_untruncated_and_sampler_logp_is_the_chosen_kind():
    rollout = _rollout()
    adv = compute_advantages(np.array([1.0, 0.0], np.float32), 2, LITE_PPO)
    default = rollout_to_batch(rollout, adv)
    sampled = rollout_to_batch(rollout, adv, sampler_logp=rollout.logprobs)
    response = np.s_[:, 2:]  # targets of the response tokens (prompt of 3 -> 2 prompt targets)
    for batch in (default, sampled):
        np.testing.assert_array_equal(np.asarray(batch.old_logp)[response], np.float32(-0.9))  # what the trainer recomputes
        assert not np.asarray(batch.old_logp)[:, :2].any()
    np.testing.assert_array_equal(np.asarray(default.sampler_logp)[response], np.float32(-0.9))
    np.testing.assert_array_equal(np.asarray(sampled.sampler_logp)[response], -0.5)


def _draw(width: int, first: int, rows: int = 4) -> Rollout:
    """A rollout of `rows` rows whose prompt has `width` slots (the last one real) and whose
    row i carries the value first + i everywhere else."""
    ids = np.arange(first, first + rows)
    per_row = lambda dtype, cols: np.repeat(ids[:, None], cols, 1).astype(dtype)
    return Rollout(
        prompt_tokens=per_row(np.int32, width), prompt_mask=np.eye(1, width, width - 1, dtype=np.float32).repeat(rows, 0),
        response_tokens=per_row(np.int32, 3), response_mask=np.ones((rows, 3), np.float32),
        logprobs=per_row(np.float32, 3), logprobs_untruncated=per_row(np.float32, 3),
        lengths=ids.astype(np.int32), truncated=ids % 2 == 0)


def test_merge_groups_takes_the_picked_groups_in_order_and_pads_prompts_left():
    a, b = _draw(2, 0), _draw(4, 100)  # groups of 2 rows: a holds groups 0, 1; b (a wider bucket) 0, 1
    merged = merge_groups([(b, 1), (a, 0), (b, 0)], group_size=2, pad_id=-1)
    np.testing.assert_array_equal(np.asarray(merged.lengths), [102, 103, 0, 1, 100, 101])
    np.testing.assert_array_equal(np.asarray(merged.truncated), [True, False, True, False, True, False])
    assert merged.prompt_tokens.shape == (6, 4)
    np.testing.assert_array_equal(np.asarray(merged.prompt_tokens)[2], [-1, -1, 0, 0])  # a's row, left-padded
    np.testing.assert_array_equal(np.asarray(merged.prompt_mask)[2], [0, 0, 0, 1])
    np.testing.assert_array_equal(np.asarray(merged.prompt_tokens)[0], [102] * 4)
    assert merge_groups([(a, 0), (a, 1)], group_size=2, pad_id=-1) is a  # one draw in order: no copy


def test_routes_are_aligned_with_the_input_tokens_and_merged_groups_keep_them():
    """Router replay: position i of the batch feeds token i of prompt + response, so it carries
    that token's route: the prompt's (one per prompt, shared by its G rows), then the response's."""
    n, g, layers, k = 4, 2, 1, 2
    rollout = _draw(2, 0)._replace(
        prompt_routes=np.arange(2 * 2 * layers * k, dtype=np.uint8).reshape(2, 2, layers, k),  # 2 prompts
        routes=(100 + np.arange(n * 3 * layers * k)).astype(np.uint8).reshape(n, 3, layers, k))
    adv = compute_advantages(np.array([1.0, 0.0, 1.0, 1.0], np.float32), g, LITE_PPO)
    routes = np.asarray(rollout_to_batch(rollout, adv).routes)
    assert routes.shape == (n, 2 + 3 - 1, layers, k) and routes.dtype == np.uint8
    for row in range(n):
        np.testing.assert_array_equal(routes[row, :2], rollout.prompt_routes[row // g])
        np.testing.assert_array_equal(routes[row, 2:], rollout.routes[row, :2])  # the last token feeds nothing
    assert rollout_to_batch(_draw(2, 0), adv).routes is None

    wide = _draw(4, 100)._replace(prompt_routes=np.full((2, 4, layers, k), 7, np.uint8),
                                  routes=np.full((n, 3, layers, k), 9, np.uint8))
    merged = merge_groups([(wide, 1), (rollout, 0)], group_size=g, pad_id=-1)
    merged_routes = np.asarray(rollout_to_batch(merged, adv).routes)
    np.testing.assert_array_equal(merged_routes[:2, :4], 7)
    np.testing.assert_array_equal(merged_routes[2:, :2], 0)  # the narrower prompt's new left padding
    np.testing.assert_array_equal(merged_routes[2:, 2:4], np.repeat(rollout.prompt_routes[:1], 2, axis=0))
    np.testing.assert_array_equal(merged_routes[2:, 4:], rollout.routes[:2, :2])

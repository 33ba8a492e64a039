"""rollout_to_batch: which sampler log-prob the corrections see (Recipe.sampler_logp_kind)."""

import numpy as np

from jaxrl4llm.core import LITE_PPO, compute_advantages
from jaxrl4llm.sampling import Rollout
from jaxrl4llm.train.batching import rollout_to_batch


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

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


# ---------------------------------------------------------------------------- tool-integrated rollouts
def _tool_rollout():
    """4 rows (2 prompts x G=2), prompts of 2-3 tokens, responses of R=6 slots: row 0 has a tool span
    at columns 2-3, row 1 none, row 2 two spans (1 and 3-4), row 3 a span at its last token (4).
    Tool columns carry a garbage sampler log-prob (-30): a figure that counted them would move."""
    tool = np.zeros((4, 6), np.float32)
    tool[0, 2:4] = 1
    tool[2, 1] = tool[2, 3:5] = 1
    tool[3, 4] = 1
    lengths = np.array([6, 4, 6, 5], np.int32)
    mask = (np.arange(6)[None] < lengths[:, None]).astype(np.float32)
    rng = np.random.default_rng(0)
    logp = np.where(tool > 0, -30.0, -rng.uniform(0.1, 2.0, (4, 6))).astype(np.float32) * mask
    return Rollout(
        prompt_tokens=np.array([[0, 4, 5], [0, 4, 5], [6, 7, 8], [6, 7, 8]], np.int32),
        prompt_mask=np.array([[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]], np.float32),
        response_tokens=(rng.integers(1, 13, (4, 6)) * mask).astype(np.int32), response_mask=mask,
        logprobs=logp, logprobs_untruncated=logp, lengths=lengths, truncated=np.array([True, False, True, False]),
        tool_mask=tool)


def _tool_adv(rollout):
    return compute_advantages(np.array([1.0, 0.0, 0.0, 1.0], np.float32), 2, LITE_PPO)


def test_tool_tokens_keep_attention_and_positions_and_leave_the_loss_mask():
    from jaxrl4llm.sampling import model_token_lists, response_token_lists

    rollout = _tool_rollout()
    adv = _tool_adv(rollout)
    with_tools, plain = rollout_to_batch(rollout, adv), rollout_to_batch(rollout._replace(tool_mask=None), adv)
    for name in ("input_tokens", "targets", "positions", "attention_mask", "old_logp", "sampler_logp"):
        np.testing.assert_array_equal(np.asarray(getattr(with_tools, name)), np.asarray(getattr(plain, name)), name)
    response = np.asarray(with_tools.loss_mask)[:, 2:]  # target column P - 1 + j holds response token j
    np.testing.assert_array_equal(response, rollout.response_mask * (1 - rollout.tool_mask))
    assert not np.asarray(with_tools.loss_mask)[:, :2].any()
    model = model_token_lists(rollout)
    full = response_token_lists(rollout)
    assert model[1] == full[1] and model[0] == full[0][:2] + full[0][4:]
    assert model[2] == [full[2][0], full[2][2], full[2][5]] and model[3] == full[3][:4]
    merged = merge_groups([(rollout, 1), (rollout, 0)], group_size=2, pad_id=0)  # dynamic sampling's redraw
    np.testing.assert_array_equal(np.asarray(merged.tool_mask), rollout.tool_mask[[2, 3, 0, 1]])


def _toy_with_offsets(params, inputs, targets, positions, attention_mask):
    """The bigram toy model (context-free), plus learnable per-position offsets of its log-prob and
    entropy: d loss / d offset[b, i] is the loss's gradient at position i of row b."""
    from tests.train.toy_model import V, toy_logprob_fn

    logp, entropy = toy_logprob_fn(params["model"], inputs % V, targets % V, positions, attention_mask)
    return logp + params["logp_offset"], entropy + params["entropy_offset"]


def test_gradient_at_tool_positions_is_exactly_zero():
    """Policy gradient, KL and entropy bonus: no gradient reaches a tool token's log-prob or entropy."""
    import dataclasses

    import jax

    from jaxrl4llm.train.step import batch_loss_terms
    from tests.train.toy_model import toy_params

    rollout = _tool_rollout()
    recipe = dataclasses.replace(LITE_PPO, kl_coef=0.1, entropy_coef=0.01)
    batch = rollout_to_batch(rollout, compute_advantages(np.array([1.0, 0.0, 0.0, 1.0], np.float32), 2, recipe))
    batch = batch._replace(ref_logp=batch.old_logp - 0.2 * batch.loss_mask)
    zeros = np.zeros(batch.loss_mask.shape, np.float32)
    params = {"model": toy_params(), "logp_offset": zeros, "entropy_offset": zeros}
    grads = jax.grad(lambda p: batch_loss_terms(p, batch, logprob_fn=_toy_with_offsets, recipe=recipe)[0].numerator)(
        params)
    tool = np.zeros(zeros.shape, bool)
    tool[:, 2:] = rollout.tool_mask > 0
    for name in ("logp_offset", "entropy_offset"):
        g = np.asarray(grads[name])
        assert (g[tool] == 0.0).all(), name
        assert (g[np.asarray(batch.loss_mask) > 0] != 0.0).all(), name  # every model token gets a gradient


def test_update_figures_count_the_model_s_tokens_only():
    """A context-free model cannot tell a tool token in attention from padding, so the update on a
    rollout with tool tokens equals the update on the same rollout with those tokens cut from its
    response mask: same parameters and the same sampler_trainer_logp_gap, entropy, KL and token counts,
    though the tool columns carry a garbage sampler log-prob."""
    import dataclasses

    import jax

    from jaxrl4llm.train.step import UpdateSettings, init_train_state, make_optimizer, make_update_fn
    from tests.train.toy_model import V, toy_logprob_fn, toy_params

    rollout = _tool_rollout()
    recipe = dataclasses.replace(LITE_PPO, kl_coef=0.1, entropy_coef=0.01)
    adv = compute_advantages(np.array([1.0, 0.0, 0.0, 1.0], np.float32), 2, recipe)
    masked_out = rollout._replace(tool_mask=None, response_mask=rollout.response_mask * (1 - rollout.tool_mask))
    opt, sched = make_optimizer(lr=1e-2, max_grad_norm=None)
    update = jax.jit(make_update_fn(
        logprob_fn=lambda p, x, y, pos, m: toy_logprob_fn(p, x % V, y % V, pos, m), recipe=recipe, optimizer=opt,
        schedule=sched, settings=UpdateSettings(old_logp_from_update=True)))
    runs = []
    for r in (rollout, masked_out):
        batch = rollout_to_batch(r, adv)
        runs.append(update(init_train_state(toy_params(), opt), batch._replace(ref_logp=batch.old_logp * 0.9)))
    (s1, m1, _), (s2, m2, _) = runs
    assert float(m1["num_tokens"]) == float((rollout.response_mask * (1 - rollout.tool_mask)).sum())
    assert 0 < float(m1["sampler_trainer_logp_gap"]) < 5  # -30 on tool columns would show
    for k in ("sampler_trainer_logp_gap", "entropy", "kl", "num_tokens", "loss"):
        np.testing.assert_allclose(np.asarray(m1[k]), np.asarray(m2[k]), rtol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_rollouts_in_flight_keep_their_tool_masks_through_a_checkpoint():
    from jaxrl4llm.train.rollout_pipeline import PendingRollout, pending_from_host, pending_to_host

    rollout = _tool_rollout()
    arrays, meta = pending_to_host([PendingRollout(2, 1, rollout, np.zeros(4, np.float32), {})], np.asarray)
    back = pending_from_host(arrays, meta, np.asarray)[0].rollout
    np.testing.assert_array_equal(back.tool_mask, rollout.tool_mask)
    plain = pending_from_host(*pending_to_host([PendingRollout(2, 1, rollout._replace(tool_mask=None),
                                                               np.zeros(4, np.float32), {})], np.asarray), np.asarray)
    assert plain[0].rollout.tool_mask is None

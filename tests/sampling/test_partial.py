"""Partial rollouts: the continuous engine kept across rollouts and weight versions (sampling/partial.py)."""

import jax
import numpy as np

from jaxrl4llm.sampling import generate
from jaxrl4llm.sampling.partial import PartialRollouts, RowVersions
from tests.sampling.conftest import PAD, random_prompts
from tests.sampling.test_continuous import assert_same_rows

R, G, T = 19, 3, 16
EOS = list(range(5, 96, 9))


def _perturbed(state, seed):
    """Other weights of the same shapes (a later policy version)."""
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])


def test_partial_rollouts_give_each_rollout_its_rows_and_say_which_weights_sampled_each_token(qwen3):
    """3 rollouts of 2 prompts x 3 samples on 4 slots (pages of 4, bursts of 3): each segment admits
    the next rollout's rows as its own finish, so rows cross segments. With the same weights in every
    segment, rollout t equals the static engine's sample of its prompts with rng_t, row for row. With a
    new version per segment: rows sampled within one segment equal the static sample under that
    segment's weights; a row carried across keeps its earlier tokens and log-probs, and continues under
    the next weights (its tail differs); RowVersions says which version sampled each token."""
    _, _, graphdef, state = qwen3
    prompts = [random_prompts(seed, lengths=(7, 12)) for seed in (1, 2, 3)]
    rngs = [jax.random.key(10 + t) for t in range(3)]
    budgets = [np.random.default_rng(t).integers(1, R + 1, 2 * G) for t in range(3)]
    sampling = dict(num_samples=G, max_new_tokens=R, temperature=0.9, top_k=20, top_p=0.95, eos_token_ids=EOS)
    weights = [state, _perturbed(state, 1), _perturbed(state, 2)]

    def run(version_states):
        stream = PartialRollouts(graphdef, state, num_prompts=2, prompt_len=T, pad_token_id=PAD, slots=4,
                                 kv_page_size=4, decode_burst=3, **sampling)
        stream.enqueue(prompts[0], rngs[0], budgets[0])
        out = []
        for t in range(3):
            if t + 1 < 3:
                stream.enqueue(prompts[t + 1], rngs[t + 1], budgets[t + 1])
            out.append(stream.segment(graphdef, version_states[t], version=t))
        return out

    def static(t, weights_state):
        return generate(graphdef, weights_state, prompts[t], engine="static", rng=rngs[t], pad_token_id=PAD,
                        row_max_new_tokens=budgets[t], prompt_buckets=(T,), **sampling)

    for t, (rollout, versions) in enumerate(run([state] * 3)):
        assert_same_rows(rollout, static(t, state))
        assert np.all(versions.first <= t) and np.all(versions.second <= t)
    carried = 0
    for t, (rollout, versions) in enumerate(run(weights)):
        lengths = np.asarray(rollout.lengths)
        assert np.all((versions.first == t) | (versions.first == t - 1)) and np.all(versions.second >= versions.first)
        one = versions.split >= lengths  # every token from one version
        for v in set(versions.first[one].tolist()):
            rows = one & (versions.first == v)
            expect = static(t, weights[v])
            for name in ("response_tokens", "lengths"):
                np.testing.assert_array_equal(np.asarray(getattr(rollout, name))[rows],
                                              np.asarray(getattr(expect, name))[rows], err_msg=name)
            np.testing.assert_allclose(np.asarray(rollout.logprobs)[rows], np.asarray(expect.logprobs)[rows], atol=1e-5)
        older = static(t, weights[t - 1]) if t else None
        for n in np.flatnonzero(~one):  # carried rows: the older weights' prefix, then the newer weights
            carried += 1
            assert versions.second[n] == versions.first[n] + 1 == t
            j = versions.split[n]
            np.testing.assert_array_equal(np.asarray(rollout.response_tokens)[n, :j],
                                          np.asarray(older.response_tokens)[n, :j])
            np.testing.assert_allclose(np.asarray(rollout.logprobs)[n, :j], np.asarray(older.logprobs)[n, :j],
                                       atol=1e-5)
        if t:
            tail = ~one
            assert not np.array_equal(np.asarray(rollout.logprobs)[tail], np.asarray(older.logprobs)[tail])
    assert carried >= 3  # rows did cross segments


def test_row_versions_count_the_tokens_of_each_version():
    v = RowVersions(first=np.array([3, 3, 4]), split=np.array([2, 9, 0]), second=np.array([4, 4, 5]))
    versions, tokens = v.token_versions(np.array([5, 4, 6]))
    assert versions.tolist() == [3, 3, 4, 4, 4, 5] and tokens.tolist() == [2, 4, 0, 3, 0, 6]


def test_partial_rollouts_record_each_rows_routes_across_segments_and_checkpoints(tmp_path_factory):
    """A tiny Qwen3-MoE, greedy, rollouts of 2 prompts x 2 samples on 2 slots (rows cross segments):
    each rollout's routes are the forward's expert ids over its rows, whichever segment fed a token
    (`test_continuous.assert_routes_are_the_forwards`); an engine restored from `host_state` after the
    first segment hands out the same routes as the one that ran on."""
    from tests.sampling.conftest import load_family
    from tests.sampling.test_continuous import assert_routes_are_the_forwards

    _, config, graphdef, state = load_family("qwen3_moe", tmp_path_factory)
    prompts = [random_prompts(seed, lengths=(5, 9)) for seed in (1, 2, 3)]
    budgets = [np.asarray(b) for b in ([7, 2, 3, 7], [6, 3, 7, 2], [2, 5, 4, 6])]  # rows end apart: they cross
    make = lambda: PartialRollouts(graphdef, state, num_prompts=2, prompt_len=T, pad_token_id=PAD, slots=2,
                                   kv_page_size=4, decode_burst=2, num_samples=2, max_new_tokens=7, greedy=True,
                                   eos_token_ids=[], record_routes=True)
    stream = make()
    stream.enqueue(prompts[0], jax.random.key(0), budgets[0])
    stream.enqueue(prompts[1], jax.random.key(1), budgets[1])
    first, _ = stream.segment(graphdef, state, version=0)
    arrays, meta = stream.host_state(lambda x: np.asarray(jax.device_get(x)))
    restored = make()
    restored.restore(arrays, meta)
    outs = []
    for s in (stream, restored):
        s.enqueue(prompts[2], jax.random.key(2), budgets[2])
        outs.append([s.segment(graphdef, state, version=v) for v in (1, 2)])
    crossed = 0
    for rollout, versions in [(first, None)] + outs[0]:
        assert_routes_are_the_forwards(rollout, graphdef, state, config)
        if versions is not None:
            crossed += int(np.sum(versions.split < np.asarray(rollout.lengths)))
    assert crossed > 0  # some rows' tokens were fed in two segments
    for (a, _), (b, _) in zip(*outs):
        for name in ("routes", "prompt_routes", "response_tokens"):
            np.testing.assert_array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)), err_msg=name)

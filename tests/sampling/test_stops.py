"""Stop token ids and stop strings (`sampling.stops`), in both engines and for partial rollouts."""

import re
import sys

import jax
import numpy as np
import pytest

from jaxrl4llm.sampling import generate
from jaxrl4llm.sampling.decode_loop import decode_backend, sample_program, weights_program
from jaxrl4llm.sampling.stops import (MAX_STOP_SEQUENCES, end_token_ids, ends_with_stop_sequence, first_stop_string,
                                      last_tokens, response_text, stop_token_sequences, text_before_stop)
from tests.sampling.conftest import PAD, random_prompts


class AngleTokenizer:
    """Token i reads "<i>"; `decode` as a transformers tokenizer takes it (PAD, special, skipped)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids if not (skip_special_tokens and i == PAD))

    def batch_decode(self, lists, skip_special_tokens=True):
        return [self.decode(ids, skip_special_tokens) for ids in lists]


TOKENIZER = AngleTokenizer()
DECODE = TOKENIZER.decode


def test_end_token_ids_appends_new_stop_ids_and_keeps_the_eos_array_without_them():
    np.testing.assert_array_equal(end_token_ids([7, 3]), [7, 3])
    np.testing.assert_array_equal(end_token_ids([]), [-1])
    np.testing.assert_array_equal(end_token_ids([7], [9, 7, 9, 2]), [7, 9, 2])


def test_first_stop_string_finds_the_token_that_completes_a_match_across_tokens():
    ids = [11, 22, 33, 44, 55]  # "<11><22><33><44><55>"
    assert first_stop_string(ids, DECODE, ["3><4"]) == (4, len("<11><22><3"))  # spans tokens 33 and 44
    assert first_stop_string(ids, DECODE, ["<55>", "2><3"]) == (3, len("<11><2"))  # the first to complete wins
    assert first_stop_string(ids, DECODE, ["<66>"]) is None
    assert first_stop_string(ids, DECODE, []) is None
    assert first_stop_string([], DECODE, ["x"]) is None


def test_response_text_drops_a_stop_token_and_the_text_from_a_stop_string():
    assert response_text([1, 2, 9], DECODE, stop_token_ids=[9]) == "<1><2>"
    assert response_text([1, 2, 9], DECODE, stop_token_ids=[5]) == "<1><2><9>"
    assert response_text([1, 2, 3], DECODE, stop_strings=["2><3"]) == "<1><"
    assert text_before_stop("a STOP b END", ["END", "STOP"]) == "a "


def baseline(qwen3, engine, **extra):
    """Greedy rows without EOS (every row runs R tokens) for 3 prompts x 2 samples."""
    _, _, graphdef, state = qwen3
    kwargs = dict(num_samples=2, max_new_tokens=12, pad_token_id=PAD, rng=jax.random.key(1), greedy=True,
                  eos_token_ids=[], engine=engine, slots=4)
    return generate(graphdef, state, random_prompts(3, lengths=(5, 3, 7)), **{**kwargs, **extra})


def first_new_token(row: np.ndarray, after: int = 2) -> tuple[int, int]:
    """(index, token): the first token at index >= `after` that does not occur earlier in the row."""
    for j in range(after, len(row)):
        if row[j] not in row[:j]:
            return j, int(row[j])
    pytest.skip("no token first seen late in the row")


def assert_cut(got, full, row: int, length: int):
    """Row `row` of `got` is row `row` of `full` cut after `length` tokens; the other rows unchanged."""
    tokens, mask = np.asarray(got.response_tokens), np.asarray(got.response_mask)
    np.testing.assert_array_equal(tokens[row, :length], np.asarray(full.response_tokens)[row, :length])
    assert (tokens[row, length:] == PAD).all()
    np.testing.assert_array_equal(mask[row], np.arange(mask.shape[1]) < length)
    assert int(got.lengths[row]) == length and not bool(got.truncated[row])
    assert (np.asarray(got.logprobs)[row, length:] == 0).all()
    np.testing.assert_allclose(np.asarray(got.logprobs)[row, :length], np.asarray(full.logprobs)[row, :length],
                               atol=1e-5)


@pytest.mark.parametrize("engine", ["static", "continuous"])
def test_a_row_ends_at_its_first_stop_token_id(qwen3, engine):
    """A stop token id ends the row inside the decode loop as an EOS does: the token kept (mask 1),
    not truncated; a row without it runs on."""
    full = baseline(qwen3, engine)
    j, token = first_new_token(np.asarray(full.response_tokens)[0])
    stopped = baseline(qwen3, engine, stop_token_ids=[token])
    assert_cut(stopped, full, 0, j + 1)
    for n in range(full.num_rows):  # every row ends at its first occurrence of the token, or runs R
        row = np.asarray(full.response_tokens)[n]
        hits = np.flatnonzero(row == token)
        assert int(stopped.lengths[n]) == (hits[0] + 1 if len(hits) else 12)
        assert bool(stopped.truncated[n]) == (len(hits) == 0)


@pytest.mark.parametrize("engine", ["static", "continuous"])
def test_a_stop_string_spanning_two_tokens_ends_the_row(qwen3, engine):
    """"<{a}><{b}" spans tokens a = j-1 and b = j of row 0 ("<a>" and "<b>"): the row ends with token j
    (mask up to it, pad and log-prob 0 after, not truncated), and its scored text ends where the
    string starts."""
    full = baseline(qwen3, engine)
    row = np.asarray(full.response_tokens)[0]
    for j in range(3, len(row)):
        stop = f"<{row[j - 1]}><{row[j]}"
        if stop not in DECODE(row[:j].tolist()):
            break
    stopped = baseline(qwen3, engine, stop_strings=[stop], tokenizer=TOKENIZER)
    assert_cut(stopped, full, 0, j + 1)
    text = response_text(np.asarray(stopped.response_tokens)[0, :j + 1].tolist(), DECODE, stop_strings=[stop])
    assert text == DECODE(row[:j - 1].tolist())


@pytest.mark.parametrize("engine", ["static", "continuous"])
def test_min_p_one_samples_the_greedy_rows(qwen3, engine):
    """min_p reaches the engine's program: with min_p = 1 only the argmax survives, so sampling at
    temperature 1.5 gives the greedy rows, each token with log-prob 0 under the kept set."""
    greedy = baseline(qwen3, engine)
    sampled = baseline(qwen3, engine, greedy=False, temperature=1.5, min_p=1.0)
    np.testing.assert_array_equal(np.asarray(sampled.response_tokens), np.asarray(greedy.response_tokens))
    np.testing.assert_allclose(np.asarray(sampled.logprobs), 0.0, atol=1e-6)


def test_off_settings_lower_the_program_without_them(qwen3):
    """min_p=None (off) lowers exactly the program that does not name min_p; a min_p changes it."""
    _, config, graphdef, state = qwen3
    backend = decode_backend(config, mesh=None, use_kernels=False, block_size=16)
    weights = weights_program(graphdef, state, config=config, backend=backend)
    tokens, mask = np.ones((1, 4), np.int32), np.ones((1, 4), np.int32)
    args = (weights, tokens, mask, np.ones((1,), bool), jax.random.key(0), np.int32(0), np.float32(1.0),
            np.float32(1.0), np.asarray([5], np.int32), np.int32(PAD))
    static = dict(config=config, num_samples=2, max_new_tokens=6, top_k=0, use_top_p=False, greedy=False,
                  block_size=16, backend=backend)
    text = lambda **kw: sample_program.lower(*args, **static, **kw).as_text()
    assert text() == text(min_p=None) == text(stop_seqs=None)
    assert text() != text(stop_seqs=np.asarray([[3, 4]], np.int32))
    assert text() != text(min_p=np.float32(0.1))


class EncodingAngleTokenizer(AngleTokenizer):
    """AngleTokenizer that also encodes: "<i>" -> i (text that is not whole tokens encodes to nothing)."""

    def encode(self, text, add_special_tokens=False):
        ids = re.findall(r"<(\d+)>", text)
        return [int(i) for i in ids] if "".join(f"<{i}>" for i in ids) == text else []


def test_stop_token_sequences_are_the_strings_spellings_right_aligned_and_deduplicated():
    tok = EncodingAngleTokenizer()
    np.testing.assert_array_equal(stop_token_sequences(tok, ["<3><4>", "<5>", "<3><4>"]), [[3, 4], [-1, 5]])
    assert stop_token_sequences(tok, ["<3"]) is None  # no whole-token spelling: the host match alone
    assert stop_token_sequences(TOKENIZER, ["<3><4>"]) is None  # no encode
    assert stop_token_sequences(tok, []) is None
    assert stop_token_sequences(tok, [f"<{i}>" for i in range(40)]).shape == (MAX_STOP_SEQUENCES, 1)
    assert stop_token_sequences(tok, ["<1>" * 9]) is None  # longer than MAX_STOP_SEQUENCE_TOKENS
    window = np.array([[7, 3, 4], [3, 4, 7], [-2, -2, 5]])
    np.testing.assert_array_equal(ends_with_stop_sequence(window, np.array([[-1, 3, 4], [-1, -1, 5]])),
                                  [True, False, True])
    np.testing.assert_array_equal(last_tokens(np.array([[1, 2, 3, 4]] * 2), np.array([1, 3]), 3),
                                  [[-2, 1, 2], [2, 3, 4]])


@pytest.mark.parametrize("engine", ["static", "continuous"])
def test_a_stop_string_the_tokenizer_spells_ends_the_row_inside_the_decode_loop(qwen3, engine, monkeypatch):
    """"<a><b>" spelled by tokens j-1, j of row 0: with a tokenizer that encodes, the engine itself
    ends the row at token j (its own lengths, before the host cut, read with the cut switched off:
    the continuous engine's slot is free from there), and the rollout equals the host-cut one."""
    full = baseline(qwen3, engine)
    row = np.asarray(full.response_tokens)[0]
    j = next((j for j in range(2, len(row)) if f"<{row[j - 1]}><{row[j]}>" not in DECODE(row[:j].tolist())), None)
    if j is None:
        pytest.skip("row 0 repeats its pairs")
    stop = f"<{row[j - 1]}><{row[j]}>"
    host_cut = baseline(qwen3, engine, stop_strings=[stop], tokenizer=TOKENIZER)
    in_loop = baseline(qwen3, engine, stop_strings=[stop], tokenizer=EncodingAngleTokenizer())
    for a, b in zip(in_loop, host_cut):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert_cut(in_loop, full, 0, j + 1)
    monkeypatch.setattr(sys.modules["jaxrl4llm.sampling.generate"], "apply_stop_strings", lambda rollout, *a, **k: rollout)
    engine_only = baseline(qwen3, engine, stop_strings=[stop], tokenizer=EncodingAngleTokenizer())
    assert int(engine_only.lengths[0]) == j + 1 and not bool(engine_only.truncated[0])
    assert int(full.lengths[0]) == 12  # without the in-loop stop the row decodes its whole budget


def test_partial_rollouts_end_a_row_at_a_spelled_stop_string_inside_the_engine(qwen3, monkeypatch):
    """The partial-rollout engine gets the spellings too: with the host cut switched off, its row 0
    ends at the token completing "<a><b>", the static engine's row cut there."""
    from jaxrl4llm.sampling.partial import PartialRollouts

    _, _, graphdef, state = qwen3
    prompts = random_prompts(3, lengths=(5, 3, 7))
    full = generate(graphdef, state, prompts, num_samples=2, max_new_tokens=12, pad_token_id=PAD, greedy=True,
                    eos_token_ids=[], engine="static", rng=jax.random.key(1), prompt_buckets=(8,))
    row = np.asarray(full.response_tokens)[0]
    j = next((j for j in range(2, len(row)) if f"<{row[j - 1]}><{row[j]}>" not in DECODE(row[:j].tolist())), None)
    if j is None:
        pytest.skip("row 0 repeats its pairs")
    monkeypatch.setattr(sys.modules["jaxrl4llm.sampling.partial"], "apply_stop_strings", lambda rollout, *a, **k: rollout)
    stream = PartialRollouts(graphdef, state, num_prompts=3, num_samples=2, max_new_tokens=12, prompt_len=8,
                             eos_token_ids=[], pad_token_id=PAD, greedy=True, slots=4,
                             stop_strings=[f"<{row[j - 1]}><{row[j]}>"], tokenizer=EncodingAngleTokenizer())
    stream.enqueue(prompts, jax.random.key(1))
    rollout, _ = stream.segment(graphdef, state, version=0)
    assert_cut(rollout, full, 0, j + 1)

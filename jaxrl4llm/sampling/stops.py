"""Where a response stops besides EOS: stop token ids (on device) and stop strings (on the host).

    stop token ids:  the row ends at its first token in eos_ids ∪ stop_token_ids (inside the jitted
                     decode, as an EOS: the token is kept in the row and its mask, the row is not
                     truncated; vLLM's `stop_token_ids`). Its text is dropped from the scored text.
    stop strings:    k = min{k : decode(y_<k+1) holds a stop string}; the row keeps tokens y_0..y_{k-1}
                     (mask 1 up to the token that completed the match, pad / 0 after; lengths = k;
                     not truncated) and its text ends where the earliest match starts (vLLM's `stop`,
                     include_stop_str_in_output=False).

Stop strings can span tokens, so they are matched on decoded text, on the host, after the sampler
returns: that match is the authority for where a row is cut. Both engines also stop a row early,
inside their jitted decode loop, when its last tokens spell a stop string (`stop_token_sequences`:
the tokenizer's own spellings of each string, the string alone and after a few contexts, at most
MAX_STOP_SEQUENCES of at most MAX_STOP_SEQUENCE_TOKENS tokens): the row ends there as at an EOS
(the continuous engine frees its slot, the static engine's row is done), and the host cut then
finds the same token. A spelling outside that set (another tokenisation, a string longer than
the cap) is caught by the host alone: that row decodes on to EOS or its budget, and its tokens
after the match are dropped, before scoring and training, as before.

A tool format's trigger strings are spelled the same way (`trigger_token_sequences`): a row that
spells one is handed to the host for its tool call instead of ending (`tools.protocol`).

    stop sequences:  stops[s] [L] right-aligned, -1 = any token; row n ends after token t when
                     for some s, y_{t-L+1..t} == stops[s] wherever stops[s] >= 0   (`ends_with_stop_sequence`)
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm.sampling.rollout import Rollout
from jaxrl4llm.tools.protocol import ToolFormat, trigger_strings


def end_token_ids(eos_token_ids: Sequence[int], stop_token_ids: Sequence[int] = ()) -> np.ndarray:
    """The tokens that end a row inside the decode loop, [E] int32: the EOS ids, then the stop ids
    not among them ([-1], no token, when both are empty). Without stop ids: the EOS array as it was."""
    eos = [int(t) for t in eos_token_ids]
    ids = eos + [int(t) for t in dict.fromkeys(stop_token_ids) if int(t) not in eos]
    return np.asarray(ids or [-1], dtype=np.int32)


MAX_STOP_SEQUENCES = 32  # token spellings of all stop strings matched in the decode loop
MAX_STOP_SEQUENCE_TOKENS = 8  # longer spellings are left to the host match
# contexts a stop string is also encoded after: a BPE tokenizer spells "</answer>" after text
# (e.g. with a leading space merged in) differently from alone; the spelling is the context's
# encoding's tail when its head is the context's own encoding
STOP_CONTEXTS = ("x", " ", "\n", "a ", ".", "1")


def stop_token_sequences(tokenizer, stop_strings: Sequence[str], *, max_sequences: int = MAX_STOP_SEQUENCES,
                         max_tokens: int = MAX_STOP_SEQUENCE_TOKENS,
                         skip_special_tokens: bool = True) -> np.ndarray | None:
    """The token spellings of `stop_strings` the decode loop matches, [S, L] int32, each right-aligned
    (-1 on its left: any token), L = the longest kept. For each string: encode(s), and for each
    c in STOP_CONTEXTS encode(c + s) minus encode(c)'s tokens (when it starts with them); kept when
    1 <= its length <= max_tokens and its decoded text holds s (so the host cut confirms the stop),
    deduplicated in that order, the first max_sequences. None (no in-loop stop: the programs without
    it) when no spelling is kept, stop_strings is empty or the tokenizer has no `encode`.
    skip_special_tokens: how a spelling's text is decoded for that check: True as the host match of
    stop strings decodes (`apply_stop_strings`); False for strings that are special tokens (a tool
    trigger such as Llama 3.1's `<|eom_id|>`, which a decode that skips special tokens drops).
    """
    if not stop_strings or not hasattr(tokenizer, "encode"):
        return None
    encode = lambda text: [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    found: dict[tuple[int, ...], None] = {}
    for s in stop_strings:
        spellings = [encode(s)]
        for context in STOP_CONTEXTS:
            head, whole = encode(context), encode(context + s)
            if whole[:len(head)] == head:
                spellings.append(whole[len(head):])
        for ids in spellings:
            if 1 <= len(ids) <= max_tokens and s in tokenizer.decode(ids, skip_special_tokens=skip_special_tokens):
                found.setdefault(tuple(ids))
    kept = list(found)[:max_sequences]
    if not kept:
        return None
    width = max(len(ids) for ids in kept)
    return np.asarray([[-1] * (width - len(ids)) + list(ids) for ids in kept], np.int32)


def trigger_token_sequences(fmt: ToolFormat, tokenizer, *, max_tokens: int = MAX_STOP_SEQUENCE_TOKENS) -> np.ndarray | None:
    """The token spellings of a tool format's triggers (`tools.protocol.trigger_strings`), [S, L] int32
    right-aligned as `stop_token_sequences` builds them, their text decoded with special tokens
    kept; None when the tokenizer spells none within MAX_STOP_SEQUENCE_TOKENS tokens. A row whose
    last tokens spell one is handed to the host for its tool call, where a stop string ends it
    (the host confirms the trigger on the turn's text: `tools.protocol.parse_call`). ToRL and
    Qwen-Agent pass the fence trigger to vLLM as a stop string (``stop=["```output"]``). max_tokens:
    the longest spelling kept (a character-level tokenizer spells "```output" in 9)."""
    return stop_token_sequences(tokenizer, trigger_strings(fmt), skip_special_tokens=False, max_tokens=max_tokens)


def last_tokens(tokens: jax.Array, end: jax.Array, width: int) -> jax.Array:
    """Each row's `width` tokens ending at column end (included): tokens [..., R], end [...] int32 ->
    [..., width], -2 (no token) before column 0."""
    cols = end[..., None] - width + 1 + jnp.arange(width, dtype=jnp.int32)
    window = jnp.take_along_axis(tokens, jnp.clip(cols, 0, tokens.shape[-1] - 1), axis=-1)
    return jnp.where(cols >= 0, window, -2)


def ends_with_stop_sequence(window: jax.Array, stop_seqs: jax.Array) -> jax.Array:
    """Whether a row's last tokens window [..., L] end with one of stop_seqs [S, L] (right-aligned,
    -1 = any token; `stop_token_sequences`) -> [...] bool."""
    hit = (stop_seqs < 0) | (window[..., None, :] == stop_seqs)  # [..., S, L]
    return jnp.any(jnp.all(hit, axis=-1), axis=-1)


def first_stop_string(token_ids: Sequence[int], decode: Callable[[list[int]], str],
                      stop_strings: Sequence[str]) -> tuple[int, int] | None:
    """(k, cut) for the first stop string in a row's text: k = the fewest tokens whose text
    decode(token_ids[:k]) holds one, cut = where the earliest match in that text starts.
    None when the text of the whole row holds none.

    Binary search over k (O(log L) decodes): a match stays in the text of every longer prefix (only
    a prefix's last, incomplete characters change when a token is added).
    """
    ids = list(token_ids)
    holds = lambda k: any(s in decode(ids[:k]) for s in stop_strings)
    if not stop_strings or not ids or not holds(len(ids)):
        return None
    low, high = 1, len(ids)  # holds(high) is True
    while low < high:
        mid = (low + high) // 2
        if holds(mid):
            high = mid
        else:
            low = mid + 1
    text = decode(ids[:high])
    return high, min(text.find(s) for s in stop_strings if s in text)


def text_before_stop(text: str, stop_strings: Sequence[str]) -> str:
    """`text` up to the start of its earliest stop string (the whole text when it holds none)."""
    found = [text.find(s) for s in stop_strings if s in text]
    return text[:min(found)] if found else text


def response_text(token_ids: Sequence[int], decode: Callable[[list[int]], str], *, stop_strings: Sequence[str] = (),
                  stop_token_ids: Sequence[int] = ()) -> str:
    """The scored text of a response (its tokens up to its length): a last token among
    `stop_token_ids` is left out of the text, and the text ends before its first stop string."""
    ids = list(token_ids)
    if ids and stop_token_ids and ids[-1] in set(int(t) for t in stop_token_ids):
        ids = ids[:-1]
    return text_before_stop(decode(ids), stop_strings) if stop_strings else decode(ids)


@jax.jit
def cut_rows(rollout: Rollout, lengths: jax.Array, stopped: jax.Array, pad_id) -> Rollout:
    """Rows n with stopped[n] end after lengths[n] tokens: masks (tool_mask too) 0, pad and log-probs
    0 after that, lengths[n], not truncated. lengths, stopped [N] (lengths[n] <= the row's length where stopped)."""
    length = jnp.where(stopped, lengths, rollout.lengths).astype(rollout.lengths.dtype)
    keep = jnp.arange(rollout.response_tokens.shape[1])[None, :] < length[:, None]  # [N, R]
    return rollout._replace(
        response_tokens=jnp.where(keep, rollout.response_tokens, pad_id).astype(rollout.response_tokens.dtype),
        response_mask=rollout.response_mask * keep,
        logprobs=jnp.where(keep, rollout.logprobs, 0.0),
        logprobs_untruncated=jnp.where(keep, rollout.logprobs_untruncated, 0.0),
        lengths=length,
        truncated=rollout.truncated & ~stopped,
        tool_mask=None if rollout.tool_mask is None else rollout.tool_mask * keep,
    )


def apply_stop_strings(rollout: Rollout, tokenizer, stop_strings: Sequence[str], pad_token_id: int, *,
                       skip_special_tokens: bool = True, fetch=None) -> Rollout:
    """The rollout with each row cut after the token that completes its first stop string
    (`first_stop_string` on the text the reward reads: `tokenizer.decode`, special tokens skipped);
    the rollout itself when `stop_strings` is empty. Rows stay on device (`cut_rows`).
    fetch: a global array's whole value on this host (default `jax.device_get`; a multi-host run
    passes `train.hosts.fetch`)."""
    if not stop_strings:
        return rollout
    if tokenizer is None:
        raise ValueError("stop_strings need a tokenizer (generate(tokenizer=...)): they are matched on decoded text")
    fetch = fetch or (lambda x: np.asarray(jax.device_get(x)))
    tokens, lengths = fetch(rollout.response_tokens), fetch(rollout.lengths)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    new_lengths, stopped = lengths.astype(np.int32).copy(), np.zeros(lengths.shape, bool)
    for n in range(tokens.shape[0]):
        found = first_stop_string(tokens[n, :lengths[n]].tolist(), decode, stop_strings)
        if found is not None:
            new_lengths[n], stopped[n] = found[0], True
    if not stopped.any():
        return rollout
    return cut_rows(rollout, new_lengths, stopped, np.int32(pad_token_id))

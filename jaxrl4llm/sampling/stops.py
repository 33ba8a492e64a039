"""Where a response stops besides EOS: stop token ids (on device) and stop strings (on the host).

    stop token ids:  the row ends at its first token in eos_ids ∪ stop_token_ids (inside the jitted
                     decode, as an EOS: the token is kept in the row and its mask, the row is not
                     truncated; vLLM's `stop_token_ids`). Its text is dropped from the scored text.
    stop strings:    k = min{k : decode(y_<k+1) holds a stop string}; the row keeps tokens y_0..y_{k-1}
                     (mask 1 up to the token that completed the match, pad / 0 after; lengths = k;
                     not truncated) and its text ends where the earliest match starts (vLLM's `stop`,
                     include_stop_str_in_output=False).

Stop strings can span tokens, so they are matched on decoded text, on the host, after the sampler
returns (both engines run their whole decode loop in one jit: there is no host loop between
decode bursts to free a slot from). A row stopped by a string therefore still decodes to EOS or
its budget; only its tokens after the match are dropped, before scoring and training.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl4llm.sampling.rollout import Rollout


def end_token_ids(eos_token_ids: Sequence[int], stop_token_ids: Sequence[int] = ()) -> np.ndarray:
    """The tokens that end a row inside the decode loop, [E] int32: the EOS ids, then the stop ids
    not among them ([-1], no token, when both are empty). Without stop ids: the EOS array as it was."""
    eos = [int(t) for t in eos_token_ids]
    ids = eos + [int(t) for t in dict.fromkeys(stop_token_ids) if int(t) not in eos]
    return np.asarray(ids or [-1], dtype=np.int32)


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
    """Rows n with stopped[n] end after lengths[n] tokens: mask 0, pad and log-probs 0 after that,
    lengths[n], not truncated. lengths, stopped [N] (lengths[n] <= the row's length where stopped)."""
    length = jnp.where(stopped, lengths, rollout.lengths).astype(rollout.lengths.dtype)
    keep = jnp.arange(rollout.response_tokens.shape[1])[None, :] < length[:, None]  # [N, R]
    return rollout._replace(
        response_tokens=jnp.where(keep, rollout.response_tokens, pad_id).astype(rollout.response_tokens.dtype),
        response_mask=rollout.response_mask * keep,
        logprobs=jnp.where(keep, rollout.logprobs, 0.0),
        logprobs_untruncated=jnp.where(keep, rollout.logprobs_untruncated, 0.0),
        lengths=length,
        truncated=rollout.truncated & ~stopped,
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

"""Rollout: what the sampler returns, one row per sampled response (a pytree of arrays).

Row n answers prompt n // G (the G = num_samples responses of a prompt are adjacent, as the
loss math in `core/` expects). Prompts are left-padded, so the training batch is simply

    tokens = concat(prompt_tokens, response_tokens)   mask = concat(prompt_mask, response_mask)
    positions = cumsum(mask) - 1                       (a prompt's first real token is position 0)

which are exactly the positions the sampler used.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import numpy as np


class Rollout(NamedTuple):
    """Sampled responses and their log-probs (N = num_prompts * num_samples rows, R response slots).

    prompt_tokens [N, P] int32: left-padded prompt (pad_token_id on the left).
    prompt_mask [N, P] float32: 1 on real prompt tokens.
    response_tokens [N, R] int32: generated tokens; pad_token_id after EOS.
    response_mask [N, R] float32: 1 on generated tokens up to and including EOS, 0 after.
    logprobs [N, R] float32: log p(y_t) under the distribution y_t was drawn from
        (temperature, top-k and top-p applied); 0 where response_mask is 0.
    logprobs_untruncated [N, R] float32: log softmax(logits / temperature)[y_t] (no top-k/top-p),
        what a teacher-forced forward with the same temperature recomputes; 0 where masked.
    lengths [N] int32: number of response tokens (EOS included).
    truncated [N] bool: no EOS within max_new_tokens.
    routes [N, R, L, k] (a mixture-of-experts model sampled with record_routes; else None): the
        expert ids each layer ran for the token fed at response position t (token t; the last
        token of a row is never fed: its route, and those after it, are 0). dtype
        `models.layers.moe.route_dtype(num_experts)` (uint8 up to 256 experts).
    prompt_routes [num_prompts, P, L, k] (with routes): the expert ids of each prompt's tokens,
        left-padded as prompt_tokens (0 on padding); row n's prompt is prompt_routes[n // G]
        (a prompt is prefilled once for its G rows).
    tool_mask [N, R] float32 (a rollout with tools, `rollout.tools`; else None): 1 on response
        tokens the tool inserted (forced observation tokens), 0 on the model's own tokens and on
        padding. Tool tokens are in response_mask and lengths (they take positions and count
        against the response budget); the trainer's loss mask leaves them out
        (`train.batching.rollout_to_batch`) and the reward reads the model's tokens only
        (`model_token_lists`).
    """

    prompt_tokens: jax.Array
    prompt_mask: jax.Array
    response_tokens: jax.Array
    response_mask: jax.Array
    logprobs: jax.Array
    logprobs_untruncated: jax.Array
    lengths: jax.Array
    truncated: jax.Array
    routes: jax.Array | None = None
    prompt_routes: jax.Array | None = None
    tool_mask: jax.Array | None = None

    @property
    def num_rows(self) -> int:
        return self.response_tokens.shape[0]


def response_token_lists(rollout: Rollout) -> list[list[int]]:
    """The generated token ids of every row (EOS included, padding dropped), on the host."""
    tokens = np.asarray(rollout.response_tokens)
    lengths = np.asarray(rollout.lengths)
    return [tokens[n, : lengths[n]].tolist() for n in range(tokens.shape[0])]


def model_tokens(tokens, length: int, tool_mask=None) -> list[int]:
    """The ids a row's model sampled: tokens[:length] ([R] int) without the tool's forced tokens
    (tool_mask [R] 1; None: a rollout without tools, every token is the model's). What the reward
    decodes: a ``\\boxed{}`` that the code printed earns nothing (`tools.protocol.model_text`)."""
    tokens = np.asarray(tokens)[: int(length)]
    if tool_mask is None:
        return tokens.tolist()
    return tokens[~(np.asarray(tool_mask)[: int(length)] > 0)].tolist()


def model_token_lists(rollout: Rollout) -> list[list[int]]:
    """`model_tokens` of every row, on the host (`response_token_lists` for a rollout without tools)."""
    tokens, lengths = np.asarray(rollout.response_tokens), np.asarray(rollout.lengths)
    tool = None if rollout.tool_mask is None else np.asarray(rollout.tool_mask)
    return [model_tokens(tokens[n], lengths[n], None if tool is None else tool[n]) for n in range(tokens.shape[0])]


def prompt_token_lists(rollout: Rollout) -> list[list[int]]:
    """The prompt token ids of every row (left padding dropped), on the host."""
    tokens = np.asarray(rollout.prompt_tokens)
    mask = np.asarray(rollout.prompt_mask) > 0
    return [tokens[n, mask[n]].tolist() for n in range(tokens.shape[0])]


def decode_responses(rollout: Rollout, tokenizer, *, skip_special_tokens: bool = True) -> list[str]:
    """Response text of every row: tokenizer.batch_decode of `response_token_lists` (host side).

    `tokenizer` is anything with `batch_decode(list[list[int]], skip_special_tokens=...)`
    (a transformers tokenizer, e.g. from `jaxrl4llm.models.load_tokenizer`).
    """
    return decode_token_lists(response_token_lists(rollout), tokenizer, skip_special_tokens=skip_special_tokens)


def decode_token_lists(token_lists: Sequence[Sequence[int]], tokenizer, *, skip_special_tokens: bool = True) -> list[str]:
    """Text of each token-id list: tokenizer.batch_decode (special tokens skipped by default)."""
    return list(tokenizer.batch_decode([list(t) for t in token_lists], skip_special_tokens=skip_special_tokens))


def group_rows(values: Sequence, group_size: int) -> list[list]:
    """[v_0 .. v_{N-1}] -> [[v_0 .. v_{G-1}], [v_G ..], ...]: the responses of each prompt."""
    if len(values) % group_size:
        raise ValueError(f"{len(values)} rows do not split into groups of {group_size}")
    return [list(values[i : i + group_size]) for i in range(0, len(values), group_size)]

"""Shape buckets: pad prompt lengths and prompt counts up to a few sizes so a run compiles a few programs.

    bucket(n) = min{b in buckets : b >= n}

Every distinct (prompt bucket, batch bucket) pair is one XLA compile of the sampler; a
training run with prompts of 30..500 tokens and 8 prompts per step compiles at most
len(PROMPT_BUCKETS) programs, not one per step.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

# Left-padded prompt lengths (tokens): powers of two and the 1.5x step between them, so at most a
# third of a prompt bucket is padding (a half with powers of two alone). The trainer's batch keeps
# the sampler's width, so padding costs the update, the prefill and the KV cache alike: GSM8K
# prompts of 139 tokens train at 192 + R positions instead of 256 + R. Longer prompts round up
# to a multiple of the last bucket.
PROMPT_BUCKETS: tuple[int, ...] = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
# Number of distinct prompts per call.
BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def bucket(n: int, buckets: Sequence[int], *, multiple_of: int = 1) -> int:
    """Smallest bucket >= n that is a multiple of `multiple_of`; past the last bucket, the next
    multiple of lcm(last bucket, multiple_of).

    Args: n >= 1; buckets ascending positive ints. Returns an int >= n.
    """
    if n < 1:
        raise ValueError(f"bucket size must be at least 1, got {n}")
    for b in buckets:
        if b >= n and b % multiple_of == 0:
            return b
    step = int(np.lcm(buckets[-1], multiple_of))
    return -(-n // step) * step


class PaddedPrompts(NamedTuple):
    """Prompts left-padded to a bucket.

    tokens [P_pad, T] int32 (pad_token_id on the left); mask [P_pad, T] int32 (1 = real);
    row_valid [P_pad] bool (False for the filler rows that round P up to its bucket).
    """

    tokens: np.ndarray
    mask: np.ndarray
    row_valid: np.ndarray


def left_pad_prompts(prompts: Sequence[Sequence[int]], *, pad_token_id: int, length: int,
                     num_rows: int) -> PaddedPrompts:
    """Right-align each prompt in a [num_rows, length] array; filler rows repeat prompt 0 (masked out later).

    Raises ValueError naming the prompt index when a prompt is empty or longer than `length`.
    """
    if not prompts:
        raise ValueError("generate() needs at least one prompt, got an empty list")
    if num_rows < len(prompts):
        raise ValueError(f"num_rows={num_rows} is smaller than the number of prompts ({len(prompts)})")
    tokens = np.full((num_rows, length), pad_token_id, dtype=np.int32)
    mask = np.zeros((num_rows, length), dtype=np.int32)
    for i, prompt in enumerate(prompts):
        n = len(prompt)
        if n == 0:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if n > length:
            raise ValueError(f"prompt {i} has {n} tokens, more than the prompt budget of {length}; "
                             f"raise max_prompt_length (or truncate the prompt)")
        tokens[i, length - n:] = np.asarray(prompt, dtype=np.int32)
        mask[i, length - n:] = 1
    tokens[len(prompts):] = tokens[0]
    mask[len(prompts):] = mask[0]
    row_valid = np.arange(num_rows) < len(prompts)
    return PaddedPrompts(tokens, mask, row_valid)

"""Supervised fine-tuning on (prompt, completion) token pairs: the warm start of the demo (and a
cold start for any small model before RL).

    L = -sum_{b,t} m_bt log p(y_bt | y_<t) / sum m_bt     (completion tokens only)
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl4llm.train.step import TrainBatch


def pack_sft_examples(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], *, length: int,
                      pad_id: int) -> TrainBatch:
    """Left-pads prompt + completion to `length` + 1 tokens; the loss mask covers completions.

    Raises ValueError naming the example when prompt + completion exceeds the length.
    """
    n = len(prompts)
    tokens = np.full((n, length + 1), pad_id, np.int32)
    mask = np.zeros((n, length + 1), np.float32)
    completion = np.zeros((n, length + 1), np.float32)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        seq = list(p) + list(c)
        if len(seq) > length + 1:
            raise ValueError(f"SFT example {i} has {len(seq)} tokens, more than the packing length {length + 1}; raise the length.")
        start = length + 1 - len(seq)
        tokens[i, start:] = seq
        mask[i, start:] = 1
        completion[i, start + len(p):] = 1
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    zeros_t = np.zeros((n, length), np.float32)
    zeros_b = np.ones((n,), np.float32)
    return TrainBatch(
        input_tokens=tokens[:, :-1], targets=tokens[:, 1:], positions=positions[:, :-1],
        attention_mask=mask[:, :-1].astype(np.int32), loss_mask=completion[:, 1:], old_logp=zeros_t, ref_logp=zeros_t,
        sampler_logp=zeros_t, advantages=zeros_b, row_weights=zeros_b, denominator_weights=zeros_b,
    )


def sft_train(params, logprob_fn: Callable, data: TrainBatch, *, steps: int, batch_size: int, lr: float,
              seed: int = 0, warmup_steps: int = 20, log_every: int = 50, log: Callable[[str], None] = print):
    """Trains `params` on `data` (from pack_sft_examples) with AdamW + cosine schedule; returns params."""
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup_steps, max(steps, warmup_steps + 1), end_value=lr * 0.1)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.01))
    opt_state = opt.init(params)

    @jax.jit
    def step(params, opt_state, batch: TrainBatch):
        def loss_fn(p):
            logp, _ = logprob_fn(p, batch.input_tokens, batch.targets, batch.positions, batch.attention_mask)
            return -jnp.sum(logp * batch.loss_mask) / jnp.maximum(jnp.sum(batch.loss_mask), 1.0)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    rng = np.random.default_rng(seed)
    n = data.input_tokens.shape[0]
    losses = []
    for i in range(steps):
        idx = rng.choice(n, size=batch_size, replace=False)
        batch = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)[idx]), data)
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(loss)
        if log_every and (i + 1) % log_every == 0:
            log(f"sft step {i + 1}/{steps}: loss {float(np.mean(jax.device_get(losses[-log_every:]))):.4f}")
    return params

"""What each sampler does under the rows' response lengths (`train.response_lengths`), as the meter's
input: a run's decode work depends on the lengths, not on the budget (`static_decode_work`,
`continuous_decode_work`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrl4llm.train.response_lengths import LengthDistribution


@dataclasses.dataclass(frozen=True)
class DecodeWork:
    """What a static decode batch does under a length distribution, per chunk of `rows` rows.

    steps: expected decode-loop steps of a chunk (its longest row's length - 1: the first
      token comes from the prefill); mean_length: expected tokens a row generates;
      idle_fraction: 1 - generated tokens / (rows x (steps + 1)), the row-steps spent on finished rows.
    """

    steps: float
    mean_length: float
    idle_fraction: float
    longest: tuple[int, ...] = ()  # each drawn chunk's longest row


def static_decode_work(dist: LengthDistribution, rows: int, budget: int, *, draws: int = 256, seed: int = 0) -> DecodeWork:
    """Monte Carlo over `draws` chunks of `rows` rows: a static batch runs until its longest row ends."""
    rng = np.random.default_rng(seed)
    lengths = dist.sample(draws * rows, budget, rng).reshape(draws, rows)
    longest = lengths.max(axis=1)
    return DecodeWork(steps=float(np.mean(longest - 1)), mean_length=float(lengths.mean()),
                      idle_fraction=float(1 - lengths.sum() / (longest.sum() * rows)),
                      longest=tuple(int(x) for x in longest))


def decode_block_trips(longest, block_size: int, max_new_tokens: int) -> list[float]:
    """Expected trips of each KV-block loop of `sampling.decode_loop.sample_program` [num_blocks]:
    a chunk whose longest row has L tokens runs L - 1 decode steps, block j the steps
    j*blk + 1 .. (j+1)*blk of them."""
    num_blocks = -(-(max_new_tokens - 1) // block_size)
    steps = np.asarray(longest, np.float64) - 1
    return [float(np.mean(np.clip(steps - j * block_size, 0, block_size))) for j in range(num_blocks)]



@dataclasses.dataclass(frozen=True)
class ContinuousWork:
    """What the continuous sampler (`sampling.continuous`) does under a length distribution, per call.

    bursts: expected refills (trips of the outer loop); prefill_rounds: prompt prefills per refill
      (trips of the admission loop; one prompt a round per shard); steps: decode steps in all,
      steps_per_burst their mean per refill (trips of the burst loop); chunks_per_step: trips of
      each layer's page-chunk loops (the XLA attention: the longest live slot's pages, in chunks);
      kv_tokens, kv_pages: per step and shard, keys every slot attends to (an idle slot counts one,
      as the kernel runs it) and the pages read for them; useful_fraction: live slot-steps over
      slot-steps (the row-steps that make a token); kv_partitions: per step and shard, the partitions
      whose partials a split attention kernel writes (`partitions` of `continuous_decode_work`; 0
      without it).
    When a refill chooses its prefill batch at run time (`sampling.continuous.prefill_batch`):
    batched_refills: refills a call that prefill rounds of `prefill_batch` prompts (they admit more
    than half of it), batched_rounds: those rounds per such refill, single_rounds: one-prompt rounds
    per other refill (0 when it admits none).
    """

    bursts: float
    prefill_rounds: float
    steps: float
    steps_per_burst: float
    chunks_per_step: float
    kv_tokens: float
    kv_pages: float
    useful_fraction: float
    mean_length: float
    prefill_batch: int = 1
    batched_refills: float = 0.0
    batched_rounds: float = 0.0
    single_rounds: float = 0.0
    kv_partitions: float = 0.0


def segment_schedule(lengths: np.ndarray, nd: int, sd: int, samples: int, burst: int, page_size: int, pages_per_chunk: int,
                     prompt_tokens: float, lookahead: bool, prefill: tuple[int, bool] = (1, False),
                     partitions=None) -> list[np.ndarray]:
    """The continuous engine's schedule over a stream of rollouts (lengths [shards, K * nd], rollout
    j = the rows j*nd .. (j+1)*nd - 1 of each shard), one segment a rollout: it ends after the
    burst in which the rollout's last row finishes; with `lookahead` (partial rollouts) it admits
    the next rollout's rows too, and the slots carry over. `prefill`: (A, choose) of
    `sampling.continuous.prefill_batch` (a refill of m prompts runs ceil(m / A) rounds of A; with
    choose, m rounds of one when m <= A / 2). `partitions`: live pages of each slot (0: idle) ->
    the partitions whose partials the attention kernel writes for it (None: not counted). Returns
    per segment [bursts, rounds, steps, live slot-steps, keys, pages, page-chunk trips, batched
    refills, their rounds, one-prompt rounds, written partitions]."""
    a, choose = prefill
    shards = lengths.shape[0]
    need = lengths - 1  # decode steps each row takes after its prefill token
    left = np.zeros((shards, sd), np.int64)  # steps a slot's row still takes (0: free)
    done = np.zeros((shards, sd), np.int64)  # steps it took so far (its row's length - 1)
    row = np.full((shards, sd), -1, np.int64)  # the stream row a slot holds
    nxt = np.zeros(shards, np.int64)
    out = []
    for j in range(lengths.shape[1] // nd):
        end, limit = (j + 1) * nd, min((j + 2 if lookahead else j + 1) * nd, lengths.shape[1])
        totals = np.zeros(11)
        while True:
            if not (((left > 0) & (row < end)).any() or (nxt < end).any()):
                break
            free = left == 0
            take = np.minimum(free.sum(1), limit - nxt)
            m = int((-(-(nxt + take) // samples) - (-(-nxt // samples))).max())  # prompts the busiest shard admits
            if choose and 2 * m <= a:
                totals[[1, 9]] += m
            else:
                totals[[1, 7, 8]] += [-(-m // a), choose, -(-m // a) * choose]
            for d in range(shards):
                at = np.flatnonzero(free[d])[:take[d]]
                left[d, at], done[d, at], row[d, at] = need[d, nxt[d]:nxt[d] + take[d]], 0, np.arange(nxt[d],
                                                                                                      nxt[d] + take[d])
            nxt += take
            totals[0] += 1
            n = min(burst, int(left.max()))
            if n == 0:
                continue
            k = np.arange(n)[None, None, :]  # the burst's steps
            live = k < left[..., None]
            tokens = prompt_tokens + done[..., None] + 1 + k  # keys a live slot attends to
            totals[2] += n
            totals[3] += live.sum()
            totals[4] += np.where(live, tokens, 1).sum() / shards
            totals[5] += np.where(live, np.ceil(tokens / page_size), 1).sum() / shards
            longest = np.where(live, np.ceil(tokens / page_size), 0).max(axis=(0, 1))
            totals[6] += np.ceil(longest / pages_per_chunk).sum()
            if partitions is not None:
                totals[10] += partitions(np.where(live, np.ceil(tokens / page_size), 0).astype(np.int64)).sum() / shards
            left, done = np.maximum(left - n, 0), np.where(left > 0, done + np.minimum(left, n), done)
        out.append(totals)
    return out


def continuous_decode_work(dist: LengthDistribution, rows: int, slots: int, budget: int, *, shards: int = 1,
                           samples: int = 1, burst: int = 16, page_size: int = 16, pages_per_chunk: int = 8,
                           prompt_tokens: float = 0.0, draws: int = 4, seed: int = 0,
                           partial: bool = False, prefill: tuple[int, bool] = (1, False),
                           partitions=None) -> ContinuousWork:
    """Monte Carlo of the continuous engine's schedule over `draws` calls of `rows` rows.

    Each of `shards` shards holds rows/shards rows (in order, `samples` a prompt) and
    slots/shards slots. At a refill every free slot takes the next waiting row (its first token
    comes from the prompt's prefill, run once per prompt, one prompt a round); then a burst runs
    min(burst, the longest remaining row over all shards) steps, each slot one token a step. A
    row of L tokens holds its slot for L - 1 steps; its attention at its j-th step reads
    prompt_tokens + j keys. The bursts ~ the makespan of the rows on the slots / burst.
    partial (rollout.partial): one stream of draws + 2 rollouts, each segment admitting the next
    rollout's rows into the slots its own free; the figures are per segment in the steady state
    (the first segment, which starts from empty slots, and the last, with no next rollout, left out).
    prefill: (A, choose) of `sampling.continuous.prefill_batch`: prompts a prefill round takes.
    partitions: a slot's live pages (0: idle) -> partitions a split attention kernel writes for it
    (`sampling.gpu_paged_attention.written_partitions`), counted into kv_partitions."""
    rng = np.random.default_rng(seed)
    nd, sd = rows // shards, max(slots // shards, 1)
    if partial:
        draws *= 3  # segments vary more than calls (a segment's length depends on the one before)
        lengths = dist.sample(shards * nd * (draws + 2), budget, rng).reshape(shards, draws + 2, nd)
        segments = segment_schedule(lengths.reshape(shards, -1), nd, sd, samples, burst, page_size, pages_per_chunk,
                                    prompt_tokens, lookahead=True, prefill=prefill, partitions=partitions)[1:-1]
        means = lengths[:, 1:-1].mean()
    else:
        segments, means = [], []
        for _ in range(draws):
            lengths = dist.sample(shards * nd, budget, rng).reshape(shards, nd)
            segments += segment_schedule(lengths, nd, sd, samples, burst, page_size, pages_per_chunk, prompt_tokens,
                                         lookahead=False, prefill=prefill, partitions=partitions)
            means.append(lengths.mean())
        means = float(np.mean(means))
    b, r, s, live, kv, pages, chunks, batched, batched_rounds, single_rounds, written = np.mean(segments, axis=0)
    return ContinuousWork(bursts=b, prefill_rounds=r / max(b, 1), steps=s, steps_per_burst=s / max(b, 1),
                          chunks_per_step=chunks / max(s, 1), kv_tokens=kv / max(s, 1), kv_pages=pages / max(s, 1),
                          useful_fraction=live / max(s * shards * sd, 1), mean_length=float(means),
                          prefill_batch=prefill[0], batched_refills=batched,
                          batched_rounds=batched_rounds / batched if batched else 0.0,
                          single_rounds=single_rounds / (b - batched) if b > batched else 0.0,
                          kv_partitions=written / max(s, 1))

"""Packed training rows: whole sequences side by side in fixed [rows, S] buffers, no padding rows.

A step's padded TrainBatch holds every response in a row of L = P + R - 1 positions; at the
study's lengths (8k budget, responses averaging 1-3k) most of those positions are padding.
Packing puts several sequences in one row, each a segment with its own id and positions that
restart at 0, and cuts the mini-batch into micro-batches of a fixed token budget
(`trainer.tokens_per_micro_batch` per data-parallel device) whose number follows the data:

    plan   = pack_plan(prompt_lengths, response_lengths, ...)      host, numpy (first-fit decreasing)
    packed = pack(batch, plan)                                     device, one gather program
    view   = unpack_micro(micro, logp, entropy)                    inside the update, per micro-batch

The model runs on the packed rows (segment ids keep the sequences apart in attention); the loss
runs on `unpack_micro`'s view: every sequence of the micro-batch as a row of its W scored
positions, the same [rows, W] layout the padded update scores, with empty slots weighted 0 and
counted nowhere. So every aggregation mode and every recipe is computed by the same
`core.policy_loss` on the same per-sequence rows, and the normalisers stay global: token counts
and sequence counts are sums over real rows, summed over micro-batches and divided once per
optimizer step (train/step.py), the prompt weights come from the whole batch
(`compute_advantages`), and a row-sum mode counts the micro-batch's real rows (`rows=`).

The layout (the verl / NeMo-RL "remove padding + dynamic batch size", MaxText and tunix segment
ids) in shapes: n mini-batches, M micro-batches (a bound; `num_micro[j]` of them hold data),
RR = data-parallel devices x rows per device, S = L, c = sequences per row at most, W = R.
Rows are dealt to devices by fill so that every device gets a near-equal share of tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl4llm.models.sharding import DEFAULT_RULES, logical_to_spec
from jaxrl4llm.train.train_batch import TrainBatch

# a packed row holds at most this many sequences (the loss view has c slots per row)
SEQUENCES_PER_ROW = 8
# default budget per data-parallel device and micro-batch (verl's ppo_max_token_len_per_gpu)
DEFAULT_TOKENS_PER_MICRO_BATCH = 16384


class PackedBatch(NamedTuple):
    """A step's TrainBatch packed into micro-batches of whole sequences.

    Token arrays [n, M, RR, S] (mini-batch, micro-batch, row, position):
      input_tokens, targets, positions (restart at 0 in each segment) int32; segment_ids int32
      (k = the row's k-th sequence, 0 = padding); loss_mask, old_logp, ref_logp, sampler_logp
      float32 as in TrainBatch; token_row_weights float32 (the row weight of the token's sequence).
    Slot arrays [n, M, RR, c] (the c sequences a row may hold):
      slot_first int32 (the packed column of the sequence's first scored position), slot_valid
      float32 (1 = a sequence, 0 = empty slot); advantages, row_weights, denominator_weights float32.
    num_micro [n] int32: micro-batches of mini-batch j that hold sequences (the rest are empty).
    routes [n, M, RR, S, layers, k] (router replay; else None): the sampler's expert ids of each
      packed position's input token, as TrainBatch.routes (0 on padding).
    teacher_logp [n, M, RR, S] float32 (a run with a teacher; else None): TrainBatch.teacher_logp packed.
    """

    input_tokens: chex.Array
    targets: chex.Array
    positions: chex.Array
    segment_ids: chex.Array
    loss_mask: chex.Array
    old_logp: chex.Array
    ref_logp: chex.Array
    sampler_logp: chex.Array
    token_row_weights: chex.Array
    slot_first: chex.Array
    slot_valid: chex.Array
    advantages: chex.Array
    row_weights: chex.Array
    denominator_weights: chex.Array
    num_micro: chex.Array
    routes: chex.Array | None = None
    teacher_logp: chex.Array | None = None


@dataclasses.dataclass(frozen=True)
class PackLayout:
    """The static shape of a packed step (part of the jit key of the update).

    mini_batches n, micro_batches M (upper bound), shards = data-parallel devices, rows_per_shard
    R (rows per device and micro-batch), row_width S (= the padded width L), response_width W
    (the scored positions of a sequence: max_new_tokens), sequences B (the step's rows),
    sequences_per_row c."""

    mini_batches: int
    micro_batches: int
    shards: int
    rows_per_shard: int
    row_width: int
    response_width: int
    sequences: int
    sequences_per_row: int = SEQUENCES_PER_ROW

    @property
    def rows(self) -> int:
        """RR: the rows of one micro-batch over all devices."""
        return self.shards * self.rows_per_shard

    @property
    def positions(self) -> int:
        """Positions of one micro-batch over all devices (the per-device budget is
        rows_per_shard x row_width)."""
        return self.rows * self.row_width


def pack_layout(*, rows: int, mini_batches: int, shards: int, prompt_width: int, response_width: int,
                tokens_per_micro_batch: int | None) -> PackLayout:
    """The layout of `rows` sequences of prompt_width + response_width - 1 positions at most:
    rows_per_shard = tokens_per_micro_batch // S (at least 1), M = the micro-batches the worst
    case (every sequence full length, one per row) needs. tokens_per_micro_batch None:
    DEFAULT_TOKENS_PER_MICRO_BATCH, at most the padded mini-batch's share of a device."""
    s = prompt_width + response_width - 1
    per_shard = -(-rows // (mini_batches * shards))  # sequences of a mini-batch on one device
    budget = tokens_per_micro_batch or min(DEFAULT_TOKENS_PER_MICRO_BATCH, per_shard * s)
    r = max(1, budget // s)
    return PackLayout(mini_batches=mini_batches, micro_batches=-(-per_shard // r), shards=shards, rows_per_shard=r,
                      row_width=s, response_width=response_width, sequences=rows)


class PackPlan(NamedTuple):
    """Where every packed position comes from (host numpy; see PackedBatch for the shapes).

    source [n, M, RR, S] int32: flat index b * L + column into the padded [B, L] arrays, -1 = padding.
    segment_ids [n, M, RR, S] int32; slot_sequence [n, M, RR, c] int32 (b, -1 = empty);
    slot_first [n, M, RR, c] int32; num_micro [n] int32."""

    source: np.ndarray
    segment_ids: np.ndarray
    slot_sequence: np.ndarray
    slot_first: np.ndarray
    num_micro: np.ndarray


def first_fit_decreasing(lengths: np.ndarray, capacity: int, max_items: int) -> list[list[int]]:
    """Bins of item indices, longest item first into the first bin it fits (tokens <= capacity,
    items <= max_items), a new bin when none does. Every length must be <= capacity.

    Only the bins that can still take an item are scanned: one drops out when it holds max_items or
    its room is under the smallest item (every later item is at least that long), which gives the
    same bins as scanning them all. Python ints and lists: a run's layout packs a few thousand
    sampled mini-batches at startup (`expected_micro_batches`), where numpy's per-call cost dominated."""
    sizes = np.asarray(lengths).tolist()
    order = sorted(range(len(sizes)), key=lambda j: -sizes[j])  # stable, as np.argsort(kind="stable")
    smallest = sizes[order[-1]] if order else 0
    bins: list[list[int]] = []
    free: list[int] = []
    open_bins: list[int] = []  # the bins that may take another item, in the order they were opened
    for i in order:
        size = sizes[i]
        for place, k in enumerate(open_bins):
            if free[k] >= size:
                break
        else:  # a new bin
            k, place = len(bins), len(open_bins)
            bins.append([])
            free.append(capacity)
            open_bins.append(k)
        bins[k].append(i)
        free[k] -= size
        if len(bins[k]) == max_items or free[k] < smallest:
            del open_bins[place]
    return bins


def sequence_positions(prompt_lengths: np.ndarray, response_lengths: np.ndarray, layout: PackLayout) -> np.ndarray:
    """[B] positions each sequence takes in a packed row: plen + rlen - 1 (the last response token
    is only a target). Raises ValueError if one does not fit a row (layout.row_width)."""
    need = np.maximum(np.asarray(prompt_lengths, np.int64) + np.asarray(response_lengths, np.int64) - 1, 0)
    if need.max(initial=0) > layout.row_width:
        raise ValueError(f"a sequence of {need.max()} positions does not fit a packed row of {layout.row_width}.")
    return need


def deal_rows(need: np.ndarray, layout: PackLayout, mini_batch: int = 0) -> tuple[list[list[list[int]]], int]:
    """One mini-batch's sequences (`need` [B / mini_batches] positions each) packed into rows
    first-fit decreasing, the rows dealt to the devices fullest first, round robin: (per device its
    rows, each a list of indices into `need`; the micro-batches the fullest device needs).

    Raises ValueError if that is more than layout.micro_batches."""
    bins = first_fit_decreasing(need, layout.row_width, layout.sequences_per_row)
    sizes = np.asarray(need).tolist()
    fill = [sum(sizes[i] for i in bb) for bb in bins]
    order = np.argsort(-np.asarray(fill), kind="stable")
    per_shard: list[list[list[int]]] = [[] for _ in range(layout.shards)]
    for rank, k in enumerate(order):
        per_shard[rank % layout.shards].append(bins[k])
    micro = max(-(-len(rows) // layout.rows_per_shard) for rows in per_shard)
    if micro > layout.micro_batches:
        raise ValueError(f"mini-batch {mini_batch} needs {micro} micro-batches, more than the layout's "
                         f"{layout.micro_batches}.")
    return per_shard, micro


def micro_batch_counts(prompt_lengths: np.ndarray, response_lengths: np.ndarray, layout: PackLayout) -> np.ndarray:
    """[mini_batches] micro-batches each mini-batch fills: `pack_plan`'s num_micro, without
    building its arrays (what `expected_micro_batches` and `jaxrl4llm plan` need)."""
    need = sequence_positions(prompt_lengths, response_lengths, layout)
    per_mini = need.shape[0] // layout.mini_batches
    return np.array([deal_rows(need[j * per_mini:(j + 1) * per_mini], layout, j)[1]
                     for j in range(layout.mini_batches)], np.int32)


def pack_plan(prompt_lengths: np.ndarray, response_lengths: np.ndarray, layout: PackLayout,
              prompt_width: int) -> PackPlan:
    """The packing of B sequences (rows of the padded batch, mini-batch j = rows [j B/n, (j+1) B/n)).

    Sequence b needs plen_b + rlen_b - 1 positions (its prompt and response minus the last
    token, which is only a target): padded columns [P - plen_b, P - 1 + rlen_b). Its scored
    positions (targets = response tokens) start at its offset + plen_b - 1. Rows of a mini-batch
    are packed first-fit decreasing, then dealt to the devices fullest first, round robin.

    Raises ValueError if a mini-batch needs more micro-batches than layout.micro_batches (it
    cannot: the bound is the all-full-length case)."""
    lay, p = layout, prompt_width
    plen = np.asarray(prompt_lengths, np.int64)
    need = sequence_positions(plen, response_lengths, lay)
    b, n, s, c = plen.shape[0], lay.mini_batches, lay.row_width, lay.sequences_per_row
    shape = (n, lay.micro_batches, lay.rows, s)
    source = np.full(shape, -1, np.int32)
    segments = np.zeros(shape, np.int32)
    slot_seq = np.full(shape[:3] + (c,), -1, np.int32)
    slot_first = np.zeros(shape[:3] + (c,), np.int32)
    num_micro = np.zeros(n, np.int32)
    per_mini = b // n
    for j in range(n):
        ids = np.arange(j * per_mini, (j + 1) * per_mini)
        per_shard, num_micro[j] = deal_rows(need[ids], lay, j)
        for d, rows in enumerate(per_shard):
            for i, row in enumerate(rows):
                m, r = divmod(i, lay.rows_per_shard)
                rr = d * lay.rows_per_shard + r
                offset = 0
                for slot, k in enumerate(row):
                    seq = int(ids[k])
                    width = int(need[seq])
                    start = p - int(plen[seq])  # the sequence's first padded column
                    source[j, m, rr, offset:offset + width] = seq * s + start + np.arange(width)
                    segments[j, m, rr, offset:offset + width] = slot + 1
                    slot_seq[j, m, rr, slot] = seq
                    slot_first[j, m, rr, slot] = offset + int(plen[seq]) - 1
                    offset += width
    return PackPlan(source, segments, slot_seq, slot_first, num_micro)


def pack(batch: TrainBatch, plan: PackPlan) -> PackedBatch:
    """The padded TrainBatch [B, L] (advantages [B] or [B, L]) gathered into the plan's packed
    layout; jit it with the packed shardings (`packed_shardings`). Padding positions hold 0."""
    valid = plan.source >= 0
    flat_index = jnp.maximum(plan.source, 0)
    rows_of = flat_index // batch.input_tokens.shape[1]
    tokens = lambda x: jnp.where(valid, x.reshape(-1)[flat_index], 0).astype(x.dtype)
    used = plan.slot_sequence >= 0
    slots = lambda x: jnp.where(used, x[jnp.maximum(plan.slot_sequence, 0)], 0).astype(x.dtype)
    if batch.advantages.ndim == 2:
        raise ValueError("token-level advantages [B, L] are not packed yet; set trainer.packing=false.")
    routes = None
    if batch.routes is not None:  # [B, L, layers, k] -> [n, M, RR, S, layers, k], 0 where no position maps
        flat = batch.routes.reshape((-1,) + batch.routes.shape[2:])
        routes = jnp.where(valid[..., None, None], flat[flat_index], 0).astype(batch.routes.dtype)
    return PackedBatch(
        input_tokens=tokens(batch.input_tokens), targets=tokens(batch.targets), positions=tokens(batch.positions),
        segment_ids=jnp.asarray(plan.segment_ids), loss_mask=tokens(batch.loss_mask), old_logp=tokens(batch.old_logp),
        ref_logp=tokens(batch.ref_logp), sampler_logp=tokens(batch.sampler_logp),
        token_row_weights=jnp.where(valid, batch.row_weights[rows_of], 0.0).astype(jnp.float32),
        slot_first=jnp.asarray(plan.slot_first), slot_valid=used.astype(jnp.float32),
        advantages=slots(batch.advantages), row_weights=slots(batch.row_weights),
        denominator_weights=slots(batch.denominator_weights), num_micro=jnp.asarray(plan.num_micro), routes=routes,
        teacher_logp=None if batch.teacher_logp is None else tokens(batch.teacher_logp),
    )


def packed_shardings(mesh, rules=None) -> PackedBatch:
    """PackedBatch of shardings: the row axis (2) split as the rules' "batch" axis (routes too, when a
    batch carries them), num_micro replicated."""
    batch_axes = logical_to_spec(("batch",), rules or DEFAULT_RULES)[0]
    rows = NamedSharding(mesh, PartitionSpec(None, None, batch_axes))
    fields = {name: rows for name in PackedBatch._fields}
    return PackedBatch(**dict(fields, num_micro=NamedSharding(mesh, PartitionSpec())))


def _gather_slots(x: chex.Array, columns: chex.Array) -> chex.Array:
    """x [RR, S] at columns [RR, c, W] (row-local) -> [RR * c, W]."""
    rr, c, w = columns.shape
    return jnp.take_along_axis(x, columns.reshape(rr, c * w), axis=1).reshape(rr * c, w)


def slot_columns(slot_first: chex.Array, width: int, row_width: int) -> chex.Array:
    """[RR, c] first scored columns -> [RR, c, W] columns first + t (clipped into the row)."""
    return jnp.minimum(slot_first[..., None] + jnp.arange(width, dtype=jnp.int32), row_width - 1)


def unpack_micro(micro: PackedBatch, logp: chex.Array, entropy: chex.Array, width: int
                 ) -> tuple[TrainBatch, chex.Array, chex.Array, chex.Array]:
    """One packed micro-batch as the loss's per-sequence view.

    Args: micro: a PackedBatch slice [RR, S] / [RR, c] (no n, M axes); logp, entropy [RR, S] of
      the model on micro's rows; width: W, the scored positions of a sequence.
    Returns: (TrainBatch [RR*c, W] of loss_mask, old/ref/sampler log-probs and the slot weights,
      its token fields None; logp [RR*c, W]; entropy [RR*c, W]; rows: the real sequences, a
      scalar). Position t of slot k is the packed column slot_first + t, counted while it is
      in the slot's segment and in the loss mask.
    """
    rr, s = logp.shape
    cols = slot_columns(micro.slot_first, width, s)
    inside = (micro.slot_first[..., None] + jnp.arange(width, dtype=jnp.int32) < s).reshape(-1, width)
    slot_ids = jnp.arange(1, micro.slot_first.shape[1] + 1, dtype=jnp.int32)
    own = _gather_slots(micro.segment_ids, cols) == jnp.tile(slot_ids, rr)[:, None]
    own = own & inside & (micro.slot_valid.reshape(-1, 1) > 0)
    view = lambda x: jnp.where(own, _gather_slots(x, cols), 0.0)
    batch = TrainBatch(
        input_tokens=None, targets=None, positions=None, attention_mask=None,
        loss_mask=view(micro.loss_mask), old_logp=view(micro.old_logp), ref_logp=view(micro.ref_logp),
        sampler_logp=view(micro.sampler_logp), advantages=micro.advantages.reshape(-1),
        row_weights=micro.row_weights.reshape(-1), denominator_weights=micro.denominator_weights.reshape(-1),
        teacher_logp=None if micro.teacher_logp is None else view(micro.teacher_logp),
    )
    return batch, view(logp), view(entropy), jnp.sum(micro.slot_valid)


def scatter_slots(values: chex.Array, micro: PackedBatch, row_width: int) -> chex.Array:
    """The inverse placement of `unpack_micro` for flags: values [RR*c, W] bool -> [RR, S] bool
    (True where a slot position holding True maps)."""
    rr, c = micro.slot_first.shape
    w = values.shape[1]
    cols = slot_columns(micro.slot_first, w, row_width).reshape(rr, c * w)
    out = jnp.zeros((rr, row_width), jnp.int32)
    out = jax.vmap(lambda o, i, v: o.at[i].max(v))(out, cols, values.reshape(rr, c * w).astype(jnp.int32))
    return out > 0


def to_padded(packed_values: np.ndarray, plan: PackPlan, rows: int, width: int) -> np.ndarray:
    """Packed token values [n, M, RR, S] -> the padded layout [B, L] (host numpy; 0 on padding),
    by the plan's sources: for checks and tests."""
    out = np.zeros(rows * width, np.asarray(packed_values).dtype)
    valid = plan.source >= 0
    out[plan.source[valid]] = np.asarray(packed_values)[valid]
    return out.reshape(rows, width)


def packed_abstract(layout: PackLayout, mesh, routes: tuple | None = None, teacher: bool = False) -> PackedBatch:
    """PackedBatch of ShapeDtypeStructs (with `packed_shardings`) of the layout's largest step:
    what `jaxrl4llm plan` compiles the packed update and log-prob pass for. routes: (layers, k, dtype)
    of router replay's routes, or None (no routes); teacher: with teacher_logp (a run with a teacher)."""
    shardings = packed_shardings(mesh)
    tokens = (layout.mini_batches, layout.micro_batches, layout.rows, layout.row_width)
    slots = tokens[:3] + (layout.sequences_per_row,)
    shapes = dict(num_micro=(layout.mini_batches,), advantages=slots, row_weights=slots, denominator_weights=slots,
                  slot_first=slots, slot_valid=slots)
    ints = ("input_tokens", "targets", "positions", "segment_ids", "slot_first", "num_micro")
    fields = {name: jax.ShapeDtypeStruct(shapes.get(name, tokens), jnp.int32 if name in ints else jnp.float32,
                                         sharding=getattr(shardings, name))
              for name in PackedBatch._fields if name not in ("routes", "teacher_logp")}
    if teacher:
        fields["teacher_logp"] = jax.ShapeDtypeStruct(tokens, jnp.float32, sharding=shardings.teacher_logp)
    if routes is not None:
        layers, k, dtype = routes
        fields["routes"] = jax.ShapeDtypeStruct(tokens + (layers, k), dtype, sharding=shardings.routes)
    return PackedBatch(**fields)


@functools.lru_cache(maxsize=256)  # pure: `plan` and the loop's layout ask it again for the same run
def expected_micro_batches(layout: PackLayout, lengths, prompt_tokens: float, *, draws: int = 4,
                           seed: int = 0) -> float:
    """The mean number of micro-batches a mini-batch of the layout fills when its responses'
    lengths follow `lengths` (train.response_lengths.LengthDistribution) and every prompt has
    `prompt_tokens` real tokens: `pack_plan`'s counts (`micro_batch_counts`) on `draws` sampled steps
    (the trips of the packed update's and log-prob pass's micro-batch loop, for `jaxrl4llm plan`)."""
    rng = np.random.default_rng(seed)
    plen = np.full(layout.sequences, max(int(round(prompt_tokens)), 1))
    counts = [micro_batch_counts(plen, lengths.sample(layout.sequences, layout.response_width, rng), layout).mean()
              for _ in range(draws)]
    return float(np.mean(counts))

"""Tool calls in the continuous engine: the host loop that parks rows, runs their code and resumes them.

    state = tool_init(...)                                   (continuous.py; one call's rows)
    loop:
        state = tool_resume(state, observations ready)       forced tokens into the rows' next columns
        state, parked = tool_segment(state, steps, wait)     decode; a trigger parks its slot (pages kept);
                                                             ends early once new parked slots waited `wait`
        new parked rows -> parse_call -> executor.run        in a thread: runs while the next segment decodes
                                                             (one batch at a time; calls parsed meanwhile wait)
        finished calls -> observation_text -> observation_tokens -> ready
        nothing decodes and calls are out -> wait for the first to finish

A slot parks when the model's own tokens end with the format's trigger (`stops.trigger_token_sequences`;
never inside tool output) and its row has turns left (`ToolsSpec.max_turns`). The host reads the
row's text since its last observation (`tools.protocol.parse_call`), runs the code on the executor
(anything with `run(codes) -> [ToolResult]`, `tools.PythonExecutor`), renders the observation
(`observation_text`, cut in the middle to `max_output_chars`), and tokenizes it into at most
min(room, max_tool_tokens) tokens (`observation_tokens`; room: the row's budget left, tool tokens
count against it). The slot resumes by decoding those tokens as if it had sampled them (their KV
written by the same decode step; `Tools.mask` marks them), then samples on. A trigger without code
resumes with the format's error observation; a trigger inside the code being written resumes with
no token and does not count as a call. Design: tools.md A4.3 (park and force-decode; verl, SkyRL
and slime resend the whole history to the server instead).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from typing import NamedTuple

import jax
import numpy as np

from jaxrl4llm.tools.protocol import ToolCall, ToolFormat, ToolsSpec, observation_text, observation_tokens, parse_call

SEGMENT_STEPS = 32  # decode steps a tool segment runs before the host looks at parked rows
MIN_SEGMENT_STEPS = 4  # the shortest segment while calls run


@dataclasses.dataclass
class ToolStats:
    """A rollout's tool figures (host side; `metrics()` for the loop's log).

    calls [N] int: the calls each row made (code runs and error observations; a trigger inside
    the code is none). statuses: calls by outcome (the executor's ok / error / timeout / oom / crash,
    the parser's no_code / unclosed_block / invalid_call). tool_seconds: wall time the executor
    ran; hidden_seconds: of it, the time a segment decoded meanwhile. wait_seconds: the host waited
    for calls with nothing to decode. parked_share: parked
    slot-steps / slot-steps. segments: host round trips. tool_tokens: forced tokens fed.
    decode_steps: decode steps the engine ran. batches: executor batches (a segment's new calls)."""

    calls: np.ndarray
    statuses: dict
    tool_seconds: float = 0.0
    hidden_seconds: float = 0.0
    wait_seconds: float = 0.0
    parked_share: float = 0.0
    segments: int = 0
    tool_tokens: int = 0
    decode_steps: int = 0
    batches: int = 0

    def metrics(self) -> dict[str, float]:
        """Scalars for the training log: tools/calls_per_row, tools/error_rate (calls that did not
        return "ok"), tools/timeout_rate, tools/seconds, tools/hidden_share, tools/parked_share,
        tools/segments, tools/tokens."""
        calls = max(int(self.calls.sum()), 1)
        return {"tools/calls_per_row": float(self.calls.mean()) if self.calls.size else 0.0,
                "tools/error_rate": (sum(self.statuses.values()) - self.statuses.get("ok", 0)) / calls,
                "tools/timeout_rate": self.statuses.get("timeout", 0) / calls,
                "tools/seconds": self.tool_seconds,
                "tools/hidden_share": self.hidden_seconds / self.tool_seconds if self.tool_seconds else 1.0,
                "tools/parked_share": self.parked_share, "tools/segments": float(self.segments),
                "tools/tokens": float(self.tool_tokens)}


class _Pending(NamedTuple):
    """A parked slot (d, s) whose call runs: its row and the room left in its budget."""

    slot: tuple
    row: int
    room: int


def _turn_text(tokenizer, tokens: np.ndarray, mask: np.ndarray, length: int) -> str:
    """The row's text since its last observation (all of it without one), special tokens kept."""
    forced = np.nonzero(mask[:length])[0]
    start = int(forced[-1]) + 1 if forced.size else 0
    return tokenizer.decode([int(t) for t in tokens[start:length]], skip_special_tokens=False)


def _timed_run(executor, codes):
    start = time.perf_counter()
    results = executor.run(codes)
    return results, start, time.perf_counter()


class SegmentClock:
    """A rollout's segment times so far: a segment's seconds = fixed + steps x step, fitted by least
    squares over its segments (`segment(steps, seconds)`), and the host's seconds between two
    segments (`host(seconds)`, a running mean). step_seconds: a decode step; round_trip_seconds:
    what ending a segment costs (fixed + host). The first segment is left out of the fit (it
    prefills every slot's prompt, and the rollout's first compiles the program). Until two step
    counts differ: step = the last segment's seconds / its steps, fixed = 0."""

    def __init__(self):
        self.sums = np.zeros(5)  # n, sum s, sum w, sum s^2, sum s w
        self.last = (1, 0.0)
        self.host_seconds = 0.0
        self.segments = 0

    def segment(self, steps: int, seconds: float) -> None:
        steps = max(steps, 1)
        self.segments += 1
        if self.segments > 1:
            self.sums += (1, steps, seconds, steps * steps, steps * seconds)
        self.last = (steps, seconds)

    def host(self, seconds: float) -> None:
        self.host_seconds = seconds if not self.host_seconds else 0.5 * (self.host_seconds + seconds)

    def _fit(self) -> tuple[float, float]:
        n, s, w, ss, sw = self.sums
        spread = n * ss - s * s
        if n >= 2 and spread > 0:
            step = (n * sw - s * w) / spread
            fixed = (w - step * s) / n
            if step > 0 and fixed >= 0:
                return fixed, step
        steps, seconds = self.last
        return 0.0, max(seconds / steps, 1e-9)

    @property
    def step_seconds(self) -> float:
        return self._fit()[1]

    @property
    def round_trip_seconds(self) -> float:
        return self._fit()[0] + self.host_seconds


def _submit(pool, executor, queued):
    """(pendings, future) of one executor batch of the queued (code, _Pending) calls."""
    return [call for _, call in queued], pool.submit(_timed_run, executor, [code for code, _ in queued])


def _overlap(span, intervals) -> float:
    return sum(max(0.0, min(span[1], b) - max(span[0], a)) for a, b in intervals)


def run_tools(state, *, segment, resume, fmt: ToolFormat, spec: ToolsSpec, executor, tokenizer, num_rows: int,
              segment_steps: int = SEGMENT_STEPS):
    """Drive a `continuous.tool_init` state to its end (the module docstring's loop).

    A segment runs `segment_steps` decode steps, or while calls run about as many as a call takes
    (the mean call batch's seconds over a decode step's, `SegmentClock`; at least
    MIN_SEGMENT_STEPS): a parked row then resumes right after its call returns instead of idling
    until a whole segment ends. A segment also ends once the slots that parked in it have waited, in
    all, the slot-steps one host round trip costs (`continuous.segment_end`): park_wait = a round
    trip's seconds / a decode step's seconds x the slots decoding, both from `SegmentClock`. A call
    so reaches the executor about when waiting for it costs as much as stopping the engine to hand
    it over.

    segment(state, max_steps, park_wait) -> (state, ParkedRows) and resume(state, resume, tokens, count,
    refund) -> state: `continuous.tool_segment` and `continuous.tool_resume` with their other
    arguments bound. num_rows: N, the rows over all shards. Returns (state, ToolStats)."""
    stats = ToolStats(calls=np.zeros(num_rows, np.int64), statuses=collections.Counter())
    width = spec.max_tool_tokens
    pending: dict[tuple[int, int], _Pending] = {}
    batches, ready, decoding = [], [], []  # batches: (pendings, future); ready: (slot, ids, refund)
    queued = []  # (code, _Pending) of calls parsed while a batch ran: the next batch
    steps, steps_before = segment_steps, 0
    clock, last_end, park_wait = SegmentClock(), None, None
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        while True:
            if ready:
                stats.tool_tokens += sum(len(ids) for _, ids, _ in ready)
                state = resume(state, *_resume_arrays(ready, view.parked.shape, width))
                ready = []
            start = time.perf_counter()
            if last_end is not None:
                clock.host(start - last_end)
            state, view = segment(state, np.int32(steps), np.int32(park_wait or 1))
            view = jax.device_get(view)
            last_end = time.perf_counter()
            decoding.append((start, last_end))
            stats.segments += 1
            codes, calls = [], []
            for d, s in zip(*np.nonzero(view.parked)):
                if (d, s) in pending:
                    continue
                row, length = int(view.row[d, s]), int(view.length[d, s])
                room = int(view.budget[d, s]) - length
                found = parse_call(fmt, _turn_text(tokenizer, view.tokens[d, s], view.mask[d, s], length))
                if isinstance(found, ToolCall):
                    pending[(d, s)] = _Pending((d, s), row, room)
                    codes.append(found.code)
                    calls.append(pending[(d, s)])
                    continue
                if found.reason != "trigger_in_code":
                    stats.calls[row] += 1
                    stats.statuses[found.reason] += 1
                ids = _observation(fmt, tokenizer, found.observation_text, room, spec) if found.observation_text else []
                ready.append(((d, s), ids, found.reason == "trigger_in_code"))
            queued += zip(codes, calls)
            batches = _collect(batches, ready, pending, stats, fmt, tokenizer, spec, decoding, wait=False)
            if queued and not batches:  # one batch at a time: the calls that came while one ran go together
                batches, queued = [_submit(pool, executor, queued)], []
            # while calls run, the next segment lasts about as long as a call: its rows resume right after
            clock.segment(int(view.steps) - steps_before, last_end - start)
            steps_before, step_seconds = int(view.steps), clock.step_seconds
            decoding_slots = int(np.sum((view.row >= 0) & ~view.parked))
            park_wait = int(np.ceil(clock.round_trip_seconds / step_seconds * max(decoding_slots, 1)))
            steps = segment_steps
            if batches:
                latency = stats.tool_seconds / stats.batches if stats.batches else step_seconds * segment_steps / 4
                steps = int(min(segment_steps, max(MIN_SEGMENT_STEPS, np.ceil(latency / step_seconds))))
            if not view.busy and not ready:
                if not batches:
                    break
                waited = time.perf_counter()
                batches = _collect(batches, ready, pending, stats, fmt, tokenizer, spec, decoding, wait=True)
                stats.wait_seconds += time.perf_counter() - waited
                if queued and not batches:
                    batches, queued = [_submit(pool, executor, queued)], []
        stats.decode_steps = int(view.steps)
        slot_steps = int(view.steps) * int(np.prod(view.parked.shape))
        stats.parked_share = int(view.parked_steps) / slot_steps if slot_steps else 0.0
    stats.statuses = dict(stats.statuses)
    return state, stats


def _observation(fmt, tokenizer, text: str, room: int, spec: ToolsSpec) -> list[int]:
    ids, _ = observation_tokens(fmt, tokenizer, text, room=room, max_tool_tokens=spec.max_tool_tokens)
    return ids


def _collect(batches, ready, pending, stats: ToolStats, fmt, tokenizer, spec: ToolsSpec, decoding, *, wait: bool):
    """Move the finished call batches' observations to `ready` (waiting for the first when `wait`);
    returns the batches still running."""
    if wait:
        concurrent.futures.wait([f for _, f in batches], return_when=concurrent.futures.FIRST_COMPLETED)
    running = []
    for calls, future in batches:
        if not future.done():
            running.append((calls, future))
            continue
        results, start, end = future.result()
        stats.batches += 1
        stats.tool_seconds += end - start
        stats.hidden_seconds += min(end - start, _overlap((start, end), decoding))
        for call, result in zip(calls, results):
            stats.calls[call.row] += 1
            stats.statuses[result.status] += 1
            text = observation_text(fmt, result, max_output_chars=spec.max_output_chars)
            ready.append((call.slot, _observation(fmt, tokenizer, text, call.room, spec), False))
            del pending[call.slot]
    return running


def _resume_arrays(ready, shape, width: int):
    """(resume [D, S] bool, tokens [D, S, K] int32, count [D, S] int32, refund [D, S] bool) of the ready slots."""
    resume, refund = np.zeros(shape, bool), np.zeros(shape, bool)
    tokens, count = np.zeros(shape + (width,), np.int32), np.zeros(shape, np.int32)
    for (d, s), ids, refunded in ready:
        resume[d, s], refund[d, s], count[d, s] = True, refunded, len(ids)
        tokens[d, s, :len(ids)] = ids
    return resume, tokens, count, refund

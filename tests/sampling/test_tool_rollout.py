"""Tool calls in the continuous engine (sampling/tool_rollout.py, continuous.tool_*): parked slots keep
their pages while the others decode; greedy rows with 0, 1 and 2 calls (fewer slots than rows) equal
an oracle that re-runs `generate` on prompt + response + observation after each call.

A tiny random model writes no code: its tokens are read as characters (id i is chr(32 + i)), and a
format whose trigger is a two-token string the model emits in its greedy loops parks it. The tool
is a deterministic stand-in whose output depends on the row's text (and itself spells the trigger,
which must not re-trigger). The host loop alone (`run_tools`) also runs over a scripted engine, in
the qwen3_chat format of a BPE tokenizer, with the real Python executor; segments end at parks
(`segment_end`, `SegmentClock`)."""

import json
from collections import Counter

import jax
import numpy as np
import pytest

from jaxrl4llm.models import ModelConfig, init_model
from jaxrl4llm.sampling import generate, generate_with_tools
from jaxrl4llm.sampling.buckets import left_pad_prompts
from jaxrl4llm.sampling.continuous import engine_spec_for, tool_init, tool_resume, tool_segment
from jaxrl4llm.sampling.decode_loop import decode_backend, weights_program
from jaxrl4llm.sampling.generate import eos_without_triggers
from jaxrl4llm.sampling.stops import trigger_token_sequences
from jaxrl4llm.tools.protocol import (ToolFormat, ToolsSpec, observation_text, observation_tokens, parse_call,
                                      tool_format)
from jaxrl4llm.tools.python_executor import ToolResult

CONFIG = ModelConfig(architecture="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=4, num_kv_heads=2, head_dim=8, dtype="float32", max_position_embeddings=256)
# the greedy model of key 1 loops on ")PM@^8 ": "PM" is its trigger; code follows the last "b"
FORMAT = ToolFormat("llama3_chat", trigger="PM", call_opening="b", observation_opening="<",
                    observation_closing=">")
PROMPTS = [np.random.default_rng(0).integers(1, 96, n).tolist() for n in (5, 3, 7, 2, 6, 4)]
R = 40


class CharTokenizer:
    """Token i is the character chr(32 + i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(32 + int(i)) for i in ids)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - 32 for c in text]


class StandIn:
    """The tool: prints "PM" (the trigger, inside tool output) and its code's length and last character."""

    def __init__(self):
        self.codes = []

    def run(self, codes):
        self.codes += list(codes)
        return [ToolResult("ok", f"PM{len(c)}{c[-1]}", 0.0) for c in codes]


def tiny_model():
    return init_model(CONFIG, jax.random.key(1), std=0.3)


def oracle(graphdef, state, budgets, spec: ToolsSpec, tool):
    """Each row decoded by `generate` (greedy) from its prompt + response so far, cut at the first
    model-token trigger while it has turns left, the observation appended: (tokens, tool mask,
    log-probs) per row."""
    tokenizer = CharTokenizer()
    width = len(tokenizer.encode(FORMAT.trigger))
    rows = [dict(resp=[], mask=[], lps=[], turns=0, done=False) for _ in PROMPTS]
    while not all(r["done"] for r in rows):
        active = [(n, r) for n, r in enumerate(rows) if not r["done"]]
        out = generate(graphdef, state, [PROMPTS[n] + r["resp"] for n, r in active], num_samples=1, max_new_tokens=R,
                       greedy=True, eos_token_ids=[], pad_token_id=0, rng=jax.random.key(0))
        tokens, lps = np.asarray(out.response_tokens), np.asarray(out.logprobs)
        for i, (n, r) in enumerate(active):
            for token, lp in zip(tokens[i], lps[i]):
                r["resp"].append(int(token)), r["mask"].append(0), r["lps"].append(float(lp))
                if len(r["resp"]) >= budgets[n]:
                    r["done"] = True
                    break
                tail = r["resp"][-width:]
                if (len(r["resp"]) >= 2 and tokenizer.decode(tail) == FORMAT.trigger and not any(r["mask"][-width:])
                        and r["turns"] < spec.max_turns):
                    r["turns"] += 1
                    forced = [j for j, m in enumerate(r["mask"]) if m]
                    turn = tokenizer.decode(r["resp"][forced[-1] + 1 if forced else 0:])
                    found = parse_call(FORMAT, turn)
                    text = observation_text(FORMAT, tool.run([found.code])[0], max_output_chars=spec.max_output_chars) \
                        if hasattr(found, "code") else found.observation_text
                    ids, _ = observation_tokens(FORMAT, tokenizer, text, room=budgets[n] - len(r["resp"]),
                                                max_tool_tokens=spec.max_tool_tokens)
                    r["resp"] += ids
                    r["mask"] += [1] * len(ids)
                    r["lps"] += [0.0] * len(ids)
                    r["done"] = len(r["resp"]) >= budgets[n]
                    break
    return rows


def test_rows_with_tool_calls_equal_the_oracle_that_regenerates_after_each_call():
    """Greedy, 6 rows on 3 slots, max_turns 2, observations cut to 6 tokens, budgets that end rows
    before a call, inside an observation, and after the turns ran out: tokens, tool mask and the
    model tokens' log-probs (1e-5) equal the oracle's; calls of 0, 1 and 2 per row; a code-less
    turn reads the error observation; the stand-in saw the oracle's codes."""
    graphdef, state = tiny_model()
    spec = ToolsSpec(format="llama3_chat", max_turns=2, max_tool_tokens=6, max_output_chars=4)
    budgets = [R, 13, 24, 9, R, R]
    tool = StandIn()
    rollout, stats = generate_with_tools(graphdef, state, PROMPTS, tools=spec, executor=tool, tokenizer=CharTokenizer(),
                                         num_samples=1, max_new_tokens=R, eos_token_ids=[], pad_token_id=0,
                                         rng=jax.random.key(0), greedy=True, slots=3, kv_page_size=4,
                                         decode_burst=4, segment_steps=8, row_max_new_tokens=budgets, fmt=FORMAT)
    want = oracle(graphdef, state, budgets, spec, StandIn())
    tokens, mask = np.asarray(rollout.response_tokens), np.asarray(rollout.tool_mask)
    lps, lengths = np.asarray(rollout.logprobs), np.asarray(rollout.lengths)
    for n, row in enumerate(want):
        k = len(row["resp"])
        assert lengths[n] == k, (n, lengths[n], k)
        np.testing.assert_array_equal(tokens[n, :k], row["resp"], err_msg=f"row {n}")
        np.testing.assert_array_equal(mask[n, :k], row["mask"], err_msg=f"row {n}")
        assert not mask[n, k:].any()
        model = np.asarray(row["mask"]) == 0
        np.testing.assert_allclose(lps[n, :k][model], np.asarray(row["lps"])[model], atol=1e-5, err_msg=f"row {n}")
    calls = [r["turns"] for r in want]
    np.testing.assert_array_equal(stats.calls, calls)
    assert {0, 1, 2} <= set(calls), calls
    assert stats.statuses.get("ok", 0) > 0 and stats.statuses.get("no_code", 0) > 0, stats.statuses
    assert stats.segments > 1 and 0 < stats.parked_share < 1
    text = CharTokenizer().decode(tokens[0, :lengths[0]][mask[0, :lengths[0]] == 0])
    assert text.count(FORMAT.trigger) > 2  # past max_turns a trigger decodes on
    assert mask[2, lengths[2] - 1] == 1 and bool(rollout.truncated[2])  # the budget ends inside an observation
    # the stand-in's output spells the trigger: forced, it parked nothing (the oracle checks model tokens only)
    assert any(FORMAT.trigger in CharTokenizer().decode(tokens[n][mask[n] == 1]) for n in range(len(PROMPTS)))


def hand_driven_engine(prompts, burst: int = 2):
    """(weights, spec, a fresh `tool_init` state) of `prompts` (at most 3) and padding rows, on 2
    slots, greedy, max_turns 1."""
    graphdef, state = tiny_model()
    backend = decode_backend(CONFIG, mesh=None, use_kernels=False, block_size=32)
    weights = weights_program(graphdef, state, config=CONFIG, backend=backend)
    spec = engine_spec_for(CONFIG, backend, mesh=None, num_prompts=4, num_samples=1, max_new_tokens=R, top_k=0,
                           top_p=1.0, greedy=True, use_kernels=False, slots=2, page_size=4, burst=burst)
    padded = left_pad_prompts(prompts, pad_token_id=0, length=16, num_rows=4)
    budgets = np.asarray([R] * len(prompts) + [1] * (4 - len(prompts)), np.int32)
    triggers = trigger_token_sequences(FORMAT, CharTokenizer())
    engine = tool_init(padded.tokens, padded.mask, padded.row_valid, jax.random.key(0), np.int32(0), np.int32(0),
                       budgets, triggers, np.int32(1), spec=spec)
    return weights, spec, engine


def test_a_segment_ends_once_its_new_parked_slots_waited_park_wait_slot_steps():
    """segment_end: `max_steps` steps, or slots parked since the segment began waited park_wait
    slot-steps in all (those parked at its start do not count). In the engine, a segment of up to 64
    steps with park_wait 1 hands a new parked slot over one step after it parked (bursts of 16
    included); without park_wait the same segment decodes on past it."""
    from jaxrl4llm.sampling.continuous import Tools, segment_end

    def tools(parked, steps, parked_steps):
        parked = np.asarray([parked], bool)
        return Tools(parked, np.zeros_like(parked, np.int32), None, None, None, np.int32(steps),
                     np.int32(parked_steps))

    class Now:
        def __init__(self, t):
            self.tools = t

    start = tools([True, False, False], 10, 7)
    for parked, steps, parked_steps, wait, end in [
            ([True, False, False], 13, 10, 1, False),  # only the slot parked at the start waited
            ([True, True, False], 13, 10 + 2, 2, True),  # the new one waited 2 slot-steps
            ([True, True, False], 13, 10 + 2, 3, False),
            ([True, True, True], 11, 8, 1, False),  # two parked on the last step: none waited yet
            ([True, False, False], 14, 11, None, True)]:  # max_steps 4
        assert bool(segment_end(start, Now(tools(parked, steps, parked_steps)), max_steps=4, park_wait=wait)) == end

    weights, spec, fresh = hand_driven_engine(PROMPTS[:2], burst=16)
    run = lambda engine, wait: tool_segment(weights, engine, np.float32(1.0), np.float32(1.0), np.zeros((0,), np.int32),
                                            np.int32(0), np.int32(64), park_wait=wait, spec=spec)
    _, early = run(fresh, np.int32(1))
    new = int(np.asarray(early.parked).sum())
    assert new >= 1 and int(early.steps) < 64 and int(early.parked_steps) == new
    _, _, fresh = hand_driven_engine(PROMPTS[:2], burst=16)
    _, late = run(fresh, None)
    assert int(late.steps) > int(early.steps) + 1 and int(late.parked_steps) > new


def test_a_parked_slot_keeps_its_pages_while_the_others_decode_and_every_page_comes_back():
    """3 rows on 2 slots, segments of 2 steps by hand: once a slot parks, two more segments leave its
    length and pages as they were (none of them free) while the other slot decodes on; a refunded
    resume (no token) lets its row park again past max_turns 1; resumed with an observation, every
    row finishes, one call each, and every page is free again."""
    prompts = PROMPTS[:3]
    weights, spec, engine = hand_driven_engine(prompts)
    segment = lambda engine: tool_segment(weights, engine, np.float32(1.0), np.float32(1.0),
                                          np.zeros((0,), np.int32), np.int32(0), np.int32(2), spec=spec)
    for _ in range(20):
        engine, view = segment(engine)
        if view.parked.any():
            break
    (d,), (s,) = np.nonzero(np.asarray(view.parked))
    other = 1 - s
    pool_pages = engine.free.stack.shape[1]
    length, pages = int(view.length[d, s]), np.asarray(engine.slots.pages[d, s])
    used = pages[:-(-((len(prompts[view.row[d, s]]) % 4) + length - 1) // 4)]
    other_length = int(view.length[d, other])
    for _ in range(2):
        engine, view = segment(engine)
        free = np.asarray(engine.free.stack[d, :int(engine.free.top[d])])
        assert int(view.length[d, s]) == length and bool(view.parked[d, s])
        np.testing.assert_array_equal(np.asarray(engine.slots.pages[d, s]), pages)
        assert not set(used.tolist()) & set(free.tolist())
    assert int(view.length[d, other]) > other_length  # the other slot decoded on
    observation = np.broadcast_to(np.asarray(CharTokenizer().encode("<1>"), np.int32), (1, 2, 3))
    first_row, parks = int(view.row[d, s]), Counter()
    # the first call resumes with no token and refunded (a trigger inside the code): its row parks
    # again at its next trigger although max_turns is 1; then every parked slot resumes with "<1>"
    engine = tool_resume(engine, np.asarray(view.parked), observation, np.zeros((1, 2), np.int32),
                         np.asarray(view.parked))
    for _ in range(40):
        engine, view = segment(engine)
        resume = np.asarray(view.parked)
        parks.update(int(r) for r in np.asarray(view.row)[resume])
        engine = tool_resume(engine, resume, observation, resume.astype(np.int32) * 3, np.zeros((1, 2), bool))
        if not view.busy and not view.parked.any():
            break
    assert not view.busy and int(view.steps) > 0
    assert parks[first_row] == 1 and sorted(parks) == [0, 1, 2]
    assert int(engine.free.top[0]) == pool_pages - 1
    assert sorted(np.asarray(engine.free.stack[0, :pool_pages - 1]).tolist()) == list(range(1, pool_pages))
    assert np.asarray(engine.tools.mask[0, :3]).sum(axis=1).tolist() == [3, 3, 3]  # one call a row (max_turns 1)


def test_a_one_token_trigger_among_the_eos_ids_no_longer_ends_a_row():
    """Llama 3.1's <|eom_id|> is an EOS id and llama3_chat's trigger: with tools it parks the row."""
    class Llama3Ids:  # <|eom_id|> = 128008, <|eot_id|> = 128009, <|end_of_text|> = 128001
        special = {"<|eom_id|>": 128008}

        def encode(self, text, add_special_tokens=False):
            return [self.special[text]] if text in self.special else [ord(c) for c in text]

        def decode(self, ids, skip_special_tokens=True):
            names = {v: k for k, v in self.special.items()}
            return "".join(names.get(i, "" if i > 255 else chr(i)) for i in ids)

    triggers = trigger_token_sequences(tool_format("llama3_chat"), Llama3Ids())
    assert eos_without_triggers([128001, 128008, 128009], triggers) == [128001, 128009]
    assert eos_without_triggers([5, 7], trigger_token_sequences(FORMAT, CharTokenizer())) == [5, 7]


def test_the_segment_clock_fits_a_round_trip_and_a_step():
    """seconds = fixed + steps x step by least squares, the first segment (prefill, compile) left out;
    a round trip = fixed + the host's seconds between segments."""
    from jaxrl4llm.sampling.tool_rollout import SegmentClock

    clock = SegmentClock()
    clock.segment(32, 5.0)  # the first: compiles
    assert clock.step_seconds == 5.0 / 32 and clock.round_trip_seconds == 0.0
    for steps in (4, 16, 9, 32):
        clock.segment(steps, 0.002 + steps * 0.001)
    clock.host(0.0004), clock.host(0.0006)
    np.testing.assert_allclose([clock.step_seconds, clock.round_trip_seconds], [0.001, 0.0025], rtol=1e-9)


class ScriptedEngine:
    """`run_tools`' segment and resume over rows that write scripted texts, one token a step (on one
    shard of `slots` slots, rows admitted in order): a row parks when its own tokens end with a
    trigger spelling and it has turns left; resume appends the observation (tool mask 1) at once."""

    def __init__(self, scripts, tokenizer, triggers, *, slots: int, budget: int, max_turns: int):
        self.scripts = [tokenizer.encode(text, add_special_tokens=False) for text in scripts]
        self.triggers = [t[t >= 0].tolist() for t in np.asarray(triggers)]
        self.slots, self.budget, self.max_turns = slots, budget, max_turns

    def init(self):
        return dict(slot_row=[-1] * self.slots, parked=[False] * self.slots, next_row=0, done=set(),
                    tokens=[[] for _ in self.scripts], mask=[[] for _ in self.scripts], read=[0] * len(self.scripts),
                    turns=[0] * len(self.scripts), steps=0, parked_steps=0)

    def segment(self, state, max_steps, park_wait):
        from jaxrl4llm.sampling.continuous import ParkedRows

        parked_at_start, start_steps, start_parked_steps = sum(state["parked"]), state["steps"], state["parked_steps"]
        while state["steps"] - start_steps < int(max_steps):
            new = sum(state["parked"]) - parked_at_start
            waited = state["parked_steps"] - start_parked_steps - (state["steps"] - start_steps) * parked_at_start
            if new and waited >= int(park_wait):
                break
            for s in range(self.slots):  # refill
                if state["slot_row"][s] < 0 and state["next_row"] < len(self.scripts):
                    state["slot_row"][s], state["next_row"] = state["next_row"], state["next_row"] + 1
            live = [s for s in range(self.slots) if state["slot_row"][s] >= 0 and not state["parked"][s]]
            if not live:
                break
            state["parked_steps"] += sum(state["parked"])
            state["steps"] += 1
            for s in live:
                n = state["slot_row"][s]
                state["tokens"][n].append(self.scripts[n][state["read"][n]])
                state["mask"][n].append(0)
                state["read"][n] += 1
                own = [t for t, m in zip(state["tokens"][n], state["mask"][n]) if not m]
                if state["read"][n] == len(self.scripts[n]):
                    state["slot_row"][s] = -1
                    state["done"].add(n)
                elif state["turns"][n] < self.max_turns and any(own[-len(t):] == t for t in self.triggers):
                    state["parked"][s], state["turns"][n] = True, state["turns"][n] + 1
        rows = np.asarray([state["slot_row"]])
        pad = lambda x: np.asarray([[x[r] + [0] * (self.budget - len(x[r])) if r >= 0 else [0] * self.budget
                                     for r in state["slot_row"]]])
        busy = any(r >= 0 and not p for r, p in zip(state["slot_row"], state["parked"])) or \
            state["next_row"] < len(self.scripts)
        return state, ParkedRows(np.asarray([state["parked"]]), rows,
                                 np.asarray([[len(state["tokens"][r]) if r >= 0 else 0 for r in state["slot_row"]]]),
                                 np.full(rows.shape, self.budget), pad(state["tokens"]), pad(state["mask"]),
                                 np.asarray(busy), np.asarray(state["steps"]), np.asarray(state["parked_steps"]))

    def resume(self, state, resume, tokens, count, refund):
        for s in np.nonzero(resume[0])[0]:
            n = state["slot_row"][s]
            state["tokens"][n] += tokens[0, s, :count[0, s]].tolist()
            state["mask"][n] += [1] * int(count[0, s])
            state["parked"][s] = False
            state["turns"][n] -= int(refund[0, s])
        return state


def test_the_host_loop_runs_qwen3_chat_calls_of_a_bpe_tokenizer_in_the_executor():
    """The host side end to end in the qwen3_chat format, with a byte-level BPE whose `</tool_call>`
    is one added token and the real Python executor: a call's code runs and its output comes back
    as Qwen3's tool turn (tool mask on it only); a `</tool_call>` inside the call's JSON string parks
    the row, which resumes with no token, refunded, and its call runs when it closes; invalid JSON
    gets the error turn; a row without a call is never parked; calls and statuses are counted."""
    from jaxrl4llm.sampling.tool_rollout import run_tools
    from jaxrl4llm.tools import ExecutorConfig, PythonExecutor
    from jaxrl4llm.tools.protocol import QWEN3_CHAT
    from tests.tools.chat_tokenizer import chat_tokenizer

    tokenizer = chat_tokenizer()
    call = lambda code: '<tool_call>\n{"name": "python", "arguments": {"code": "%s"}}\n</tool_call>' % code
    scripts = ["<think>\nCompute it.\n</think>\n\n" + call("print(6 * 7)") + "The answer is \\boxed{42}.<|im_end|>",
               call("print('</tool_call>'[2:6])") + "It printed tool.<|im_end|>",
               "The answer is \\boxed{6}.<|im_end|>",
               '<tool_call>\n{"name": "python", "arguments": {"code": 1 +}}\n</tool_call>' + "Sorry.<|im_end|>"]
    triggers = trigger_token_sequences(QWEN3_CHAT, tokenizer)
    assert triggers.shape[0] >= 1 and all((t >= 0).sum() == 1 for t in np.asarray(triggers))  # one added token
    spec = ToolsSpec(format="qwen3_chat", max_turns=1, max_tool_tokens=160, max_output_chars=64)
    engine = ScriptedEngine(scripts, tokenizer, triggers, slots=2, budget=400, max_turns=spec.max_turns)
    with PythonExecutor(ExecutorConfig(timeout=5.0, workers=1, preload=())) as executor:
        state, stats = run_tools(engine.init(), segment=engine.segment, resume=engine.resume, fmt=QWEN3_CHAT,
                                 spec=spec, executor=executor, tokenizer=tokenizer, num_rows=4, segment_steps=8)
    turn = lambda text: QWEN3_CHAT.observation_opening + text + QWEN3_CHAT.observation_closing
    split = scripts[1].index("It printed")
    payload = scripts[3][len("<tool_call>"):scripts[3].index("</tool_call>")]
    with pytest.raises(json.JSONDecodeError) as invalid:
        json.loads(payload)
    expected = [scripts[0].replace("</tool_call>", "</tool_call>" + turn("42"), 1),
                scripts[1][:split] + turn("tool") + scripts[1][split:],
                scripts[2],
                scripts[3].replace("</tool_call>", "</tool_call>" + turn(
                    f"Error: the tool call is not valid JSON ({invalid.value})"), 1)]
    for n, text in enumerate(expected):
        tokens, mask = np.asarray(state["tokens"][n]), np.asarray(state["mask"][n], bool)
        assert tokenizer.decode(tokens, skip_special_tokens=False) == text
        assert tokenizer.decode(tokens[~mask], skip_special_tokens=False) == scripts[n]  # the model's own
    assert stats.calls.tolist() == [1, 1, 0, 1]
    assert stats.statuses == {"ok": 2, "invalid_call": 1} and stats.tool_tokens == int(sum(map(sum, state["mask"])))

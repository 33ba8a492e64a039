"""Rollout tokens/s with tool calls against a rollout without, at the same tokens.

    python benchmarks/tool_rollout.py [--size demo] [--prompts 8] [--samples 8] [--max-new-tokens 256]
        [--lengths lognormal:mean=160,sigma=0.5] [--slots 32] [--tool-ms 20] [--observation 16]
        [--max-turns 4] [--segment-steps 32] [--repeats 3] [--vocab V]

A random Qwen3 of `--size` (benchmarks/sampler.py SIZES; `--vocab` replaces its vocabulary: a
random model's most sampled token is frequent enough to call a tool often only in a small one) samples P x G rows whose lengths are drawn
from `--lengths` and forced through `row_max_new_tokens` with no EOS, so every arm decodes exactly
the same number of tokens (tool tokens count against a row's budget):
- plain: `generate(engine="continuous", slots=S)`;
- segments: `generate_with_tools` with a trigger no row writes (16 fixed tokens): the cost of
  running the engine in segments and reading parked rows on the host, with no call;
- tools: `generate_with_tools` whose trigger is the token the model samples most often (from the
  plain arm's rows; a random model writes no code), a stand-in tool that sleeps `--tool-ms` per
  batch of calls and returns `--observation` tokens, `--max-turns` calls a row at most.
Tokens are read as characters (id i is chr(256 + i)). It prints tokens/s of each arm (the best of
`--repeats` timed runs, the arms interleaved, after a run that compiles), the time against plain,
calls per row, decode steps (a load-free measure of the parked slots' cost), tool seconds and the
share of them hidden behind decoding, and the parked-slot share. `measure` is also the GPU check's
`tools` phase (benchmarks/gpu_check.py: Qwen3-0.6B's shapes, bfloat16).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections import Counter

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.sampler import SAMPLED, SIZES, draw_lengths  # noqa: E402
from jaxrl4llm.models import ModelConfig, init_model  # noqa: E402
from jaxrl4llm.sampling import generate, generate_with_tools  # noqa: E402
from jaxrl4llm.tools.protocol import ToolFormat, ToolsSpec  # noqa: E402
from jaxrl4llm.tools.python_executor import ToolResult  # noqa: E402

BASE = 256  # token i is chr(BASE + i)


class CharTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(BASE + int(i)) for i in ids)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) - BASE for c in text]


class SleepingTool:
    """Sleeps `seconds` per batch of calls; each call returns `tokens` fixed tokens."""

    def __init__(self, seconds: float, tokens: int):
        self.seconds, self.output = seconds, "".join(chr(BASE + 1 + i % 7) for i in range(tokens))

    def run(self, codes):
        time.sleep(self.seconds)
        return [ToolResult("ok", self.output, self.seconds) for _ in codes]


# The benchmark's workload: the command line's defaults, and what `measure` takes.
DEFAULTS = dict(size="demo", prompts=8, samples=8, prompt_len=32, max_new_tokens=256,
                lengths="lognormal:mean=160,sigma=0.5", slots=32, tool_ms=20.0, observation=16, max_turns=4,
                segment_steps=32, repeats=3, dtype="float32", vocab=None)


def measure(*, size: str, prompts: int, samples: int, prompt_len: int, max_new_tokens: int, lengths: str, slots: int,
            tool_ms: float, observation: int, max_turns: int, segment_steps: int, repeats: int, dtype: str,
            vocab: int | None) -> dict:
    """The three arms (module docstring) on a random Qwen3 of `size` (vocabulary `vocab` or the
    size's), each timed `repeats` times after a run that compiles, the arms interleaved.

    Returns {"tokens": response tokens every arm decodes, "vocab", "platform", "trigger_share": the
    tools arm's trigger's share of the plain arm's sampled tokens, "arms": {arm: {"seconds": best
    time, "tokens_per_s", "vs_plain": seconds / plain's - 1}}}; the segments and tools arms' entries
    add "calls_per_row", "tool_token_share", "decode_steps", "segments", "tool_s", "hidden_share",
    "wait_s" (the host's wait for the tool) and "parked_share"."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    hidden, layers, heads, kv_heads, head_dim, inter, size_vocab = SIZES[size]
    vocab = vocab or size_vocab
    config = ModelConfig(architecture="qwen3", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                         num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                         dtype=dtype, max_position_embeddings=4096)
    graphdef, state = init_model(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompt_ids = [rng.integers(1, vocab, prompt_len).tolist() for _ in range(prompts)]
    rows = prompts * samples
    row_lengths = draw_lengths(lengths, rows, max_new_tokens, seed=0)
    total = int(row_lengths.sum())
    common = dict(num_samples=samples, max_new_tokens=max_new_tokens, eos_token_ids=[], pad_token_id=0,
                  rng=jax.random.key(1), slots=slots, row_max_new_tokens=row_lengths, **SAMPLED)

    tokenizer = CharTokenizer()
    plain = generate(graphdef, state, prompt_ids, **common)  # compiles; its most sampled token is the trigger
    tokens = np.asarray(plain.response_tokens)
    counts = Counter(int(t) for n in range(rows) for t in tokens[n, 1:row_lengths[n]])
    trigger, trigger_count = counts.most_common(1)[0]
    spec = ToolsSpec(format="llama3_chat", max_turns=max_turns, max_tool_tokens=observation + 2,
                     max_output_chars=observation)
    formats = {"segments": ToolFormat("llama3_chat", trigger=tokenizer.decode(range(vocab - 16, vocab)),
                                      call_opening="", observation_opening="", observation_closing=""),
               "tools": ToolFormat("llama3_chat", trigger=tokenizer.decode([trigger]), call_opening="",
                                   observation_opening=tokenizer.decode([1]), observation_closing=tokenizer.decode([2]))}
    arms = {"plain": lambda: (generate(graphdef, state, prompt_ids, **common), None)}
    for name, fmt in formats.items():
        arms[name] = functools.partial(generate_with_tools, graphdef, state, prompt_ids, tools=spec,
                                       tokenizer=tokenizer, fmt=fmt, segment_steps=segment_steps, **common)
    results, best = {}, {name: float("inf") for name in arms}
    for repeat in range(repeats + 1):  # the arms interleaved (the machine's load drifts); run 0 compiles
        for name, arm in arms.items():
            start = time.perf_counter()
            out = arm() if name == "plain" else arm(executor=SleepingTool(tool_ms / 1000, observation))
            jax.block_until_ready(out[0].response_tokens)
            if repeat:
                best[name] = min(best[name], time.perf_counter() - start)
            results[name] = out
    figures = {"tokens": total, "vocab": vocab, "platform": jax.devices()[0].platform,
               "trigger_share": trigger_count / max(1, sum(counts.values())), "arms": {}}
    for name, (rollout, stats) in results.items():
        assert int(np.asarray(rollout.lengths).sum()) == total, "the arms decoded different token counts"
        arm = {"seconds": best[name], "tokens_per_s": total / best[name], "vs_plain": best[name] / best["plain"] - 1}
        if stats is not None:
            m = stats.metrics()
            arm.update(calls_per_row=m["tools/calls_per_row"],
                       tool_token_share=float(np.asarray(rollout.tool_mask).sum()) / total,
                       decode_steps=stats.decode_steps, segments=stats.segments, tool_s=stats.tool_seconds,
                       hidden_share=m["tools/hidden_share"], wait_s=stats.wait_seconds, parked_share=stats.parked_share)
        figures["arms"][name] = arm
    return figures


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = DEFAULTS
    parser.add_argument("--size", default=d["size"], choices=sorted(SIZES))
    for name in ("prompts", "samples", "prompt_len", "max_new_tokens"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=d[name])
    parser.add_argument("--lengths", default=d["lengths"])
    parser.add_argument("--slots", type=int, default=d["slots"])
    parser.add_argument("--tool-ms", type=float, default=d["tool_ms"])
    parser.add_argument("--observation", type=int, default=d["observation"], help="tokens a call returns")
    parser.add_argument("--max-turns", type=int, default=d["max_turns"])
    parser.add_argument("--segment-steps", type=int, default=d["segment_steps"])
    parser.add_argument("--repeats", type=int, default=d["repeats"])
    parser.add_argument("--dtype", default=d["dtype"], choices=("bfloat16", "float32"))
    parser.add_argument("--vocab", type=int, default=d["vocab"], help="vocabulary size (default: the size's)")
    args = parser.parse_args(argv)
    f = measure(**vars(args))
    print(f"{args.size} ({args.dtype}, vocabulary {f['vocab']}), {args.prompts} prompts x {args.samples} samples, "
          f"{args.slots} slots, {f['tokens']} tokens (lengths {args.lengths}, R={args.max_new_tokens}), {f['platform']}, "
          f"tool {args.tool_ms:g} ms a batch, {args.observation} tokens a call, segments of {args.segment_steps} steps, "
          f"best of {args.repeats}")
    for name, a in f["arms"].items():
        line = f"{name:9s} {a['tokens_per_s']:10.0f} tokens/s  ({a['seconds']:.3f} s, {a['vs_plain']:+.1%})"
        if "calls_per_row" in a:
            line += (f"  calls/row {a['calls_per_row']:.2f}  tool tokens {a['tool_token_share']:.1%}  decode steps "
                     f"{a['decode_steps']}  segments {a['segments']}  tool {a['tool_s']:.3f} s, hidden "
                     f"{a['hidden_share']:.0%}, host waited {a['wait_s']:.3f} s  parked share {a['parked_share']:.1%}")
        print(line)


if __name__ == "__main__":
    main()

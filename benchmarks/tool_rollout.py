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
share of them hidden behind decoding, and the parked-slot share.
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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="demo", choices=sorted(SIZES))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--lengths", default="lognormal:mean=160,sigma=0.5")
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--tool-ms", type=float, default=20.0)
    parser.add_argument("--observation", type=int, default=16, help="tokens a call returns")
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--segment-steps", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=("bfloat16", "float32"))
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the size's)")
    args = parser.parse_args(argv)

    hidden, layers, heads, kv_heads, head_dim, inter, vocab = SIZES[args.size]
    vocab = args.vocab or vocab
    config = ModelConfig(architecture="qwen3", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                         num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                         dtype=args.dtype, max_position_embeddings=4096)
    graphdef, state = init_model(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, vocab, args.prompt_len).tolist() for _ in range(args.prompts)]
    rows = args.prompts * args.samples
    lengths = draw_lengths(args.lengths, rows, args.max_new_tokens, seed=0)
    total = int(lengths.sum())
    common = dict(num_samples=args.samples, max_new_tokens=args.max_new_tokens, eos_token_ids=[], pad_token_id=0,
                  rng=jax.random.key(1), slots=args.slots, row_max_new_tokens=lengths, **SAMPLED)

    tokenizer = CharTokenizer()
    plain = generate(graphdef, state, prompts, **common)  # compiles; its most sampled token is the trigger
    tokens = np.asarray(plain.response_tokens)
    counts = Counter(int(t) for n in range(rows) for t in tokens[n, 1:lengths[n]])
    trigger = counts.most_common(1)[0][0]
    spec = ToolsSpec(format="llama3_chat", max_turns=args.max_turns, max_tool_tokens=args.observation + 2,
                     max_output_chars=args.observation)
    formats = {"segments": ToolFormat("llama3_chat", trigger=tokenizer.decode(range(vocab - 16, vocab)),
                                      call_opening="", observation_opening="", observation_closing=""),
               "tools": ToolFormat("llama3_chat", trigger=tokenizer.decode([trigger]), call_opening="",
                                   observation_opening=tokenizer.decode([1]), observation_closing=tokenizer.decode([2]))}
    arms = {"plain": lambda: (generate(graphdef, state, prompts, **common), None)}
    for name, fmt in formats.items():
        arms[name] = functools.partial(generate_with_tools, graphdef, state, prompts, tools=spec, tokenizer=tokenizer,
                                       fmt=fmt, segment_steps=args.segment_steps, **common)
    results, best = {}, {name: float("inf") for name in arms}
    for repeat in range(args.repeats + 1):  # the arms interleaved (the machine's load drifts); run 0 compiles
        for name, arm in arms.items():
            start = time.perf_counter()
            out = arm() if name == "plain" else arm(executor=SleepingTool(args.tool_ms / 1000, args.observation))
            jax.block_until_ready(out[0].response_tokens)
            if repeat:
                best[name] = min(best[name], time.perf_counter() - start)
            results[name] = out
    print(f"{args.size} ({args.dtype}, vocabulary {vocab}), {args.prompts} prompts x {args.samples} samples, {args.slots} slots, "
          f"{total} tokens (lengths {args.lengths}, R={args.max_new_tokens}), {jax.devices()[0].platform}, "
          f"tool {args.tool_ms:g} ms a batch, {args.observation} tokens a call, segments of {args.segment_steps} steps, "
          f"best of {args.repeats}")
    for name, (rollout, stats) in results.items():
        assert int(np.asarray(rollout.lengths).sum()) == total, "the arms decoded different token counts"
        line = f"{name:9s} {total / best[name]:10.0f} tokens/s  ({best[name]:.3f} s, {best[name] / best['plain'] - 1:+.1%})"
        if stats is not None:
            m = stats.metrics()
            line += (f"  calls/row {m['tools/calls_per_row']:.2f}  tool tokens "
                     f"{float(np.asarray(rollout.tool_mask).sum()) / total:.1%}  decode steps {stats.decode_steps}  "
                     f"segments {stats.segments}  tool {stats.tool_seconds:.3f} s, hidden {m['tools/hidden_share']:.0%}"
                     f", host waited {stats.wait_seconds:.3f} s  parked share {stats.parked_share:.1%}")
        print(line)


if __name__ == "__main__":
    main()

"""The tool task's warm start, with the Python tool and without: held-out accuracy, calls per row.

    python benchmarks/tool_task.py RUN_DIR [--problems 200] [--samples 4] [--temperature 1.0]

RUN_DIR holds what `jaxrl4llm demo --task tools --out-dir RUN_DIR` prepares (data/test.jsonl and the
warmstart folder; `train.demo.prepare_task` builds them when missing). The rollout with tools here
is an oracle of the engine's: each row is sampled to the fence trigger (a stop string), the block
runs in the PythonExecutor, the observation (`tools.protocol.observation_text`) is appended to the
row's tokens and the row is sampled on from the whole prefix (`generate` again: one call, as
`configs/examples/tool_demo.yaml`'s max_turns 1), within the same 96-token budget. The reward reads
the model's own text (the observation removed), as training does. Without tools the same rows
decode on past the trigger and write an output of their own.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import numpy as np

from jaxrl4llm.data import format_prompt, load_problems
from jaxrl4llm.models import load_pretrained, load_tokenizer
from jaxrl4llm.rewards import math_reward
from jaxrl4llm.sampling import generate, response_token_lists
from jaxrl4llm.tools import ExecutorConfig, PythonExecutor, ToolCall, observation_text, parse_call
from jaxrl4llm.tools.protocol import FENCE
from jaxrl4llm.train.demo import prepare_task

BUDGET = 96  # rollout.max_new_tokens of configs/examples/tool_demo.yaml


def sample(model, tok, prompts, *, max_new_tokens, temperature, seed, stop=()):
    from flax import nnx

    graphdef, state = nnx.split(model)
    rollout = generate(graphdef, state, prompts, num_samples=1, max_new_tokens=max_new_tokens,
                       temperature=temperature, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                       rng=jax.random.PRNGKey(seed), stop_strings=stop, tokenizer=tok)
    return response_token_lists(rollout)


def run(model, tok, problems, *, temperature: float, seed: int, tools: bool, executor) -> dict:
    prompts = [tok(format_prompt(p, "demo"))["input_ids"] for p in problems]
    first = sample(model, tok, prompts, max_new_tokens=BUDGET, temperature=temperature, seed=seed,
                   stop=(FENCE.trigger,) if tools else ())
    texts = [tok.decode(ids, skip_special_tokens=True) for ids in first]
    model_texts, calls = list(texts), 0
    if tools:
        called = [i for i, t in enumerate(texts) if t.endswith(FENCE.trigger)]
        parsed = {i: parse_call(FENCE, texts[i]) for i in called}
        runnable = [i for i in called if isinstance(parsed[i], ToolCall)]
        results = dict(zip(runnable, executor.run([parsed[i].code for i in runnable])))
        calls = len(called)
        rows, prefixes, rooms = [], [], []
        for i in called:
            obs = (observation_text(FENCE, results[i], max_output_chars=32) if i in results
                   else parsed[i].observation_text)
            obs_ids = tok.encode(obs, add_special_tokens=False)
            room = BUDGET - len(first[i]) - len(obs_ids)
            if room > 0:
                rows.append(i)
                prefixes.append(prompts[i] + first[i] + obs_ids)
                rooms.append(room)
        if rows:
            more = sample(model, tok, prefixes, max_new_tokens=max(rooms), temperature=temperature, seed=seed + 1)
            for i, ids, room in zip(rows, more, rooms):
                model_texts[i] = tok.decode(first[i] + ids[:room], skip_special_tokens=True)
    rewards = np.array([math_reward(t, p.answer) for t, p in zip(model_texts, problems)])
    return {"accuracy": float(rewards.mean()), "calls_per_row": calls / len(problems)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--problems", type=int, default=200)
    ap.add_argument("--samples", type=int, default=4, help="seeds per problem, each a sampled rollout")
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args()
    paths = prepare_task(Path(args.run_dir), "tools", None, False)
    model = load_pretrained(paths["warmstart"], dtype="float32")
    tok = load_tokenizer(paths["warmstart"])
    problems = load_problems(paths["test"])[: args.problems]
    out = {}
    with PythonExecutor(ExecutorConfig(timeout=5.0, workers=2)) as executor:
        for tools in (False, True):
            t0 = time.perf_counter()
            runs = [run(model, tok, problems, temperature=args.temperature, seed=s, tools=tools, executor=executor)
                    for s in range(args.samples)]
            out["tools" if tools else "no_tools"] = {
                "accuracy": float(np.mean([r["accuracy"] for r in runs])),
                "calls_per_row": float(np.mean([r["calls_per_row"] for r in runs])),
                "seconds": time.perf_counter() - t0}
    print(json.dumps({"problems": len(problems), "samples": args.samples, "temperature": args.temperature, **out},
                     indent=1))


if __name__ == "__main__":
    main()

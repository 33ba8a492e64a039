"""Benchmark of the math verifier (jaxrl4llm.rewards).

Prints:
  - throughput: verifications per second of ``batch_math_reward`` on MATH-500-style answers
    (the 500 gold answers of math500_test.jsonl, each with 4 predictions: the same answer in a
    realistic response, a respelled answer, a "Final Answer:" phrase, and a perturbed wrong
    answer), using all cores (2 here);
  - the worst-case wall time of one ``math_reward`` on each hostile input;
  - agreement with the labelled cases (own set, the notation set and the shared public set);
  - with ``--mv-python PATH``: the same agreement figures for huggingface/math-verify run by a
    separate interpreter (math-verify pins antlr 4.13.2, which must not enter our venv), and
    its throughput on the same MATH-500-style batch (one process) as the peer figure.

Usage: python benchmarks/verifier.py [--data DIR] [--mv-python /tmp/mv-venv/bin/python]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from jaxrl4llm.rewards import SandboxPool, batch_math_reward, math_reward  # noqa: E402
from jaxrl4llm.rewards.limits import DEFAULT_TIMEOUT  # noqa: E402
from tests.rewards import _hostile  # noqa: E402
from tests.rewards.labelled_cases import CASES  # noqa: E402
from tests.rewards.notation_cases import CASES as NOTATION_CASES  # noqa: E402
from tests.rewards.test_sandbox import HOSTILE_RESPONSES  # noqa: E402

FILLER = (
    "Let us work through the problem carefully. We first rewrite the given condition, then "
    "simplify both sides and check the boundary cases. Substituting back confirms the value.\n"
)


def _respell(answer: str) -> str:
    s = answer.replace(r"\frac", r"\dfrac")
    if re.fullmatch(r"-?\d+", s):
        return s + ".0"
    if s.startswith("(") and s.endswith(")"):
        return r"\left" + s[0] + s[1:-1] + r"\right" + s[-1]
    return "x = " + s if "=" not in s and "," not in s else s


def _perturb(answer: str, rng: random.Random) -> str:
    digits = [m.start() for m in re.finditer(r"\d", answer)]
    if not digits:
        return answer + "+1"
    i = rng.choice(digits)
    return answer[:i] + str((int(answer[i]) + 1) % 10) + answer[i + 1 :]


def math500_batch(data: Path) -> tuple[list[str], list[str], list[int]]:
    rows = [json.loads(line) for line in (data / "math500_test.jsonl").read_text().splitlines()]
    rng = random.Random(0)
    responses, golds, expected = [], [], []
    for row in rows:
        g = row["answer"]
        variants = [
            (FILLER * 4 + f"Therefore the answer is $\\boxed{{{g}}}$.", 1),
            (FILLER * 2 + f"So we get $\\boxed{{{_respell(g)}}}$.", 1),
            (FILLER * 3 + f"Final Answer: The final answer is ${g}$. I hope it is correct.", 1),
            (FILLER * 4 + f"Hence $\\boxed{{{_perturb(g, rng)}}}$.", 0),
        ]
        for response, label in variants:
            responses.append(response)
            golds.append(g)
            expected.append(label)
    return responses, golds, expected


def agreement(responses, golds, expected) -> float:
    rewards = batch_math_reward(responses, golds)
    return sum((r == 1.0) == bool(e) for r, e in zip(rewards, expected)) / len(expected)


_MV_SCRIPT = r"""
import json, sys, time
from math_verify import parse, verify
def reward(pred, gold):
    try:
        g = parse("$" + str(gold) + "$") if "\\boxed" not in str(gold) else parse(str(gold))
        if not g:
            g = parse(str(gold))
        parsed = parse(pred)
        if not parsed and "$" not in pred and "\\boxed" not in pred:
            parsed = parse("$" + pred + "$")  # a bare LaTeX answer: give it delimiters
        return 1.0 if verify(g, parsed) else 0.0
    except Exception:
        return 0.0
sets = json.load(open(sys.argv[1]))
out = {}
for name, rows in sets.items():
    t = time.perf_counter()
    r = [reward(p, g) for p, g, _ in rows]
    dt = time.perf_counter() - t
    out[name] = {"agreement": sum((x == 1.0) == bool(e) for x, (_, _, e) in zip(r, rows)) / len(rows),
                 "per_second": len(rows) / dt}
print(json.dumps(out))
"""


def run_math_verify(python: str, sets: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sets.json"
        path.write_text(json.dumps(sets))
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        out = subprocess.run([python, "-c", _MV_SCRIPT, str(path)], capture_output=True, text=True, env=env, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=os.environ.get("JAXRL4LLM_SHARED_DATA", str(REPO.parent / "shared" / "data")))
    parser.add_argument("--mv-python", default=None, help="python of a separate venv with math-verify installed")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    data = Path(args.data)
    if not (data / "math500_test.jsonl").is_file():
        sys.exit(f"math500_test.jsonl not found in {data}; pass --data or set JAXRL4LLM_SHARED_DATA")

    cores = os.cpu_count()
    responses, golds, expected = math500_batch(data)
    batch_math_reward([r"\boxed{\sqrt{2}}"] * 4, ["x"] * 4)  # start and warm the worker pool
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        rewards = batch_math_reward(responses, golds)
        times.append(time.perf_counter() - t)
    cold, best = times[0], min(times)
    label_match = sum((r == 1.0) == bool(e) for r, e in zip(rewards, expected)) / len(expected)
    print(f"throughput: {len(responses) / cold:.0f} verifications/s on {len(responses)} MATH-500-style "
          f"responses ({cores} cores, first pass with cold parse caches); {len(responses) / best:.0f}/s when the "
          f"same golds repeat (best of {args.repeats}); matches the intended label on {label_match:.1%}")

    worst = 0.0
    for name, response in HOSTILE_RESPONSES.items():
        t = time.perf_counter()
        r = math_reward(response, "5")
        dt = time.perf_counter() - t
        worst = max(worst, dt)
        print(f"  hostile {name:28s} reward {r:.0f} in {dt * 1000:8.1f} ms")
    print(f"worst-case hostile time: {worst * 1000:.1f} ms (limit {DEFAULT_TIMEOUT:.1f} s)")
    with SandboxPool(1) as pool:  # the hard-kill path: a call that ignores the in-worker alarm
        pool.run(pow, [(2, 10)], timeout=60)
        t = time.perf_counter()
        out = pool.run(_hostile.ignore_alarm_and_spin, [()], timeout=DEFAULT_TIMEOUT, default="killed")
        print(f"hard kill of a worker that ignores the alarm: {out[0]} after {(time.perf_counter() - t) * 1000:.0f} ms, "
              f"worker replaced ({pool.restarts} restart)")

    public = [json.loads(line) for line in (data / "verifier_cases_public.jsonl").read_text().splitlines() if line.strip()]
    public = [r for r in public if not r.get("ambiguous")]
    own = agreement([c[0] for c in CASES], [c[1] for c in CASES], [c[2] for c in CASES])
    pub = agreement([r["pred"] for r in public], [r["gold"] for r in public], [r["equal"] for r in public])
    notation = agreement([c[0] for c in NOTATION_CASES], [c[1] for c in NOTATION_CASES], [c[2] for c in NOTATION_CASES])
    print(f"agreement: own labelled cases {own:.2%} ({len(CASES)}), notation cases {notation:.2%} "
          f"({len(NOTATION_CASES)}), public cases {pub:.2%} ({len(public)} non-ambiguous)")

    if args.mv_python:
        sets = {
            "own": [[c[0], c[1], c[2]] for c in CASES],
            "notation": [[c[0], c[1], c[2]] for c in NOTATION_CASES],
            "public": [[r["pred"], r["gold"], r["equal"]] for r in public],
            "math500": [[p, g, e] for p, g, e in zip(responses, golds, expected)],
        }
        mv = run_math_verify(args.mv_python, sets)
        print(f"math-verify: agreement own {mv['own']['agreement']:.2%}, notation {mv['notation']['agreement']:.2%}, "
              f"public {mv['public']['agreement']:.2%}; "
              f"MATH-500-style {mv['math500']['per_second']:.0f} verifications/s (1 process), "
              f"label match {mv['math500']['agreement']:.1%}")
        print(f"ratio (ours, cold, / math-verify throughput): {len(responses) / cold / mv['math500']['per_second']:.2f}")


if __name__ == "__main__":
    main()

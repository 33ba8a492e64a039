r"""The demo task: short arithmetic word problems a tiny model can learn on a CPU in minutes.

``make_demo_problems`` draws seeded problems of controllable difficulty:

- ``digits``: digits of the starting number and of added/subtracted operands;
- ``ops``: operation mix drawn from ``+``, ``-``, ``*`` (``*`` uses a one-digit multiplier);
- ``steps``: number of operations (1-3).

Example (digits=2, ops="+-", steps=2): ``Ann has 12 pens. Gets 30 more. Loses 5. How many?``
with gold ``37`` and worked solution ``12+30=42 42-5=37 \boxed{37}``. Results stay >= 0.

``write_demo_task`` writes ``train.jsonl``/``test.jsonl`` (fields problem, answer, id, solution)
in the layout of the real datasets, so ``load_problems`` and the verifier treat them alike.
``build_char_tokenizer`` saves a character-level Hugging Face tokenizer for the demo model.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models

from jaxrl4llm.data.problems import Problem, problem_to_record, write_splits

_NAMES = ("Ann", "Bo", "Cy", "Di", "Ed", "Flo", "Gus", "Ivy", "Jo", "Kim", "Lu", "Max")
_ITEMS = ("pens", "cards", "coins", "eggs", "books", "cups", "keys", "caps", "toys", "nuts")
_PHRASES = {"+": "Gets {b} more.", "-": "Loses {b}.", "*": "Then has {b} times as many."}
_STEP_RE = re.compile(r"Gets (\d+) more\.|Loses (\d+)\.|Then has (\d+) times as many\.")
_START_RE = re.compile(r"has (\d+) ")


def _apply(value: int, op: str, operand: int) -> int:
    return value + operand if op == "+" else value - operand if op == "-" else value * operand


def make_demo_problems(
    num: int,
    *,
    seed: int = 0,
    digits: int = 2,
    ops: str = "+-",
    steps: int = 1,
    id_prefix: str = "demo",
) -> list[Problem]:
    """``num`` seeded arithmetic word problems with exact integer gold answers.

    Args:
      num: number of problems.
      seed: random seed (same seed, same problems).
      digits: digits (1-4) of the start value and of + / - operands.
      ops: the operation mix, a non-empty string over ``+-*``.
      steps: operations per problem (1-3).
      id_prefix: prefix of the problem ids.
    """
    if not 1 <= digits <= 4:
        raise ValueError(f"digits must be in 1..4, got {digits}")
    if not 1 <= steps <= 3:
        raise ValueError(f"steps must be in 1..3 (prompts stay short), got {steps}")
    if not ops or set(ops) - set("+-*"):
        raise ValueError(f"ops must be a non-empty string over '+-*', got {ops!r}")
    rng = random.Random(seed)
    low, high = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
    problems = []
    for index in range(num):
        value = rng.randint(max(low, 1), high)
        text = f"{rng.choice(_NAMES)} has {value} {rng.choice(_ITEMS)}."
        chain = []
        for _ in range(steps):
            op = rng.choice(ops)
            if op == "-" and value == 0:
                op = "+"
            if op == "*":
                operand = rng.randint(2, 9)
            elif op == "-":
                operand = rng.randint(1, min(value, high))
            else:
                operand = rng.randint(max(low, 1), high)
            text += " " + _PHRASES[op].format(b=operand)
            chain.append((op, operand))
            value = _apply(value, op, operand)
        text += " How many?"
        problems.append(
            Problem(problem=text, answer=str(value), id=f"{id_prefix}-{index}",
                    metadata={"digits": digits, "ops": ops, "steps": steps})
        )
    return problems


def demo_solution(problem: Problem | str) -> str:
    r"""A short correct worked solution ending in ``\boxed{answer}``: ``12+30=42 \boxed{42}``."""
    text = problem.problem if isinstance(problem, Problem) else str(problem)
    start = _START_RE.search(text)
    if start is None:
        raise ValueError(f"not a demo problem (no 'has <number>'): {text!r}")
    value = int(start.group(1))
    parts = []
    for m in _STEP_RE.finditer(text):
        add, sub, mul = m.groups()
        op, operand = ("+", int(add)) if add else ("-", int(sub)) if sub else ("*", int(mul))
        new = _apply(value, op, operand)
        parts.append(f"{value}{op}{operand}={new}")
        value = new
    parts.append(rf"\boxed{{{value}}}")
    return " ".join(parts)


def write_demo_task(
    out_dir: str | Path,
    *,
    num_train: int = 2000,
    num_test: int = 200,
    seed: int = 0,
    digits: int = 2,
    ops: str = "+-",
    steps: int = 1,
) -> dict[str, str]:
    """Write ``train.jsonl`` and ``test.jsonl`` (problem, answer, id, solution + settings).

    Test problems that also occur in the train split are replaced, so the splits are disjoint.
    Returns the two paths.
    """
    train = make_demo_problems(num_train, seed=seed, digits=digits, ops=ops, steps=steps, id_prefix="train")
    seen = {p.problem for p in train}
    test: list[Problem] = []
    draw_seed = seed + 1_000_003
    while len(test) < num_test:
        batch = make_demo_problems(num_test, seed=draw_seed, digits=digits, ops=ops, steps=steps, id_prefix="test")
        for p in batch:
            if p.problem not in seen and len(test) < num_test:
                seen.add(p.problem)
                test.append(Problem(p.problem, p.answer, f"test-{len(test)}", p.metadata))
        draw_seed += 1
        if draw_seed > seed + 1_000_003 + 50:
            raise ValueError("cannot draw enough distinct test problems; use more digits or steps")
    paths = write_splits(out_dir, {split: [problem_to_record(p, solution=demo_solution(p)) for p in problems]
                                   for split, problems in (("train", train), ("test", test))})
    return paths


CHAR_TOKENIZER_CHARS = (
    "0123456789"
    "abcdefghijklmnopqrstuvwxyz"
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    " \n\t"
    "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~"
)
PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<|pad|>", "<|bos|>", "<|endoftext|>", "<|unk|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def build_char_tokenizer(out_dir: str | Path) -> str:
    """Save a character-level tokenizer as a Hugging Face tokenizer folder and return its path.

    Vocabulary: ids 0-3 are ``<|pad|>``, ``<|bos|>``, ``<|endoftext|>`` (eos) and ``<|unk|>``,
    then one id per character of ``CHAR_TOKENIZER_CHARS`` (digits, letters, punctuation
    including ``\\{}``, space, newline, tab). It has a simple chat template
    (``role: content`` lines, then ``assistant:``). Load it with
    ``transformers.AutoTokenizer.from_pretrained(out_dir)``.
    """
    from transformers import PreTrainedTokenizerFast

    specials = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN]
    vocab = {tok: i for i, tok in enumerate(specials)}
    for ch in CHAR_TOKENIZER_CHARS:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    core.decoder = decoders.Fuse()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out))
    return str(out)


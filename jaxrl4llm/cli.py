"""Command line: `jaxrl4llm train | eval | sample | plot | convert | plan | bin-difficulty | demo | sweep | report`.

Every command takes `--help`. Training-style commands take one or more `-c CONFIG.yaml`
(merged in order) and `section.key=value` overrides anywhere among the flags, e.g.

    jaxrl4llm train -c configs/models/qwen3_4b_base.yaml -c configs/lite_ppo.yaml \\
        model.path=/data/Qwen3-4B-Base data.train_files=[/data/train.jsonl] trainer.out_dir=runs/lite --resume

`bin-difficulty` takes its options as `--name value` or `name=value` (`rollouts=16`).
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import shlex
import sys
from pathlib import Path

# The commands import what they run inside their functions (checked by tests/test_imports.py): `jaxrl4llm --help`
# takes 1.9 s so, 3.2 s with every command's modules imported at the top (3 runs each, 2-core CPU, 2026-11-27),
# and `default_to_cpu` must set JAX_PLATFORMS before the first `import jax`, which those modules make.

# Device files of the accelerators JAX drives: TPU (/dev/accel*, or /dev/vfio/* on v5p/v6e), NVIDIA
# and AMD GPUs. Without one, the CLI runs JAX on the CPU (default_to_cpu).
ACCELERATOR_DEVICE_FILES = ("/dev/accel*", "/dev/vfio/*", "/dev/nvidia*", "/dev/kfd")

CONFIG_HELP = "YAML config file; repeat to merge several in order (later files win)."
OVERRIDES_HELP = ("section.key=value overrides applied after the files, in order, anywhere on the command line, "
                  "e.g. optim.lr=2e-6 rollout.samples_per_prompt=16.")
# Commands whose options may also be written `name=value` (for `--name value`), like overrides.
KEY_VALUE_OPTIONS = ("bin-difficulty",)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", action="append", default=[], metavar="YAML", help=CONFIG_HELP)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)


def _load(args):
    from jaxrl4llm.train.config import load_config

    return load_config(args.config, args.overrides)


RESUME_CHOICES = {None: False, "latest": True, "auto": "auto"}  # args.resume -> train(resume=...)


def cmd_train(args) -> int:
    """Runs `train`. The first SIGTERM (a preemption, `kill`) lets the step in progress end, saves
    its checkpoint and exits with status 75 (`preemption.RESUME_EXIT_CODE`: resume me); Ctrl-C
    (130) or a second SIGTERM (143) stop at once. Each prints one line with the command that
    continues the run from its last checkpoint, and no traceback."""
    from jaxrl4llm.train import preemption
    from jaxrl4llm.train.loop import train
    from jaxrl4llm.train.report import print_run_report

    cfg = _load(args)
    with preemption.watch():
        try:
            summary = train(cfg, resume=RESUME_CHOICES[args.resume], allow_config_change=args.allow_config_change)
        except preemption.Preempted as p:
            print(interrupted_line(args, cfg.trainer.out_dir, f"preempted after step {p.step} (SIGTERM), its "
                                   f"checkpoint saved; exit status {preemption.RESUME_EXIT_CODE}"), file=sys.stderr,
                  flush=True)
            return preemption.RESUME_EXIT_CODE
        except KeyboardInterrupt as e:
            print(interrupted_line(args, cfg.trainer.out_dir), file=sys.stderr, flush=True)
            return 143 if isinstance(e, preemption.Terminated) else 130
    print_run_report(summary)
    return 0


def interrupted_line(args, out_dir: str, what: str = "interrupted") -> str:
    """`jaxrl4llm train: interrupted; checkpoint step 7 in runs/x; resume with: jaxrl4llm train ... --resume`:
    the user's own arguments (args.argv), --resume added."""
    from jaxrl4llm.train.run_folder import checkpoint_steps

    argv = list(getattr(args, "argv", None) or ["train"])
    steps = checkpoint_steps(out_dir)
    if not steps:
        return (f"jaxrl4llm train: {what} before the first checkpoint (trainer.checkpoint_every); "
                f"start over with: jaxrl4llm {shlex.join(argv)}")
    if not any(a == "--resume" or a.startswith("--resume=") for a in argv):
        argv.append("--resume")
    return f"jaxrl4llm train: {what}; last checkpoint: step {steps[-1]} in {out_dir}; resume with: jaxrl4llm {shlex.join(argv)}"


def cmd_eval(args) -> int:
    import jax

    from jaxrl4llm.train.config import ConfigError
    from jaxrl4llm.train.evaluation import evaluate, format_table
    from jaxrl4llm.train.loop import run_meshes
    from jaxrl4llm.train.policy import load_policy
    from jaxrl4llm.train.prompts import load_eval_sets
    from jaxrl4llm.train.reward_fn import make_reward_fn
    from jaxrl4llm.train.run_folder import is_run_folder

    cfg = _load(args)
    if not cfg.data.eval_files:
        raise ConfigError("jaxrl4llm eval needs data.eval_files=[FILE, ...].")
    # the reward and the data before the model (then the tokenizer alone): a bad one fails in seconds
    reward_fn = make_reward_fn(cfg, log=lambda line: print(line, file=sys.stderr))
    sets = load_eval_sets(cfg)
    policy = load_policy(cfg, run_meshes(cfg)[0])
    records = [] if args.output else None
    result = evaluate(policy, sets, cfg, reward_fn, jax.random.PRNGKey(cfg.trainer.seed), records=records)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        with open(args.output, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        print(f"generations: {args.output} ({len(records)} lines)", file=sys.stderr)
    # model.path=RUN/hf_export: a run's model (a local folder, not a Hub id)
    run = Path(cfg.model.path).parent if cfg.model.path and Path(cfg.model.path).is_dir() else None
    if run is not None and is_run_folder(run):
        (run / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
        print(f"aggregate: {run / 'eval.json'}", file=sys.stderr)
    print(format_table(result), file=sys.stderr)  # benchmark x metric, for reading; stdout stays JSON
    print(json.dumps(result, indent=2))
    return 0


def cmd_sample(args) -> int:
    import jax

    from jaxrl4llm.train.loop import run_meshes
    from jaxrl4llm.train.policy import load_policy

    cfg = _load(args)
    policy = load_policy(cfg, run_meshes(cfg)[0])
    prompts = args.prompt or [sys.stdin.read()]
    if args.template:
        from jaxrl4llm.data import format_prompt

        prompts = [format_prompt(p, args.template, tokenizer=policy.tokenizer) for p in prompts]
    from jaxrl4llm.data import encode_prompt_text

    # as training encodes them: chat-template prompts without extra special tokens, others with them
    ids = [encode_prompt_text(p, policy.tokenizer, args.template or "raw") for p in prompts]
    rollout = policy.generate(ids, num_samples=args.num_samples, max_new_tokens=cfg.rollout.max_new_tokens,
                              temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                              rng=jax.random.PRNGKey(args.seed))
    for i, text in enumerate(policy.decode(rollout)):
        print(f"--- prompt {i // args.num_samples} sample {i % args.num_samples}")
        print(text)
    return 0


def cmd_plot(args) -> int:
    from jaxrl4llm.study.plot import plot_runs

    path = plot_runs(args.run_dirs, args.out, metrics=args.metrics)
    print(f"curves: {path}")
    return 0


def cmd_convert(args) -> int:
    from jaxrl4llm.train.export import export_checkpoint

    path = export_checkpoint(args.run_dir, args.out, step=args.step)
    print(f"exported Hugging Face folder: {path}")
    return 0


def cmd_bin_difficulty(args) -> int:
    from jaxrl4llm.train.binning import bin_difficulty_command

    bin_difficulty_command(args)
    return 0


def cmd_plan(args) -> int:
    from jaxrl4llm.plan.programs import chip_spec, format_plan, plan_run, plan_to_dict

    cfg = _load(args)
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if args.json else (lambda line: print(line, flush=True))
    topology = args.topology or cfg.mesh.topology
    if args.show_layout:
        from jaxrl4llm.plan.programs import plan_layout
        from jaxrl4llm.train.config import ConfigError

        if not topology:
            raise ConfigError("plan --show-layout needs a topology: pass --topology (e.g. v5p:4x4x4, h100:8, cpu) "
                              "or set mesh.topology.")
        print(json.dumps(plan_layout(cfg, topology).to_dict(), indent=2))
        return 0
    which = {None: "the sampler's and the trainer's programs", "trainer": "the trainer's programs",
             "sampler": "the sampler's programs"}[args.only]
    log(f"plan: compiling {which} for {topology} (seconds for a small model; a few "
        f"minutes each for a Qwen3-8B update or sampler on a TPU pod topology)")
    chip = chip_spec(topology, peak=args.peak, peak_flops=args.peak_flops, hbm_bandwidth=args.hbm_bandwidth,
                     memory_fraction=args.memory_fraction) if topology else None  # None: plan_run says what is missing
    plan = plan_run(cfg, args.topology, lengths=args.response_lengths, prompt_tokens=args.prompt_tokens, log=log,
                    chip=chip, trainer_only=args.only == "trainer", sampler_only=args.only == "sampler")
    out = plan_to_dict(plan) if args.json else format_plan(plan)
    fits = plan.fits
    if args.eval_problems:
        from jaxrl4llm.plan.programs import format_eval, plan_eval

        log(f"plan: compiling the sampler of an evaluation of {args.eval_problems} problems")
        ev = plan_eval(cfg, args.topology, problems=args.eval_problems, lengths=args.response_lengths,
                       prompt_tokens=args.prompt_tokens, log=log, chip=chip)
        fits = fits and ev.fits
        if args.json:
            out["eval"] = plan_to_dict(ev)
        else:
            out += "\n\n" + format_eval(ev, args.eval_problems)
    print(json.dumps(out, indent=2) if args.json else out)
    return 0 if fits else 1


def cmd_demo(args) -> int:
    from jaxrl4llm.study.plot import plot_runs
    from jaxrl4llm.train.demo import run_demo

    summary = run_demo(out_dir=args.out_dir, overrides=args.overrides, quick=args.quick,
                       rebuild_warmstart=args.rebuild_warmstart, sft_steps=args.sft_steps, task=args.task)
    run_dir = Path(summary["out_dir"])
    print(f"curves: {plot_runs([run_dir], run_dir / 'curves.png')}")
    return 0


def cmd_miniature(args) -> int:
    from jaxrl4llm.study import miniature

    if args.action == "prepare":
        for name, path in miniature.prepare(args.out_dir, rebuild=args.rebuild).items():
            print(f"{name}: {path}")
        return 0
    gates = miniature.pilot(args.out_dir)
    return 0 if all(g.passed for g in gates) else 1


def cmd_sweep(args) -> int:
    from jaxrl4llm.study.sweep import sweep_command

    return sweep_command(args)


def cmd_report(args) -> int:
    from jaxrl4llm.study.study_report import write_report

    path = write_report(args.run_dirs, args.out, baseline=args.baseline, plots=not args.no_plots,
                        prediction_grids=args.predictions)
    print(f"report: {path}")
    return 0


def _train_parser(sub) -> None:
    """The `train` command's parser, added to `sub` (build_parser's subparsers)."""
    p = sub.add_parser("train", help="run an RL experiment from YAML configs",
                       description="Sample, reward, update, evaluate and checkpoint, as the configs say. "
                       "Writes OUT/metrics.jsonl, OUT/tb (TensorBoard), OUT/checkpoints and OUT/hf_export.")
    _add_config_args(p)
    p.add_argument("--resume", nargs="?", const="latest", default=None, choices=("latest", "auto"),
                   help="continue from the latest checkpoint in trainer.out_dir; `--resume auto`: continue if it holds "
                   "a complete checkpoint, else start fresh (what a launcher that relaunches runs uses)")
    p.add_argument("--allow-config-change", action="store_true",
                   help="with --resume: accept changes to the keys that fix the checkpoint's shapes, the data, the "
                   "reward, the objective or the seed (model.*, data.train_files, rollout sizes, trainer.seed, ...); "
                   "other changes are always accepted, and every change is listed")
    p.set_defaults(fn=cmd_train)


def _eval_parser(sub) -> None:
    """The `eval` command's parser, added to `sub` (build_parser's subparsers)."""
    p = sub.add_parser("eval", help="evaluate a model on data.eval_files (mean@n, pass@k, maj@k, length)",
                       description="Samples eval.samples responses per problem at eval.temperature, eval.top_p, "
                       "eval.top_k (unset: trainer.eval_samples, trainer.eval_temperature, rollout.top_p / top_k; "
                       "temperature 0 = greedy, one sample), prints a table of mean@n, pass@k and maj@k (k = 1, 2, "
                       "4, ..., n) and mean response length per file to stderr and the same as JSON to stdout (also "
                       "to RUN/eval.json when model.path is a run's RUN/hf_export); --output writes every generation.")
    _add_config_args(p)
    p.add_argument("--output", default=None, metavar="FILE.jsonl",
                   help="write every generation: one JSON line per (problem, sample) with the prompt, response, "
                   "extracted answer, gold answer and reward")
    p.set_defaults(fn=cmd_eval)


def _sample_parser(sub) -> None:
    """The `sample` command's parser, added to `sub` (build_parser's subparsers)."""
    p = sub.add_parser("sample", help="sample completions for prompts from a model",
                       description="Generates with the JAX sampler using the rollout.* settings of the config.")
    _add_config_args(p)
    p.add_argument("--prompt", action="append", help="prompt text (repeatable); default: read stdin")
    p.add_argument("--template", default=None, help="wrap each prompt with a template (base, demo, chat)")
    p.add_argument("-n", "--num-samples", type=int, default=1, help="samples per prompt")
    p.add_argument("--seed", type=int, default=0, help="sampling seed")
    p.set_defaults(fn=cmd_sample)


def _plot_parser(sub) -> None:
    """The `plot` command's parser, added to `sub` (build_parser's subparsers)."""
    p = sub.add_parser("plot", help="draw training curves of one or more runs to a PNG",
                       description="Reads RUN_DIR/metrics.jsonl of each run and overlays their curves.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("-o", "--out", default=None, help="output PNG (default: FIRST_RUN_DIR/curves.png)")
    p.add_argument("--metrics", nargs="*", default=None, help="metric names to plot (default: the study's panel)")
    p.set_defaults(fn=cmd_plot)


def _convert_parser(sub) -> None:
    """The `convert` command's parser, added to `sub` (build_parser's subparsers)."""
    p = sub.add_parser("convert", help="export a run's checkpoint to a Hugging Face folder",
                       description="Restores the orbax checkpoint of RUN_DIR (latest or --step) and writes config.json, "
                       "safetensors and the tokenizer to --out, loadable by transformers and vLLM.")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.set_defaults(fn=cmd_convert)


def _plan_parser(sub) -> None:
    """The `plan` command's parser, added to `sub` (build_parser's subparsers)."""
    p = sub.add_parser("plan", help="compile a run's programs for a TPU/GPU topology; memory per chip and step time",
                       description="AOT-compiles the sampler, log-prob pass and update of the configured run with "
                       "XLA's TPU compiler (pip install -e .[tpu]), its CUDA compiler (pip install -e .[gpu]) or for "
                       "this CPU, on this machine with no accelerator, and prints bytes per chip (XLA's and our "
                       "analytic count), what each program costs with every loop trip counted, the step's time at a "
                       "length distribution, and what to change when a program does not fit (exit status 1). "
                       "docs/scaling.md.")
    _add_config_args(p)
    p.add_argument("--topology", default=None,
                   help="TPU slice (v5p:4x4x4, v5e:8x8, v6e:8x8, v4:4x4x4), GPUs (h100:8, h100:2x8 = 2 hosts x 8) "
                        "or cpu (this machine, its peak FLOP/s and bandwidth measured now); default: mesh.topology")
    p.add_argument("--response-lengths", default=None, metavar="DIST",
                   help="the responses' lengths: fixed, fixed:LEN, lognormal:mean=M,sigma=S, or a run folder "
                        "(its response_lengths.jsonl); default lognormal, mean max_new_tokens / 4, sigma 0.8")
    p.add_argument("--prompt-tokens", type=float, default=None, metavar="N",
                   help="real prompt tokens a row, for padding and useful-token MFU (default: the prompt bucket)")
    p.add_argument("--eval-problems", type=int, default=0, metavar="N",
                   help="also compile and price an evaluation of N problems x eval.samples samples (the "
                        "sampler as `train` evaluates: rollout.engine, rollout.slots / prompts_per_step)")
    p.add_argument("--peak", default="datasheet", choices=("datasheet", "measured"),
                   help="price at the chip's datasheet peak FLOP/s and memory bandwidth (default), or at what this "
                        "host's accelerator measures now (a bf16 matmul and a copy; run plan on the GPU/TPU host)")
    p.add_argument("--peak-flops", type=float, default=None, metavar="FLOP/S",
                   help="price at this bf16 matmul rate (e.g. measured on the chip: 7.9e14 for an H100)")
    p.add_argument("--hbm-bandwidth", type=float, default=None, metavar="BYTES/S",
                   help="price at this memory bandwidth, bytes read + written per second (a copy's)")
    p.add_argument("--memory-fraction", type=float, default=None, metavar="F",
                   help="the share of a chip's memory a process gets (default JAX's: on a GPU "
                        "XLA_PYTHON_CLIENT_MEM_FRACTION, else 0.75; 1 on TPU and CPU); the fit check takes 90%% of it")
    p.add_argument("--only", default=None, choices=("trainer", "sampler"),
                   help="compile one side's programs alone: trainer (the log-prob pass and the update) or sampler "
                        "(its weights and decode programs); a quicker answer when a change touches one side, the "
                        "step time then that side's")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--show-layout", action="store_true",
                   help="print the run's layout on the topology (train/layout.py: the model, meshes, micro-batches, "
                        "packing, the sampler's settings; a run writes the same to its layout.json) and compile nothing")
    p.set_defaults(fn=cmd_plan)


def _bin_difficulty_parser(sub) -> None:
    """The `bin-difficulty` command's parser, added to `sub` (build_parser's subparsers)."""
    p = sub.add_parser("bin-difficulty", help="bin problems into easy/medium/hard by correct answers in k rollouts",
                       description="The study's binning: sample --rollouts responses per problem with the JAX sampler, "
                       "count correct answers, write easy/medium/hard JSONL files and a histogram.")
    p.add_argument("--model", required=True, help="local Hugging Face model folder")
    p.add_argument("--data", required=True, help="JSONL/JSON/parquet problems file")
    p.add_argument("--rollouts", type=int, default=8, help="responses sampled per problem (default 8)")
    p.add_argument("--out", default="difficulty_bins", help="output folder")
    p.add_argument("--easy-min", type=int, default=None, help="correct counts >= this are easy (default: rollouts - rollouts // 4, 6 for 8)")
    p.add_argument("--hard-max", type=int, default=None, help="correct counts <= this are hard (default: rollouts // 4, 2 for 8)")
    p.add_argument("--template", default="base", help="prompt template (base, demo, chat)")
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.99)
    p.add_argument("--top-p", type=float, default=0.99)
    p.add_argument("--top-k", type=int, default=100)
    p.add_argument("--batch-prompts", type=int, default=16, help="prompts per sampler call")
    p.add_argument("--limit", type=int, default=None, help="only the first N problems")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(fn=cmd_bin_difficulty)


def _demo_parser(sub) -> None:
    """The `demo` command's parser, added to `sub` (build_parser's subparsers)."""
    p = sub.add_parser("demo", help="Lite PPO on the built-in arithmetic task on the CPU (the README's first command)",
                       description="Builds the demo task and tokenizer, warm-starts a small model by SFT, runs Lite PPO, "
                       "and prints held-out accuracy before -> after and the curves PNG.")
    p.add_argument("--out-dir", default="runs/demo", help="where data, checkpoints and curves go")
    p.add_argument("--task", choices=("arithmetic", "tools"), default="arithmetic",
                   help="arithmetic (the default) or tools: products of 3-digit numbers that the policy solves by "
                   "writing Python (configs/examples/tool_demo.yaml; use a separate --out-dir)")
    p.add_argument("--quick", action="store_true", help="a much shorter run (smoke test; does not reach the target)")
    p.add_argument("--rebuild-warmstart", action="store_true",
                   help="build the SFT warm start (OUT/warmstart) again even if one from the same recipe exists")
    p.add_argument("--sft-steps", type=int, default=None, help="SFT steps of the warm start (default 300; 30 with --quick)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help=OVERRIDES_HELP)
    p.set_defaults(fn=cmd_demo)


def _miniature_parser(sub) -> None:
    """The `miniature` command's parser, added to `sub` (build_parser's subparsers)."""
    p = sub.add_parser("miniature", help="the miniature study's chain task, warm starts and pilot gates (issue #40)",
                       description="prepare: writes the chain task (OUT/data) and SFTs the base-like and aligned-like warm "
                       "starts (OUT/base_like, OUT/aligned_like; reused while their recipe matches). pilot: short runs of "
                       "both starts at both budgets, then each gate of the study's pilot with its value (exit 1 if one "
                       "fails). The grids: configs/sweeps/chain_*.yaml; docs/results/miniature.md.")
    p.add_argument("action", choices=("prepare", "pilot"))
    p.add_argument("--out-dir", default="runs/miniature", help="where the task, the warm starts and the pilot go")
    p.add_argument("--rebuild", action="store_true", help="prepare: build the warm starts again even if their recipe matches")
    p.set_defaults(fn=cmd_miniature)


def _sweep_parser(sub) -> None:
    """The `sweep` command's parser, added to `sub` (build_parser's subparsers)."""
    p = sub.add_parser("sweep", help="run a grid of runs (recipes x data x models x seeds) from a YAML file",
                       description="Expands GRID.yaml into cells OUT_ROOT/<recipe>/<data>/<model>/seed<k>, validates every "
                       "cell's config, then runs the cells one after another, each a `jaxrl4llm train` process. Run it "
                       "again to continue: finished cells (done.json) are skipped, unfinished ones resume from their last "
                       "checkpoint. A failing cell does not stop the others; the exit status is 1 if any failed. "
                       "docs/sweeps.md.")
    p.add_argument("grid", metavar="GRID.yaml", help="the grid file, e.g. configs/sweeps/miniature.yaml")
    p.add_argument("--emit", action="store_true",
                   help="print one launch line per cell (for a cluster or tpu_scripts/launch.sh) and run nothing")
    p.add_argument("--emit-prefix", default="jaxrl4llm train", metavar="CMD",
                   help="the command --emit puts before each cell's arguments (default: jaxrl4llm train; "
                   "e.g. tpu_scripts/launch.sh)")
    p.add_argument("--only", action="append", default=[], metavar="PATTERN",
                   help="only the cells whose folder name matches (fnmatch; repeatable), e.g. 'grpo' or '*/seed0'")
    p.add_argument("--dry-run", action="store_true", help="print each cell's state and command and run nothing")
    p.set_defaults(fn=cmd_sweep)


def _report_parser(sub) -> None:
    """The `report` command's parser, added to `sub` (build_parser's subparsers)."""
    p = sub.add_parser("report", help="compare runs over seeds: curves with 95%% intervals, accuracy tables, t-tests",
                       description="Groups run folders into arms (a sweep's recipe/data/model labels, or equal configs "
                       "but the seed) and writes OUT/report.md and PNG curves: mean and 95% t-interval over seeds, "
                       "final held-out accuracy per benchmark, and each arm against the baseline arm (difference, "
                       "95% interval, Welch t-test). A folder that is not a run is searched for runs. docs/sweeps.md.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders, or folders holding them (a sweep's out_root)")
    p.add_argument("-o", "--out", default="report", help="output folder (default: report)")
    p.add_argument("--baseline", default=None, metavar="LABEL", help="the arm the others are compared with (default: the first)")
    p.add_argument("--no-plots", action="store_true", help="write the tables only (no PNG curves)")
    p.add_argument("--predictions", action="append", default=[], metavar="GRID.yaml",
                   help="judge the pre-registered predictions of this grid file (repeatable; docs/sweeps.md)")
    p.set_defaults(fn=cmd_report)


# Each command's parser, in the order `jaxrl4llm --help` lists the commands.
COMMAND_PARSERS = (
    _train_parser,
    _eval_parser,
    _sample_parser,
    _plot_parser,
    _convert_parser,
    _plan_parser,
    _bin_difficulty_parser,
    _demo_parser,
    _miniature_parser,
    _sweep_parser,
    _report_parser,
)


def build_parser() -> argparse.ArgumentParser:
    """The `jaxrl4llm` parser: one subparser per command (COMMAND_PARSERS), each setting `fn`."""
    parser = argparse.ArgumentParser(prog="jaxrl4llm", description="RL for LLM reasoning in JAX (GRPO, DAPO, Dr. GRPO, Lite PPO).")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_parser in COMMAND_PARSERS:
        add_parser(sub)
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The parser's namespace, with a command's positionals (the `key=value` overrides) taken
    from anywhere among its flags: `train -c a.yaml trainer.steps=3 --resume optim.lr=1e-5`.
    An unknown `--flag` is still an error. For KEY_VALUE_OPTIONS commands, `name=value` stands
    for `--name=value` when --name (underscores as dashes) is one of the command's options."""
    command = next((a for a in argv if not a.startswith("-")), None)
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if command not in subparsers.choices:  # no or an unknown command, -h: argparse's own message
        return parser.parse_args(argv)
    sub = subparsers.choices[command]
    rest = argv[argv.index(command) + 1:]
    if command in KEY_VALUE_OPTIONS:
        options = {s for a in sub._actions for s in a.option_strings if s.startswith("--")}
        rest = [_as_option(token, options) for token in rest]
    if command == "train":
        rest = _resume_flag(rest)
    args = sub.parse_intermixed_args(rest)
    args.command = command
    return args


def _resume_flag(words: list[str]) -> list[str]:
    """`--resume auto` -> `--resume=auto`, a bare `--resume` -> `--resume=latest`: argparse would
    take an override after a bare `--resume` (`--resume optim.lr=1e-5`) as its value."""
    out = []
    for word in words:
        if word == "auto" and out[-1:] == ["--resume=latest"]:
            out[-1] = "--resume=auto"
        else:
            out.append("--resume=latest" if word == "--resume" else word)
    return out


def _as_option(token: str, options: set[str]) -> str:
    """`name=value` -> `--name=value` when `--name` (underscores as dashes) is one of `options`."""
    name, eq, value = token.partition("=")
    flag = "--" + name.replace("_", "-")
    return f"{flag}={value}" if eq and not token.startswith("-") and flag in options else token


def default_to_cpu(env=os.environ, device_files=ACCELERATOR_DEVICE_FILES, platform: str = sys.platform) -> bool:
    """Sets JAX_PLATFORMS=cpu when it is unset on a Linux machine with no TPU or GPU device file;
    True when it did.

    With libtpu installed (the `tpu` and `test` extras) JAX probes for a TPU on every start and,
    on a machine without one, prints `E0000 ... INVALID_ARGUMENT ... TPU_WORKER_HOSTNAMES` lines
    before it falls back to the CPU. Where no accelerator can be there is nothing to probe for.
    A JAX_PLATFORMS of the user's (even empty) is kept, and so is JAX's own choice on a TPU VM or
    a GPU host, which have the device files.
    """
    if "JAX_PLATFORMS" in env or "JAX_PLATFORM_NAME" in env or not platform.startswith("linux"):
        return False
    if any(glob.glob(pattern) for pattern in device_files):
        return False
    env["JAX_PLATFORMS"] = "cpu"
    return True


def _no_torch_notice(record: logging.LogRecord) -> bool:
    """Drops transformers' "PyTorch was not found" on import without torch (the demo's install):
    jaxrl4llm needs only its tokenizers."""
    return "PyTorch was not found" not in record.getMessage()


def main(argv: list[str] | None = None) -> int:
    if default_to_cpu() and "jax" in sys.modules:  # imported by a caller before us: too late for the variable
        import jax

        jax.config.update("jax_platforms", "cpu")
    logging.getLogger("transformers").addFilter(_no_torch_notice)
    from jaxrl4llm.train.checkpointing import CheckpointError
    from jaxrl4llm.train.config import ConfigError
    from jaxrl4llm.train.reward_fn import RewardError

    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(build_parser(), argv)
    args.argv = argv  # the user's own words, for the resume line of an interrupted train
    # Like `python -m`: a reward or loss named by import path (`reward.fn=my_rewards:fn`) may
    # live in the working directory, which a console script does not put on sys.path.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if os.environ.get("JAXRL4LLM_DISTRIBUTED"):
        from jaxrl4llm.train import hosts

        hosts.initialize()  # many hosts (docs/scaling.md): must run before any device use
    try:
        return args.fn(args)
    except (ConfigError, CheckpointError, RewardError, FileNotFoundError, ValueError) as e:
        # Our errors name the problem and the fix; JAXRL4LLM_DEBUG=1 shows the traceback too.
        if os.environ.get("JAXRL4LLM_DEBUG"):
            raise
        print(f"jaxrl4llm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: no traceback (train says how to resume, above)
        print(f"jaxrl4llm {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

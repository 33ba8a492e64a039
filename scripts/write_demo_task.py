"""Write the arithmetic task at another difficulty than the demo's: OUT_DIR/train.jsonl, test.jsonl.

    .venv/bin/python scripts/write_demo_task.py OUT_DIR [--digits 1] [--steps 1] [--ops +-]
        [--num-train 2000] [--num-test 200] [--seed 0]

(`jaxrl4llm.data.write_demo_task`; the demo itself uses digits 1, steps 2.) The SmolLM2 example
reads `runs/smollm2_task`, written with `--digits 1 --steps 1`.
"""

from __future__ import annotations

import argparse

from jaxrl4llm.data import write_demo_task


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--digits", type=int, default=2, help="digits of the numbers (1-4)")
    ap.add_argument("--steps", type=int, default=1, help="operations per problem (1-3)")
    ap.add_argument("--ops", default="+-", help="operation mix over +-*")
    ap.add_argument("--num-train", type=int, default=2000)
    ap.add_argument("--num-test", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        paths = write_demo_task(args.out_dir, num_train=args.num_train, num_test=args.num_test, seed=args.seed,
                                digits=args.digits, ops=args.ops, steps=args.steps)
    except ValueError as e:
        ap.error(str(e))
    print(f"wrote {paths['train']} and {paths['test']}")


if __name__ == "__main__":
    main()

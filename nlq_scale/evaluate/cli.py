"""`nlq-scale eval`: downstream tasks through lm-evaluation-harness on a run's checkpoint."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

EPILOG = """examples:
  nlq-scale eval runs/quickstart --tasks nlq_lastword,nlq_cloze
  nlq-scale eval RUN_DIR --tasks lambada_openai,hellaswag --limit 500 --json   (needs a dataset cache)"""


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="score a run's checkpoint on lm-eval tasks; results go to the run's eval.json",
                       epilog=EPILOG)  # fmt: skip
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p.add_argument("--tasks", required=True,
                   help="comma-separated lm-eval task names: local nlq_lastword, nlq_cloze; or lm-eval's own "
                        "(lambada_openai, hellaswag, arc_easy, piqa, ...) with a prepared dataset cache")  # fmt: skip
    p.add_argument("--step", type=int, help="checkpoint step (default: the newest complete one)")
    p.add_argument("--limit", type=int, help="score only the first N documents of each task")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where lm-eval runs the model (auto: the GPU if one is visible)")
    p.add_argument("--json", action="store_true", help="the step's recorded results as JSON")
    p.set_defaults(func=run_eval)


def run_eval(args: argparse.Namespace) -> int:
    from nlq_scale.cli import emit_json
    from nlq_scale.evaluate.run import evaluate, parse_tasks, table

    # Libraries imported on the way (DeepSpeed's accelerator probe, via accelerate) log to stdout;
    # stdout is the table or the JSON document only.
    with contextlib.redirect_stdout(sys.stderr):
        entry = evaluate(args.run_dir, parse_tasks(args.tasks), args.step, args.limit, args.batch_size, args.device)
    if args.json:
        emit_json(entry)
    else:
        print(table(entry))
    return 0

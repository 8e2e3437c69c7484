"""`nlq-scale config`: the fully resolved config of a scale + arm + overrides, and where the shipped
configs and sbatch templates live in this installation."""

from __future__ import annotations

import argparse

from nlq_scale.errors import UsageError

SHIPPED = ("configs", "slurm")


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="show a resolved config, or where the shipped files are")
    verbs = p.add_subparsers(dest="verb", required=True)
    show = verbs.add_parser(
        "show",
        help="print the fully resolved run config (YAML)",
        description="Example: nlq-scale config show --scale 124m --arm nonlinear train.lr=1e-3",
    )
    show.add_argument("--scale", help="a scale name (nlq-scale config path configs lists where they are)")
    show.add_argument("--arm", help="an arm name")
    show.add_argument("--config", help="a run config YAML layered on top")
    show.add_argument("overrides", nargs="*", metavar="key=value")
    show.set_defaults(func=run_show)
    path = verbs.add_parser(
        "path",
        help="print the directory of the shipped configs or sbatch templates",
        description="Example: sbatch \"$(nlq-scale config path slurm)/train.sbatch\" RUN_DIR --scale 124m --arm linear",
    )
    path.add_argument("what", choices=SHIPPED)
    path.set_defaults(func=run_path)


def run_show(args: argparse.Namespace) -> int:
    from nlq_scale.config.load import dump_run_config, load_run_config

    if bool(args.scale) != bool(args.arm):
        raise UsageError("--scale and --arm go together")
    cfg = load_run_config(scale=args.scale, arm=args.arm, config_path=args.config, overrides=args.overrides)
    print(dump_run_config(cfg), end="")
    return 0


def run_path(args: argparse.Namespace) -> int:
    from nlq_scale.config.load import shipped_dir

    print(shipped_dir(args.what))
    return 0

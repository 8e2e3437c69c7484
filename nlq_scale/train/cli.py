"""`nlq-scale train`: one run into its run directory (in-process, or `--nproc N` local ranks)."""

from __future__ import annotations

import argparse
from pathlib import Path

from nlq_scale.errors import UsageError, check_creatable


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train (or resume) one run in its run directory",
        description="Train one run of an arm at a scale (or of a run config) into its run directory, or resume\n"
        "it there from its newest checkpoint. The directory holds config.yaml, metrics.jsonl, status.json,\n"
        "checkpoints/ and W&B's offline files; key=value overrides any config key (nlq-scale config show).",
        epilog="example:\n  nlq-scale train --scale cpu-xs --arm nonlinear --run-dir runs/one data.path=DATA",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--scale", help="ladder scale (configs/scales); needs --arm")
    src.add_argument("--config", help="a run config YAML (e.g. a run dir's config.yaml)")
    p.add_argument("--arm", help="arm (configs/arms) with --scale")
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--nproc", type=int, default=1, help="local rank processes (gloo on CPU)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from nlq_scale.config.load import load_run_config

    if args.scale and not args.arm:
        raise UsageError("--scale needs --arm")
    if args.nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {args.nproc}")
    check_creatable(args.run_dir, "--run-dir")
    cfg = load_run_config(scale=args.scale, arm=args.arm, config_path=args.config, overrides=args.overrides)
    if args.nproc == 1 and args.own_process:
        from nlq_scale.runtime.allocator import restart_with

        restart_with(cfg.runtime.cpu_allocator)  # before the first import of torch (--nproc starts its ranks on it)
    from nlq_scale.runtime.dist import detect_env
    from nlq_scale.train.preflight import preflight

    # Under srun/torchrun this process is one rank of a larger world: check the layout against it.
    env = detect_env() if args.nproc == 1 else None
    preflight(cfg, args.run_dir, env.world_size if env else args.nproc, env.local_rank if env else 0)
    if args.nproc == 1:
        from nlq_scale.train.api import train_run

        train_run(cfg, args.run_dir)
        return 0
    from nlq_scale.runtime.launch import launch_local
    from nlq_scale.train.rundir import CONFIG_FILE

    config_path = args.run_dir / CONFIG_FILE  # written by preflight: the ranks read what was resolved
    entry = ["-m", "nlq_scale.train.entry", "--config", str(config_path), "--run-dir", str(args.run_dir)]
    code = launch_local(entry, args.nproc, cfg.runtime.cpu_allocator)
    return 0 if code == 0 else (2 if code == 2 else 1)

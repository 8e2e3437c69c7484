"""Per-rank process entry: `python -m nlq_scale.train.entry --config RUN.yaml --run-dir DIR`.
torchrun/srun/`--nproc` start one per rank; launch/train.py is the same entry as a script."""

from __future__ import annotations

import argparse
import sys

from nlq_scale.errors import RunFailure, UsageError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nlq-scale-rank", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="resolved run config (a run dir's config.yaml)")
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    args = parser.parse_args(argv)
    from nlq_scale.runtime.quiet import quiet_libraries

    quiet_libraries()
    from nlq_scale.config.load import load_run_config
    from nlq_scale.train.api import train_run

    try:
        cfg = load_run_config(config_path=args.config, overrides=args.overrides)
        train_run(cfg, args.run_dir)
    except UsageError as e:
        print(f"nlq-scale train: error: {e}", file=sys.stderr)
        return 2
    except RunFailure as e:
        print(f"nlq-scale train: failed: {e}", file=sys.stderr)
        return 1
    return 0


# As a script only: a process started with the "spawn" method re-imports __main__.
if __name__ == "__main__":
    from nlq_scale.runtime.exit import exit_process

    exit_process(main())

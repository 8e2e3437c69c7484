"""`nlq-scale` command line. Each part of the library contributes its sub-commands from `<part>/cli.py`
(a function `add_commands(subparsers)`), so this file never changes when a part grows a command.
DESCRIPTION is what `nlq-scale --help` tells its users.

Exit codes: 0 success, 2 bad input (one line, no traceback), 1 failure at run time.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from typing import Any

from nlq_scale.errors import RunFailure, UsageError

DESCRIPTION = (
    "Train megatron-core GPTs whose attention queries come from different arms (linear, nonlinear, ...), run "
    "sweeps of them on SLURM or on this machine, and compare their scaling curves. Start with `nlq-scale "
    "quickstart`; `nlq-scale COMMAND --help` explains each command."
)
PARTS = ("config", "model", "data", "train", "cluster", "analysis", "quickstart", "doctor", "export", "evaluate")


class OneLineParser(argparse.ArgumentParser):
    """argparse prints usage plus the error; bad input here is one line naming the problem."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps an epilog's example lines as written; adds an option's default where it has one to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or "default" in text or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


class SubcommandParser(OneLineParser):
    """`train --scale S key=value --run-dir D key=value`: positionals (the overrides) on both sides of
    options. argparse matches a positional list only where it starts, so sub-commands parse
    intermixed (the top-level parser calls parse_known_args on them, and
    parse_known_intermixed_args calls it back: hence the guard)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        # A command with verbs of its own (`config show`) leaves intermixing to its verbs.
        if getattr(self, "_inside", False) or self._subparsers is not None:
            return super().parse_known_args(args, namespace)
        self._inside = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inside = False


def build_parser() -> argparse.ArgumentParser:
    from nlq_scale import __version__
    from nlq_scale.config.load import CONFIG_PATH_ENV
    from nlq_scale.runtime.quiet import VERBOSE_ENV

    parser = OneLineParser(prog="nlq-scale", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"nlq-scale {__version__}")
    parser.add_argument(
        "--config-dir",
        action="append",
        default=[],
        metavar="DIR",
        help=f"a directory of your own scales/, arms/, sweeps/, clusters/ (searched before the shipped "
        f"ones; repeatable; also ${CONFIG_PATH_ENV})",
    )
    parser.add_argument("--verbose", action="store_true",
                        help=f"show the library warnings (megatron, torch.distributed, DeepSpeed, streaming) that are "
                             f"hidden by default (sets ${VERBOSE_ENV} for the processes started from here)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=SubcommandParser)
    for part in PARTS:
        name = f"nlq_scale.{part}.cli"
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name).add_commands(sub)
    _name_known_configs(sub)
    return parser


def _name_known_configs(sub: argparse._SubParsersAction) -> None:
    """Every command's --scale and --arm help lists the names it accepts (shipped ones and those of the
    config path in the environment), verbs of a command (`config show`) included."""
    from nlq_scale.config.load import available

    for command in sub.choices.values():
        for action in command._actions:
            if isinstance(action, argparse._SubParsersAction):
                _name_known_configs(action)
            kind = {"scale": "scales", "arm": "arms"}.get(action.dest)
            if kind and "known:" not in (action.help or ""):
                known = f"known: {', '.join(available(kind))}"
                action.help = f"{action.help} ({known})" if action.help else known


def emit_json(obj: Any) -> None:
    """`--json`: one JSON document on stdout and nothing else there."""
    json.dump(obj, sys.stdout, indent=2, sort_keys=False, default=str)
    sys.stdout.write("\n")


def _add_config_dirs(dirs: list[str]) -> None:
    """Through the environment, so that ranks and submitted jobs started from here see them too."""
    from nlq_scale.config.load import CONFIG_PATH_ENV

    for d in reversed(dirs):
        if not os.path.isdir(d):
            raise UsageError(f"--config-dir {d}: not a directory")
        # idempotent: a process restarted onto its allocator (restart_with) comes through here again
        path = os.path.abspath(d)
        rest = [p for p in os.environ.get(CONFIG_PATH_ENV, "").split(os.pathsep) if p and p != path]
        os.environ[CONFIG_PATH_ENV] = os.pathsep.join([path, *rest])


def main(argv: list[str] | None = None, own_process: bool = False) -> int:
    """`own_process`: this process runs nothing but this command (the console script, `python -m`),
    so a command may restart it (`nlq-scale train` onto runtime.cpu_allocator)."""
    from nlq_scale.runtime.quiet import VERBOSE_ENV, quiet_libraries

    parser = build_parser()
    args = parser.parse_args(argv)
    args.own_process = own_process
    if args.verbose:
        os.environ[VERBOSE_ENV] = "1"  # through the environment, to ranks and submitted jobs
    quiet_libraries()
    try:
        _add_config_dirs(args.config_dir)
        return int(args.func(args) or 0)
    except UsageError as e:
        print(f"nlq-scale {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RunFailure as e:
        print(f"nlq-scale {args.command}: failed: {e}", file=sys.stderr)
        return 1


def run() -> None:
    """The `nlq-scale` console script: main() in a process of its own."""
    from nlq_scale.runtime.exit import exit_process

    exit_process(main(own_process=True))


if __name__ == "__main__":
    run()

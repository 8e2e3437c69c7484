"""Error types that map to the CLI's exit codes (2 = bad input, 1 = run-time failure), and the check
every command makes of where it will write."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


class UsageError(Exception):
    """Bad input: config, data, checkpoint or CLI arguments. The CLI prints one line and exits 2.

    The message must name the offending field or file.
    """


class RunFailure(Exception):
    """A failure at run time that is not the user's input. The CLI prints one line and exits 1."""


def check_creatable(path: Path, flag: str, directory: bool = True) -> None:
    """UsageError naming `flag` unless `path` exists or can be created, before any work is done: its
    nearest existing ancestor must be a directory a file can be created in, and a `directory` that
    exists already must be one. Tried with a temporary file, not read from permission bits, which root
    and read-only or virtual file systems make misleading."""
    target = ancestor = Path(os.path.abspath(path))
    if directory and target.exists() and not target.is_dir():
        raise UsageError(f"{flag} {path}: exists and is not a directory (nothing overwritten)")
    while not ancestor.exists():
        ancestor = ancestor.parent
    if ancestor != target and not ancestor.is_dir():
        raise UsageError(f"{flag} {path}: {ancestor} is not a directory")
    where = ancestor if ancestor.is_dir() else ancestor.parent  # an existing file (not a `directory`): its folder
    try:
        with tempfile.TemporaryFile(dir=where):
            pass
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot create files in {where} ({e.strerror})") from None


def first_line(err: BaseException) -> str:
    """An exception's first message line, or its type's name where it has none: for one-line errors."""
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


def existing_directory(path: Path) -> Path:
    """`path`, which a command reads (a root of runs), or UsageError saying what it is instead."""
    if not path.exists():
        raise UsageError(f"{path}: no such directory")
    if not path.is_dir():
        raise UsageError(f"{path}: not a directory")
    return path

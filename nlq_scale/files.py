"""Writing under a temporary name, renamed into place when complete, so that a reader never sees half a
file or directory and a failed write leaves none. The temporary names are made here, not by
tempfile's mkstemp/mkdtemp, which create 0600/0700 whatever the umask: a report or an export would
stay private to its owner on a shared cluster, while every other file of the user gets the umask's
mode (0644/0755 under umask 022)."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path


def temporary_name(dest: Path) -> Path:
    """A hidden name beside `dest`, unique to this process and call."""
    return dest.with_name(f".{dest.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary name for the caller to write `path` to; renamed onto `path` when the block ends
    without an error, removed otherwise (a full disk leaves no stray half file)."""
    tmp = temporary_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write(path: Path, text: str) -> None:
    with replacing(path) as tmp:
        tmp.write_text(text)


@contextlib.contextmanager
def staged_dir(dest: Path) -> Iterator[Path]:
    """A new directory beside `dest` for the caller to fill; when the block ends without an error it
    takes the umask's modes (libraries write through mkstemp too: safetensors) and is renamed to `dest`,
    which must be absent or an empty directory. Removed otherwise."""
    tmp = temporary_name(dest)
    tmp.mkdir()
    try:
        yield tmp
        with_umask_modes(tmp)
        if dest.exists():
            dest.rmdir()
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def current_umask() -> int:
    """Read from /proc (Linux): os.umask reads it only by setting it, which races the file creation of
    other threads."""
    with contextlib.suppress(OSError, StopIteration, ValueError):
        with open("/proc/self/status") as f:
            return int(next(line for line in f if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def with_umask_modes(root: Path) -> None:
    """`root` and everything under it get the mode a new file or directory of the user gets: 0666
    (0777 for what is executable or a directory) less the umask. Symbolic links are left as they are."""
    mask = current_umask()
    for path in [root, *root.rglob("*")]:
        mode = path.lstat().st_mode
        if stat.S_ISLNK(mode):
            continue
        full = 0o777 if stat.S_ISDIR(mode) or mode & 0o111 else 0o666
        path.chmod(full & ~mask)

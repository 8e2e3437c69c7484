"""The host memory allocator of CPU rank processes (`runtime.cpu_allocator`).

glibc's malloc hands every large block (a training step's activations and gradients, megabytes
each) back to the OS when it is freed, so the next step faults the same memory in again, page by
page: at the throughput benchmark's shape 300-550 thousand page faults and 0.6-1.0 s of kernel time
per 8 s step, and more for the arm that keeps more activations. tcmalloc keeps freed blocks for
reuse: after the first step a step faults in almost nothing. It is the allocator torch's own CPU
launcher (torch.backends.xeon.run_cpu) preloads. The allocator of a process is fixed when it starts,
so a process gets it when it starts: the `--nproc` ranks are started with it, and a process that
owns its command line (`nlq-scale train` in a process of its own, the throughput benchmark) restarts
itself on it before its first import of torch, as does each task of a submitted job. A run called
in-process (`main([...])` inside another program) keeps the allocator its process was started with.
"""

from __future__ import annotations

import ctypes.util
import functools
import os
import sys
from pathlib import Path

TCMALLOC = "tcmalloc_minimal"  # Debian/Ubuntu: libtcmalloc-minimal4 (gperftools)
PRELOAD = "LD_PRELOAD"


@functools.cache
def _tcmalloc() -> str | None:
    """tcmalloc's library name where it is installed. Looked up once per process: find_library runs
    ldconfig, and a compiler and linker where ldconfig does not list it, and every rank asks."""
    return ctypes.util.find_library(TCMALLOC)


def preload_env(choice: str, env: dict[str, str]) -> dict[str, str]:
    """`env` with tcmalloc preloaded when `choice` is "auto", it is installed, and nothing is
    preloaded already (a user's LD_PRELOAD wins)."""
    library = _tcmalloc() if choice == "auto" else None
    if library is None or env.get(PRELOAD):
        return env
    return env | {PRELOAD: library}


def loaded_allocator() -> str:
    """Which allocator this process runs: tcmalloc, jemalloc, or the system's (glibc)."""
    maps = Path("/proc/self/maps")
    mapped = maps.read_text() if maps.exists() else ""
    return next((name for name in ("tcmalloc", "jemalloc") if f"lib{name}" in mapped), "system")


def restart_with(choice: str) -> None:
    """Replace this process by a fresh one on the allocator `choice` asks for, when that preloads one
    this process does not run: the same pid, interpreter options and arguments (`python -m ...`
    stays a module run), and the environment as it is now."""
    env = preload_env(choice, dict(os.environ))
    if env.get(PRELOAD) != os.environ.get(PRELOAD) and loaded_allocator() == "system":
        sys.stdout.flush()  # what this process printed must not be lost with its buffers
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)

"""`--nproc N`: start N local rank processes (gloo) the way torchrun would, forward preemption
signals to them, and stop the rest when one fails."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Iterator

import torch.distributed as dist

from nlq_scale.runtime.allocator import preload_env
from nlq_scale.runtime.dist import STORE_HOSTED
from nlq_scale.train.signals import STOP_SIGNALS

LOCALHOST = "127.0.0.1"


@contextlib.contextmanager
def hosted_store() -> Iterator[int]:
    """The ranks' rendezvous store, served by the launcher on a port the OS gives it for the block;
    yields the port. A port found free and bound later by rank 0 can be taken in between by any
    outgoing connection on the machine (EADDRINUSE); this one is never let go."""
    store = dist.TCPStore(LOCALHOST, 0, is_master=True, wait_for_workers=False)
    try:
        yield store.port
    finally:
        del store


def rank_env(rank: int, nproc: int, port: int, cpu_allocator: str = "auto") -> dict[str, str]:
    """The environment of local rank `rank` of `nproc`, joining the store hosted_store serves on `port`,
    with the host allocator `runtime.cpu_allocator` asks for."""
    threads = max(1, (os.cpu_count() or 1) // nproc)
    return preload_env(cpu_allocator, dict(os.environ)) | {
        "RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": LOCALHOST,
        "MASTER_PORT": str(port),
        STORE_HOSTED: "1",
        "OMP_NUM_THREADS": str(threads),
    }


def launch_local(python_args: list[str], nproc: int, cpu_allocator: str = "auto", grace_s: float = 30.0) -> int:
    """Run `python <python_args...>` as ranks 0..nproc-1; returns the worst exit code."""
    with hosted_store() as port:
        children = [
            subprocess.Popen([sys.executable, *python_args], env=rank_env(r, nproc, port, cpu_allocator))
            for r in range(nproc)
        ]

        def forward(signum: int, _frame: object) -> None:
            for child in children:
                if child.poll() is None:
                    child.send_signal(signum)

        previous = {sig: signal.signal(sig, forward) for sig in STOP_SIGNALS}
        try:
            return wait_ranks(children, grace_s)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def wait_ranks(children: list[subprocess.Popen], grace_s: float, timeout_s: float | None = None) -> int | None:
    """Wait for the ranks, stopping the rest once one fails; the worst exit code, or None when
    `timeout_s` passed first (every rank is stopped then too)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while any(c.poll() is None for c in children):
        if any(c.returncode not in (None, 0) for c in children):
            _stop(children, grace_s)
            break
        if deadline is not None and time.monotonic() > deadline:
            _stop(children, grace_s)
            return None
        time.sleep(0.2)
    return max(abs(c.wait()) for c in children)


def _stop(children: list[subprocess.Popen], grace_s: float) -> None:
    for c in children:
        if c.poll() is None:
            c.terminate()
    deadline = time.time() + grace_s
    for c in children:
        try:
            c.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            c.kill()

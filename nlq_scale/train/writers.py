"""Where a background save's write runs (`checkpoint.async_writer`), both at the lowest CPU priority:

- `thread`: a thread of the training process. Its Python work takes the interpreter lock from the
  training loop while it writes; a CPU step, which spends its time in torch's kernels, hardly
  notices, but on a GPU, where the loop only issues kernels and never pauses, a step overlapping it
  took 1.48x a plain one (docs/performance.md, "CUDA graphs for the query module").
- `process`: a forked child. It shares no lock with training, but every page the training process
  writes while the child lives is copied: on a CPU that is the whole model and optimizer state at
  every step, which cost the overlapped steps as much as the write itself; on a GPU the state lives
  on the device and few host pages change. The child sends its results back through a pipe.

`auto`, the default, picks the process on CUDA and the thread on the CPU.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import queue
import signal
import sys
import threading
import warnings
from collections.abc import Callable
from typing import Any

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def at_lowest_priority(write: Callable[[], None]) -> None:
    """Call `write` at the lowest CPU priority, in a thread or process of its own
    (benchmarks/checkpoint.py times a raw write the same way)."""
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread, and the ones it starts
    write()


class ThreadWriter:
    def __init__(self, write: Callable[[], None], results: queue.SimpleQueue) -> None:
        self._thread = threading.Thread(target=at_lowest_priority, args=(write,), name="checkpoint-writer")
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self) -> None:
        self._thread.join()


class ProcessWriter:
    """`write` in a forked child; what it puts on `results` (the written items, or the exception
    that stopped it) is put on the parent's `results` once the child has sent it."""

    def __init__(self, write: Callable[[], None], results: queue.SimpleQueue) -> None:
        context = multiprocessing.get_context("fork")
        self._results, self._done = results, False
        self._pipe, child_end = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_write_in_child, args=(write, results, child_end), name="checkpoint-writer", daemon=True
        )
        with warnings.catch_warnings():
            # Python 3.12 warns at every fork of a process with threads; the child only writes files.
            warnings.simplefilter("ignore", DeprecationWarning)
            self._process.start()
        child_end.close()

    def is_alive(self) -> bool:
        if not self._done and self._pipe.poll():
            self._receive()
        return not self._done

    def join(self) -> None:
        if not self._done:
            self._receive()

    def _receive(self) -> None:
        try:
            outcome = self._pipe.recv()
        except EOFError:  # the child ended without a word: killed, or out of memory
            self._process.join()
            outcome = RuntimeError(f"the checkpoint writer process exited with code {self._process.exitcode}")
        self._process.join()
        self._results.put(outcome)
        self._done = True


def _write_in_child(write: Callable[[], None], results: queue.SimpleQueue, pipe: Any) -> None:
    _end_with_parent()
    at_lowest_priority(write)  # puts the written items or its exception on `results`
    outcome = results.get_nowait()
    try:
        pipe.send(outcome)
    except Exception as error:  # noqa: BLE001 - an exception that does not pickle still gets reported
        pipe.send(RuntimeError(f"{outcome!r} ({error})"))


def _end_with_parent() -> None:
    """A writer whose training process was killed (SIGKILL, a preempted node) stops with it instead
    of writing on into a checkpoint no one will finalize, while a relaunch may reuse the directory."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


WRITERS = {"thread": ThreadWriter, "process": ProcessWriter}


def writer_kind(setting: str, on_cuda: bool) -> str:
    """checkpoint.async_writer resolved: `auto` is the process on CUDA, the thread on the CPU."""
    if setting != "auto":
        return setting
    return "process" if on_cuda else "thread"

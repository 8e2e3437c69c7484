"""checkpoint.async_writer's two writers (nlq_scale/train/writers.py), outside a save: what the
write puts on the results queue reaches the parent's queue, and a writer that dies says so."""

from __future__ import annotations

import os
import queue
import threading

import pytest

from nlq_scale.train.writers import ProcessWriter, ThreadWriter, writer_kind


def _finish(writer) -> None:
    while writer.is_alive():
        threading.Event().wait(0.01)
    writer.join()


@pytest.mark.parametrize("kind", [ThreadWriter, ProcessWriter])
def test_the_write_runs_elsewhere_and_its_results_reach_the_parent(kind, tmp_path):
    results: queue.SimpleQueue = queue.SimpleQueue()
    marker = tmp_path / "written"

    def write() -> None:
        marker.write_text(f"{os.getpid()} {os.getpriority(os.PRIO_PROCESS, threading.get_native_id())}")
        results.put({0: ["item"]})

    _finish(kind(write, results))
    pid, nice = map(int, marker.read_text().split())
    assert (pid != os.getpid()) == (kind is ProcessWriter) and nice == 19
    assert results.get_nowait() == {0: ["item"]} and results.empty()


def test_a_writer_process_that_dies_reports_its_exit_code():
    results: queue.SimpleQueue = queue.SimpleQueue()
    writer = ProcessWriter(lambda: os._exit(3), results)
    writer.join()
    assert not writer.is_alive()
    error = results.get_nowait()
    assert isinstance(error, RuntimeError) and "exited with code 3" in str(error)


def test_an_exception_that_does_not_pickle_is_still_reported():
    results: queue.SimpleQueue = queue.SimpleQueue()

    class Unpicklable(Exception):
        def __reduce__(self):
            raise TypeError("no")

    writer = ProcessWriter(lambda: results.put(Unpicklable("disk on fire")), results)
    _finish(writer)
    error = results.get_nowait()
    assert isinstance(error, RuntimeError) and "disk on fire" in str(error)


def test_auto_is_the_process_on_cuda_and_the_thread_on_the_cpu():
    assert [writer_kind("auto", True), writer_kind("auto", False)] == ["process", "thread"]
    assert writer_kind("thread", True) == "thread" and writer_kind("process", False) == "process"

"""logging.profile_steps: torch.profiler over a window of training steps, and where their time went.

Every rank writes `<run dir>/profile/rank<R>.json`, one summary of the window: the loop's seconds per
step, the aten ops the host dispatched per step (outermost only: an op another op calls is not
counted), and on CUDA the device's busy time (the union of its kernels,
copies and fills), its busy fraction of the step, kernels launched and host synchronizations per
step, and the ops with the most device time. A busy fraction well below 1 means the device waited on
the host: launch overhead (many small kernels) or synchronizations. Rank 0 also writes the full
trace, `rank0.trace.json.gz`, for chrome://tracing or Perfetto.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

# The CUDA runtime calls that make the host wait for the device (cudaMemcpy, unlike cudaMemcpyAsync).
_SYNCS = frozenset({"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"})
_TOP_OPS = 10


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals in microseconds, in seconds (overlapping
    kernels on several streams count once)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total / 1e6


def summarize(prof: profile, step_seconds: list[float], first: int, cuda: bool) -> dict:
    """The window's figures per step (see the module docstring)."""
    n = len(step_seconds)
    events = prof.events()
    wall = sum(step_seconds) / n
    summary = {
        "steps": [first, first + n - 1],
        "seconds_per_step": wall,
        "host_ops_per_step": sum(_outermost_op(e) for e in events) / n,
    }
    if not cuda:
        return summary | {"top_host_ops": _top(prof, "self_cpu_time_total", n)}
    device = [e for e in events if e.device_type == DeviceType.CUDA]
    busy = busy_seconds([(e.time_range.start, e.time_range.end) for e in device]) / n
    return summary | {
        "device_busy_seconds_per_step": busy,
        "device_busy_fraction": busy / wall,
        "kernels_per_step": sum(not e.name.startswith(("Memcpy", "Memset")) for e in device) / n,
        "device_to_host_copies_per_step": sum("DtoH" in e.name for e in device) / n,
        "host_syncs_per_step": sum(e.device_type == DeviceType.CPU and e.name in _SYNCS for e in events) / n,
        "top_device_ops": _top(prof, "self_device_time_total", n),
    }


def _outermost_op(event) -> bool:
    """An aten op that no other aten op called: what the host dispatched, in forward, in autograd's
    backward (nested in its evaluate_function events) and in the optimizer."""
    if not event.name.startswith("aten::"):
        return False
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return False
        parent = parent.cpu_parent
    return True


def _top(prof: profile, key: str, n: int) -> list[dict]:
    """The ops with the most `key` time: name, milliseconds and calls per step."""
    averages = sorted(prof.key_averages(), key=lambda a: getattr(a, key), reverse=True)[:_TOP_OPS]
    return [{"op": a.key, "ms_per_step": getattr(a, key) / 1e3 / n, "calls_per_step": a.count / n} for a in averages]


class StepProfiler:
    """Profiles the training steps of `window` (1-based, inclusive; None: none) that this run executes:
    a run resumed inside the window profiles what is left of it, one that stops inside it (preempted,
    diverged) what it ran."""

    def __init__(self, window: tuple[int, int] | None, steps: int, run_dir: Path, rank: int, cuda: bool) -> None:
        self.window = None if window is None else (window[0], min(window[1], steps))
        self.rank, self.cuda = rank, cuda
        self.directory = run_dir / "profile"
        self._prof: profile | None = None
        self._first = 0
        self._seconds: list[float] = []

    def before(self, step: int) -> None:
        """Called before training step `step` (1-based)."""
        if self.window is None or self._prof is not None or not self.window[0] <= step <= self.window[1]:
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._prof, self._first, self._seconds = profile(activities=activities), step, []
        self._prof.start()

    def after(self, step: int, seconds: float) -> None:
        """Called after step `step` took `seconds` (the loop's own timing)."""
        if self._prof is None:
            return
        self._seconds.append(seconds)
        if step == self.window[1]:
            self.stop()

    def stop(self) -> None:
        """Ends the window early (the run stops) or on time, and writes what it profiled."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.stop()
        if self._seconds:
            self._write(prof)

    def _write(self, prof: profile) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        summary = summarize(prof, self._seconds, self._first, self.cuda)
        (self.directory / f"rank{self.rank}.json").write_text(json.dumps(summary, indent=1) + "\n")
        if self.rank == 0:
            prof.export_chrome_trace(str(self.directory / "rank0.trace.json.gz"))

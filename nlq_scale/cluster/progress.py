"""One terminal line per local run while it trains: step, loss, tokens/s and ETA, read from the run
directory the train loop keeps current (status.json every step, metrics.jsonl every log step), so the
terminal is not silent while submitit sends the job's own output to log files."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TextIO

from nlq_scale.train.rundir import last_record, read_status

PLAIN_EVERY_S = 30.0  # not a terminal (CI logs, pipes): a line this often, not a redraw per second


def progress_line(run_id: str, run_dir: Path) -> str:
    status = read_status(run_dir)
    if not status:
        return f"{run_id}: starting"
    step, total = status.get("step") or 0, status.get("total_steps")
    record = last_record(run_dir, "train/loss")
    parts = [f"{run_id}: step {step}/{total or '?'}"]
    if "train/loss" in record:
        parts.append(f"loss {record['train/loss']:.4f}")
    if record.get("tokens_per_s"):
        parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
    if total and step and status.get("elapsed_s"):
        # The mean step so far (evaluations and saves included); status' step_time_s is the slowest one.
        parts.append(f"ETA {_clock((total - step) * status['elapsed_s'] / step)}")
    return ", ".join(parts)


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressLine:
    """Redraws one line in place on a terminal; elsewhere prints a new line every PLAIN_EVERY_S seconds."""

    def __init__(self, run_id: str, run_dir: Path, out: TextIO = sys.stderr):
        self.run_id, self.run_dir, self.out = run_id, run_dir, out
        self.tty = out.isatty()
        self.last_plain = 0.0
        self.shown = ""

    def update(self) -> None:
        line = progress_line(self.run_id, self.run_dir)
        if self.tty:
            self.out.write("\r" + line.ljust(len(self.shown)))
        elif line != self.shown and time.monotonic() - self.last_plain >= PLAIN_EVERY_S:
            self.out.write(line + "\n")
            self.last_plain = time.monotonic()
        self.shown = line
        self.out.flush()

    def finish(self, state: str) -> None:
        line = f"{progress_line(self.run_id, self.run_dir)} -> {state}"
        self.out.write(("\r" + line.ljust(len(self.shown)) if self.tty else line) + "\n")
        self.out.flush()

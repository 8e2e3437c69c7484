"""`nlq-scale status ROOT`: one row per run directory under ROOT (a root, a sweep dir or one run dir).

The state is the train loop's (status.json), corrected by what the scheduler knows: a run whose
status says running/pending but whose last job (job.json) is no longer queued shows `dead` (the job
was killed without a word: node failure, OOM, scancel after its grace time; or died of an error it
could not write there, a full disk: its error is submitit's), and so does one whose
process (status.json `pid` and `host`) ran on this host and has ended while no job of it is queued
(a requeued job restarts it); a running run whose
job is still allocated (or cannot be asked about) but whose heartbeat (status.json `heartbeat_at`,
written every step) is older than its bound shows `stale` (hung or vanished processes; see
train/rundir.py STALE_STEPS); a submitted run that never started training and whose job has ended
shows `failed` with the job's own error when submitit recorded one, else `dead`. `submitted` =
queued, no status yet.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from nlq_scale.cluster.executors import JOB_FILE, WAITING_STATES, job_states, live, read_json
from nlq_scale.compat import submitit as submitit_compat
from nlq_scale.train.rundir import (
    CONFIG_FILE, STATUS_FILE, heartbeat_age, is_stale, last_record, process_gone, read_status,
)

MARKERS = (STATUS_FILE, JOB_FILE, CONFIG_FILE)
COLUMNS = ("run", "state", "step", "tokens", "val_loss", "job", "nodes", "elapsed", "error")


def find_run_dirs(root: Path, depth: int = 3) -> list[Path]:
    """Directories holding a run (any of status.json, job.json, config.yaml), sorted; skips _* and .*."""
    if any((root / m).exists() for m in MARKERS):
        return [root]
    if depth == 0 or not root.is_dir():
        return []
    out: list[Path] = []
    for child in sorted(root.iterdir()):
        if child.is_dir() and not child.name.startswith(("_", ".")):
            out += find_run_dirs(child, depth - 1)
    return out


class _BuiltinsOnly(pickle.Unpickler):
    """Run dirs are shared: a result file naming any class or function is not read (it could run code)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"global '{module}.{name}' is not allowed")


def job_error(job: dict) -> str | None:
    """The error submitit pickled for task 0 of the job, as its last traceback line."""
    if not job.get("folder") or not job.get("job_id"):
        return None
    path = submitit_compat.result_pickle(job["folder"], job["job_id"])
    try:
        with path.open("rb") as f:
            outcome, payload = _BuiltinsOnly(f).load()
    except (OSError, pickle.UnpicklingError, ValueError, TypeError, EOFError):
        return None
    if outcome != "error":
        return None
    lines = [ln for ln in str(payload).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "error"


def run_row(run_dir: Path, root: Path, job_state: str | None, stale_s: float | None = None) -> dict[str, Any]:
    """`job_state`: its last job's, as executors.job_states gives it. A job queued for its (next)
    start (requeued or retried) owes no heartbeat."""
    alive = live(job_state)
    status = read_status(run_dir)
    job = read_json(run_dir / JOB_FILE)
    state = status.get("state")
    error = status.get("error")
    if state is None:
        if job and alive is False:
            error = job_error(job)
            state = "failed" if error else "dead"
        else:
            state = "submitted" if job else "new"
    elif state in ("running", "pending") and alive is False:
        # A job that died of an error it could not record in the run dir (a full disk fails the
        # status write itself) still left it in submitit's folder.
        state, error = "dead", job_error(job)
    elif state in ("running", "pending") and alive is not True and process_gone(status):
        # (a job still queued or running is the scheduler's word: a requeued run's old process ended,
        # its job starts it again; `dead` would also end `status --watch` while the sweep goes on)
        state, error = "dead", f"its process {status['pid']} on {status['host']} has ended"
    elif state == "running" and job_state in WAITING_STATES:
        state = "pending"
    elif is_stale(status, stale_s):
        state, error = "stale", f"no heartbeat for {heartbeat_age(status):.0f} s"
    name = str(run_dir.relative_to(root)) if run_dir != root else run_dir.name
    return {
        "run": name,
        "state": state,
        "step": status.get("step"),
        "total_steps": status.get("total_steps"),
        "tokens": status.get("tokens"),
        "val_loss": last_record(run_dir, "val/loss", tail_bytes=None).get("val/loss"),
        # submitit's id (array tasks as 12_3, as squeue shows them), else what the job itself saw.
        "slurm_job_id": (job.get("job_id") if job.get("executor") == "slurm" else None) or status.get("slurm_job_id"),
        "job_id": job.get("job_id"),
        "executor": job.get("executor"),
        "num_nodes": status.get("num_nodes"),
        "elapsed_s": status.get("elapsed_s"),
        "heartbeat_age_s": heartbeat_age(status),
        "error": error,
        "log": job.get("log"),
    }


def collect(root: Path, stale_s: float | None = None) -> list[dict[str, Any]]:
    dirs = find_run_dirs(root)
    states = job_states(dirs)
    return [run_row(d, root, states.get(d), stale_s) for d in dirs]


def _cell(row: dict[str, Any], column: str) -> str:
    if column == "step":
        return f"{row['step'] if row['step'] is not None else '-'}/{row['total_steps'] or '-'}"
    if column == "val_loss":
        return f"{row['val_loss']:.4f}" if row["val_loss"] is not None else "-"
    if column == "job":
        return str(row["slurm_job_id"] or row["job_id"] or "-")
    if column == "nodes":
        return str(row["num_nodes"] or "-")
    if column == "elapsed":
        return _duration(row["elapsed_s"])
    if column == "tokens":
        return _si(row["tokens"])
    value = row.get(column)
    text = "-" if value in (None, "") else str(value)
    return text if column != "error" else text.splitlines()[0][:80]


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _si(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def format_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no runs found"
    cells = [[_cell(r, c) for c in COLUMNS] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["state"]] = counts.get(r["state"], 0) + 1
    lines.append(f"{len(rows)} runs: " + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    return "\n".join(lines)

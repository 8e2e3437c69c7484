"""The run directory contract: config.yaml, config-changes.jsonl, manifest.json, status.json,
metrics.jsonl, checkpoints/. Files are replaced atomically so a killed job never leaves half a file,
and a reader (`status`) never sees one."""

from __future__ import annotations

import json
import os
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from nlq_scale.config.load import dump_run_config
from nlq_scale.config.schema import RunConfig
from nlq_scale.errors import UsageError

STATES = ("pending", "running", "preempted", "diverged", "completed", "failed")
STATUS_FILE = "status.json"
CHANGES_FILE = "config-changes.jsonl"
# Keys a resumed run may change: how it is logged, checkpointed, evaluated and laid out on devices.
# Everything else (model, arm, data, seeds, LR schedule, global batch, ...) is the run's identity.
OPERATIONAL = (
    "logging.",
    "checkpoint.",
    "parallel.",
    "runtime.",
    "train.eval_every",
    "train.log_every",
    "train.micro_batch_size",
    "train.zero_stage",
    "train.device_peak_flops",
    "data.num_workers",
)
# A run is stale when its heartbeat is older than STALE_STEPS of its slowest step so far (a step
# interval includes its evals and checkpoint saves), and never sooner than STALE_FLOOR_S.
STALE_STEPS = 10
STALE_FLOOR_S = 300.0


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # after a failed write (a full disk): no stray half file


def write_json(path: Path, obj: Any) -> None:
    atomic_write(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_current(path: Path) -> dict:
    """A run's JSON file read from outside while it may be rewritten (status, submit, progress
    lines): absent or being replaced reads as {} (the next look sees it)."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def read_status(run_dir: Path) -> dict:
    return read_current(run_dir / STATUS_FILE)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"{path}: unreadable JSON ({e})") from None


def claim(run_dir: Path, cfg: RunConfig, create: bool = True) -> bool:
    """Create the run dir for cfg (when `create`), or accept it if it already holds the same run
    (resume). Returns True when it already held one. Operational keys (OPERATIONAL) may differ:
    with `create`, config.yaml is updated and the change appended to config-changes.jsonl. An
    identity key that differs is a UsageError naming it, and nothing is touched."""
    text = dump_run_config(cfg)
    config_path = run_dir / "config.yaml"
    if config_path.exists():
        existing, wanted = yaml.safe_load(config_path.read_text()), yaml.safe_load(text)
        changed = sorted(k for k in _diff_keys(existing, wanted) if not _unused_arm_section(k, existing, wanted))
        identity = [k for k in changed if not k.startswith(OPERATIONAL)]
        if identity:
            key = identity[0]
            raise UsageError(
                f"{run_dir}: holds a run with a different config ({key}: {_at(existing, key)!r} here, "
                f"{_at(wanted, key)!r} asked{f'; {len(identity) - 1} more' if len(identity) > 1 else ''}); "
                "only operational keys may change on resume: use another run directory (--run-dir, --root) "
                "or remove this one"
            )
        if changed and create:
            _record_changes(run_dir, {k: [_at(existing, k), _at(wanted, k)] for k in changed})
            atomic_write(config_path, text)
        return True
    if create:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(config_path, text)
    return False


def _at(tree: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def _unused_arm_section(key: str, *configs: dict) -> bool:
    """A key in the option section of an arm that none of `configs` uses: it shapes nothing, and a
    run dir saved before that arm was registered lacks the section."""
    from nlq_scale import arms

    unused = {a.options_key for a in arms.all_arms() if a.options_key} - {
        arms.get(arm).options_key for arm in {_at(c, "model.arm") for c in configs} if arm in arms.names()
    }
    return any(key == f"model.{section}" or key.startswith(f"model.{section}.") for section in unused)


def _record_changes(run_dir: Path, changes: dict[str, list]) -> None:
    """Appended before config.yaml is replaced: a crash in between leaves the record, not a silent change."""
    entry = {"time": time.time(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "changes": changes}
    with open(run_dir / CHANGES_FILE, "a") as f:
        f.write(json.dumps(entry) + "\n")


def _diff_keys(a: Any, b: Any, prefix: str = "") -> set[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out: set[str] = set()
        for key in set(a) | set(b):
            out |= _diff_keys(a.get(key), b.get(key), f"{prefix}{key}.")
        return out
    return set() if a == b else {prefix.rstrip(".")}


def _git_sha() -> str | None:
    repo = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def manifest(cfg: RunConfig, layout: dict, data_sha256: str | None, accounting: dict) -> dict:
    return {
        "package": {"name": "nlq-scale", "version": _version("nlq-scale")},
        "git_sha": _git_sha(),
        "versions": {
            name: _version(name)
            for name in ("torch", "megatron-core", "deepspeed", "mosaicml-streaming", "wandb", "submitit")
        },
        "data": {"manifest_sha256": data_sha256},
        "layout": layout,
        "accounting": accounting,
    }


def stale_after(status: dict) -> float:
    """Seconds without a heartbeat after which a running run counts as stale (see STALE_STEPS)."""
    return max(STALE_FLOOR_S, STALE_STEPS * float(status.get("step_time_s") or 0.0))


def heartbeat_age(status: dict, now: float | None = None) -> float | None:
    beat = status.get("heartbeat_at")
    return None if beat is None else (now or time.time()) - float(beat)


def is_stale(status: dict, bound_s: float | None = None) -> bool:
    """A run that says it is running but has not beaten for longer than its bound (or `bound_s`)."""
    age = heartbeat_age(status)
    if status.get("state") != "running" or age is None:
        return False
    return age > (stale_after(status) if bound_s is None else bound_s)


class Status:
    """status.json, rewritten atomically on every change. Every write is a heartbeat (heartbeat_at);
    step_time_s is the longest interval between two steps so far (kept across resumes)."""

    def __init__(self, run_dir: Path, total_steps: int, num_nodes: int) -> None:
        self.path = run_dir / STATUS_FILE
        previous = read_json(self.path)
        now = time.time()
        self.data = {
            "state": previous.get("state", "pending"),
            "step": previous.get("step", 0),
            "tokens": previous.get("tokens", 0),
            "last_checkpoint": previous.get("last_checkpoint"),
            "error": None,
            "total_steps": total_steps,
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            "num_nodes": num_nodes,
            "started_at": previous.get("started_at", now),
            "updated_at": now,
            "heartbeat_at": now,
            "step_time_s": previous.get("step_time_s"),
            "elapsed_s": previous.get("elapsed_s", 0.0),
        }
        self._session_start = now
        self._elapsed_before = self.data["elapsed_s"]
        self._last_step_at: float | None = None

    def update(self, **fields: Any) -> None:
        if "state" in fields and fields["state"] not in STATES:
            raise ValueError(f"unknown state {fields['state']}")
        now = time.time()
        if fields.get("state") == "running":
            self._last_step_at = now  # the first step's interval counts from here
        elif "step" in fields and fields["step"] != self.data["step"] and self._last_step_at is not None:
            interval = now - self._last_step_at
            self._last_step_at = now
            fields["step_time_s"] = max(interval, self.data["step_time_s"] or 0.0)
        elapsed = self._elapsed_before + now - self._session_start
        self.data.update(fields, updated_at=now, heartbeat_at=now, elapsed_s=elapsed)
        write_json(self.path, self.data)

"""The run directory contract: config.yaml, config-changes.jsonl, manifest.json, status.json,
metrics.jsonl, checkpoints/, eval.json (downstream results of `nlq-scale eval`). Training, cluster, analysis, export and doctor all read and write a
run's files through this module (checkpoints/ holds what train/checkpoint.py keeps there). Files are
replaced atomically so a killed job never leaves half a file, and a reader (`status`) never sees one."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Iterable

import yaml

from nlq_scale.config.load import build_run_config, dump_run_config, read_yaml
from nlq_scale.config.schema import RunConfig
from nlq_scale.errors import UsageError
from nlq_scale.files import atomic_write
from nlq_scale.runtime.allocator import loaded_allocator

STATES = ("pending", "running", "preempted", "diverged", "completed", "failed")
CONFIG_FILE = "config.yaml"
CHANGES_FILE = "config-changes.jsonl"
MANIFEST_FILE = "manifest.json"
STATUS_FILE = "status.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS_DIR = "checkpoints"
EVAL_FILE = "eval.json"
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
    "data.validation",  # further validation sets: val/<name>/loss; the fixed set (val/loss) is identity
    "model.core_attention",  # the same attention through another kernel
)
# Arm options that change how the same function of the same parameters is computed (a fused norm).
OPERATIONAL_OPTIONS = (".fuse_up",)
# A run is stale when its heartbeat is older than STALE_STEPS of its slowest step so far (a step
# interval includes its evals and checkpoint saves), and never sooner than STALE_FLOOR_S.
STALE_STEPS = 10
STALE_FLOOR_S = 300.0


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


def write_status(run_dir: Path, status: dict) -> None:
    if status.get("state") not in STATES:
        raise ValueError(f"unknown state {status.get('state')}")
    write_json(run_dir / STATUS_FILE, status)


def is_run_dir(filenames: Iterable[str]) -> bool:
    """A run directory's files: metrics, or (pending, or failed before its first record) config + status."""
    names = set(filenames)
    return METRICS_FILE in names or {CONFIG_FILE, STATUS_FILE} <= names


def read_config(run_dir: Path) -> RunConfig:
    """config.yaml as this version resolves it; UsageError naming the file when missing or invalid."""
    path = run_dir / CONFIG_FILE
    if not path.is_file():
        raise UsageError(f"{path}: missing; {run_dir} is not a run directory")
    raw = read_yaml(path)
    if isinstance(raw.get("model"), dict):
        # written before model.core_attention existed: megatron's own attention trained it, so a resume
        # that now runs SDPA records the change (config-changes.jsonl) instead of hiding it
        raw["model"].setdefault("core_attention", "stock")
    return build_run_config(raw, str(path))


def write_config(run_dir: Path, cfg: RunConfig) -> None:
    atomic_write(run_dir / CONFIG_FILE, dump_run_config(cfg))


def write_manifest(run_dir: Path, data: dict) -> None:
    """manifest.json holds the launch that wrote it last; a resume on other library versions than
    the launch before appends them to config-changes.jsonl first, so a run that trained on two
    stacks says so."""
    previous = run_dir / MANIFEST_FILE
    if previous.is_file():
        before = read_manifest(run_dir).get("versions", {})
        now = data.get("versions", {})
        moved = {f"versions.{name}": [before.get(name), v] for name, v in now.items() if before.get(name) != v}
        if moved:
            _record_changes(run_dir, moved)
    write_json(previous, data)


def read_manifest(run_dir: Path) -> dict:
    manifest = read_json(run_dir / MANIFEST_FILE)
    if not isinstance(manifest, dict):
        raise UsageError(f"{run_dir / MANIFEST_FILE}: expected a JSON object")
    return manifest


def write_metrics(run_dir: Path, records: list[dict]) -> None:
    atomic_write(run_dir / METRICS_FILE, "".join(json.dumps(r, allow_nan=True) + "\n" for r in records))


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl's records (none if it does not exist yet). A torn last line (the writer was
    killed mid-write) is skipped; a malformed line anywhere else is an error."""
    path = run_dir / METRICS_FILE
    if not path.is_file():
        return []
    text = path.read_text()
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines) and not text.endswith("\n"):
                break
            raise UsageError(f"{path}: line {number} is not valid JSON") from None
        if not isinstance(record, dict) or "step" not in record:
            raise UsageError(f"{path}: line {number}: expected an object with a 'step'")
        records.append(record)
    return records


def last_record(run_dir: Path, key: str, tail_bytes: int | None = 16384) -> dict:
    """The last metrics record holding `key`, from a file that may be being written: reading only
    its last `tail_bytes` (None: all of it), skipping cut lines; {} if there is none."""
    try:
        with (run_dir / METRICS_FILE).open("rb") as f:
            if tail_bytes is not None:
                f.seek(max(0, f.seek(0, 2) - tail_bytes))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return {}
    needle = json.dumps(key)
    for line in reversed(lines):
        if needle not in line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue  # cut by the tail's start or by a kill
        if key in record:
            return record
    return {}


def last_validation(run_dir: Path) -> tuple[int, float] | None:
    """(step, val/loss) of the run's last validation, if any."""
    record = last_record(run_dir, "val/loss")
    return (record["step"], float(record["val/loss"])) if record else None  # float(): JSON keeps nan a string


def read_eval(run_dir: Path) -> dict[int, dict]:
    """eval.json: checkpoint step -> {"step", "tokens", "lm_eval", "tasks": {task: {...}}} ({} if none)."""
    raw = read_json(run_dir / EVAL_FILE)
    if not isinstance(raw, dict) or not all(isinstance(v, dict) and k.isdigit() for k, v in raw.items()):
        raise UsageError(f"{run_dir / EVAL_FILE}: expected an object of step -> results")
    return {int(k): v for k, v in raw.items()}


def record_eval(run_dir: Path, step: int, entry: dict) -> dict:
    """Merges one evaluation of checkpoint `step` into eval.json: its tasks replace those tasks at
    that step only; other steps and other tasks stay. Returns the step's merged entry."""
    results = read_eval(run_dir)
    old = results.get(step, {})
    merged = {**old, **entry, "tasks": {**old.get("tasks", {}), **entry["tasks"]}}
    results[step] = merged
    write_json(run_dir / EVAL_FILE, {str(k): results[k] for k in sorted(results)})
    return merged


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
    config_path = run_dir / CONFIG_FILE
    if config_path.exists():
        # as this version resolves it (new keys at their defaults, a parameter-matched MLP width solved):
        # a run saved by an earlier version compares by what it means, not by how it was written
        existing, wanted = yaml.safe_load(dump_run_config(read_config(run_dir))), yaml.safe_load(text)
        changed = sorted(k for k in _diff_keys(existing, wanted) if not _unused_arm_section(k, existing, wanted))
        identity = [k for k in changed if not (k.startswith(OPERATIONAL) or k.endswith(OPERATIONAL_OPTIONS))]
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
        "allocator": loaded_allocator(),  # of rank 0's process in the launch that wrote this (runtime.cpu_allocator)
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


def process_gone(status: dict) -> bool:
    """The process that writes this status.json ran on this host and has ended (killed without a word:
    SIGKILL, the OOM killer). A process elsewhere cannot be asked: False."""
    if status.get("host") != socket.gethostname() or not status.get("pid"):
        return False
    try:
        os.kill(int(status["pid"]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        pass
    return False


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
        self.run_dir = run_dir
        previous = read_json(run_dir / STATUS_FILE)
        now = time.time()
        self.data = {
            "state": previous.get("state", "pending"),
            "step": previous.get("step", 0),
            "tokens": previous.get("tokens", 0),
            "last_checkpoint": previous.get("last_checkpoint"),
            "error": None,
            "total_steps": total_steps,
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
            # who writes it: `status` on the same host knows at once when that process is gone
            "pid": os.getpid(),
            "host": socket.gethostname(),
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
        now = time.time()
        if fields.get("state") == "running":
            self._last_step_at = now  # the first step's interval counts from here
        elif "step" in fields and fields["step"] != self.data["step"] and self._last_step_at is not None:
            interval = now - self._last_step_at
            self._last_step_at = now
            fields["step_time_s"] = max(interval, self.data["step_time_s"] or 0.0)
        elapsed = self._elapsed_before + now - self._session_start
        data = self.data | fields | {"updated_at": now, "heartbeat_at": now, "elapsed_s": elapsed}
        write_status(self.run_dir, data)
        self.data = data

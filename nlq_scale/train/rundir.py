"""The run directory contract (DESIGN.md): config.yaml, manifest.json, status.json, metrics.jsonl,
checkpoints/. Files are replaced atomically so a killed job never leaves half a file."""

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


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json(path: Path, obj: Any) -> None:
    atomic_write(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"{path}: unreadable JSON ({e})") from None


def claim(run_dir: Path, cfg: RunConfig, create: bool = True) -> bool:
    """Create the run dir for cfg (when `create`), or accept it if it already holds the same
    config (resume). Returns True when it already held the config. A different config is a
    UsageError and nothing is touched."""
    text = dump_run_config(cfg)
    config_path = run_dir / "config.yaml"
    if config_path.exists():
        existing = yaml.safe_load(config_path.read_text())
        if existing != yaml.safe_load(text):
            changed = sorted(_diff_keys(existing, yaml.safe_load(text)))
            raise UsageError(
                f"{run_dir}: holds a run with a different config (differs in {', '.join(changed[:5])}); "
                "use another run directory (--run-dir, --root) or remove this one"
            )
        return True
    if create:
        run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(config_path, text)
    return False


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


class Status:
    """status.json, rewritten atomically on every change."""

    def __init__(self, run_dir: Path, total_steps: int, num_nodes: int) -> None:
        self.path = run_dir / "status.json"
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
            "elapsed_s": previous.get("elapsed_s", 0.0),
        }
        self._session_start = now
        self._elapsed_before = self.data["elapsed_s"]

    def update(self, **fields: Any) -> None:
        if "state" in fields and fields["state"] not in STATES:
            raise ValueError(f"unknown state {fields['state']}")
        now = time.time()
        self.data.update(fields, updated_at=now, elapsed_s=self._elapsed_before + now - self._session_start)
        write_json(self.path, self.data)

"""metrics.jsonl (the source of truth), its W&B mirror, and the progress line. Rank 0 only.

W&B is best effort: any failure there is reported once and the mirror is switched off; training
and metrics.jsonl carry on. A resumed run continues the same W&B run rewound to its checkpoint's step
(`resume_from`: a W&B branch point, honoured when the offline run is synced), and mirrors only the
steps after it: the steps a killed job logged past its last checkpoint are replaced, none doubled.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from nlq_scale.config.schema import RunConfig
from nlq_scale.train.rundir import METRICS_FILE


def _finite_or_none(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep the fact visible as "nan"/"inf"
    return value


class WandbMirror:
    def __init__(self, cfg: RunConfig, run_dir: Path, resume_step: int | None) -> None:
        self.run = None
        self.after_step = resume_step or 0
        if not cfg.logging.wandb:
            return
        try:
            import wandb

            os.environ.setdefault("WANDB_MODE", cfg.logging.wandb_mode)
            os.environ.setdefault("WANDB_SILENT", "true")
            self.run = wandb.init(
                project=cfg.logging.wandb_project,
                entity=cfg.logging.wandb_entity,
                group=cfg.sweep,
                job_type=cfg.arm_label,  # W&B's grouping within a sweep: one job type per arm
                name=cfg.name or run_dir.name,
                dir=str(run_dir),
                **_continuation(run_dir, resume_step),
                tags=[f"arm:{cfg.arm_label}", f"scale:{cfg.scale}", f"seed:{cfg.seed}", f"lr:{cfg.train.lr:g}"]
                + list(cfg.logging.tags),
                config=cfg.model_dump(mode="json"),
                mode=cfg.logging.wandb_mode,
            )
        except Exception as e:  # noqa: BLE001 - the mirror must never stop training
            self._disable(e)

    def where(self, run_dir: Path) -> str:
        """For the start header: the mirror's mode and where its files go (how to upload them offline)."""
        if self.run is None:
            return f"W&B off: metrics in {run_dir / METRICS_FILE}"
        files = run_dir / "wandb"
        if self.run.settings.mode == "online":
            return f"W&B online: {self.run.url} (local files in {files})"
        return f"W&B offline: files in {files}; upload with: wandb sync {files}/offline-run-*"

    def _disable(self, err: Exception) -> None:
        print(f"[nlq-scale] W&B mirror disabled: {type(err).__name__}: {err}", file=sys.stderr)
        self.run = None

    def log(self, record: dict) -> None:
        if self.run is None or record["step"] <= self.after_step:
            return
        try:
            values = {k: v for k, v in record.items() if k not in ("step", "event") and isinstance(v, (int, float))}
            self.run.log(values, step=record["step"])
        except Exception as e:  # noqa: BLE001
            self._disable(e)

    def finish(self, state: str) -> None:
        if self.run is None:
            return
        try:
            self.run.summary["state"] = state
            self.run.finish(exit_code=0 if state in ("completed", "preempted") else 1)
        except Exception as e:  # noqa: BLE001
            self._disable(e)


def _wandb_id(run_dir: Path) -> str:
    """Stable per run dir so a resumed run continues the same W&B run."""
    return hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]


def _continuation(run_dir: Path, resume_step: int | None) -> dict[str, str]:
    """wandb.init's id arguments: a new run, or the earlier one rewound to the checkpoint's step
    when an earlier session mirrored it (W&B may have been off then: resume without a rewind)."""
    run_id = _wandb_id(run_dir)
    if resume_step is None:
        return {"id": run_id}
    if any((run_dir / "wandb").glob(f"*-{run_id}")):
        return {"resume_from": f"{run_id}?_step={resume_step}"}
    return {"id": run_id, "resume": "allow"}


class MetricsWriter:
    def __init__(self, run_dir: Path, cfg: RunConfig, resume: bool, enabled: bool, start_step: int) -> None:
        self.enabled = enabled
        self.start_step = start_step
        self.total_steps = cfg.train.steps
        self._file = open(run_dir / METRICS_FILE, "a") if enabled else None
        self.wandb = WandbMirror(cfg, run_dir, start_step if resume else None) if enabled else None
        self._tty = sys.stdout.isatty()
        self._t0 = time.time()

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {"step": record["step"], "tokens": record["tokens"], "time": time.time()} | record
        self._file.write(json.dumps({k: _finite_or_none(v) for k, v in record.items()}) + "\n")
        self._file.flush()
        self.wandb.log(record)

    def progress(self, step: int, loss: float, tokens_per_s: float) -> None:
        """One concise line per log interval (rewritten in place on a terminal)."""
        if not self.enabled:
            return
        done = max(step - self.start_step, 1)
        eta = (time.time() - self._t0) / done * (self.total_steps - step)
        line = f"step {step}/{self.total_steps} loss {loss:.4f} {tokens_per_s:,.0f} tok/s eta {eta / 60:.1f} min"
        print(("\r" + line) if self._tty else line, end="" if self._tty else "\n", flush=True)

    def validation(self, step: int, val: dict[str, float]) -> None:
        """A line of its own for every validation: each set's loss (val/loss, val/<name>/loss) and its
        standard error (<metric>_stderr)."""
        if not self.enabled:
            return
        losses = [f"{key.removesuffix('/loss')} loss {value:.4f} ± {val[f'{key}_stderr']:.4f}"
                  for key, value in val.items() if not key.endswith("_stderr")]
        print(("\n" if self._tty else "") + f"step {step}/{self.total_steps} " + ", ".join(losses), flush=True)

    def close(self, state: str) -> None:
        if not self.enabled:
            return
        if self._tty:
            print()
        self._file.close()
        self.wandb.finish(state)

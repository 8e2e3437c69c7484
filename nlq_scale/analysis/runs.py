"""Load finished or running runs into one in-memory form, whatever wrote them.

Sources: run directories (the run-directory contract of docs/training.md: config.yaml, manifest.json, status.json,
metrics.jsonl), offline W&B runs (read through `wandb leet inspect --json`, no network), and online
W&B projects (`wandb:ENTITY/PROJECT`, through `wandb.Api()` when the user is logged in). CSV logs
become run directories first (`nlq-scale import-csv`, csvio.py), so they load as run directories.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np

from nlq_scale.config.load import build_run_config
from nlq_scale.config.schema import RunConfig
from nlq_scale.errors import UsageError
from nlq_scale.train.rundir import (
    METRICS_FILE, STATES, STATUS_FILE, is_run_dir, read_config, read_eval, read_json, read_manifest, read_metrics,
)

VAL_KEY = "val/loss"
TRAIN_KEY = "train/loss"
WANDB_PREFIX = "wandb:"
# W&B's run states (wandb.apis.public.Run.state) in the run directory's vocabulary.
WANDB_STATES = {"finished": "completed", "failed": "failed", "crashed": "failed", "killed": "failed"}


@dataclass(frozen=True)
class Curve:
    """Validation loss over training, one point per evaluation, sorted by step."""

    step: np.ndarray
    tokens: np.ndarray  # float: NaN where the source did not record tokens
    loss: np.ndarray


@dataclass(frozen=True)
class Run:
    run_id: str
    source: str
    arm: str
    scale: str
    seed: int
    lr: float | None  # None: imported without a learning rate
    state: str  # status.json vocabulary: pending|running|preempted|diverged|completed|failed
    val: Curve
    params: int | None  # non-embedding parameters N
    flops_per_token: int | None
    first_nonfinite_train_step: int | None = None
    diverged_event_step: int | None = None  # the train loop's own divergence guard fired here
    sweep: str | None = None  # the sweep that made the run (its W&B group)
    # `nlq-scale eval` results of the newest evaluated checkpoint: "task/metric" -> value (eval.json)
    downstream: dict[str, float] = field(default_factory=dict)

    @property
    def has_val(self) -> bool:
        return self.val.loss.size > 0

    @property
    def final_loss(self) -> float:
        return float(self.val.loss[-1])

    @property
    def final_step(self) -> int:
        return int(self.val.step[-1])

    @property
    def final_tokens(self) -> float:
        return float(self.val.tokens[-1])

    @property
    def compute(self) -> float | None:
        """Training FLOPs spent up to the final evaluation (C = FLOPs/token x tokens)."""
        if self.flops_per_token is None or not self.has_val or not math.isfinite(self.final_tokens):
            return None
        return self.flops_per_token * self.final_tokens


# ---------------------------------------------------------------------------------------------
# discovery


def load_runs(roots: Iterable[str], group: str | None = None, exclude: Iterable[str] = ()) -> list[Run]:
    """Every run under the given roots; a root is a directory, a run directory, a W&B run
    directory or `.wandb` file, or `wandb:ENTITY/PROJECT` for an online project. `group`: only the
    runs of that sweep (the W&B group its runs carry); `exclude`: runs left out, by id or path."""
    runs: list[Run] = []
    for root in roots:
        found = _load_online(root[len(WANDB_PREFIX):], group) if root.startswith(WANDB_PREFIX) else _load_local(Path(root))
        if not found:
            raise UsageError(f"{root}: no runs found (expected run directories with {METRICS_FILE}, or W&B runs)")
        runs.extend(found)
    if group is not None:
        runs = _of_sweep(runs, group)
    for name in exclude:
        runs = _without(runs, name)
    return _one_per_seed(runs)


def _of_sweep(runs: list[Run], group: str) -> list[Run]:
    kept = [r for r in runs if r.sweep == group]
    if not kept:
        found = ", ".join(sorted({r.sweep or "(none)" for r in runs}))
        raise UsageError(f"--group {group}: none of the {len(runs)} runs found belong to it (sweeps: {found})")
    return kept


def _load_local(root: Path) -> list[Run]:
    if not root.exists():
        raise UsageError(f"{root}: no such file or directory")
    if root.is_file() and root.suffix != ".wandb":
        raise UsageError(f"{root}: not a directory or .wandb file (import CSV logs with `nlq-scale import-csv`)")
    if root.is_file():
        return load_wandb_offline([root])
    found = list(_run_paths(root))
    run_dirs = [p for p, of_ours in found if of_ours]
    return [load_run_dir(p) for p in run_dirs] + load_wandb_offline([p for p, of_ours in found if not of_ours])


def _run_paths(root: Path) -> Iterator[tuple[Path, bool]]:
    """(path, True) for run directories, (path, False) for W&B run directories that are not the
    mirror inside a run directory."""
    for dirpath, dirnames, filenames in os.walk(root):
        if is_run_dir(filenames):
            dirnames.clear()  # its wandb/ subdirectory mirrors the same run
            yield Path(dirpath), True
        elif any(f.startswith("run-") and f.endswith(".wandb") for f in filenames):
            dirnames.clear()
            yield Path(dirpath), False
        dirnames.sort()


def _without(runs: list[Run], name: str) -> list[Run]:
    """`runs` less the one(s) whose id is `name` or whose source is the path `name`."""
    kept = [r for r in runs if r.run_id != name and not _same_path(r.source, name)]
    if len(kept) == len(runs):
        raise UsageError(f"--exclude {name}: no run found has this id or path")
    return kept


def _same_path(source: str, name: str) -> bool:
    return source == name or Path(source).resolve() == Path(name).resolve()


def _one_per_seed(runs: list[Run]) -> list[Run]:
    """One run per arm/scale/lr/seed, in the order found (see _the_completed_one for several)."""
    groups: dict[tuple, list[Run]] = {}
    for run in runs:
        groups.setdefault((run.arm, run.scale, run.lr, run.seed), []).append(run)
    kept = {id(same[0] if len(same) == 1 else _the_completed_one(same)) for same in groups.values()}
    return [r for r in runs if id(r) in kept]


def _the_completed_one(same: list[Run]) -> Run:
    """Of runs with the same arm/scale/lr/seed (a copy of a run, a relaunch killed on its way), the one
    that completed; the others are set aside, said on stderr. With none completed, or several, which
    one counts is for the user to say."""
    completed = [r for r in same if r.state == "completed"]
    if len(completed) != 1:
        a, b = same[0], same[1]
        raise UsageError(
            f"{b.source}: same arm/scale/lr/seed as {a.source} ({a.arm}, {a.scale}, lr={a.lr}, seed={a.seed}), "
            f"and {len(completed)} of the {len(same)} completed; leave the others out with --exclude ID|PATH"
        )
    for run in same:
        if run is not completed[0]:
            print(f"set aside {run.source} ({run.state}): same arm/scale/lr/seed as {completed[0].source} "
                  "(completed)", file=sys.stderr)
    return completed[0]


# ---------------------------------------------------------------------------------------------
# run directories


def load_run_dir(path: Path) -> Run:
    cfg = read_config(path)
    state = str(read_json(path / STATUS_FILE).get("state") or "unknown")
    run = build_run(cfg, read_metrics(path), state, read_manifest(path), source=str(path), run_id=cfg.name or path.name)
    return replace(run, downstream=downstream_of(read_eval(path)))


def downstream_of(evals: dict[int, dict]) -> dict[str, float]:
    """"task/metric" -> value at the newest evaluated step (where the run's final loss is, for a
    finished run evaluated after training); perplexity is left out: it is no accuracy."""
    if not evals:
        return {}
    entry = evals[max(evals)]
    return {f"{task}/{name}": float(m["value"]) for task, result in sorted(entry.get("tasks", {}).items())
            for name, m in result.get("metrics", {}).items() if name.startswith("acc")}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# shared: records + config -> Run


def build_run(
    cfg: RunConfig,
    records: list[dict[str, Any]],
    state: str,
    manifest: dict[str, Any],
    source: str,
    run_id: str,
) -> Run:
    params, flops = _accounting(cfg, manifest)
    imported = manifest.get("import")
    lr = imported.get("lr") if isinstance(imported, dict) else cfg.train.lr
    return Run(
        run_id=run_id,
        source=source,
        arm=cfg.arm_label,
        scale=cfg.scale or "unknown",
        seed=cfg.seed,
        lr=None if lr is None else float(lr),
        state=state,
        val=val_curve(records),
        params=params,
        flops_per_token=flops,
        first_nonfinite_train_step=_first_nonfinite_step(records, TRAIN_KEY),
        diverged_event_step=next((int(r["step"]) for r in records if r.get("event") == "diverged"), None),
        sweep=cfg.sweep,
    )


def _accounting(cfg: RunConfig, manifest: dict[str, Any]) -> tuple[int | None, int | None]:
    """(non-embedding params, training FLOPs/token): the manifest's numbers; an imported run's
    manifest may say null (unknown), and then nothing is guessed from the placeholder config."""
    acc = manifest.get("accounting") or {}
    if "import" in manifest or ("non_embedding_params" in acc and "flops_per_token" in acc):
        return _opt_int(acc.get("non_embedding_params")), _opt_int(acc.get("flops_per_token"))
    from nlq_scale.model.accounting import count_parameters, flops_per_token

    return count_parameters(cfg.model).non_embedding, flops_per_token(cfg.model)


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def val_curve(records: list[dict[str, Any]]) -> Curve:
    """Validation points by step; a step logged twice (replayed after a resume) keeps its last value."""
    by_step: dict[int, tuple[float, float]] = {}
    for r in records:
        if r.get(VAL_KEY) is None:
            continue
        tokens = r.get("tokens")
        by_step[int(r["step"])] = (float(r[VAL_KEY]), math.nan if tokens is None else float(tokens))
    steps = sorted(by_step)
    return Curve(
        step=np.array(steps, dtype=np.int64),
        tokens=np.array([by_step[s][1] for s in steps], dtype=float),
        loss=np.array([by_step[s][0] for s in steps], dtype=float),
    )


def _first_nonfinite_step(records: list[dict[str, Any]], key: str) -> int | None:
    bad = [int(r["step"]) for r in records if r.get(key) is not None and not math.isfinite(float(r[key]))]
    return min(bad) if bad else None


def _is_training_config(raw: dict[str, Any]) -> bool:
    return isinstance(raw.get("model"), dict)


def _config_from_mapping(raw: dict[str, Any], source: str) -> RunConfig:
    """A W&B config holds the RunConfig dump plus W&B's own keys (`_wandb`, ...): keep ours."""
    ours = {k: v for k, v in raw.items() if k in RunConfig.model_fields}
    return build_run_config(ours, source)


# ---------------------------------------------------------------------------------------------
# W&B


@dataclass(frozen=True)
class _WandbSegment:
    """One offline W&B run directory. A resumed run (same W&B id) leaves one segment per attempt."""

    path: Path
    wandb_id: str
    started: str
    summary: dict[str, Any]
    records: list[dict[str, Any]]


def load_wandb_offline(paths: list[Path]) -> list[Run]:
    """Offline W&B runs (run directories or .wandb files), read with `wandb leet inspect`. Segments
    of one resumed run are joined in start order (a replayed step keeps the later value). W&B runs
    that are not training runs (no `model` in the config, e.g. `compare --wandb`'s own) are skipped."""
    by_id: dict[str, list[_WandbSegment]] = {}
    for path in paths:
        seg = _read_segment(path)
        if seg is not None:
            by_id.setdefault(seg.wandb_id, []).append(seg)
    return [_join_segments(sorted(segs, key=lambda s: s.started)) for _, segs in sorted(by_id.items())]


def _read_segment(path: Path) -> _WandbSegment | None:
    summary = json.loads(_leet(path, "--summary", "--json"))
    if not _is_training_config(summary.get("config") or {}):
        return None
    records = []
    for line in _leet(path, "--json").splitlines():
        rec = json.loads(line)
        if rec.get("type") == "history":
            records.append(_wandb_row(rec["history"]["item"]))
    wandb_id = str(summary.get("run_id") or path)
    return _WandbSegment(path, wandb_id, str(summary.get("start_time") or ""), summary, records)


def _join_segments(segments: list[_WandbSegment]) -> Run:
    last = segments[-1]
    cfg = _config_from_mapping(last.summary.get("config") or {}, str(last.path))
    state = _wandb_state(last.summary.get("summary") or {}, last.summary.get("state"), last.summary.get("exit_code"))
    records = [r for seg in segments for r in seg.records]
    return build_run(cfg, records, state, {}, source=str(last.path), run_id=cfg.name or last.wandb_id)


def _leet(path: Path, *flags: str) -> str:
    env = {**os.environ, "WANDB_SILENT": "true"}
    cmd = [sys.executable, "-m", "wandb", "leet", "inspect", *flags, str(path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0:
        reason = (proc.stderr.strip().splitlines() or ["unreadable"])[-1]
        raise UsageError(f"{path}: cannot read W&B run ({reason})")
    return proc.stdout


def _wandb_row(item: dict[str, Any]) -> dict[str, Any]:
    """A history row in metrics.jsonl's shape. The train loop logs with `step=` (W&B's `_step`)
    rather than a `step` key; W&B writes non-finite numbers as the strings NaN/Infinity/-Infinity."""
    row = {k: v for k, v in item.items() if not k.startswith("_")}
    for key in (VAL_KEY, TRAIN_KEY):
        if isinstance(row.get(key), str):
            row[key] = float(row[key])
    row.setdefault("step", item.get("_step", 0))
    return row


def _wandb_state(run_summary: dict[str, Any], wandb_state: Any, exit_code: Any = None) -> str:
    """The train loop's own final state (it writes summary["state"]), else W&B's run state."""
    if run_summary.get("state") in STATES:
        return str(run_summary["state"])
    state = str(wandb_state or "unknown").lower()
    if state == "finished" and exit_code not in (None, 0):
        return "failed"
    return WANDB_STATES.get(state, state)


def _load_online(project: str, group: str | None) -> list[Run]:
    import wandb

    try:
        api_runs = list(wandb.Api().runs(project, filters={"group": group} if group else None))
    except Exception as e:  # the public API raises several types for auth/network/unknown project
        raise UsageError(f"{WANDB_PREFIX}{project}: cannot list W&B runs ({e})") from None
    runs = []
    for r in api_runs:
        if not _is_training_config(dict(r.config)):
            continue
        source = f"{WANDB_PREFIX}{project}/{r.id}"
        records = [_wandb_row(row) for row in r.scan_history(keys=["_step", VAL_KEY, "tokens"])]
        cfg = _config_from_mapping(dict(r.config), source)
        state = _wandb_state(dict(r.summary), r.state)
        runs.append(build_run(cfg, records, state, {}, source=source, run_id=cfg.name or r.id))
    return runs

"""CSV input: numeric columns with one-line errors, and `import-csv`, which turns a CSV training log
(columns step, val_loss, optional train_loss and tokens) into a run directory that follows the
train contract, so runs produced elsewhere are compared like ours."""

from __future__ import annotations

import csv
import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

from nlq_scale import __version__
from nlq_scale.arms import baseline
from nlq_scale.config.load import build_run_config
from nlq_scale.config.schema import ARMS
from nlq_scale.errors import UsageError
from nlq_scale.files import staged_dir
from nlq_scale.train.rundir import write_config, write_manifest, write_metrics, write_status

Column = list[float | None]  # None = empty cell (not recorded on that row)


def read_csv_columns(path: Path, required: list[str], optional: list[str] = ()) -> dict[str, Column]:
    """The named numeric columns of a CSV with a header row. Empty cells read as None."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"{path}: cannot read ({getattr(e, 'strerror', None) or e})") from None
    rows = list(csv.reader(text.splitlines()))
    if not rows or not any(cell.strip() for cell in rows[0]):
        raise UsageError(f"{path}: empty CSV (no header row)")
    header = [h.strip() for h in rows[0]]
    missing = [c for c in required if c not in header]
    if missing:
        raise UsageError(f"{path}: missing column(s) {', '.join(missing)} (columns: {', '.join(header)})")
    body = [(n, row) for n, row in enumerate(rows[1:], start=2) if any(cell.strip() for cell in row)]
    if not body:
        raise UsageError(f"{path}: no data rows")
    wanted = [c for c in (*required, *optional) if c in header]
    out: dict[str, Column] = {c: [] for c in wanted}
    for line, row in body:
        if len(row) != len(header):
            raise UsageError(f"{path}: line {line}: {len(row)} fields, the header has {len(header)}")
        for c in wanted:
            out[c].append(_number(row[header.index(c)], path, line, c))
    return out


def _number(cell: str, path: Path, line: int, column: str) -> float | None:
    cell = cell.strip()
    if not cell:
        return None
    try:
        return float(cell)
    except ValueError:
        raise UsageError(f"{path}: line {line}: column {column}: {cell!r} is not a number") from None


def complete_column(values: Column, path: Path, column: str) -> list[float]:
    """A column that must have a value on every row."""
    for i, v in enumerate(values):
        if v is None:
            raise UsageError(f"{path}: column {column} is empty on data row {i + 1}")
    return values  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# import-csv


@dataclass(frozen=True)
class ImportSpec:
    csv: Path
    arm: str
    scale: str
    seed: int
    out_root: Path
    lr: float | None = None
    params: int | None = None  # non-embedding parameters N
    tokens_per_step: int | None = None


def run_id(spec: ImportSpec) -> str:
    lr = "" if spec.lr is None else f"-lr{spec.lr:g}"
    return f"{spec.arm}-{spec.scale}-seed{spec.seed}{lr}"


def import_csv(spec: ImportSpec) -> Path:
    """Write the run directory <out_root>/imported/<run_id>/ and return it; an existing one is
    never overwritten."""
    cols = read_csv_columns(spec.csv, ["step", "val_loss"], ["train_loss", "tokens"])
    steps = complete_column(cols["step"], spec.csv, "step")
    if any(s != int(s) or s < 0 for s in steps):
        raise UsageError(f"{spec.csv}: column step must hold non-negative integers")
    if all(v is None for v in cols["val_loss"]):
        raise UsageError(f"{spec.csv}: column val_loss has no values")
    records = _records(cols, spec)
    dest = spec.out_root / "imported" / run_id(spec)
    if dest.exists():
        raise UsageError(f"{dest}: already exists (remove it or import under another --out)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with staged_dir(dest) as tmp:
        _write_run_dir(tmp, spec, records)
    return dest


def _records(cols: dict[str, Column], spec: ImportSpec) -> list[dict]:
    records = []
    for i, step in enumerate(cols["step"]):
        tokens = cols["tokens"][i] if "tokens" in cols else None
        if tokens is None and spec.tokens_per_step is not None:
            tokens = step * spec.tokens_per_step
        rec: dict = {"step": int(step), "tokens": None if tokens is None else int(tokens), "time": None}
        for src, key in (("val_loss", "val/loss"), ("train_loss", "train/loss")):
            if src in cols and cols[src][i] is not None:
                rec[key] = cols[src][i]
        records.append(rec)
    return records


def _write_run_dir(run_dir: Path, spec: ImportSpec, records: list[dict]) -> None:
    last = max(r["step"] for r in records)
    cfg = build_run_config(
        {
            "name": run_id(spec),
            "sweep": "imported",
            "scale": spec.scale,
            "variant": spec.arm,
            "seed": spec.seed,
            # the placeholder model is never used for accounting: manifest.import says what is known
            "model": {"arm": spec.arm if spec.arm in ARMS else baseline().name},
            "train": {"steps": max(last, 1), **({"lr": spec.lr} if spec.lr is not None else {})},
        },
        source="import-csv",
    )
    p = spec.params
    manifest = {
        "package": {"name": "nlq-scale", "version": __version__},
        "import": {
            "source": str(spec.csv.resolve()),
            "sha256": hashlib.sha256(spec.csv.read_bytes()).hexdigest(),
            "lr": spec.lr,
            "params": p,
            "tokens_per_step": spec.tokens_per_step,
        },
        # C = 6 N D (Kaplan et al.) when only N is known
        "accounting": {"params": p, "non_embedding_params": p, "flops_per_token": None if p is None else 6 * p},
    }
    final_tokens = next((r["tokens"] for r in reversed(records) if r["tokens"] is not None), None)
    now = time.time()
    status = {"state": "completed", "step": last, "tokens": final_tokens, "last_checkpoint": None, "error": None,
              "total_steps": last, "slurm_job_id": None, "num_nodes": None, "started_at": None,
              "updated_at": now, "elapsed_s": None}
    write_config(run_dir, cfg)
    write_manifest(run_dir, manifest)
    write_status(run_dir, status)
    write_metrics(run_dir, records)

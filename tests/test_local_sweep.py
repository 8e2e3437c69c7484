"""A sweep run with the local executor, end to end: a progress line per run in the terminal, W&B runs
grouped by sweep and arm (read back from the offline files), and a non-zero exit when a run fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import AUTO_ALLOCATOR, nlq

TWO_STEPS = ("train.steps=2", "train.warmup_steps=1", "train.eval_every=2", "checkpoint.every=2")


def _submit_local(root: Path, data: Path, *extra: str):
    return nlq("submit", "smoke", "--executor", "local", "--root", str(root), "--only", "cpu-xs-nonlinear-s1234-*",
               f"data.path={data}", *TWO_STEPS, *extra)


def _wandb_run_record(run_dir: Path) -> dict:
    (offline,) = sorted((run_dir / "wandb").glob("offline-run-*"))
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(offline)],
                         capture_output=True, text=True, timeout=300, check=True)
    return next(r["run"] for r in map(json.loads, out.stdout.splitlines()) if r.get("type") == "run")


@pytest.mark.slow
def test_local_sweep_shows_progress_and_groups_wandb_runs(tmp_path, sample_dataset):
    r = _submit_local(tmp_path, sample_dataset)
    assert r.returncode == 0, r.stderr[-3000:]
    run_id = "cpu-xs-nonlinear-s1234-lr0.003"
    assert f"{run_id}: step 2/2, loss " in r.stderr and "-> completed" in r.stderr
    run = _wandb_run_record(tmp_path / "smoke" / run_id)
    assert (run["run_group"], run["job_type"]) == ("smoke", "nonlinear")
    assert {"scale:cpu-xs", "seed:1234", "lr:0.003", "arm:nonlinear"} <= set(run["tags"])
    # the job's task restarted itself on tcmalloc where it is installed (runtime.cpu_allocator: auto)
    manifest = json.loads((tmp_path / "smoke" / run_id / "manifest.json").read_text())
    assert manifest["allocator"] == AUTO_ALLOCATOR


@pytest.mark.slow
def test_a_local_run_that_fails_fails_the_command(tmp_path, sample_dataset):
    """A run asking for CUDA on a machine without it (submit cannot know the node) ends without
    completing: submit exits 1 and names it."""
    r = _submit_local(tmp_path, sample_dataset, "runtime.device=cuda")
    assert r.returncode == 1, r.stderr[-3000:]
    assert "1 of 1 local runs did not complete: cpu-xs-nonlinear-s1234-lr0.003" in r.stderr


@pytest.mark.slow
def test_a_sweep_with_eval_evaluates_each_run_after_training(tmp_path, sample_dataset):
    """Sweep key `eval`: the local executor scores each completed run right after it trains."""
    sweep = tmp_path / "eval-sweep.yaml"
    sweep.write_text(
        "name: evalsweep\ncluster: local\nscales: [cpu-xs]\narms: [linear]\nseeds: [1]\n"
        f"data: {{path: {sample_dataset}, seed: 0}}\n"
        "eval: {tasks: [nlq_cloze, nlq_lastword], limit: 5}\n"
    )
    r = nlq("submit", str(sweep), "--executor", "local", "--root", str(tmp_path / "runs"), *TWO_STEPS)
    assert r.returncode == 0, r.stderr[-3000:]
    (run_dir,) = [p for p in (tmp_path / "runs" / "evalsweep").iterdir() if p.is_dir() and p.name[0] not in "_."]
    (entry,) = json.loads((run_dir / "eval.json").read_text()).values()
    assert entry["step"] == 2 and {t: v["n"] for t, v in entry["tasks"].items()} == {"nlq_cloze": 5, "nlq_lastword": 5}

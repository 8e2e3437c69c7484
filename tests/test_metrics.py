"""metrics.jsonl is the source of truth and W&B its offline mirror; W&B failing never stops training."""

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO, last_by_step, read_metrics

ARGS = ["--scale", "cpu-xs", "--arm", "nonlinear", "train.steps=12", "train.eval_every=6"]


def train(run_dir, data, *extra, env=None):
    return subprocess.run(
        [sys.executable, "-m", "nlq_scale.cli", "train", *ARGS, "--run-dir", str(run_dir), f"data.path={data}", *extra],
        capture_output=True, text=True, cwd=REPO, timeout=600, env=os.environ | (env or {}),
    )  # fmt: skip


@pytest.mark.slow
def test_offline_wandb_run_mirrors_metrics_jsonl(sample_dataset, tmp_path):
    from nlq_scale.analysis.runs import load_wandb_offline

    run_dir = tmp_path / "run"
    r = train(run_dir, sample_dataset, "logging.wandb=true")
    assert r.returncode == 0, r.stderr[-2000:]
    offline = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(offline) == 1
    (mirrored,) = load_wandb_offline(offline)
    truth = last_by_step(read_metrics(run_dir), "val/loss")
    assert dict(zip(mirrored.val.step.tolist(), mirrored.val.loss.tolist())) == truth
    assert (mirrored.arm, mirrored.scale, mirrored.state) == ("nonlinear", "cpu-xs", "completed")


@pytest.mark.slow
def test_failing_wandb_never_stops_training(sample_dataset, tmp_path):
    run_dir = tmp_path / "run"
    # Online mode with no credentials and no network: wandb.init fails; training must not.
    env = {"WANDB_MODE": "online", "WANDB_API_KEY": "", "HOME": str(tmp_path), "WANDB_INIT_TIMEOUT": "20"}
    r = train(run_dir, sample_dataset, "logging.wandb=true", "logging.wandb_mode=online", env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "W&B mirror disabled" in r.stderr
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "completed"
    assert last_by_step(read_metrics(run_dir), "val/loss").keys() == {6, 12}

"""The sweep commands' user-facing behaviour: `submit --only`, `submit` refusing what `train` would
refuse, sbatch options from the cluster file, `status --watch`, `cancel`, and the per-run progress line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, nlq

SMOKE = ("smoke", "train.steps=2", "train.warmup_steps=1", "train.eval_every=2", "checkpoint.every=2")


def _dry_run(tmp_path: Path, data: Path, *args: str):
    return nlq("submit", *SMOKE, "--root", str(tmp_path), "--dry-run", "--json", f"data.path={data}", *args)


def test_submit_only_keeps_matching_runs(tmp_path, sample_dataset):
    r = _dry_run(tmp_path, sample_dataset, "--only", "cpu-xs-*", "--only", "*-nonlinear-*")
    assert r.returncode == 0, r.stderr
    ids = [run["run_id"].rsplit("-lr", 1)[0] for run in json.loads(r.stdout)["runs"]]
    kept = ["cpu-xs-linear", "cpu-xs-nonlinear", "cpu-s-nonlinear", "cpu-m-nonlinear"]
    assert ids == [f"{run}-s{seed}" for run in kept for seed in (1234, 2345)]


def test_submit_only_that_matches_nothing_names_the_runs(tmp_path, sample_dataset):
    r = _dry_run(tmp_path, sample_dataset, "--only", "350m-*")
    assert r.returncode == 2
    assert "--only 350m-*: matches none" in r.stderr and "cpu-xs-linear-s1234" in r.stderr


def test_submit_refuses_a_validation_set_the_layout_cannot_split(tmp_path):
    """train's preflight refuses a validation set the data-parallel ranks cannot split evenly; submit says so first."""
    r = nlq("submit", "paper-124m", "--root", str(tmp_path), "--dry-run", "data.val_sequences=60")
    assert r.returncode == 2
    assert "data.val_sequences (60) must be a multiple of the data-parallel size (8)" in r.stderr
    assert not (tmp_path / "paper-124m").exists()


def test_submit_refuses_an_unknown_eval_task_before_queueing_anything(tmp_path, sample_dataset):
    sweep = yaml.safe_load((REPO / "configs" / "sweeps" / "smoke.yaml").read_text())
    path = tmp_path / "evaluated.yaml"
    path.write_text(yaml.safe_dump(sweep | {"eval": {"tasks": ["nlq_cloze", "hellaswg"]}}))
    r = nlq("submit", str(path), "--root", str(tmp_path / "runs"), "--executor", "local", f"data.path={sample_dataset}")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and "eval.tasks: hellaswg: unknown lm-eval task" in r.stderr
    assert not (tmp_path / "runs").exists()


def _cluster_file(tmp_path: Path, **extra) -> Path:
    raw = yaml.safe_load((REPO / "configs" / "clusters" / "example-8x80gb.yaml").read_text()) | extra
    path = tmp_path / "my-cluster.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture
def fake_srun(tmp_path, monkeypatch):
    """submitit's SLURM executor wants an `srun` on PATH; these tests only render sbatch scripts, so
    they must not depend on whether an earlier test installed SLURM on this machine."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "bin" / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")


def sbatch_script(executor) -> str:
    return executor._executor._make_submission_file_text("true", "uid")  # what sbatch would be given


def test_sbatch_options_come_from_the_cluster_file(tmp_path, fake_srun):
    from nlq_scale.cluster.executors import make_executor
    from nlq_scale.cluster.plan import Layout, load_cluster

    cluster = load_cluster(str(_cluster_file(tmp_path, exclusive=True, gres="gpu:8", exclude="node[07,12]",
                                             account="proj42", qos="high")))
    layout = Layout(nodes=2, tasks_per_node=8, tp=1, pp=1, dp=16, micro_batch_size=4, grad_accum=1,
                    recompute="selective", sequence_parallel=False)
    executor = make_executor("slurm", tmp_path / "submitit", cluster, layout, "ladder-124m")
    script = sbatch_script(executor)
    for line in ("--exclusive", "--gres=gpu:8", "--exclude='node[07,12]'", "--account=proj42", "--qos=high",
                 "--nodes=2", "--ntasks-per-node=8"):
        assert f"#SBATCH {line}\n" in script, line
    assert "--gpus-per-node" not in script  # gres asks for the GPUs instead


@pytest.mark.parametrize(("gres", "line"), [(None, "--gpus-per-node=1"), ("gpu:8", "--gres=gpu:1"),
                                            ("gpu:a100:8", "--gres=gpu:a100:1"), ("gpu:a100", "--gres=gpu:a100")])
def test_an_evaluation_job_asks_for_one_gpu_after_its_training_job(tmp_path, fake_srun, gres, line):
    from nlq_scale.cluster.executors import eval_executor
    from nlq_scale.cluster.plan import load_cluster

    cluster = load_cluster(str(_cluster_file(tmp_path, gres=gres, account="proj42")))
    script = sbatch_script(eval_executor("slurm", tmp_path / "submitit", cluster, "ladder", after="123_4"))
    for expected in (line, "--dependency=afterok:123_4", "--account=proj42", "--ntasks-per-node=1"):
        assert f"#SBATCH {expected}\n" in script, expected
    assert sum(ln.startswith(("#SBATCH --gres", "#SBATCH --gpus")) for ln in script.splitlines()) == 1


def test_a_misspelt_sbatch_option_in_the_cluster_file_is_refused(tmp_path, sample_dataset):
    path = _cluster_file(tmp_path, exclusiv=True)
    r = nlq("plan", "ladder", "--cluster", str(path))
    assert r.returncode == 2
    assert "exclusiv" in r.stderr and str(path) in r.stderr


def test_plan_help_lists_known_sweeps_clusters_and_an_example():
    r = nlq("plan", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())  # argparse wraps the help
    assert "ladder, lr-transfer-cpu, paper-124m, smoke" in text and "example-8x80gb, local" in text
    assert "example:\n  nlq-scale plan ladder" in r.stdout


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, sample_dataset) -> Path:
    run = tmp_path_factory.mktemp("finished") / "sweep" / "one"
    r = nlq("train", "--scale", "cpu-xs", "--arm", "linear", "--run-dir", str(run), f"data.path={sample_dataset}",
            "train.steps=2", "train.warmup_steps=1", "train.eval_every=2", "checkpoint.every=2")
    assert r.returncode == 0, r.stderr
    return run


@pytest.mark.slow  # the trained run takes > 20 s
def test_progress_line_shows_step_loss_speed_and_eta(finished_run):
    from nlq_scale.cluster.progress import progress_line

    line = progress_line("one", finished_run)
    assert line.startswith("one: step 2/2, loss ")
    assert " tok/s, ETA 0:00:00" in line


@pytest.mark.slow  # the trained run takes > 20 s
def test_status_watch_ends_when_no_run_is_live(finished_run):
    r = nlq("status", str(finished_run.parent), "--watch", "0.1", timeout=60)
    assert r.returncode == 0, r.stderr
    assert "one" in r.stdout and "completed" in r.stdout


@pytest.mark.slow  # the trained run takes > 20 s
def test_cancel_without_jobs_cancels_nothing(finished_run):
    r = nlq("cancel", str(finished_run.parent), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["cancelled"] == []

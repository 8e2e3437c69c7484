"""logging.profile_steps: a profiled window of a real run leaves a summary per rank and rank 0's trace."""

import gzip
import json

import pytest

from nlq_scale.train.profiling import busy_seconds
from tests.conftest import nlq
from tests.test_train import train_args


def test_busy_time_counts_overlapping_kernels_once():
    # [0, 10) and [5, 20) overlap on two streams; [30, 40) stands alone; [32, 35) lies inside it.
    assert busy_seconds([(30.0, 40.0), (0.0, 10.0), (5.0, 20.0), (32.0, 35.0)]) == pytest.approx(30e-6)
    assert busy_seconds([]) == 0.0


def test_profiled_window_writes_summary_and_trace(sample_dataset, tmp_path):
    run_dir = tmp_path / "profiled"
    r = nlq(*train_args(run_dir, sample_dataset), "train.steps=4", "train.warmup_steps=1", "logging.profile_steps=[2,3]", "--nproc", "1")
    assert r.returncode == 0, r.stderr
    summary = json.loads((run_dir / "profile" / "rank0.json").read_text())
    assert summary["steps"] == [2, 3]
    assert summary["seconds_per_step"] > 0 and summary["host_ops_per_step"] > 100
    assert any(op["op"] == "aten::mm" and op["calls_per_step"] > 0 for op in summary["top_host_ops"])
    assert "device_busy_fraction" not in summary  # a CPU run has no device timeline
    with gzip.open(run_dir / "profile" / "rank0.trace.json.gz", "rt") as f:
        assert any(e.get("name") == "aten::mm" for e in json.load(f)["traceEvents"])


def test_reversed_profile_window_is_refused(sample_dataset, tmp_path):
    r = nlq(*train_args(tmp_path / "never", sample_dataset), "logging.profile_steps=[3,2]")
    assert r.returncode == 2 and "logging.profile_steps" in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert not (tmp_path / "never").exists()


def test_window_past_the_last_step_ends_with_the_run(sample_dataset, tmp_path):
    run_dir = tmp_path / "short"
    r = nlq(*train_args(run_dir, sample_dataset), "train.steps=3", "train.warmup_steps=1",
            "logging.profile_steps=[2,9]", "--nproc", "1")  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert json.loads((run_dir / "profile" / "rank0.json").read_text())["steps"] == [2, 3]

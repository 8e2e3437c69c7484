"""Runs that hang or vanish show `stale` and are resubmitted on request; concurrent submissions of a
sweep submit each run once (the sweep lock), and `status` reads run dirs while they are written."""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nlq_scale.cluster import executors
from nlq_scale.cluster.plan import load_cluster
from nlq_scale.cluster.status import collect
from nlq_scale.train.rundir import STALE_FLOOR_S, Status, is_stale
from tests.test_cluster_jobs import planned, toy_loss, toy_train
from tests.conftest import ended, nlq
from tests.test_cluster_slurm import (  # noqa: F401 - fixtures: the session's local SLURM and dataset
    START, events, job_processes, local_slurm, one_arm_sweep, prepared_data, slurm_cluster, submit_real, wait_done,
    wait_step,
)


def write_status(run_dir: Path, **fields) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    doc = {"state": "running", "step": 7, "total_steps": 30} | fields
    (run_dir / "status.json").write_text(json.dumps(doc))


def fake_local_controller() -> subprocess.Popen:
    """A process that the local executor's liveness check takes for a job controller."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "submitit.local._local"])
    deadline = time.time() + 30
    while not executors.local_job_alive(str(proc.pid)):  # until its exec shows in /proc
        assert time.time() < deadline
        time.sleep(0.01)
    return proc


def test_every_status_write_is_a_heartbeat_with_the_slowest_step_time(tmp_path):
    status = Status(tmp_path, total_steps=10, num_nodes=1)
    before = time.time()
    status.update(state="running")
    time.sleep(0.05)
    status.update(step=1)
    last_write = time.time()
    status.update(step=2)
    after = time.time()
    doc = json.loads((tmp_path / "status.json").read_text())
    assert last_write <= doc["heartbeat_at"] <= after  # the last write's time, however slow the machine
    assert 0.05 <= doc["step_time_s"] <= after - before  # the slower of the two intervals: the slept one
    assert not is_stale(doc)


def test_old_heartbeat_shows_stale_with_a_bound_from_the_step_time(tmp_path):
    root = tmp_path / "runs"
    now = time.time()
    write_status(root / "hung", heartbeat_at=now - STALE_FLOOR_S - 60, step_time_s=1.0)
    write_status(root / "slow", heartbeat_at=now - STALE_FLOOR_S - 60, step_time_s=60.0)  # bound 600 s
    write_status(root / "done", state="completed", heartbeat_at=now - 10_000, step_time_s=1.0)
    states = {row["run"]: row["state"] for row in collect(root)}
    assert states == {"hung": "stale", "slow": "running", "done": "completed"}
    assert {row["run"]: row["state"] for row in collect(root, stale_s=30)}["slow"] == "stale"


def test_stale_run_is_skipped_unless_retry_stale_which_cancels_its_job(tmp_path):
    runs = planned(tmp_path / "data")[:1]
    root = tmp_path / "runs"
    run_dir = runs[0].spec.run_dir(root)
    write_status(run_dir, heartbeat_at=time.time() - 3600, step_time_s=1.0)
    controller = fake_local_controller()
    try:
        (run_dir / "job.json").write_text(json.dumps({"executor": "local", "job_id": str(controller.pid)}))
        (skip,) = executors.decide(runs, root, retry_failed=False)
        assert skip.action == "skip" and "stale" in skip.reason and "--retry-stale" in skip.reason
        (retry,) = executors.decide(runs, root, retry_failed=False, retry_stale=True)
        assert retry.action == "retry" and retry.cancel["job_id"] == str(controller.pid)
        executors.cancel_job(retry.cancel)
        assert controller.wait(timeout=10) != 0  # terminated by the cancellation
    finally:
        controller.kill()


def test_a_cancelled_job_must_have_ended_before_its_run_is_resubmitted():
    """scancel returns at once while the job's processes run on (SIGTERM: a step and a checkpoint
    save, up to KillWait): submit waits until the job has left the queue, and gives up on the run
    when it never does."""
    from nlq_scale.errors import RunFailure

    controller = fake_local_controller()
    job = {"executor": "local", "job_id": str(controller.pid)}
    try:
        with pytest.raises(RunFailure, match=f"job {controller.pid} still in the queue 1 s after it was cancelled"):
            executors.wait_ended([job], timeout_s=1)
        executors.cancel_job(job)
        executors.wait_ended([job], timeout_s=30)
        assert controller.poll() is not None or ended(controller.pid)
    finally:
        controller.kill()


@pytest.mark.parametrize("payload_is_code", [False, True])
def test_status_reads_job_results_as_data_only(tmp_path, payload_is_code):
    from submitit.core.utils import JobPaths

    from tests.test_train_reliability import Payload

    run_dir, folder, marker = tmp_path / "run", tmp_path / "submitit", tmp_path / "payload-ran"
    run_dir.mkdir()
    folder.mkdir()
    job = {"executor": "local", "job_id": "999999999", "folder": str(folder)}  # no such process: ended
    (run_dir / "job.json").write_text(json.dumps(job))
    error = Payload(marker) if payload_is_code else "Traceback (most recent call last):\nRuntimeError: boom"
    JobPaths(folder, job_id=job["job_id"], task_id=0).result_pickle.write_bytes(pickle.dumps(("error", error)))
    (row,) = collect(run_dir)
    assert (row["state"], row["error"]) == (("dead", None) if payload_is_code else ("failed", "RuntimeError: boom"))
    assert not marker.exists()


def test_a_run_that_died_on_a_full_disk_shows_dead_with_the_jobs_error(tmp_path):
    """Found by benchmarks/chaos.py: a disk that fills between checkpoints fails the step's status.json
    write, so the run cannot record `failed`; it stays `running` with its job gone. `status` shows it
    dead with the error submitit kept elsewhere (its folder), which tells the user to free space."""
    from submitit.core.utils import JobPaths

    run_dir, folder = tmp_path / "run", tmp_path / "submitit"
    folder.mkdir()
    write_status(run_dir, heartbeat_at=time.time())
    job = {"executor": "local", "job_id": "999999999", "folder": str(folder)}  # no such process: ended
    (run_dir / "job.json").write_text(json.dumps(job))
    error = "Traceback (most recent call last):\nOSError: [Errno 28] No space left on device"
    JobPaths(folder, job_id=job["job_id"], task_id=0).result_pickle.write_bytes(pickle.dumps(("error", error)))
    (row,) = collect(run_dir)
    assert (row["state"], row["error"]) == ("dead", "OSError: [Errno 28] No space left on device")


def test_a_run_dir_on_a_full_disk_stops_the_submission_before_any_job_is_queued(tmp_path):
    """Found by benchmarks/chaos.py: `submit --retry-failed` while a run's disk was still full queued
    its job, then died with a traceback writing job.json, leaving a job no `status` or `submit` knew
    of. Every run dir takes a probe write first; one that cannot stops the submission in one line."""
    from nlq_scale.errors import RunFailure

    runs = planned(tmp_path / "data")[:2]
    root = tmp_path / "runs"
    full = runs[1].spec.run_dir(root)
    full.mkdir(parents=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(full)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    queued = []
    try:
        subprocess.run(["dd", "if=/dev/zero", f"of={full / 'filler'}", "bs=64k"], capture_output=True)  # until ENOSPC
        with pytest.raises(RunFailure, match=rf"^{full}: cannot write there \(No space left on device\); nothing "):
            executors.submit(executors.decide(runs, root, retry_failed=False), load_cluster("local-slurm"), "local", root, "test",
                             train_fn=lambda cfg, run_dir: queued.append(run_dir))  # fmt: skip
        assert queued == [] and not list(root.rglob("job.json"))
    finally:
        subprocess.run(["umount", "-l", str(full)], capture_output=True)


def test_a_second_submission_of_a_sweep_waits_for_the_first(tmp_path):
    order = []

    def second():
        with executors.sweep_lock(tmp_path, "sweep-a"):
            order.append("second")

    with executors.sweep_lock(tmp_path, "sweep-a"):
        other = threading.Thread(target=second)
        other.start()
        with executors.sweep_lock(tmp_path, "sweep-b"):  # another sweep: not held up
            order.append("other sweep")
        time.sleep(0.3)
        order.append("first")
    other.join(timeout=10)
    assert order == ["other sweep", "first", "second"]


def test_a_requeued_run_whose_old_process_ended_shows_running_not_dead(tmp_path):
    """Found by benchmarks/chaos.py: on the local cluster every job runs on this host, so a run
    requeued by `scontrol requeue` (its process killed, its job queued again) showed `dead`, and
    `status --watch` ended while the sweep was still in flight."""
    from nlq_scale.cluster.status import run_row

    gone = subprocess.Popen(["true"])
    gone.wait()
    write_status(tmp_path, heartbeat_at=time.time(), pid=gone.pid, host=socket.gethostname())
    (tmp_path / "job.json").write_text(json.dumps({"executor": "slurm", "job_id": "12_3"}))
    assert run_row(tmp_path, tmp_path, job_state="RUNNING")["state"] == "running"  # requeued: started again
    assert run_row(tmp_path, tmp_path, job_state="REQUEUED")["state"] == "pending"
    assert run_row(tmp_path, tmp_path, job_state="")["state"] == "dead"  # left the queue
    assert run_row(tmp_path, tmp_path, job_state=None)["state"] == "dead"  # no scheduler to ask: the process says it

def test_a_run_whose_job_waits_in_the_queue_is_never_stale(tmp_path, monkeypatch):
    """Found by benchmarks/chaos.py: a hung run retried with --retry-stale keeps its old heartbeat
    while its new job waits behind the sweep's other jobs; it showed `stale` again, and every
    --retry-stale cancelled the queued job and queued a new one at the back, never to start."""
    runs = planned(tmp_path / "data")[:1]
    root = tmp_path / "runs"
    run_dir = runs[0].spec.run_dir(root)
    write_status(run_dir, heartbeat_at=time.time() - 3600, step_time_s=1.0)
    (run_dir / "job.json").write_text(json.dumps({"executor": "slurm", "job_id": "116"}))
    for squeue_state, decided, shown in (("PENDING", "skip", "pending"), ("RUNNING", "retry", "stale")):
        monkeypatch.setattr(executors, "slurm_queue_states", lambda ids, s=squeue_state: {"116": s})
        (decision,) = executors.decide(runs, root, retry_failed=False, retry_stale=True)
        assert decision.action == decided, decision.reason
        assert collect(root)[0]["state"] == shown


def test_a_submission_goes_to_the_cluster_of_slurm_conf_without_the_jobs_own_slurm_env(monkeypatch):
    """Found by benchmarks/chaos.py on a second local cluster: submitit's clean_env dropped SLURM_CONF
    with the job's SLURM_* variables, so sbatch queued the sweep on /etc/slurm/slurm.conf's cluster
    while squeue asked SLURM_CONF's, and every run showed `dead`."""
    monkeypatch.setenv("SLURM_CONF", "/var/lib/another-cluster/slurm.conf")
    monkeypatch.setenv("SLURM_JOB_ID", "17")  # submitting from inside a job (the LR search's follow-up)
    seen = executors.launch(lambda: (os.environ.get("SLURM_CONF"), os.environ.get("SLURM_JOB_ID")))
    assert seen == ("/var/lib/another-cluster/slurm.conf", None)
    assert os.environ["SLURM_JOB_ID"] == "17"


@pytest.mark.slow
@pytest.mark.slurm
def test_hung_job_shows_stale_and_retry_stale_cancels_and_resubmits_it(slurm_cluster, tmp_path):
    runs = planned(tmp_path / "data", "train.steps=40")[:1]
    root = tmp_path / "runs"
    cluster = load_cluster("local-slurm")
    run_dir = runs[0].spec.run_dir(root)
    _, (first,) = executors.decide_and_submit(runs, root, "test-two-arm", cluster, "slurm", train_fn=toy_train)
    wait_step(run_dir, 5)
    hung = job_processes(first["job_id"])
    assert len(hung) >= 2  # both ranks, one per emulated node
    for pid in hung:
        os.kill(pid, signal.SIGSTOP)  # alive and allocated, but silent: a hang
    time.sleep(4)
    (row,) = collect(root, stale_s=3)
    assert row["state"] == "stale" and row["heartbeat_age_s"] > 3
    decisions, (second,) = executors.decide_and_submit(runs, root, "test-two-arm", cluster, "slurm",
                                                       retry_stale=True, stale_s=3, train_fn=toy_train)
    assert decisions[0].action == "retry" and second["job_id"] != first["job_id"]
    assert first["job_id"] not in executors.slurm_queue_states([first["job_id"]])  # cancelled, and ended first
    assert wait_done([run_dir], timeout=300)[run_dir] == "completed"
    assert events(run_dir)[-1]["val/loss"] == pytest.approx(toy_loss(40, 2), rel=1e-12)


@pytest.mark.slow
@pytest.mark.slurm
def test_two_submits_at_once_queue_each_run_once_and_status_never_fails(slurm_cluster, tmp_path, monkeypatch):
    secret = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("WANDB_API_KEY", secret)  # in the submitter's environment: must not reach any file
    runs = planned(tmp_path / "data", "train.steps=200")
    root = tmp_path / "runs"
    cluster = load_cluster("local-slurm")
    records: list[list[dict]] = []
    errors: list[BaseException] = []
    watching = True

    def submit():
        try:
            records.append(executors.decide_and_submit(runs, root, "test-two-arm", cluster, "slurm", train_fn=toy_train)[1])
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    def watch():
        while watching:
            try:
                collect(root) if root.exists() else None
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

    threads = [threading.Thread(target=submit) for _ in range(2)]
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        watching = False
        watcher.join(timeout=30)
        job_ids = [r["job_id"] for batch in records for r in batch]
        if job_ids:
            subprocess.run(["scancel", *{j.split("_")[0] for j in job_ids}], capture_output=True)
    assert not errors, errors
    assert sorted(len(batch) for batch in records) == [0, len(runs)]
    assert len(set(job_ids)) == len(runs)
    scripts = list(root.rglob("*_submission.sh"))
    assert scripts and not [p for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def lose_node(node: str, job_id: str) -> None:
    """What a crashed node looks like from the rest of the cluster: its slurmd, the job's step daemon
    and tasks there are gone at once (SIGKILL; the emulated nodes share this host)."""
    pid_file = Path(os.environ["SLURM_CONF"]).parent / f"slurmd-{node}.pid"
    slurmd = int(pid_file.read_text())
    os.kill(slurmd, signal.SIGKILL)
    deadline = time.time() + 30
    while not ended(slurmd):
        assert time.time() < deadline, "slurmd survived SIGKILL"
        time.sleep(0.1)
    # Its pid file stays, as after a crash: start.sh must not take that dead (or reused) pid for this slurmd.
    for pid in job_processes(job_id, node):
        stepd = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        for victim in (pid, stepd):
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.slow
@pytest.mark.slurm
def test_lost_node_run_is_resubmitted_and_resumes_to_the_uninterrupted_loss(
    slurm_cluster, prepared_data, one_arm_sweep, tmp_path
):
    overrides = (f"data.path={prepared_data}", "train.steps=24")  # checkpoints every 10 steps
    (run,) = submit_real(tmp_path / "lost", *overrides, sweep=one_arm_sweep)["runs"]
    run_dir = Path(run["run_dir"])
    try:
        wait_step(run_dir, 12, timeout=600)
        lose_node("node2", run["job_id"])
        # The surviving rank sees its peer vanish: the run stops failed (not `running` forever).
        deadline = time.time() + 120
        while (row := collect(run_dir)[0])["state"] not in ("failed", "stale", "dead"):
            assert time.time() < deadline, row
            time.sleep(1)
        last_good = json.loads((run_dir / "status.json").read_text())["last_checkpoint"]
    finally:
        subprocess.run(["bash", str(START)], capture_output=True, timeout=300, check=True)  # the node comes back
    out = nlq("submit", str(one_arm_sweep), "--root", str(tmp_path / "lost"), "--retry-failed", "--retry-stale",
              "--json", *overrides)  # fmt: skip
    assert out.returncode == 0, out.stderr
    (retry,) = json.loads(out.stdout)["runs"]
    assert retry["action"] == "retry"
    deadline = time.time() + 600  # the run dir still says failed until the new job reaches training
    while executors.read_json(run_dir / "status.json").get("slurm_job_id") != retry["job_id"]:
        assert time.time() < deadline, "the resubmitted job never started training"
        time.sleep(1)
    assert wait_done([run_dir], timeout=600)[run_dir] == "completed"
    (ref,) = submit_real(tmp_path / "reference", *overrides, sweep=one_arm_sweep)["runs"]
    ref_dir = Path(ref["run_dir"])
    assert wait_done([ref_dir], timeout=600)[ref_dir] == "completed"
    resumes = [e for e in events(run_dir) if e.get("event") == "resume"]
    assert [e["checkpoint"] for e in resumes] == [last_good]

    def final_val(d):
        return [e["val/loss"] for e in events(d) if "val/loss" in e][-1]

    assert final_val(run_dir) == final_val(ref_dir)

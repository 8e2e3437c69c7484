"""Submission, requeue and status through submitit's local executor, driven by a small real training
callable of our own (`toy_train`) that keeps train_run's contract: torch.distributed (gloo) across the
job's tasks, status.json / metrics.jsonl in the run dir, USR1/USR2/TERM only set a flag and the step
loop checkpoints and returns "preempted", an exception writes status failed and re-raises.
The real train loop runs through the same path in tests/test_cluster_slurm.py.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import time
from pathlib import Path

import cloudpickle
import pytest
import yaml

from nlq_scale.cluster import executors
from nlq_scale.cluster.job import ReceivedSignals, submitit_handles
from nlq_scale.cluster.plan import load_cluster, plan_sweep
from nlq_scale.cluster.status import collect, format_table
from nlq_scale.cluster.sweep import load_sweep
from nlq_scale.config.schema import RunConfig

REPO = Path(__file__).resolve().parents[1]
TEST_SWEEP = REPO / "configs" / "sweeps" / "test-two-arm.yaml"
FAIL_TAG = "toy-fail"


# ---------------------------------------------------------------- the toy trainer (runs inside jobs)


def toy_loss(steps: int, world: int) -> float:
    """What toy_train's final loss must be, computed without any job, signal or checkpoint."""
    x = 10.0
    for step in range(steps):
        x = _toy_update(x, step, world)
    return x


def _toy_update(x: float, step: int, world: int) -> float:
    contributions = sum((r + 1) * (step + 1) for r in range(world))  # what the all-reduce sums
    return 0.9 * x + 1e-3 * contributions


def toy_train(cfg: RunConfig, run_dir: Path) -> str:
    """train_run's contract in 60 lines: a gloo all-reduce per step, resumable, signal-safe."""
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    # A peer that never arrives fails the job in 2 minutes, not torch's default 30 (which holds both
    # emulated nodes and starves every test queued behind it).
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    stop = {"sig": 0}
    previous = {s: signal.signal(s, lambda n, f: stop.update(sig=n))
                for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)}
    ckpt = run_dir / "toy_ckpt.json"
    state = json.loads(ckpt.read_text()) if ckpt.exists() else {"step": 0, "x": 10.0}
    started = time.time()
    nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", 1))

    def status(**kw):
        if rank == 0:
            doc = {"state": "running", "step": state["step"], "tokens": state["step"] * 512, "last_checkpoint": None,
                   "error": None, "total_steps": cfg.train.steps, "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                   "num_nodes": nodes, "started_at": started, "updated_at": time.time(),
                   "elapsed_s": time.time() - started, "heartbeat_at": time.time(), "step_time_s": 0.2, **kw}
            tmp = run_dir / ".status.tmp"
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, run_dir / "status.json")

    def metric(**kw):
        if rank == 0:
            with (run_dir / "metrics.jsonl").open("a") as f:
                f.write(json.dumps({"step": state["step"], "tokens": state["step"] * 512, "time": time.time(), **kw}) + "\n")

    try:
        metric(event="resume" if state["step"] else "start", world_size=world, job=os.environ.get("SLURM_JOB_ID"))
        while state["step"] < cfg.train.steps:
            if FAIL_TAG in cfg.logging.tags and state["step"] == 3:
                raise RuntimeError("toy failure at step 3")
            t = torch.tensor([float((rank + 1) * (state["step"] + 1)), float(stop["sig"])])
            dist.all_reduce(t[:1])
            dist.all_reduce(t[1:], op=dist.ReduceOp.MAX)  # every rank stops at the same step
            state["x"] = 0.9 * state["x"] + 1e-3 * float(t[0])
            state["step"] += 1
            time.sleep(0.2)
            status()
            if t[1] > 0:
                if rank == 0:
                    ckpt.write_text(json.dumps(state))
                metric(event="preempt", signal=int(t[1]))
                status(state="preempted")
                return "preempted"
        metric(**{"val/loss": state["x"], "event": "end"})
        status(state="completed")
        return "completed"
    except Exception as e:
        status(state="failed", error=f"{type(e).__name__}: {e}")
        raise
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        dist.destroy_process_group()


cloudpickle.register_pickle_by_value(__import__(__name__, fromlist=["_"]))  # jobs need no tests/ on sys.path


# ---------------------------------------------------------------- helpers


def planned(data_dir: Path, *overrides: str, sweep: Path = TEST_SWEEP):
    return plan_sweep(load_sweep(sweep), load_cluster("local-slurm"), [f"data.path={data_dir}", *overrides])


def prepare_text_dataset(tmp: Path, seq_len: int = 64) -> Path:
    """A small real dataset through the real `prepare-data`: stdlib English text, one doc per topic."""
    import pydoc_data.topics

    from tests.conftest import nlq

    docs = tmp / "docs"
    docs.mkdir()
    for i, (_, text) in enumerate(sorted(pydoc_data.topics.topics.items())):
        (docs / f"{i:03d}.txt").write_text(text)
    out = nlq("prepare-data", "--source", "text", "--input", str(docs), "--seq-len", str(seq_len), "--val-docs", "8",
              "--no-progress", "--out", str(tmp / "prepared"))
    assert out.returncode == 0, out.stderr
    return tmp / "prepared"


def wait_states(run_dirs: list[Path], done: set[str], timeout: float) -> dict[Path, str]:
    """Poll `status`'s view of each run (which also sees jobs that died before training) until done."""
    deadline = time.time() + timeout
    while True:
        states = {d: next((row["state"] for row in collect(d)), None) for d in run_dirs}  # None: no run dir yet
        if all(s in done for s in states.values()) or time.time() > deadline:
            return states
        time.sleep(0.5)


# ---------------------------------------------------------------- tests


def test_received_signals_sees_signals_caught_by_other_handlers():
    caught = []
    previous = signal.signal(signal.SIGUSR1, lambda n, f: caught.append(n))
    try:
        with ReceivedSignals() as received:
            signal.raise_signal(signal.SIGUSR1)
        assert caught == [signal.SIGUSR1]
        assert received.signals == {signal.SIGUSR1}
        assert not submitit_handles(signal.SIGUSR2)  # outside a submitit job nothing may be re-raised
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_job_rendezvous_port_is_shared_by_its_tasks_and_below_the_ephemeral_range():
    from nlq_scale.runtime.dist import job_master_port

    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {job: job_master_port(job) for job in [str(i) for i in range(2000)] + ["8_0", "8_1", "1234_17"]}
    assert all(1024 < p < ephemeral_low for p in ports.values())
    assert job_master_port("8_0") == ports["8_0"] != ports["8_1"]  # array tasks: each its own port
    assert len(set(ports.values())) > 1800  # spread: concurrent jobs on one node rarely meet


@pytest.mark.slow
def test_local_executor_runs_completes_and_resubmit_is_a_no_op(tmp_path):
    runs = planned(tmp_path / "data")[:1]
    cluster = load_cluster("local-slurm")
    root = tmp_path / "runs"
    decisions = executors.decide(runs, root, retry_failed=False)
    assert [d.action for d in decisions] == ["submit"]
    records = executors.submit(decisions, cluster, "local", root, "test-two-arm", train_fn=toy_train)
    run_dir = decisions[0].run_dir
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "completed", (run_dir / "status.json").read_text()
    assert status["step"] == runs[0].cfg.train.steps
    job = json.loads((run_dir / "job.json").read_text())
    assert job["executor"] == "local" and job["job_id"] == records[0]["job_id"]
    # What submitit pickled holds the config as plain data (the model is built inside the job) and
    # its requeue checkpoint pickles the same.
    (pickled,) = (root / "test-two-arm" / "_submitit").glob(f"*/{job['job_id']}_submitted.pkl")
    submitted = cloudpickle.loads(pickled.read_bytes()).function
    requeued = cloudpickle.loads(cloudpickle.dumps(submitted.checkpoint().function))
    for fn in (submitted, requeued):
        assert type(fn.config) is dict and fn.run_dir == str(run_dir)
        assert RunConfig.model_validate(fn.config) == runs[0].cfg
    # both planned ranks (2 nodes x 1 task) ran as two local tasks and all-reduced over gloo
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert events[0]["world_size"] == 2
    assert events[-1]["val/loss"] == pytest.approx(toy_loss(runs[0].cfg.train.steps, 2), rel=1e-12)

    again = executors.decide(runs, root, retry_failed=False)
    assert [(d.action, d.reason) for d in again] == [("skip", "completed")]
    assert executors.submit(again, cluster, "local", root, "test-two-arm", train_fn=toy_train) == []

    rows = collect(root)
    assert [(r["run"], r["state"], r["step"], r["total_steps"]) for r in rows] == [
        (f"test-two-arm/{runs[0].spec.run_id}", "completed", 30, 30)
    ]
    assert "1 runs: 1 completed" in format_table(rows)


@pytest.mark.slow
def test_local_failure_shows_failed_and_retry_is_opt_in(tmp_path):
    runs = planned(tmp_path / "data", f"logging.tags=[{FAIL_TAG}]")[:1]
    cluster = load_cluster("local-slurm")
    root = tmp_path / "runs"
    executors.submit(executors.decide(runs, root, False), cluster, "local", root, "t", train_fn=toy_train)
    row = collect(root)[0]
    assert row["state"] == "failed" and row["error"] == "RuntimeError: toy failure at step 3"
    assert [d.action for d in executors.decide(runs, root, retry_failed=False)] == ["skip"]
    assert [d.action for d in executors.decide(runs, root, retry_failed=True)] == ["retry"]


@pytest.mark.slow
def test_local_preemption_requeues_through_submitit_and_resumes(tmp_path):
    """USR2 to the running tasks (what SLURM sends on preemption): the toy checkpoints, TrainJob hands the
    signal to submitit, whose local controller restarts the job; the run resumes and ends as if
    uninterrupted."""
    import threading

    runs = planned(tmp_path / "data", "train.steps=40")[:1]
    cluster = load_cluster("local-slurm")
    root = tmp_path / "runs"
    run_dir = runs[0].spec.run_dir(root)

    def preempt_once():
        wait_states([run_dir], {"running"}, timeout=60)
        while executors.read_json(run_dir / "status.json").get("step", 0) < 5:
            time.sleep(0.1)
        for pid in _task_pids(run_dir):
            os.kill(pid, signal.SIGUSR2)

    thread = threading.Thread(target=preempt_once, daemon=True)
    thread.start()
    executors.submit(executors.decide(runs, root, False), cluster, "local", root, "t", train_fn=toy_train)
    thread.join(timeout=5)
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events if "event" in e] == ["start", "preempt", "resume", "end"]
    assert events[-1]["val/loss"] == pytest.approx(toy_loss(40, 2), rel=1e-12)
    assert executors.read_json(run_dir / "status.json")["state"] == "completed"


def test_running_but_dead_run_is_resumed_and_shown_dead(tmp_path):
    import subprocess

    runs = planned(tmp_path / "data")[:1]
    root = tmp_path / "runs"
    run_dir = runs[0].spec.run_dir(root)
    run_dir.mkdir(parents=True)
    (run_dir / "status.json").write_text(json.dumps({"state": "running", "step": 7, "total_steps": 30}))
    gone = subprocess.Popen(["true"])
    gone.wait()
    (run_dir / "job.json").write_text(json.dumps({"executor": "local", "job_id": str(gone.pid)}))
    (decision,) = executors.decide(runs, root, retry_failed=False)
    assert (decision.action, decision.reason) == ("resume", "running at step 7, no live job")
    assert collect(root)[0]["state"] == "dead"


def test_run_dir_with_another_config_is_refused_before_anything_happens(tmp_path):
    from nlq_scale.errors import UsageError

    runs = planned(tmp_path / "data")[:1]
    root = tmp_path / "runs"
    run_dir = runs[0].spec.run_dir(root)
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(runs[0].cfg.model_dump(mode="json") | {"seed": 1}))
    with pytest.raises(UsageError, match=f"{runs[0].spec.run_id}: holds a run with a different config"):
        executors.decide(runs, root, retry_failed=False)


def _task_pids(run_dir: Path) -> list[int]:
    """The job's task processes: children of the local controller recorded in job.json."""
    controller = executors.read_json(run_dir / "job.json")["job_id"]
    children = Path(f"/proc/{controller}/task/{controller}/children").read_text().split()
    return [int(c) for c in children]

"""Sweeps on a real SLURM: the two-node cluster of slurm/local-cluster/start.sh (started by the session
fixture), submitit's slurm executor, preemption through a higher-priority partition.

The first group drives the submission machinery with tests/test_cluster_jobs.py's toy trainer (fast,
and independent of the train loop); the second runs the real `nlq-scale submit` / `train_run` end to
end on a prepared dataset.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from nlq_scale.cluster import executors
from nlq_scale.cluster.plan import load_cluster
from nlq_scale.cluster.status import collect
from tests.conftest import nlq, process_state
from tests.test_cluster_jobs import (
    FAIL_TAG, TEST_SWEEP, planned, prepare_text_dataset, toy_loss, toy_train, wait_states,
)

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

REPO = Path(__file__).resolve().parents[1]
START = REPO / "slurm" / "local-cluster" / "start.sh"
STOP = REPO / "slurm" / "local-cluster" / "stop.sh"
TERMINAL = {"completed", "failed", "diverged", "dead"}


STATE_DIR = Path(os.environ.get("NLQ_SLURM_STATE", "/var/lib/nlq-slurm"))


@contextlib.contextmanager
def cluster_held() -> Iterator[None]:
    """The cluster to this process alone while it runs: pytest-xdist workers share it, and a test
    (or start.sh, which restarts a slurmd a test killed on purpose) must not act under another test."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / "tests.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def local_slurm():
    """The local cluster, started through its script; stopped again only if this session started it."""
    conf = STATE_DIR / "slurm.conf"
    with cluster_held():
        was_up = conf.exists() and subprocess.run(["scontrol", "ping"], env=os.environ | {"SLURM_CONF": str(conf)},
                                                  capture_output=True).returncode == 0
        out = subprocess.run(["bash", str(START)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"start.sh failed:\n{out.stdout}\n{out.stderr}"
    exported = [ln for ln in out.stdout.splitlines() if ln.startswith("export SLURM_CONF=")]
    os.environ["SLURM_CONF"] = exported[-1].split("=", 1)[1]
    yield Path(os.environ["SLURM_CONF"])
    # Under pytest-xdist another worker's session may still be using the cluster: leave it up.
    if not was_up and "PYTEST_XDIST_WORKER" not in os.environ:
        subprocess.run(["bash", str(STOP)], capture_output=True, timeout=120)


def queued_jobs() -> set[str]:
    """Job ids (array ids for arrays) this cluster still holds, pending or running."""
    out = subprocess.run(["squeue", "-h", "-o", "%F"], capture_output=True, text=True, timeout=60).stdout
    return set(out.split())


@pytest.fixture
def slurm_cluster(local_slurm):
    """The cluster for one test, held alone: jobs the test leaves queued or running are cancelled
    afterwards, so a failing test cannot hold the two nodes and starve every test after it."""
    with cluster_held():
        before = queued_jobs()
        yield local_slurm
        if leftover := queued_jobs() - before:
            subprocess.run(["scancel", *sorted(leftover)], capture_output=True, timeout=60)


def submit_toy(runs, root: Path, sweep: str = "test-two-arm") -> list[dict]:
    decisions = executors.decide(runs, root, retry_failed=False)
    return executors.submit(decisions, load_cluster("local-slurm"), "slurm", root, sweep, train_fn=toy_train)


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def wait_done(run_dirs: list[Path], timeout: float = 300) -> dict[Path, str]:
    states = wait_states(run_dirs, TERMINAL, timeout)
    if not all(s in TERMINAL for s in states.values()):
        pytest.fail(f"runs did not finish: {states}\n{cluster_view(run_dirs)}")
    return states


def cluster_view(run_dirs: list[Path]) -> str:
    """What a failed wait needs to be understood from CI output alone: the queue, the nodes, job logs."""
    def run(*cmd: str) -> str:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout

    logs = {d.name: Path(executors.read_json(d / "job.json").get("log", "/nonexistent")) for d in run_dirs}
    tails = {k: p.read_text()[-3000:] if p.exists() else "no log" for k, p in logs.items()}
    return (f"squeue:\n{run('squeue', '-o', '%i %P %T %R %M')}\nsinfo:\n{run('sinfo', '-N', '-o', '%N %T %E')}\n"
            f"status: {[executors.read_json(d / 'status.json') for d in run_dirs]}\nlogs: {tails}")


# Steps of a real run preempted after step 8 (preempt_held keeps it from finishing first).
PREEMPTED_STEPS = 60
URGENT = ["srun", "-p", "urgent", "-N2", "-n2", "--job-name=urgent", "true"]


def preempt_with_urgent_job() -> None:
    """A job in the higher-priority partition that needs both nodes: SLURM preempts the running batch job."""
    subprocess.run(URGENT, check=True, timeout=180, capture_output=True)


def job_processes(job_id: str, node: str | None = None) -> list[int]:
    """The Python processes of a SLURM (array) job on this host, on one emulated node or all, of the
    cluster SLURM_CONF names: another local cluster (benchmarks/chaos.py's) counts its job ids anew."""
    array_id, _, task = job_id.partition("_")
    want = {f"SLURM_ARRAY_JOB_ID={array_id}", f"SLURM_ARRAY_TASK_ID={task}"} if task else {f"SLURM_JOB_ID={job_id}"}
    want |= {f"SLURMD_NODENAME={node}"} if node else set()
    want |= {f"SLURM_CONF={os.environ['SLURM_CONF']}"} if "SLURM_CONF" in os.environ else set()
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            environ = set((proc / "environ").read_bytes().split(b"\0"))
            exe = os.readlink(proc / "exe")
        except (OSError, ValueError):
            continue
        if "python" in Path(exe).name and all(w.encode() in environ for w in want):
            pids.append(int(proc.name))
    return pids


def signal_pending(pid: int, signum: int) -> bool:
    """Whether `signum` waits, undelivered, for process `pid` (or one of its threads)."""
    masks = [line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
             if line.startswith(("SigPnd:", "ShdPnd:"))]  # fmt: skip
    return any(int(mask, 16) >> (signum - 1) & 1 for mask in masks)


def preempt_held(job_id: str) -> None:
    """preempt_with_urgent_job while the job's Python processes are stopped, until SLURM's preemption
    signal (USR2) is pending for them, or something continued them: the preemption lands mid-run however
    fast this machine trains (a run free to go on could finish its 60 steps before the scheduler acted)."""
    held = job_processes(job_id)
    assert held, f"no process of job {job_id} on this host"
    for pid in held:
        os.kill(pid, signal.SIGSTOP)
    try:
        urgent = subprocess.Popen(URGENT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 180
        # SLURM may continue them itself (SIGCONT with its own signals): then they handle USR2 already
        while (all(process_state(pid) == "T" for pid in held)
               and not any(signal_pending(pid, signal.SIGUSR2) for pid in held)):
            assert time.time() < deadline and urgent.poll() is None, f"job {job_id} was never signalled"
            time.sleep(0.1)
    finally:
        for pid in held:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    assert urgent.wait(timeout=180) == 0


def wait_step(run_dir: Path, step: int, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while executors.read_json(run_dir / "status.json").get("step", 0) < step:
        if time.time() > deadline:
            pytest.fail(f"{run_dir.name} never reached step {step}\n{cluster_view([run_dir])}")
        time.sleep(0.3)


# ---------------------------------------------------------------- with the toy trainer


def test_two_arm_sweep_spans_two_nodes_and_completes(slurm_cluster, tmp_path):
    runs = planned(tmp_path / "data")
    assert [(r.plan.layout.nodes, r.plan.layout.tasks_per_node) for r in runs] == [(2, 1), (2, 1)]
    root = tmp_path / "runs"
    records = submit_toy(runs, root)
    assert len({r["job_id"].split("_")[0] for r in records}) == 1  # one job array for the scale
    queued = executors.decide(runs, root, retry_failed=False)  # while queued or running: hands off
    assert [(d.action, d.reason) for d in queued] == [
        ("skip", f"job {r['job_id']} still queued or running") for r in records]
    dirs = [r.spec.run_dir(root) for r in runs]
    assert set(wait_done(dirs).values()) == {"completed"}
    for d, rec in zip(dirs, records):
        status = executors.read_json(d / "status.json")
        assert status["num_nodes"] == 2 and status["slurm_job_id"]
        assert events(d)[0]["world_size"] == 2
        assert events(d)[-1]["val/loss"] == pytest.approx(toy_loss(30, 2), rel=1e-12)
    assert submit_toy(runs, root) == []  # resubmitting a finished sweep submits nothing


def test_preempted_run_requeues_and_resumes(slurm_cluster, tmp_path):
    runs = planned(tmp_path / "data", "train.steps=80")[:1]
    root = tmp_path / "runs"
    run_dir = runs[0].spec.run_dir(root)
    submit_toy(runs, root)
    wait_step(run_dir, 5)
    preempt_with_urgent_job()
    assert wait_done([run_dir])[run_dir] == "completed"
    evs = events(run_dir)
    assert [e["event"] for e in evs if "event" in e] == ["start", "preempt", "resume", "end"]
    assert evs[1]["signal"] == 12  # SIGUSR2: submitit's preemption signal, sent at preemption
    assert evs[0]["job"] == evs[2]["job"]  # the same SLURM job came back (requeued, not resubmitted)
    assert evs[-1]["val/loss"] == pytest.approx(toy_loss(80, 2), rel=1e-12)
    restarts = subprocess.run(["scontrol", "show", "job", evs[0]["job"]], capture_output=True, text=True).stdout
    assert "Restarts=1" in restarts or "Restarts=2" in restarts, restarts


def test_failing_run_shows_failed_with_its_error(slurm_cluster, tmp_path):
    runs = planned(tmp_path / "data", f"logging.tags=[{FAIL_TAG}]")[:1]
    root = tmp_path / "runs"
    submit_toy(runs, root)
    run_dir = runs[0].spec.run_dir(root)
    assert wait_done([run_dir])[run_dir] == "failed"
    out = nlq("status", str(root), "--json")
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)["runs"]
    assert row["state"] == "failed" and row["error"] == "RuntimeError: toy failure at step 3"
    table = nlq("status", str(root)).stdout
    assert "failed" in table and "toy failure at step 3" in table


def test_job_dying_before_training_shows_failed_from_submitit(slurm_cluster, tmp_path):
    """No status.json ever written (the callable raised before training): status reads submitit's error."""
    runs = planned(tmp_path / "data")[:1]
    root = tmp_path / "runs"
    decisions = executors.decide(runs, root, False)
    executors.submit(decisions, load_cluster("local-slurm"), "slurm", root, "t", train_fn=_raise_before_training)
    deadline = time.time() + 120
    while (row := collect(root)[0])["state"] == "submitted":
        assert time.time() < deadline, row
        time.sleep(1)
    assert row["state"] == "failed" and row["error"] == "ValueError: no dataset here", row


def _raise_before_training(cfg, run_dir):
    raise ValueError("no dataset here")


# ---------------------------------------------------------------- bad input: nothing submitted


def _queue_size() -> int:
    return len(subprocess.run(["squeue", "-h"], capture_output=True, text=True).stdout.splitlines())


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"arms": ["linear", "quadratic"]}, "unknown arm 'quadratic'"),
        ({"lrs": [0.001, 0.0]}, "lrs.1: Input should be greater than 0"),
        ({"arms": [{"name": "linear", "lrs": [-1e-3]}]}, "arms.0.lrs.0: Input should be greater than 0"),
        ({"scales": ["175b"]}, "cannot fit cluster local-slurm"),
        ({"data": {"path": "/nonexistent/prepared", "seed": 0}}, "no such dataset directory"),
    ],
)
def test_bad_sweep_exits_2_with_one_line_and_submits_nothing(slurm_cluster, tmp_path, edit, message):
    import yaml

    sweep = yaml.safe_load(TEST_SWEEP.read_text()) | edit
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(sweep))
    before = _queue_size()
    out = nlq("submit", str(path), "--root", str(tmp_path / "runs"))
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and message in out.stderr, out.stderr
    assert _queue_size() == before and not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- the real train loop, end to end


@pytest.fixture(scope="session")
def prepared_data(tmp_path_factory):
    return prepare_text_dataset(tmp_path_factory.mktemp("data"))


def edited_sweep(path: Path, **edit) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(yaml.safe_load(TEST_SWEEP.read_text()) | edit))
    return path


@pytest.fixture
def one_arm_sweep(tmp_path) -> Path:
    return edited_sweep(tmp_path / "one-arm.yaml", arms=["linear"])


EVAL = {"tasks": ["nlq_cloze"], "limit": 4}


def submit_real(root: Path, *overrides: str, sweep: Path = TEST_SWEEP) -> dict:
    out = nlq("submit", str(sweep), "--root", str(root), "--json", *overrides)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_real_two_arm_sweep_then_resubmit_submits_nothing(slurm_cluster, prepared_data, tmp_path):
    root = tmp_path / "runs"
    doc = submit_real(root, f"data.path={prepared_data}")
    assert [r["action"] for r in doc["runs"]] == ["submit", "submit"]
    dirs = [Path(r["run_dir"]) for r in doc["runs"]]
    assert set(wait_done(dirs, timeout=900).values()) == {"completed"}
    for d in dirs:
        manifest = json.loads((d / "manifest.json").read_text())
        assert manifest["layout"]["world_size"] == 2 and manifest["layout"]["dp"] == 2
        assert executors.read_json(d / "status.json")["num_nodes"] == 2
        assert any("val/loss" in e for e in events(d))
    out = nlq("status", str(root), "--json")
    assert [r["state"] for r in json.loads(out.stdout)["runs"]] == ["completed", "completed"]
    again = submit_real(root, f"data.path={prepared_data}")
    assert [r["action"] for r in again["runs"]] == ["skip", "skip"]
    assert all(r["job_id"] is None for r in again["runs"])


def test_real_preemption_resumes_to_the_uninterrupted_loss(slurm_cluster, prepared_data, tmp_path, one_arm_sweep):
    """...and its evaluation job (sweep key `eval`, afterok on the training job) waits through the
    requeue and scores the completed run."""
    overrides = (f"data.path={prepared_data}", f"train.steps={PREEMPTED_STEPS}", "checkpoint.every=0")
    interrupted, reference = tmp_path / "interrupted", tmp_path / "reference"
    evaluated = edited_sweep(tmp_path / "evaluated.yaml", arms=["linear"], eval=EVAL)
    (run,) = submit_real(interrupted, *overrides, sweep=evaluated)["runs"]
    run_dir = Path(run["run_dir"])
    wait_step(run_dir, 8, timeout=600)
    preempt_held(run["job_id"])
    (ref,) = submit_real(reference, *overrides, sweep=one_arm_sweep)["runs"]
    ref_dir = Path(ref["run_dir"])
    assert set(wait_done([run_dir, ref_dir], timeout=1200).values()) == {"completed"}
    kinds = [e["event"] for e in events(run_dir) if e.get("event")]
    assert "preempt" in kinds and "resume" in kinds, kinds
    assert executors.read_json(run_dir / "status.json")["slurm_job_id"] == run["job_id"]  # requeued, same job

    def final_val(d):
        return [e["val/loss"] for e in events(d) if "val/loss" in e][-1]

    assert final_val(run_dir) == final_val(ref_dir)
    (entry,) = wait_eval(run_dir, run["eval_job_id"]).values()
    assert entry["step"] == PREEMPTED_STEPS and entry["tasks"]["nlq_cloze"]["n"] == EVAL["limit"]


def wait_eval(run_dir: Path, job_id: str, timeout: float = 300) -> dict:
    deadline = time.time() + timeout
    while not (run_dir / "eval.json").exists():
        assert job_id in queued_jobs() or (run_dir / "eval.json").exists(), f"evaluation job {job_id} ended, no eval.json"
        assert time.time() < deadline, f"evaluation job {job_id} still queued after {timeout} s"
        time.sleep(1)
    return json.loads((run_dir / "eval.json").read_text())


def test_real_failing_run_shows_failed_and_is_never_evaluated(slurm_cluster, prepared_data, tmp_path):
    root = tmp_path / "runs"
    # The Transformer Engine layer spec cannot be built on this CPU-only machine: the run raises.
    doc = submit_real(root, f"data.path={prepared_data}", "model.transformer_impl=transformer_engine",
                      sweep=edited_sweep(tmp_path / "evaluated.yaml", arms=["linear"], eval=EVAL))
    (run,) = doc["runs"]
    run_dir = Path(run["run_dir"])
    assert wait_done([run_dir], timeout=600)[run_dir] == "failed"
    (row,) = json.loads(nlq("status", str(root), "--json").stdout)["runs"]
    assert row["state"] == "failed" and row["error"], row
    # slurmctld marks the dependency at its next scheduling pass. The job stays queued: the local
    # cluster does not set kill_invalid_depend, so "" (left the queue) would mean it ran.
    deadline, reason = time.time() + 60, "Dependency"
    while reason != "DependencyNeverSatisfied":
        assert reason == "Dependency" and time.time() < deadline, reason
        time.sleep(1)
        reason = subprocess.run(["squeue", "-h", "-j", run["eval_job_id"], "-o", "%r"], capture_output=True,
                                text=True, timeout=60).stdout.strip()  # fmt: skip
    assert not (run_dir / "eval.json").exists()


def test_proxy_lr_search_submits_its_targets_from_a_follow_up_job(slurm_cluster, prepared_data, tmp_path):
    """Phase 1's proxies are queued with a follow-up job after them (afterany) that runs the same
    submit again: it submits the targets at the proxies' eta*."""
    from tests.test_cluster_lr_search import LRS, check_targets, lr_search_sweep, target_dirs

    root = tmp_path / "runs"
    out = nlq("submit", str(lr_search_sweep(tmp_path, prepared_data, cluster="local-slurm")), "--root", str(root),
              "--json")
    assert out.returncode == 0, out.stderr
    assert [r["action"] for r in json.loads(out.stdout)["runs"]] == ["submit"] * len(LRS)
    assert "submits the targets once the proxy jobs have ended" in out.stderr
    assert set(wait_done([Path(r["run_dir"]) for r in json.loads(out.stdout)["runs"]]).values()) == {"completed"}
    deadline = time.time() + 180
    while len([d for d in target_dirs(root / "lrs") if (d / "job.json").exists()]) < 3:
        assert time.time() < deadline, f"no targets submitted:\n{subprocess.run(['squeue'], capture_output=True, text=True).stdout}"
        time.sleep(1)
    check_targets(root / "lrs", target_dirs(root / "lrs"))


def test_sbatch_template_trains_and_requeues_itself_after_preemption(slurm_cluster, prepared_data, tmp_path):
    """slurm/train.sbatch (no submitit): srun runs `nlq-scale train` in both tasks; preempted, the job
    requeues itself (run-train.sh) and resumes to completion."""
    run_dir = tmp_path / "run"
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    out = subprocess.run(
        ["sbatch", "--parsable", "-N2", "--ntasks-per-node=1", f"--output={tmp_path}/sbatch-%j.out",
         str(REPO / "slurm" / "train.sbatch"), str(run_dir), "--scale", "cpu-xs", "--arm", "linear",
         f"data.path={prepared_data}", f"train.steps={PREEMPTED_STEPS}", "logging.wandb=false"],
        capture_output=True, text=True, cwd=REPO, env=env, check=True,
    )
    job = out.stdout.strip()
    wait_step(run_dir, 8, timeout=600)
    preempt_held(job)
    assert wait_done([run_dir], timeout=900)[run_dir] == "completed"
    kinds = [e["event"] for e in events(run_dir) if e.get("event")]
    assert "preempt" in kinds and "resume" in kinds, kinds
    assert executors.read_json(run_dir / "status.json")["slurm_job_id"] == job
    assert "ended as preempted" in Path(tmp_path / f"sbatch-{job}.out").read_text()


def test_sbatch_template_runs_tensor_parallel_across_two_nodes(slurm_cluster, prepared_data, tmp_path):
    """`srun nlq-scale train` checks the layout against the real world size (SLURM_NTASKS = 2), not 1:
    a TP=2 run across the two nodes completes. Submitted from an unrelated directory, the template
    finds run-train.sh through `nlq-scale config path slurm`."""
    run_dir = tmp_path / "run"
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    subprocess.run(
        ["sbatch", "--parsable", "-N2", "--ntasks-per-node=1", f"--output={tmp_path}/sbatch-%j.out",
         str(REPO / "slurm" / "train.sbatch"), str(run_dir), "--scale", "cpu-xs", "--arm", "nonlinear",
         f"data.path={prepared_data}", "train.steps=6", "train.warmup_steps=1", "parallel.tp=2",
         "logging.wandb=false"],
        capture_output=True, text=True, cwd=tmp_path, env=env, check=True,
    )  # fmt: skip
    assert wait_done([run_dir], timeout=600)[run_dir] == "completed"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["layout"]["tp"] == 2 and manifest["layout"]["world_size"] == 2 and manifest["layout"]["nodes"] == 2

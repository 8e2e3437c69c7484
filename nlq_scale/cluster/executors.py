"""Submission through submitit: SLURM (job arrays per scale) or this machine (`local`).

Idempotent: each run's directory tells what to do with it (status.json from the train loop, job.json
from the last submission): completed and diverged runs are skipped, failed ones too unless
--retry-failed, stale ones (running, but no heartbeat for too long) too unless --retry-stale (which
cancels their old job first), runs whose last job still sits in the queue are left alone, everything
else (new, preempted, running-but-dead) is submitted and resumes from its run dir. One submission of
a sweep at a time: a lock file in the sweep directory serialises them, so two at once submit each
run once.

job.json (written here, read by `status`): {"executor", "job_id", "folder", "submitted_at", "log"}.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import signal
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Literal


from nlq_scale.cluster.plan import ClusterConfig, Layout, PlannedRun
from nlq_scale.compat import submitit as submitit_compat
from nlq_scale.errors import RunFailure, UsageError
from nlq_scale.train.rundir import claim, heartbeat_age, is_stale, read_status, stale_after, write_json
from nlq_scale.train.rundir import read_current as read_json  # job.json, read as status.json is

ExecutorKind = Literal["slurm", "local"]
JOB_FILE = "job.json"
LOCK_FILE = ".submit.lock"
# squeue states of a job waiting for its (next) start: a run whose job waits has no heartbeat to give,
# however long the queue, and is not stale.
WAITING_STATES = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"}
# squeue states of a job that will still run (or is running) without resubmission.
LIVE_STATES = {"PENDING", "RUNNING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "COMPLETING",
               "SUSPENDED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED"}


# ---------------------------------------------------------------- reading run dirs


def slurm_queue_states(job_ids: Iterable[str]) -> dict[str, str] | None:
    """{job id: squeue state} for the given ids still known to slurmctld; None if squeue is unavailable."""
    ids = sorted({j for j in job_ids if j})
    if not ids:
        return {}
    if shutil.which("squeue") is None:
        return None
    # One call for all: `-j` with an unknown id fails the whole call, so list everything and filter.
    out = subprocess.run(["squeue", "-h", "-r", "-o", "%i|%T"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        return None
    states = dict(line.split("|", 1) for line in out.stdout.split() if "|" in line)
    return {j: states[j] for j in ids if j in states}


def local_job_alive(job_id: str) -> bool:
    """The local executor's job id is its controller's pid: alive while that controller runs."""
    try:
        cmdline = Path(f"/proc/{int(job_id)}/cmdline").read_bytes()
    except (OSError, ValueError):
        return False
    return submitit_compat.LOCAL_CONTROLLER_MODULE.encode() in cmdline


def job_liveness(run_dirs: Iterable[Path]) -> dict[Path, bool | None]:
    """For each run dir with a job.json: is its last job still queued or running (None = cannot tell)."""
    return {d: live(state) for d, state in job_states(run_dirs).items()}


def live(job_state: str | None) -> bool | None:
    """Whether a job in this squeue state will still run without resubmission (None = cannot tell)."""
    return None if job_state is None else job_state in LIVE_STATES


def job_states(run_dirs: Iterable[Path]) -> dict[Path, str | None]:
    """For each run dir with a job.json: its last job's squeue state, "" once it has left the queue
    (the local executor's job: RUNNING while its controller runs), None = cannot tell."""
    jobs = {d: read_json(d / JOB_FILE) for d in run_dirs}
    jobs = {d: j for d, j in jobs.items() if j.get("job_id")}
    slurm = slurm_queue_states(j["job_id"] for j in jobs.values() if j.get("executor") == "slurm")
    return {d: _queue_state(j, slurm) for d, j in jobs.items()}


def _queue_state(job: dict, slurm: dict[str, str] | None) -> str | None:
    """One job's state as job_states gives it, from squeue's answer for the SLURM jobs (None: no answer)."""
    if job.get("executor") == "local":
        return "RUNNING" if local_job_alive(job["job_id"]) else ""
    return None if slurm is None else slurm.get(job["job_id"], "")


# ---------------------------------------------------------------- deciding


@dataclass(frozen=True)
class Decision:
    run: PlannedRun
    run_dir: Path
    action: Literal["submit", "resume", "retry", "skip"]
    reason: str
    cancel: dict | None = None  # a retried run's job (job.json) still queued: cancelled before resubmitting


@contextlib.contextmanager
def sweep_lock(root: Path, sweep: str) -> Iterator[None]:
    """Held for a whole submission of `sweep` under `root`: a second one waits, then finds the
    first's jobs queued. Other sweeps have their own lock. flock: released if the holder dies."""
    folder = root / sweep
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / LOCK_FILE, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting for another submit of sweep {sweep} under {root} to finish", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def decide(
    runs: list[PlannedRun], root: Path, retry_failed: bool, retry_stale: bool = False, stale_s: float | None = None
) -> list[Decision]:
    dirs = [r.spec.run_dir(root) for r in runs]
    for run, run_dir in zip(runs, dirs):
        claim(run_dir, run.cfg, create=False)  # a different run there: refuse before submitting
    states = job_states(d for d in dirs if (d / JOB_FILE).exists())
    return [_decide_one(run, d, states.get(d, ""), retry_failed, retry_stale, stale_s) for run, d in zip(runs, dirs)]


def _decide_one(
    run: PlannedRun, run_dir: Path, job_state: str | None, retry_failed: bool, retry_stale: bool, stale_s: float | None
) -> Decision:
    status = read_status(run_dir)
    state = status.get("state")
    job = read_json(run_dir / JOB_FILE)
    alive = live(job_state)
    if state == "completed":
        return Decision(run, run_dir, "skip", "completed")
    if state == "diverged":
        return Decision(run, run_dir, "skip", "diverged (a result, not an error)")
    if state == "failed":
        if retry_failed:  # its job may linger (a lost node keeps the allocation): cancelled first
            return Decision(run, run_dir, "retry", f"failed: {status.get('error')}", cancel=job if alive else None)
        return Decision(run, run_dir, "skip", "failed (resubmit with --retry-failed)")
    if alive is not False and job_state not in WAITING_STATES and is_stale(status, stale_s):
        silence = f"no heartbeat for {heartbeat_age(status):.0f} s (bound {stale_s or stale_after(status):.0f} s)"
        if retry_stale:
            return Decision(run, run_dir, "retry", f"stale: {silence}", cancel=job or None)
        return Decision(run, run_dir, "skip", f"stale: {silence} (resubmit with --retry-stale)")
    if alive:
        return Decision(run, run_dir, "skip", f"job {job['job_id']} still queued or running")
    if alive is None:
        return Decision(run, run_dir, "skip", f"job {job['job_id']}: cannot query the scheduler (no squeue)")
    if state is None:
        return Decision(run, run_dir, "submit", "new" if not job else f"job {job['job_id']} ended before training")
    return Decision(run, run_dir, "resume", f"{state} at step {status.get('step')}, no live job")


def cancel_job(job: dict) -> None:
    """Cancel a retried run's job before its replacement starts, so two never write one run dir."""
    if job.get("executor") == "local":
        if local_job_alive(job["job_id"]):
            os.kill(int(job["job_id"]), signal.SIGTERM)
        return
    out = subprocess.run(["scancel", str(job["job_id"])], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        reason = (out.stderr.strip().splitlines() or ["no reason given"])[-1]
        raise RunFailure(f"scancel {job['job_id']} (the retried run's job) failed: {reason}")


CANCEL_WAIT_S = 300.0


def wait_ended(jobs: list[dict], timeout_s: float = CANCEL_WAIT_S) -> None:
    """Until the cancelled jobs have left the queue. scancel returns at once, but a job's processes
    run on for up to SLURM's KillWait (SIGTERM: the run finishes its step and saves a checkpoint,
    minutes for a large model), and the replacement must not start beside them in the same run dir."""
    deadline = time.time() + timeout_s
    while live := [j for j in jobs if _still_there(j)]:
        if time.time() > deadline:
            raise RunFailure(f"job {live[0]['job_id']} still in the queue {timeout_s:.0f} s after it was cancelled: "
                             "its run was not resubmitted")
        time.sleep(0.5)


def _still_there(job: dict) -> bool:
    slurm = None if job.get("executor") == "local" else slurm_queue_states([job["job_id"]])
    return bool(_queue_state(job, slurm))  # squeue gone (None): nothing to wait for


# ---------------------------------------------------------------- submitting


def submitit_folder(root: Path, sweep: str) -> Path:
    """A fresh folder per submission: job ids restart when a cluster's state is purged."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    return root / sweep / "_submitit" / f"{stamp}-{os.getpid()}"


def make_executor(kind: ExecutorKind, folder: Path, cluster: ClusterConfig, layout: Layout, name: str):
    import submitit

    executor = submitit.AutoExecutor(folder=folder, cluster=kind, slurm_max_num_timeout=cluster.max_num_timeout)
    if kind == "local":
        # One machine: all ranks as tasks of one node.
        executor.update_parameters(name=name, timeout_min=cluster.time_limit_min, nodes=1,
                                   tasks_per_node=layout.world_size)
        return executor
    params = {
        "name": name,
        "timeout_min": cluster.time_limit_min,
        "nodes": layout.nodes,
        "tasks_per_node": layout.tasks_per_node,
        "slurm_partition": cluster.partition,
        "slurm_account": cluster.account,
        "slurm_qos": cluster.qos,
        "slurm_constraint": cluster.constraint,
        "slurm_exclusive": cluster.exclusive or None,
        "slurm_gres": cluster.gres,
        "slurm_exclude": cluster.exclude,
        "slurm_signal_delay_s": cluster.signal_delay_s,
        "slurm_array_parallelism": cluster.array_parallelism,
        "slurm_setup": cluster.setup or None,
        "cpus_per_task": cluster.cpus_per_task,
        "mem_gb": cluster.mem_gb,
        # Preemption with PreemptMode=REQUEUE and `scontrol requeue` need a requeueable job.
        "slurm_additional_parameters": {"requeue": True},
    }
    if cluster.device == "gpu" and cluster.gres is None:
        params["gpus_per_node"] = cluster.gpus_per_node
    executor.update_parameters(**{k: v for k, v in params.items() if v is not None})
    return executor


def submit_follow_up(cluster: ClusterConfig, root: Path, sweep: str, after: Iterable[str], fn) -> str:
    """Queue `fn` as a one-task SLURM job that starts once the jobs `after` ended (whatever their
    end): the learning-rate search's second submit. Returns its job id."""
    import submitit

    arrays = sorted({str(job_id).split("_")[0] for job_id in after})  # an array's id waits for all its tasks
    executor = submitit.AutoExecutor(folder=submitit_folder(root, sweep), cluster="slurm")
    params = {"name": f"{sweep}-lr-search", "timeout_min": 30, "nodes": 1, "tasks_per_node": 1,
              "slurm_partition": cluster.partition, "slurm_account": cluster.account, "slurm_qos": cluster.qos,
              "slurm_setup": cluster.setup or None,
              "slurm_additional_parameters": {"dependency": "afterany:" + ":".join(arrays)}}  # fmt: skip
    executor.update_parameters(**{k: v for k, v in params.items() if v is not None})
    return str(launch(lambda: executor.submit(fn)).job_id)


def submit_eval(kind: ExecutorKind, folder: Path, cluster: ClusterConfig, name: str, run_dir: Path,
                evaluation, after: str | None = None):  # fmt: skip
    """Queue `nlq-scale eval` of a run (sweep key `eval`) as a one-task job; on SLURM it starts only
    when the training job `after` succeeded (afterok: a failed or cancelled run has nothing to score)."""
    from nlq_scale.cluster.job import EvalJob

    executor = eval_executor(kind, folder, cluster, name, after)
    fn = EvalJob(str(run_dir), list(evaluation.tasks), evaluation.limit, evaluation.batch_size)
    return launch(lambda: executor.submit(fn))


def eval_executor(kind: ExecutorKind, folder: Path, cluster: ClusterConfig, name: str, after: str | None):
    import submitit

    executor = submitit.AutoExecutor(folder=folder, cluster=kind)
    params = {"name": f"{name}-eval", "timeout_min": cluster.time_limit_min, "nodes": 1, "tasks_per_node": 1}
    if kind == "slurm":
        params |= {"slurm_partition": cluster.partition, "slurm_account": cluster.account, "slurm_qos": cluster.qos,
                   "slurm_setup": cluster.setup or None, "cpus_per_task": cluster.cpus_per_task,
                   "slurm_additional_parameters": {"dependency": f"afterok:{after}"}}  # fmt: skip
        if cluster.device == "gpu":  # one GPU scores the model; lm-eval runs it there (--device auto)
            params |= _one_gpu(cluster)
    executor.update_parameters(**{k: v for k, v in params.items() if v is not None})
    return executor


def _one_gpu(cluster: ClusterConfig) -> dict:
    """The request for one GPU in the cluster's own form: `gres` with its count set to 1
    (gpu:a100:8 -> gpu:a100:1; gpu and gpu:a100 already mean one), else --gpus-per-node=1."""
    if cluster.gres is None:
        return {"gpus_per_node": 1}
    name, _, count = cluster.gres.rpartition(":")
    return {"slurm_gres": f"{name}:1" if name and count.isdigit() else cluster.gres}


def _record_job(run_dir: Path, kind: ExecutorKind, job) -> dict:
    record = {
        "executor": kind,
        "job_id": str(job.job_id),
        "folder": str(job.paths.folder),
        "submitted_at": time.time(),
        "log": str(job.paths.stderr),
    }
    try:
        write_json(run_dir / JOB_FILE, record)
    except OSError as e:  # the run dir took a probe a moment ago (_prepare_run_dir): rare, but said
        raise RunFailure(f"{run_dir / JOB_FILE}: job {record['job_id']} was queued for this run but could not be "
                         f"recorded ({e.strerror or e}): cancel it (scancel {record['job_id']}) before submitting "
                         "again") from e  # fmt: skip
    return record


def _prepare_run_dir(decision: Decision) -> None:
    """The config train_run will find (and accept) there, and room for the job's record: a run dir
    that cannot take it (a full disk) is refused before a job is queued that `status` and the next
    `submit` would not know of."""
    try:
        claim(decision.run_dir, decision.run.cfg)
        probe = decision.run_dir / f".{JOB_FILE}.probe"
        probe.write_bytes(bytes(4096))  # about a job record's size, rounded up to a block
        probe.unlink()
    except OSError as e:
        raise RunFailure(f"{decision.run_dir}: cannot write there ({e.strerror or e}); nothing was submitted: "
                         "free space (docs/slurm.md, \"After a fault\") and submit again") from e


def _groups(decisions: list[Decision]) -> dict[tuple, list[Decision]]:
    """One job array per scale and resource shape."""
    groups: dict[tuple, list[Decision]] = {}
    for d in decisions:
        lay = d.run.plan.layout
        groups.setdefault((d.run.spec.scale, lay.nodes, lay.tasks_per_node), []).append(d)
    return groups


def submit(
    decisions: list[Decision],
    cluster: ClusterConfig,
    kind: ExecutorKind,
    root: Path,
    sweep: str,
    train_fn=None,
    evaluation=None,
) -> list[dict]:
    """Submit every non-skipped decision. SLURM: returns once queued. local: runs them one after the
    other on this machine and returns when all ended. `evaluation` (the sweep's EvalSpec): each run
    is evaluated after training (local: right after it; SLURM: a job depending on it)."""
    from nlq_scale.cluster.job import TrainJob

    todo = [d for d in decisions if d.action != "skip"]
    if not todo:
        return []
    if kind == "slurm" and shutil.which("sbatch") is None:
        raise UsageError("--executor slurm: sbatch not found (no SLURM here; try --executor local)")
    for d in todo:  # every run dir first: one that cannot take its record stops the submission untouched
        _prepare_run_dir(d)
    folder = submitit_folder(root, sweep)
    records = []
    for (scale, _, _), group in _groups(todo).items():
        executor = make_executor(kind, folder, cluster, group[0].run.plan.layout, f"{sweep}-{scale}")
        for d in group:
            if d.cancel:
                cancel_job(d.cancel)
        wait_ended([d.cancel for d in group if d.cancel])
        fns = [TrainJob(d.run.cfg.model_dump(mode="json"), str(d.run_dir), train_fn) for d in group]
        if kind == "slurm":
            jobs = launch(lambda: _submit_array(executor, fns))
            records += [_record(d, kind, job) for d, job in zip(group, jobs)]
            if evaluation is not None:
                for record, d, job in zip(records[-len(group):], group, jobs):
                    after = str(job.job_id)
                    record["eval_job_id"] = str(submit_eval(kind, folder, cluster, sweep, d.run_dir, evaluation, after).job_id)
            continue
        for d, fn in zip(group, fns):  # one at a time: runs on one machine would only slow each other down
            job = launch(lambda: executor.submit(fn))
            records.append(_record(d, kind, job))
            _wait_local(job, d)
            if evaluation is not None and read_status(d.run_dir).get("state") == "completed":
                records[-1]["eval_job_id"] = _eval_locally(folder, cluster, sweep, d, evaluation)
    return records


def _eval_locally(folder: Path, cluster: ClusterConfig, sweep: str, d: Decision, evaluation) -> str:
    eval_job = submit_eval("local", folder, cluster, sweep, d.run_dir, evaluation)
    print(f"evaluating {d.run.spec.run_id} locally (job {eval_job.job_id}, log {eval_job.paths.stderr})",
          file=sys.stderr, flush=True)  # fmt: skip
    eval_job.wait()
    if eval_job.state != "DONE" and eval_job.exception() is not None:
        print(f"evaluation of {d.run.spec.run_id} failed: see {eval_job.paths.stderr}", file=sys.stderr, flush=True)
    return str(eval_job.job_id)


def decide_and_submit(
    runs: list[PlannedRun], root: Path, sweep: str, cluster: ClusterConfig, kind: ExecutorKind, *,
    dry_run: bool = False, retry_failed: bool = False, retry_stale: bool = False, stale_s: float | None = None,
    train_fn=None, evaluation=None,
) -> tuple[list[Decision], list[dict]]:
    """`submit`: decided and submitted under the sweep's lock, so a second submission decides only
    once the first's jobs are recorded (and finds them queued)."""
    if dry_run:
        return decide(runs, root, retry_failed, retry_stale, stale_s), []
    with sweep_lock(root, sweep):
        decisions = decide(runs, root, retry_failed, retry_stale, stale_s)
        return decisions, submit(decisions, cluster, kind, root, sweep, train_fn, evaluation)


def _record(d: Decision, kind: ExecutorKind, job) -> dict:
    return {"run_id": d.run.spec.run_id, "action": d.action, **_record_job(d.run_dir, kind, job)}


def _submit_array(executor, fns: list) -> list:
    with executor.batch():
        jobs = [executor.submit(fn) for fn in fns]
    return jobs


def launch(submission):
    """Run a submitit submission outside any job's SLURM env; failures become one RunFailure line."""
    import submitit

    conf = os.environ.get("SLURM_CONF")
    try:
        with submitit.helpers.clean_env():  # a submission from inside a job must not inherit its SLURM env
            # ...but clean_env drops SLURM_CONF too: sbatch would read /etc/slurm/slurm.conf and queue
            # the jobs on another cluster than the one squeue, scancel and `status` ask.
            if conf is not None:
                os.environ["SLURM_CONF"] = conf
            return submission()
    except (subprocess.CalledProcessError, *submitit_compat.submission_errors(), OSError) as e:
        raise RunFailure(f"submission failed: {e}") from e


def _wait_local(job, decision: Decision) -> None:
    print(f"running {decision.run.spec.run_id} locally (job {job.job_id}, log {job.paths.stderr})",
          file=sys.stderr, flush=True)
    from nlq_scale.cluster.progress import ProgressLine

    line = ProgressLine(decision.run.spec.run_id, decision.run_dir)
    while not job.done():
        line.update()
        time.sleep(1.0)
    line.finish(read_status(decision.run_dir).get("state") or "no status")

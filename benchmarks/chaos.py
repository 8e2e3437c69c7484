"""Chaos at sweep scale (issue 62): a sweep of 40 short real runs on a 4-node local SLURM cluster of its
own, under a seeded random schedule of faults at once (preemptions by `scontrol requeue` and by
`scancel --signal=USR2`, a node lost mid-run and later resumed, a run's processes stopped (hung), a full
disk under one run directory for a while, a second `submit` at the same moment as the first, a
`status --watch` reader throughout), with a user who does what docs/slurm.md says after each fault and
nothing else; then the same sweep undisturbed. Prints one JSON line per seed: faults by kind, runs
completed, completed more than once, lost or left running/stale, final validation losses equal to the
undisturbed sweep's, wall time against the undisturbed. Goal: every run completed exactly once, every
final loss bit-equal, wall time within 2x. Not in CI: minutes; root (it starts daemons and mounts a tmpfs).

    .venv/bin/python benchmarks/chaos.py [--seeds 1 2] [--seeds-per-cell 10] [--steps 8]

The cluster (slurm/local-cluster/start.sh with NLQ_SLURM_STATE=/var/lib/nlq-slurm-chaos, ports 16917 and
17101-17104) runs beside the tests' and is stopped at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nlq_scale.cluster.executors import slurm_queue_states  # noqa: E402
from nlq_scale.cluster.status import collect  # noqa: E402
from tests.conftest import nlq  # noqa: E402
from tests.test_cluster_reliability import lose_node  # noqa: E402
from tests.test_cluster_slurm import job_processes  # noqa: E402

LOCAL_CLUSTER = REPO / "slurm" / "local-cluster"
NODES = 4
CLUSTER_ENV = {"NLQ_SLURM_STATE": "/var/lib/nlq-slurm-chaos", "NLQ_SLURM_NODES": str(NODES),
               "NLQ_SLURM_CTLD_PORT": "16917", "NLQ_SLURM_NODE_PORTS": f"17101-{17100 + NODES}"}  # fmt: skip
# The user's bound for a hung run (`--stale-after`, docs/slurm.md "Stale runs"): steps take a second
# here, so the 300 s default would only make the benchmark wait.
STALE_AFTER_S = 60
DISK_FULL_S = 20  # how long the run directory's filesystem stays full
NODE_DOWN_S = 20  # how long the lost node stays down before it is brought back
POLL_S = 5  # how often the user looks at `status`


# ---------------------------------------------------------------- the cluster and the sweep


@contextlib.contextmanager
def chaos_cluster() -> Iterator[None]:
    """Its own cluster (state dir, ports, munge): the tests' cluster is never touched."""
    out = subprocess.run(["bash", str(LOCAL_CLUSTER / "start.sh")], env=os.environ | CLUSTER_ENV, capture_output=True,
                         text=True, timeout=600, check=True)  # fmt: skip
    os.environ["SLURM_CONF"] = out.stdout.strip().splitlines()[-1].split("=", 1)[1]
    try:
        yield
    finally:
        subprocess.run(["bash", str(LOCAL_CLUSTER / "stop.sh")], env=os.environ | CLUSTER_ENV, capture_output=True,
                       timeout=300)  # fmt: skip


def restart_lost_daemons() -> None:
    """What the admin does once the node is repaired: start.sh starts the missing slurmd, resumes it."""
    subprocess.run(["bash", str(LOCAL_CLUSTER / "start.sh")], env=os.environ | CLUSTER_ENV, capture_output=True,
                   timeout=600, check=True)  # fmt: skip


def write_sweep(work: Path, data: Path, seeds: int, steps: int) -> tuple[Path, Path]:
    """40 one-node runs (2 scales x 2 arms x `seeds` seeds), each checkpointing twice before its end."""
    import yaml

    sweep = {"name": "chaos", "scales": ["cpu-xs", "cpu-s"], "arms": ["linear", "nonlinear"],
             "seeds": list(range(1, seeds + 1)), "data": {"path": str(data), "seed": 0}, "parallel": {"nodes": 1},
             "overrides": {"logging.wandb": False, "train.steps": steps, "train.warmup_steps": 2,
                           "train.eval_every": steps // 2, "train.log_every": steps // 2,
                           "checkpoint.every": (steps - 1) // 2}}  # fmt: skip
    cluster = {"name": "chaos-local", "device": "cpu", "nodes": NODES, "gpus_per_node": 1, "gpu_memory_gb": 4,
               "overhead_gb": 0, "peak_tflops": 0.1, "assumed_mfu": 0.2, "partition": "batch", "time_limit_min": 60,
               "array_parallelism": NODES, "max_num_timeout": 3, "signal_delay_s": 30}  # fmt: skip
    (work / "chaos.yaml").write_text(yaml.safe_dump(sweep))
    (work / "chaos-local.yaml").write_text(yaml.safe_dump(cluster))
    return work / "chaos.yaml", work / "chaos-local.yaml"


@dataclass
class Sweep:
    sweep_file: Path
    cluster_file: Path
    root: Path
    actions: list[str] = field(default_factory=list)  # the submits the user ran after the first

    @property
    def dir(self) -> Path:
        return self.root / "chaos"

    def submit(self, *flags: str) -> subprocess.CompletedProcess:
        out = nlq("submit", str(self.sweep_file), "--root", str(self.root), "--cluster", str(self.cluster_file),
                  "--stale-after", str(STALE_AFTER_S), *flags)  # fmt: skip
        if out.returncode != 0:
            raise RuntimeError(f"submit {' '.join(flags)} failed: {out.stderr[-2000:]}")
        return out

    def rows(self) -> list[dict]:
        """What `nlq-scale status --json --stale-after` shows (in process: the CPUs are the runs')."""
        return collect(self.dir, STALE_AFTER_S) if self.dir.exists() else []


def running_jobs(sweep: Sweep) -> list[dict]:
    """Rows of runs training right now, past their first step and two short of their last (so that
    their job still runs when the fault lands), whose job SLURM has RUNNING: `status` shows a
    requeued run `running` while its job completes or waits, and a fault there would hit nothing."""
    rows = [r for r in sweep.rows()
            if r["state"] == "running" and 1 <= (r["step"] or 0) <= (r["total_steps"] or 0) - 2 and r["slurm_job_id"]]
    slurm = slurm_queue_states(r["slurm_job_id"] for r in rows) or {}
    return [r for r in rows if slurm.get(r["slurm_job_id"]) == "RUNNING"]


def node_of(job_id: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True,
                          timeout=60).stdout.strip()  # fmt: skip


# ---------------------------------------------------------------- the user


def user_flags(rows: list[dict], disk_full: bool) -> list[str] | None:
    """The submit docs/slurm.md gives for what `status` shows: failed -> --retry-failed, stale ->
    --retry-stale, dead (its job gone) -> a plain submit, which resumes it; a run that failed or died
    of a full disk only once space is freed. None: nothing to do."""
    rows = [r for r in rows if not (disk_full and "no space left" in (r["error"] or "").lower())]
    states = {r["state"] for r in rows}
    flags = (["--retry-failed"] if "failed" in states else []) + (["--retry-stale"] if "stale" in states else [])
    return flags if flags or "dead" in states else None


def tend(sweep: Sweep, deadline: float, disk_full: threading.Event) -> None:
    """Look at `status` every few seconds and act on it, until every run completed or the deadline."""
    while time.time() < deadline:
        rows = sweep.rows()
        if rows and all(r["state"] == "completed" for r in rows):
            return
        flags = user_flags(rows, disk_full.is_set())
        if flags is not None:
            action = " ".join(["submit", *flags])
            try:
                sweep.submit(*flags)
            except RuntimeError as e:  # its one-line error read, the user looks again (and counted)
                action += f" -> {str(e).strip().splitlines()[-1][:200]}"
            sweep.actions.append(action)
        time.sleep(POLL_S)


# ---------------------------------------------------------------- the faults


def preempt_requeue(sweep: Sweep, job: str) -> str:
    subprocess.run(["scontrol", "requeue", job], capture_output=True, timeout=60)
    return job


def preempt_signal(sweep: Sweep, job: str) -> str:
    """SLURM's preemption signal (submitit's USR2) to the job's step 0, where submitit runs training:
    the run checkpoints and requeues itself. (Signalled as a whole, a task of an array with tasks
    still pending gets USR2 again and again while scancel retries for 95 s, then fails: docs/slurm.md.)"""
    subprocess.run(["scancel", "--signal=USR2", f"{job}.0"], capture_output=True, timeout=60, check=True)
    return job


def hang(sweep: Sweep, job: str) -> str:
    """Stopped, not killed: the job stays allocated and silent."""
    for pid in job_processes(job):
        os.kill(pid, signal.SIGSTOP)
    return job


def node_lost(sweep: Sweep, job: str) -> str:
    """A node dies under a run (its slurmd and the job's processes there SIGKILLed), the admin sets it
    down; the user does what docs/slurm.md "Lost nodes" says; the node comes back later."""
    node = node_of(job)
    lose_node(node, job)
    subprocess.run(["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=chaos"], capture_output=True,
                   timeout=60)  # fmt: skip
    sweep.submit("--retry-failed", "--retry-stale")
    sweep.actions.append("submit --retry-failed --retry-stale")
    time.sleep(NODE_DOWN_S)
    restart_lost_daemons()
    return f"{job}@{node}"


@contextlib.contextmanager
def small_disk(run_dir: Path, size_mb: int = 256) -> Iterator[Path]:
    """The run directory on a filesystem of its own, so that only it can be filled."""
    run_dir.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(run_dir)], check=True)
    try:
        yield run_dir
    finally:
        subprocess.run(["umount", "-l", str(run_dir)], capture_output=True)


def fill_disk(sweep: Sweep, run_dir: Path, disk_full: threading.Event) -> str:
    """Once the run trains: its filesystem full for DISK_FULL_S, then the space freed."""
    while not (run_dir / "status.json").exists() or (collect(run_dir)[0]["step"] or 0) < 1:
        time.sleep(0.5)
    filler = run_dir / ".filler"
    disk_full.set()
    subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=1M"], capture_output=True)  # until ENOSPC
    time.sleep(DISK_FULL_S)
    filler.unlink(missing_ok=True)  # gone with the tmpfs if the sweep has already ended
    disk_full.clear()
    return run_dir.name


FAULTS = {"preempt_requeue": preempt_requeue, "preempt_signal": preempt_signal, "hang": hang, "node_lost": node_lost}


def schedule(rng: random.Random, span_s: float) -> list[tuple[float, str]]:
    """2-4 preemptions of each kind, one hang, one lost node, at random times in the first 70% of the
    undisturbed sweep's wall time (while runs are still queued behind the ones hit)."""
    kinds = ["preempt_requeue"] * rng.randint(2, 4) + ["preempt_signal"] * rng.randint(2, 4) + ["hang", "node_lost"]
    return sorted((rng.uniform(0.05, 0.7) * span_s, kind) for kind in kinds)


def inject(sweep: Sweep, plan: list[tuple[float, str]], rng: random.Random, start: float, log: list[dict]) -> None:
    for at_s, kind in plan:
        time.sleep(max(0.0, start + at_s - time.time()))
        while not (jobs := running_jobs(sweep)):  # a fault needs a run in flight
            time.sleep(0.5)
        try:
            target = FAULTS[kind](sweep, rng.choice(jobs)["slurm_job_id"])
        except (OSError, subprocess.SubprocessError, RuntimeError) as e:  # e.g. the run ended between look and act
            target = f"missed: {e!r}"
        log.append({"kind": kind, "at_s": round(time.time() - start, 1), "target": target})


# ---------------------------------------------------------------- one sweep, with or without chaos


def watch(sweep: Sweep, until: threading.Event) -> dict:
    """`status --watch` throughout; it ends by itself when no run is queued or running (between a failure
    and the user's resubmit): then it is started again. Its failures are counted."""
    stats = {"readers": 0, "errors": []}
    while not until.is_set():
        proc = subprocess.Popen([sys.executable, "-m", "nlq_scale.cli", "status", str(sweep.dir), "--watch", "2",
                                 "--stale-after", str(STALE_AFTER_S)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, cwd=REPO)  # fmt: skip
        stats["readers"] += 1
        while proc.poll() is None and not until.is_set():
            time.sleep(1)
        proc.terminate()
        err = proc.communicate()[1]
        if proc.returncode not in (0, -signal.SIGTERM) or "Traceback" in err:
            stats["errors"].append(err[-500:])
        until.wait(2)
    return stats


def run_sweep(sweep: Sweep, seed: int | None, span_s: float, timeout_s: float) -> dict:
    rng = random.Random(seed)
    disk_full = threading.Event()
    faults: list[dict] = []
    workers: list[threading.Thread] = []
    with contextlib.ExitStack() as stack:
        start = time.time()
        if seed is None:
            sweep.submit()
        else:
            target = sweep.dir / rng.choice(sweep_run_ids(sweep))
            stack.enter_context(small_disk(target))
            second = threading.Thread(target=sweep.submit)  # a second submit at the same moment
            second.start()
            sweep.submit()
            second.join()
            faults.append({"kind": "concurrent_submit", "at_s": 0.0, "target": "sweep"})
            workers.append(threading.Thread(target=lambda: faults.append(
                {"kind": "full_disk", "target": fill_disk(sweep, target, disk_full)})))
            workers.append(threading.Thread(target=inject, args=(sweep, schedule(rng, span_s), rng, start, faults)))
        done = threading.Event()
        watched: dict = {}
        reader = threading.Thread(target=lambda: watched.update(watch(sweep, done)))
        for t in [*workers, reader]:
            t.daemon = True
            t.start()
        tend(sweep, start + timeout_s, disk_full)
        wall_s = time.time() - start
        done.set()
        reader.join(timeout=30)
        rows = sweep.rows()
        return {"wall_s": wall_s, "rows": rows, "faults": faults, "watch": watched,
                "ends": {r["run"]: ends(sweep.dir / r["run"]) for r in rows}}  # fmt: skip


def sweep_run_ids(sweep: Sweep) -> list[str]:
    from nlq_scale.cluster.sweep import expand, load_sweep

    return [spec.run_id for spec in expand(load_sweep(sweep.sweep_file))]


def ends(run_dir: Path) -> int:
    """How often the run trained to its end (an `end` event each time): more than once is duplicated work."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    return sum(json.loads(line).get("event") == "end" for line in lines if line.strip())


def summary(seed: int, chaos: dict, reference: dict, user: list[str]) -> dict:
    ref = {r["run"]: r["val_loss"] for r in reference["rows"]}
    got = {r["run"]: r for r in chaos["rows"]}
    states = Counter(r["state"] for r in chaos["rows"])
    diffs = [abs(got[k]["val_loss"] - v) for k, v in ref.items()
             if k in got and got[k]["val_loss"] is not None and v is not None]  # fmt: skip
    return {
        "seed": seed,
        "runs": len(ref),
        "faults": dict(Counter(f["kind"] for f in chaos["faults"])),
        "faults_missed": sum(str(f.get("target", "")).startswith("missed") for f in chaos["faults"]),
        "user_submits": dict(Counter(a.split(" -> ")[0] for a in user)),
        "user_submits_refused": sum(" -> " in a for a in user),
        "completed": states.get("completed", 0),
        "completed_more_than_once": sum(n > 1 for n in chaos["ends"].values()),
        "lost": len(ref) - len(got) + sum(s not in ("completed", "running", "stale") for s in
                                          (r["state"] for r in chaos["rows"])),  # fmt: skip
        "left_running_or_stale": states.get("running", 0) + states.get("stale", 0),
        "final_loss_equal": sum(d == 0.0 for d in diffs),
        "final_loss_max_abs_diff": max(diffs, default=None),
        "watch_readers": chaos["watch"].get("readers"),
        "watch_errors": len(chaos["watch"].get("errors", [])),
        "wall_s": round(chaos["wall_s"], 1),
        "undisturbed_wall_s": round(reference["wall_s"], 1),
        "wall_ratio": round(chaos["wall_s"] / reference["wall_s"], 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1], help="one disturbed sweep (and JSON line) per seed")
    p.add_argument("--seeds-per-cell", type=int, default=10, help="training seeds per scale and arm (40 runs)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--work", type=Path, help="keep the run roots here (default: a temporary dir, removed)")
    a = p.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="nlq-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        with chaos_cluster():
            data = work / "data"
            if not data.exists():
                nlq("prepare-data", "--sample", "--out", str(data), "--seq-len", "64", "--no-progress")
            sweep_file, cluster_file = write_sweep(work, data, a.seeds_per_cell, a.steps)
            reference = run_sweep(Sweep(sweep_file, cluster_file, work / "undisturbed"), None, 0, 3600)
            for seed in a.seeds:
                sweep = Sweep(sweep_file, cluster_file, work / f"chaos-{seed}")
                chaos = run_sweep(sweep, seed, reference["wall_s"], 4 * reference["wall_s"])
                print(json.dumps(summary(seed, chaos, reference, sweep.actions)), flush=True)
                (work / f"chaos-{seed}.log.json").write_text(json.dumps(  # what was hit when, for a closer look
                    {"faults": chaos["faults"], "user": sweep.actions, "watch": chaos["watch"]}, indent=1))
    finally:
        if a.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

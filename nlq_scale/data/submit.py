"""`prepare-data --parts N --executor {slurm,local}`.

slurm: the N parts as one SLURM job array (submitit, with the cluster file's partition, account,
time limit and setup lines) and the merge as a job that starts once every part has succeeded
(`afterok` on the array; killed by SLURM if a part fails).
local: the N parts as processes of this machine, then the merge in this one.
"""

from __future__ import annotations

import datetime
import os
import shutil
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

from nlq_scale.data.parts import merge_parts, parts_dir, prepare_part
from nlq_scale.data.prepare import PrepareOptions, check_out_dir, input_files, planned_inputs
from nlq_scale.errors import UsageError


def run_part(options: dict, index: int, count: int, workers: int | None = None) -> dict:
    """One part in a process of its own; tokenizer threads: `workers`, else the CPUs it may use."""
    opts = PrepareOptions(**options, workers=workers or len(os.sched_getaffinity(0)))
    return prepare_part(opts, index, count, progress=False)


def run_locally(opts: PrepareOptions, count: int, *, keep_parts: bool = False) -> dict:
    """The parts as `count` processes here (--workers split among them), then the merge here (the
    MDS writer is imported while the parts run)."""
    options = opts.model_dump(mode="json", exclude={"workers"})
    threads = max(opts.workers // count, 1)
    # fork: no thread runs here yet, and the parts start without importing anything again
    with ProcessPoolExecutor(max_workers=count, mp_context=get_context("fork")) as pool:
        running = [pool.submit(run_part, options, i, count, threads) for i in range(1, count + 1)]
        import nlq_scale.compat.streaming  # noqa: F401  (a second of imports, off the critical path)

        for part in running:
            part.result()
    return merge_parts(opts.out, force=opts.force, keep_parts=keep_parts, progress=False, workers=opts.workers)


def run_merge(out: str, force: bool, keep_parts: bool) -> dict:
    return merge_parts(Path(out), force=force, keep_parts=keep_parts, progress=False,
                       workers=len(os.sched_getaffinity(0)))


def _executor(cluster, folder: Path, name: str):
    from nlq_scale.cluster.executors import make_executor
    from nlq_scale.cluster.plan import Layout

    one_task = Layout(nodes=1, tasks_per_node=1, tp=1, pp=1, dp=1, micro_batch_size=1, grad_accum=1,
                      recompute="none", sequence_parallel=False)
    cpu_only = cluster.model_copy(update={"device": "cpu"})  # tokenizing needs no GPU: ask for none
    return make_executor("slurm", folder, cpu_only, one_task, name)


def submit_parts(opts: PrepareOptions, count: int, cluster_name: str, *, keep_parts: bool = False) -> dict:
    """Queue the parts and the merge; returns their job ids and where submitit keeps the logs."""
    from nlq_scale.cluster.executors import launch
    from nlq_scale.cluster.plan import load_cluster

    if shutil.which("sbatch") is None:
        raise UsageError("--executor slurm: sbatch not found (no SLURM here)")
    cluster = load_cluster(cluster_name)
    check_out_dir(opts, planned_inputs(input_files(opts)))  # also checks every input exists, before queueing
    out = opts.out.resolve()
    options = opts.model_dump(mode="json", exclude={"workers"})
    options.update(out=str(out), inputs=[str(Path(p).resolve()) for p in options["inputs"]])  # jobs start elsewhere
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    folder = parts_dir(out) / "_submitit" / f"{stamp}-{os.getpid()}"
    executor = _executor(cluster, folder, f"prepare-{out.name}")
    parts = launch(lambda: executor.map_array(run_part, [options] * count, range(1, count + 1), [count] * count))
    array_id = parts[0].job_id.split("_")[0]
    executor.update_parameters(slurm_array_parallelism=1, slurm_additional_parameters={
        "requeue": True, "dependency": f"afterok:{array_id}", "kill-on-invalid-dep": "yes"})
    merge = launch(lambda: executor.submit(run_merge, str(out), opts.force, keep_parts))
    return {"out": str(out), "outcome": "submitted", "parts": count, "parts_job": array_id,
            "merge_job": str(merge.job_id), "logs": str(folder)}

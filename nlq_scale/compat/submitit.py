"""submitit internals: the preemption signal and handler of a job, the local executor's controller
process, the command line of a job's task, the result pickle a job leaves, and the submission
errors (cluster/ and data/submit.py go through here)."""

from __future__ import annotations

import sys
from pathlib import Path

from nlq_scale.compat import Private

DISTRIBUTION = "submitit"
WRITTEN_FOR = "==1.5.*"  # read against 1.5.4

# The local executor starts its controller as `python -m <this> <folder>`: its pid is the job id.
LOCAL_CONTROLLER_MODULE = "submitit.local._local"
# Both executors start each task of a job as `python -u -m <this> <folder>`.
JOB_MODULE = "submitit.core._submit"

RELIES_ON = (
    Private("submitit.core.job_environment:JobEnvironment", "_usr_sig", params=()),
    Private("submitit.core.job_environment", "SignalHandler"),
    Private("submitit.local.local:start_controller", f'"{LOCAL_CONTROLLER_MODULE}"', in_source=True),
    Private("submitit.local.local:LocalExecutor", f'"-u -m {JOB_MODULE}"', in_source=True),
    Private("submitit.slurm.slurm:SlurmExecutor", f'"-u -m {JOB_MODULE}"', in_source=True),
    Private("submitit.core.utils:JobPaths", "__init__", params=("folder", "job_id", "task_id")),
    Private("submitit.core.utils:JobPaths", "result_pickle"),
    Private("submitit.core.submission:process_job", '("error", traceback.format_exc())', in_source=True),
    Private("submitit.core.utils", "FailedJobError"),
    Private("submitit.core.utils", "FailedSubmissionError"),
)


def preemption_signal(env) -> int:
    """The signal submitit's handler in this job (`env`, a submitit.JobEnvironment) requeues on."""
    return env._usr_sig()


def in_job_process() -> bool:
    """This process is a task of a submitit job (which reads the job's pickle when it starts)."""
    return any(a == "-m" and b == JOB_MODULE for a, b in zip(sys.orig_argv, sys.orig_argv[1:]))


def is_job_handler(handler: object) -> bool:
    """Whether `handler` (from signal.getsignal) is a submitit job's preemption handler."""
    from submitit.core.job_environment import SignalHandler

    return isinstance(getattr(handler, "__self__", None), SignalHandler)


def result_pickle(folder: str | Path, job_id: str) -> Path:
    """Where task 0 of a job leaves ("success", result) or ("error", traceback text)."""
    from submitit.core.utils import JobPaths

    return JobPaths(folder, job_id=job_id, task_id=0).result_pickle


def submission_errors() -> tuple[type[Exception], ...]:
    from submitit.core.utils import FailedJobError, FailedSubmissionError

    return FailedJobError, FailedSubmissionError

"""What one submitted job runs: `TrainJob`, a submitit Checkpointable around `train_run`.

Signal flow. submitit's `process_job` installs its handler for the preemption signal (USR2:
checkpoint the callable, requeue through `scontrol requeue` or the local controller, exit) before it
calls us. `train_run` replaces it with its own USR1/USR2/TERM handlers for the duration of training
(they only set a flag: the loop finishes the step, saves a checkpoint and returns "preempted") and
restores it afterwards. So when training comes back "preempted" because USR2 arrived, the checkpoint
is already on disk and we re-raise USR2: submitit's own handler then does what it does on any
preemption or timeout, on global rank 0 only - dumps `self.checkpoint()` (the same TrainJob, which
resumes from its run dir), decrements the timeout budget if the time limit is near, and requeues.
A run stopped by TERM alone (scancel, or the kill after a grace time) is not requeued: cancelling
must stay possible. Which signals arrived is read from a wakeup fd, because train_run's handlers,
not ours, are installed while they arrive.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable

import submitit

from nlq_scale.compat import submitit as submitit_compat
from nlq_scale.config.schema import RunConfig

TrainFn = Callable[[RunConfig, Path], str]


class ReceivedSignals:
    """Records every signal that reaches a Python-level handler inside the block, whoever's it is."""

    def __enter__(self) -> ReceivedSignals:
        self.signals: set[int] = set()
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._previous = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        return self

    def __exit__(self, *exc: Any) -> None:
        signal.set_wakeup_fd(self._previous)
        try:
            while chunk := os.read(self._read, 4096):
                self.signals.update(chunk)
        except BlockingIOError:
            pass
        os.close(self._read)
        os.close(self._write)


def submitit_handles(sig: int) -> bool:
    """True inside a submitit job whose preemption handler is (again) installed for sig."""
    return submitit_compat.is_job_handler(signal.getsignal(sig))


class TrainJob(submitit.helpers.Checkpointable):
    """Trains one run in its run dir. Picklable: holds the config as plain data, not the model object.

    train_fn: None means `nlq_scale.train.api.train_run` (imported inside the job); tests pass their
    own function with the same contract.
    """

    def __init__(self, config: dict[str, Any], run_dir: str, train_fn: TrainFn | None = None) -> None:
        self.config = config
        self.run_dir = run_dir
        self.train_fn = train_fn

    def __call__(self) -> str:
        cfg = RunConfig.model_validate(self.config)
        if self.train_fn is None and submitit_compat.in_job_process():
            from nlq_scale.runtime.allocator import restart_with

            # The task starts over on runtime.cpu_allocator, before torch is imported: the same pid
            # (srun and the local controller keep tracking it), and it reads the same pickle.
            restart_with(cfg.runtime.cpu_allocator)
        from nlq_scale.runtime.dist import STORE_HOSTED, job_master_port

        env = submitit.JobEnvironment()
        # submitit would draw the port from 20000-60000, mostly inside the ephemeral range.
        os.environ["MASTER_PORT"] = str(job_master_port(env.job_id))
        os.environ.pop(STORE_HOSTED, None)  # this job's rank 0 serves the store, whatever the submitter had
        # The runtime picks its device from LOCAL_RANK, so every GPU of the node stays visible.
        submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
        train = self.train_fn or _train_run()
        preempt_signal = submitit_compat.preemption_signal(env)
        with ReceivedSignals() as received:
            state = train(cfg, Path(self.run_dir))
        print(f"nlq-scale job {env.job_id} rank {env.global_rank}: {state}", file=sys.stderr, flush=True)
        if state == "preempted" and preempt_signal in received.signals and submitit_handles(preempt_signal):
            # submitit's handler requeues on global rank 0 (and exits there); other ranks return.
            signal.raise_signal(preempt_signal)
        return state


def _train_run() -> TrainFn:
    from nlq_scale.train.api import train_run

    return train_run


class EvalJob:
    """`nlq-scale eval` of a run's newest checkpoint, as a job submitted after its training job.
    Picklable: plain data."""

    def __init__(self, run_dir: str, tasks: list[str], limit: int | None, batch_size: int) -> None:
        self.run_dir, self.tasks, self.limit, self.batch_size = run_dir, tasks, limit, batch_size

    def __call__(self) -> dict:
        from nlq_scale.evaluate.run import evaluate

        return evaluate(Path(self.run_dir), self.tasks, None, self.limit, self.batch_size)

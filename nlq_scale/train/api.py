"""Per-rank entry of a training run (what torchrun, srun, submitit and `--nproc` execute)."""

from __future__ import annotations

import contextlib
import sys
import traceback
from pathlib import Path

from nlq_scale.config.schema import RunConfig
from nlq_scale.errors import RunFailure, UsageError
from nlq_scale.runtime.device import deterministic_kernels
from nlq_scale.runtime.dist import World, detect_env, distributed
from nlq_scale.runtime.quiet import quiet_libraries
from nlq_scale.train.rundir import Status, claim, last_validation, read_status


def placement_checked(cfg: RunConfig, world: World) -> contextlib.AbstractContextManager:
    """runtime.check_device: on the CPU, host and device tensors are kept apart as on a GPU."""
    if cfg.runtime.check_device and not world.device.is_cuda:
        from nlq_scale.runtime.device_check import checking_devices

        return checking_devices()
    return contextlib.nullcontext()


def _already_completed(run_dir: Path, cfg: RunConfig) -> bool:
    status = read_status(run_dir)
    return status.get("state") == "completed" and status.get("step", 0) >= cfg.train.steps


def train_run(cfg: RunConfig, run_dir: Path) -> str:
    """Train (or resume) `cfg` in `run_dir`; returns "completed", "preempted" or "diverged".

    Expects the torch.distributed env (RANK, WORLD_SIZE, ...) or none for one process. A run dir
    holding a different config raises UsageError before anything is written.
    """
    quiet_libraries()
    from nlq_scale.train.loop import Trainer

    run_dir = Path(run_dir)
    env = detect_env()
    claim(run_dir, cfg, create=env.rank == 0)  # every rank refuses a conflicting run dir up front
    if _already_completed(run_dir, cfg):
        if env.rank == 0:
            val = last_validation(run_dir)
            print(f"[nlq-scale] nothing to do: {run_dir} already completed its {cfg.train.steps} steps"
                  + (f" (val loss {val[1]:.4f})" if val else ""), file=sys.stderr, flush=True)
        return "completed"
    with (
        distributed(cfg.parallel, env, cfg.runtime.device) as world,
        placement_checked(cfg, world),
        deterministic_kernels(world.device, cfg.runtime.deterministic),
    ):
        trainer = None
        try:
            trainer = Trainer(cfg, run_dir, world)
            return trainer.run()
        except Exception as e:
            expected = isinstance(e, (UsageError, RunFailure))  # already one line naming file and cause
            if env.rank == 0:
                Status(run_dir, cfg.train.steps, world.num_nodes).update(
                    state="failed", error=str(e) if expected else f"{type(e).__name__}: {e}".strip()
                )
                if not expected:
                    traceback.print_exc()
            raise
        finally:
            if trainer is not None:
                trainer.feed.close()  # streaming's shared memory and locks, on every exit path

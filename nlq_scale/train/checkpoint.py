"""Checkpoint directories, independent of the engine that fills them.

checkpoints/
  step_<N>/            one complete checkpoint: the engine's sharded files, trainer.pt (step,
                       tokens, data-loader state, divergence tracker), rng/rank_<r>.pt, and
                       complete.json (written last: file sizes, for detecting truncation)
  latest               names the newest complete step_<N>; updated after the rename
  .tmp_step_<N>/       a save in progress (renamed when complete, removed when it fails); a
                       background save (checkpoint.async_save) stays here until every rank's
                       write has ended, so a crash meanwhile leaves the previous step_<N> newest

Retention: the newest `keep` complete checkpoints, every `keep_every`-th step's, and always the
one just saved: the only loadable checkpoint is never deleted. A failed save (full disk, quota)
deletes nothing but its own partial directory. Every file is read as data (train/untrusted.py).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from nlq_scale.errors import RunFailure
from nlq_scale.train import untrusted
from nlq_scale.train.rundir import CHECKPOINTS_DIR, atomic_write

COMPLETE = "complete.json"
# Errors that mean the filesystem is out of room, whoever raised them.
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
_LOW_SPACE = 1 << 20  # bytes free below which a failed write is put down to a full disk


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def rng_state() -> dict[str, Any]:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@dataclass(frozen=True)
class PendingSave:
    """A save started but not committed: its files are (being) written into `tmp`."""

    step: int
    tmp: Path


class CheckpointDir:
    def __init__(self, run_dir: Path, keep: int, keep_every: int = 0) -> None:
        self.root = run_dir / CHECKPOINTS_DIR
        self.keep = keep
        self.keep_every = keep_every

    def _step_dirs(self) -> list[Path]:
        dirs = [p for p in self.root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
        return sorted(dirs, key=lambda p: int(p.name[5:]), reverse=True)

    def problem(self, ckpt: Path) -> str | None:
        """Why this checkpoint cannot be used, or None when it is complete and intact."""
        marker = ckpt / COMPLETE
        try:
            expected = json.loads(marker.read_text())["files"]
        except (OSError, ValueError, KeyError):
            return f"{ckpt}: incomplete (no readable {COMPLETE})"
        for rel, size in expected.items():
            path = ckpt / rel
            if not path.is_file():
                return f"{ckpt}: missing {rel}"
            if path.stat().st_size != size:
                return f"{ckpt}: {rel} is truncated ({path.stat().st_size} of {size} bytes)"
        return None

    def newest_complete(self, report: Callable[[str], None]) -> Path | None:
        """The newest intact checkpoint; broken newer ones are reported and skipped."""
        for ckpt in self._step_dirs():
            problem = self.problem(ckpt)
            if problem is None:
                return ckpt
            report(f"skipping checkpoint {problem}")
        return None

    def save(self, step: int, rank: int, fill: Callable[[Path], None], trainer_state: dict) -> Path:
        """Collective: every rank calls it. `fill(tmp_dir)` writes the engine's shards. A failed write
        on any rank removes the partial directory and raises RunFailure (one line) on every rank."""
        return self.commit(self.start(step, rank, fill, trainer_state), rank)

    def start(self, step: int, rank: int, fill: Callable[[Path], None], trainer_state: dict) -> PendingSave:
        """Collective: a save up to its commit. `fill` may leave the engine's shards being written in
        the background (written() then says when they are); RNG and trainer state are written here."""
        tmp = self.root / f".tmp_step_{step}"
        with self._saving(tmp, rank):
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
        with self._saving(tmp, rank), _failures_said_once():
            fill(tmp)  # the engine's shards first: dist_checkpointing wants an empty directory
            (tmp / "rng").mkdir(exist_ok=True)
            torch.save(rng_state(), tmp / "rng" / f"rank_{rank}.pt")
            if rank == 0:
                torch.save(trainer_state, tmp / "trainer.pt")
        return PendingSave(step, tmp)

    def written(self, pending: PendingSave, rank: int, engine_done: Callable[[], bool]) -> bool:
        """Collective: whether the engine's background write of `pending` has ended on every rank
        (`engine_done` asks the engine). A failed write is the save's failure, as in `save`."""
        with self._saving(pending.tmp, rank), _failures_said_once():
            return engine_done()

    def commit(self, pending: PendingSave, rank: int) -> Path:
        """Collective, once every rank's files are written: complete.json, the rename, `latest`, retention."""
        final = self.root / f"step_{pending.step}"
        tmp = pending.tmp
        with self._saving(tmp, rank):
            if rank == 0:
                atomic_write(tmp / COMPLETE, json.dumps({"step": pending.step, "files": _files(tmp)}, indent=1))
                if final.exists():  # a re-save of the same step (e.g. signal right after a periodic save)
                    shutil.rmtree(final)
                os.replace(tmp, final)
                atomic_write(self.root / "latest", final.name + "\n")
                self._prune(protect=final)
        return final

    @contextlib.contextmanager
    def _saving(self, tmp: Path, rank: int) -> Iterator[None]:
        """One phase of a save, ended by a barrier that also tells every rank whether any failed."""
        error: BaseException | None = None
        try:
            yield
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - a full disk, a quota, a dead filesystem: reported
            error = e  # below, on every rank (torch's CheckpointException is a BaseException)
        if not _any_rank(error is not None):
            return
        cause = self._cause(error, tmp)  # before the partial files go: they count as space it needed
        dist.barrier()
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        raise RunFailure(f"checkpoint {tmp}: save failed: {cause}") from error

    def _previous_size(self) -> int:
        newest = self.newest_complete(lambda _: None)
        return sum(json.loads((newest / COMPLETE).read_text())["files"].values()) if newest else 0

    def _cause(self, error: BaseException | None, tmp: Path) -> str:
        if error is None:
            return "another rank's write failed"
        lines = [ln.strip() for ln in str(error).strip().splitlines() if ln.strip()]
        return self._no_room(error, tmp) or f"{type(error).__name__}: {lines[-1] if lines else ''}".rstrip(": ")

    def _no_room(self, error: BaseException, tmp: Path) -> str | None:
        """The cause when the filesystem is out of room, else None."""
        for e in _chain(error):
            if isinstance(e, OSError) and e.errno in _NO_ROOM:
                return f"{os.strerror(e.errno).lower()} ({_free(self.root)})"
        # dist_checkpointing reports its writers' failures wrapped, where the errno may be lost (0.19
        # keeps only its type): look at the disk, which is full now, or cannot hold about what the
        # previous checkpoint holds (a run's first save has none: its partial files may pass 1 MiB).
        free = shutil.disk_usage(self.root).free
        if free < _LOW_SPACE or free + _size(tmp) < self._previous_size():
            return f"no space left on device ({_free(self.root)})"
        return None

    def abandon(self, pending: PendingSave, rank: int, error: BaseException) -> RunFailure | None:
        """Not collective: the run is failing with `error` while `pending` is written in the background
        (this rank's writer has ended). Rank 0 removes the partial directory. A full disk is reported
        as this save's failure, which the background write filling it likely is."""
        cause = self._no_room(error, pending.tmp)  # before the partial files go
        if rank == 0:
            shutil.rmtree(pending.tmp, ignore_errors=True)
        return RunFailure(f"checkpoint {pending.tmp}: save failed: {cause}") if cause else None

    def _prune(self, protect: Path) -> None:
        complete = [p for p in self._step_dirs() if self.problem(p) is None]
        kept = set(complete[: self.keep]) | {protect}
        if self.keep_every:
            kept |= {p for p in complete if int(p.name[5:]) % self.keep_every == 0}
        for old in complete:
            if old not in kept:
                shutil.rmtree(old, ignore_errors=True)

    @staticmethod
    def load_engine(ckpt: Path, engine_load: Callable[[Path], None]) -> None:
        """The engine's own files, as data only (DeepSpeed's torch.load calls included)."""
        untrusted.check_metadata(ckpt)
        with untrusted.weights_only_loads(ckpt):
            engine_load(ckpt)

    @staticmethod
    def load_trainer_state(ckpt: Path, rank: int, world_size: int) -> dict:
        """trainer.pt, and this rank's RNG states when the world size is unchanged."""
        state = untrusted.load(ckpt / "trainer.pt")
        rng_file = ckpt / "rng" / f"rank_{rank}.pt"
        if state["world_size"] == world_size and rng_file.is_file():
            set_rng_state(untrusted.load(rng_file))
        elif rank == 0:
            print(
                f"[nlq-scale] world size {state['world_size']} -> {world_size}: per-rank RNG states not restored",
                file=sys.stderr,
            )
        return state


@contextlib.contextmanager
def _failures_said_once() -> Iterator[None]:
    """dist_checkpointing logs a failed write before raising it; the save's one-line failure says it."""
    log = logging.getLogger("megatron.core.dist_checkpointing")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _any_rank(flag: bool) -> bool:
    t = torch.tensor([int(flag)], device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _size(root: Path) -> int:
    return sum(_files(root).values()) if root.is_dir() else 0


def _free(path: Path) -> str:
    return f"{shutil.disk_usage(path).free:,} bytes free on {path}"

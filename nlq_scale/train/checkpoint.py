"""Checkpoint directories, independent of the engine that fills them.

checkpoints/
  step_<N>/            one complete checkpoint: the engine's sharded files, trainer.pt (step,
                       tokens, data-loader state, divergence tracker), rng/rank_<r>.pt, and
                       complete.json (written last: file sizes, for detecting truncation)
  latest               names the newest complete step_<N>; updated after the rename
  .tmp_step_<N>/       a save in progress (renamed when complete, removed if abandoned)
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from nlq_scale.train.rundir import atomic_write

COMPLETE = "complete.json"


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


class CheckpointDir:
    def __init__(self, run_dir: Path, keep: int) -> None:
        self.root = run_dir / "checkpoints"
        self.keep = keep

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
        """Collective: every rank calls it. `fill(tmp_dir)` writes the engine's shards."""
        final = self.root / f"step_{step}"
        tmp = self.root / f".tmp_step_{step}"
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        fill(tmp)  # the engine's shards first: dist_checkpointing wants an empty directory
        (tmp / "rng").mkdir(exist_ok=True)
        torch.save(rng_state(), tmp / "rng" / f"rank_{rank}.pt")
        if rank == 0:
            torch.save(trainer_state, tmp / "trainer.pt")
        dist.barrier()
        if rank == 0:
            atomic_write(tmp / COMPLETE, json.dumps({"step": step, "files": _files(tmp)}, indent=1))
            if final.exists():  # a re-save of the same step (e.g. signal right after a periodic save)
                shutil.rmtree(final)
            os.replace(tmp, final)
            atomic_write(self.root / "latest", final.name + "\n")
            self._prune(protect=final)
        dist.barrier()
        return final

    def _prune(self, protect: Path) -> None:
        complete = [p for p in self._step_dirs() if self.problem(p) is None]
        for old in complete[self.keep :]:
            if old != protect:
                shutil.rmtree(old, ignore_errors=True)

    @staticmethod
    def load_trainer_state(ckpt: Path, rank: int, world_size: int) -> dict:
        """trainer.pt, and this rank's RNG states when the world size is unchanged."""
        state = torch.load(ckpt / "trainer.pt", weights_only=False)
        rng_file = ckpt / "rng" / f"rank_{rank}.pt"
        if state["world_size"] == world_size and rng_file.is_file():
            set_rng_state(torch.load(rng_file, weights_only=False))
        elif rank == 0:
            print(
                f"[nlq-scale] world size {state['world_size']} -> {world_size}: per-rank RNG states not restored",
                file=sys.stderr,
            )
        return state

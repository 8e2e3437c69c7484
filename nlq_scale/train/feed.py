"""Per-rank batches: one loader per data-parallel rank (on its first model-parallel rank), broadcast
to the tensor/pipeline-parallel peers, so every peer of a model replica sees the same tokens."""

from __future__ import annotations

import contextlib
import hashlib
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from torch import Tensor

from nlq_scale.config.schema import RunConfig
from nlq_scale.runtime.dist import World


def _is_loader(world: World) -> bool:
    return world.tp_rank == 0 and world.pp_rank == 0


def job_tmp_dir(run_dir: Path) -> Path:
    """Node-local scratch for streaming's locks, private to this run (never shared with other jobs);
    the loader creates it, and the last process of the run on the node to close removes it."""
    tag = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"nlq-scale-{tag}"


class DataFeed:
    def __init__(self, cfg: RunConfig, world: World, run_dir: Path) -> None:
        from nlq_scale.data.loader import make_train_loader, make_val_sets

        self.world = world
        self.device = world.device
        self.seq = cfg.model.seq_length
        self.rank_batch = cfg.train.global_batch_size // world.dp
        self._mp_group = ps.get_model_parallel_group()
        self._src = self._loader_global_rank()
        self.loader = None
        self._tmp_dir = job_tmp_dir(run_dir)
        if _is_loader(world):
            self.loader = make_train_loader(
                cfg.data,
                seq_length=self.seq,
                rank_batch_size=self.rank_batch,
                dp_rank=world.dp_rank,
                dp_size=world.dp,
                tmp_dir=self._tmp_dir,
            )
            self._iter = iter(self.loader)
        sets = make_val_sets(cfg.data, seq_length=self.seq) if _is_loader(world) else {}
        # Validation metric -> this data-parallel rank's share of the set's sequences.
        self.val = {
            metric: self._share(sets.get(metric), (sequences, self.seq + 1)).chunk(world.dp)[world.dp_rank]
            for metric, _, sequences in cfg.data.val_sets()
        }

    def _loader_global_rank(self) -> int:
        flags = [self.device.empty((1,), torch.int64) for _ in range(dist.get_world_size(self._mp_group))]
        dist.all_gather(flags, self.device.tensor([int(_is_loader(self.world))]), group=self._mp_group)
        group_rank = next(i for i, f in enumerate(flags) if int(f) == 1)
        return dist.get_global_rank(self._mp_group, group_rank)

    def _share(self, tokens: Tensor | None, shape: tuple[int, int]) -> Tensor:
        """The loader rank's host batch, on every model-parallel peer's device."""
        buf = self.device.put(tokens.contiguous()) if tokens is not None else self.device.empty(shape, torch.int64)
        if dist.get_world_size(self._mp_group) > 1:
            dist.broadcast(buf, src=self._src, group=self._mp_group)
        return buf

    def next(self) -> Tensor:
        tokens = next(self._iter).to(torch.int64) if self.loader is not None else None
        return self._share(tokens, (self.rank_batch, self.seq + 1))

    def digest(self, tokens: Tensor) -> str:
        from nlq_scale.data.loader import batch_digest

        return batch_digest(tokens, group=ps.get_data_parallel_group(), device=self.device)

    def state_dict(self) -> dict | None:
        return self.loader.state_dict() if self.loader is not None else None

    def load_state_dict(self, state: dict) -> None:
        if self.loader is not None:
            self.loader.load_state_dict(state)
            self._iter = iter(self.loader)

    def close(self) -> None:
        if self.loader is not None:
            self.loader.close()
            with contextlib.suppress(OSError):  # not empty: another rank of this run on the node is open
                self._tmp_dir.rmdir()

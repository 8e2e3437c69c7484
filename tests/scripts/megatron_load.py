"""Rank script: the megatron engine's checkpoint save and load (optimizer state saved from and read
into the optimizer's own tensors, stored tensors read straight into their targets: compat.megatron_optimizer, megatron_load, megatron_save)
against megatron's own. Usage:
  megatron_load.py save OUT --dir CKPT [overrides...]     train a few steps, save into CKPT/megatron
                                                          megatron's way, into CKPT/ours and, in
                                                          the background, into CKPT/background
  megatron_load.py compare OUT --dir CKPT [overrides...]  load CKPT/ours both ways into a trained engine
  megatron_load.py save,compare OUT ...                   both, in the same ranks (a load in the layout
                                                          saved at, without starting ranks again)
Rank 0 writes to OUT, as JSON keyed by mode, the names of the tensors whose bits differ between the saves (and
the processes each started) or
the two loads, how many stored items each load read through torch's own reader, how many loads
went through megatron's planning strategy, and how many parameters each rank holds only part of."""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing.process
import os
from pathlib import Path

import torch
from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy
from torch.distributed.checkpoint import FileSystemReader

from nlq_scale.compat import megatron_load, megatron_optimizer, megatron_save
from tests.scripts.deepspeed_engine import batches, config, megatron_engine, train


def state(engine) -> dict[str, torch.Tensor]:
    """Every tensor a load restores on this rank: the model's weights and, per distributed
    optimizer, each main param shard and its Adam moments."""
    out = {f"model.{name}": p.detach().clone() for name, p in engine.model.named_parameters()}
    for i, opt in enumerate(megatron_optimizer.distributed_optimizers(engine.optimizer)):
        for g, group in enumerate(opt.optimizer.param_groups):
            for j, main in enumerate(group["params"]):
                out[f"opt{i}.group{g}.{j}.param"] = main.detach().clone()
                for key, value in opt.optimizer.state.get(main, {}).items():
                    out[f"opt{i}.group{g}.{j}.{key}"] = value.detach().clone()
    return out


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def differing_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The keys of `a` whose tensor in `b` (which must hold every key of `a`) has other bits."""
    return sorted(k for k in a if not torch.equal(bits(a[k]), bits(b[k])))


@contextlib.contextmanager
def torch_reads(counts: list[int]):
    """Count the stored items torch's reader reads (every reader megatron or the direct reader uses
    is one: the direct reader hands it what it does not read itself)."""
    original = FileSystemReader.read_data

    def read_data(self, plan, planner):
        counts.append(len(plan.items))
        return original(self, plan, planner)

    FileSystemReader.read_data = read_data
    try:
        yield
    finally:
        FileSystemReader.read_data = original


@contextlib.contextmanager
def planned_loads(counts: list[int]):
    """Count the loads through megatron's torch_dist strategy, which plans with
    torch.distributed.checkpoint (and reshards); the same-layout path calls it only to fall back."""
    original = TorchDistLoadShardedStrategy.load

    def load(self, *args):
        counts.append(1)
        return original(self, *args)

    TorchDistLoadShardedStrategy.load = load
    try:
        yield
    finally:
        TorchDistLoadShardedStrategy.load = original


@contextlib.contextmanager
def megatrons_own_way():
    """The engine's save and load with compat's in-place paths and in-process writer switched off:
    megatron's and torch's own (the writer reporting through a Manager process)."""
    switched_off = {
        (megatron_optimizer, "in_place_optimizer_state"): lambda optimizer: contextlib.nullcontext(),
        (megatron_load, "direct_tensor_reads"): contextlib.nullcontext,
        (megatron_save, "in_process_writes"): contextlib.nullcontext,
        (megatron_load, "same_layout_strategy"): lambda device, metadata: None,  # megatron's default load strategy
    }
    saved = {(module, name): getattr(module, name) for module, name in switched_off}
    for (module, name), replacement in switched_off.items():
        setattr(module, name, replacement)
    try:
        yield
    finally:
        for (module, name), original in saved.items():
            setattr(module, name, original)


def checkpoint_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(ckpt), str(ckpt.with_suffix(".pt")))
    state = torch.load(ckpt.with_suffix(".pt"), weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


@contextlib.contextmanager
def counted_processes(started: list[int]):
    """Count the processes this one starts through multiprocessing, forked or spawned (megatron's
    writer reports through the queue of a Manager process it spawns on a process's first save)."""
    original = multiprocessing.process.BaseProcess.start

    def start(self):
        started.append(1)
        return original(self)

    multiprocessing.process.BaseProcess.start = start
    try:
        yield
    finally:
        multiprocessing.process.BaseProcess.start = original


SAVES = {  # the way of saving, and whether in the background
    "megatron": (megatrons_own_way, False),
    "ours": (contextlib.nullcontext, False),
    "background": (contextlib.nullcontext, True),
}


def save(cfg, ckpt: Path) -> dict:
    engine = megatron_engine(cfg)
    train(engine, cfg, batches(cfg, 3, seed=1), 0)
    processes = {}
    for way, (switch, background) in SAVES.items():
        (ckpt / way).mkdir(exist_ok=True)  # every rank
        processes[way] = []
        with switch(), counted_processes(processes[way]):
            engine.save(ckpt / way, background=background)
            assert engine.save_written(blocking=True)
    torch.distributed.barrier()
    if torch.distributed.get_rank() != 0:
        return {}
    a = checkpoint_tensors(ckpt / "megatron")
    result = {"keys": sorted(a), "processes": {way: len(p) for way, p in processes.items()}}
    for way in ("ours", "background"):
        b = checkpoint_tensors(ckpt / way)
        result[way] = {
            "not_in_both": sorted(a.keys() ^ b.keys()),
            "differ": differing_bits({k: a[k] for k in a.keys() & b.keys()}, b),
        }
    return result


def compare(cfg, ckpt: Path) -> dict:
    """Each load goes into an engine trained on other data first, so nothing it leaves unread can
    pass for loaded."""
    engine = megatron_engine(cfg)
    loaded, counts, planned = {}, {}, {}
    for way, switch in (("megatron", megatrons_own_way), ("in_place", contextlib.nullcontext)):
        train(engine, cfg, batches(cfg, 2, seed=7 if way == "megatron" else 8), 0)
        counts[way], planned[way] = [], []
        with switch(), torch_reads(counts[way]), planned_loads(planned[way]):
            engine.load(ckpt / "ours")
        loaded[way] = state(engine)
    a, b = loaded["megatron"], loaded["in_place"]
    differ = differing_bits(a, b)
    reads = {way: sum(c) for way, c in counts.items()}
    gathered = [None] * torch.distributed.get_world_size()
    split = sum(
        not megatron_optimizer._whole(param, part)
        for opt in megatron_optimizer.distributed_optimizers(engine.optimizer)
        for _, param, part in megatron_optimizer._owned_params(opt)
    )  # parameters this rank holds part of (the others' parts are assembled for a save)
    torch.distributed.all_gather_object(gathered, {"differ": differ, "keys": len(a), "torch_reads": reads, "split": split,
                                                 "planned": {way: len(p) for way, p in planned.items()}})
    return {"ranks": gathered}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("modes", help="save, compare or save,compare")
    parser.add_argument("out", type=Path)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    cfg = config(["train.engine=megatron", *args.overrides])
    from nlq_scale.runtime.dist import distributed

    with distributed(cfg.parallel):
        result = {mode: {"save": save, "compare": compare}[mode](cfg, args.dir) for mode in args.modes.split(",")}
    if int(os.environ.get("RANK", "0")) == 0:
        args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()

"""Rank script for the DeepSpeed engine on random tokens. Usage:
  deepspeed_engine.py MODE OUT [--dir CKPT] [overrides...]
MODE
  compare  DeepSpeedEngine and MegatronEngine from the same seed on the same batches
  resume   train, save, train on; then a fresh engine loads and trains the same batches again
  save     train, save into --dir, then eval + train on (the reference for `load`)
  load     load --dir (saved at another layout), then eval + train the same batches as `save`
Rank 0 writes the losses to OUT as JSON."""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

import torch
from megatron.core import parallel_state as ps

from nlq_scale.config import load_run_config
from nlq_scale.config.schema import RunConfig
from nlq_scale.runtime.device import Device
from nlq_scale.runtime.dist import distributed
from nlq_scale.train.schedule import lr_at

# cpu-xs with a small vocabulary and short sequences, so a step takes milliseconds.
SMALL = [
    "train.engine=deepspeed",
    "model.vocab_size=1000",
    "model.make_vocab_size_divisible_by=8",
    "model.seq_length=32",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.steps=20",
    "train.warmup_steps=3",
]
BEFORE, AFTER = 3, 3  # steps before the checkpoint, steps compared after it


def config(overrides: list[str]) -> RunConfig:
    return load_run_config("cpu-xs", "nonlinear", overrides=SMALL + overrides)


def batches(cfg: RunConfig, count: int, seed: int) -> list[torch.Tensor]:
    """This data-parallel rank's slice of `count` global batches."""
    g = torch.Generator().manual_seed(seed)
    shape = (cfg.train.global_batch_size, cfg.model.seq_length + 1)
    rows = cfg.train.global_batch_size // ps.get_data_parallel_world_size()
    start = ps.get_data_parallel_rank() * rows
    return [torch.randint(0, cfg.model.vocab_size, shape, generator=g)[start : start + rows] for _ in range(count)]


def train(engine, cfg: RunConfig, data: list[torch.Tensor], first_step: int) -> list[float]:
    losses = []
    for i, tokens in enumerate(data):
        engine.set_lr(lr_at(first_step + i, cfg.train))
        losses.append(engine.train_step(tokens).loss)
    return losses


CPU = Device(torch.device("cpu"))


# The engines built in this process and not yet closed: a test's process group ends with them
# (conftest.one_rank), or each would keep its groups alive for the rest of the pytest worker.
OPEN: list = []


def deepspeed_engine(cfg: RunConfig):
    from nlq_scale.train.engine_deepspeed import DeepSpeedEngine

    OPEN.append(DeepSpeedEngine(cfg, CPU))
    return OPEN[-1]


def megatron_engine(cfg: RunConfig):
    from nlq_scale.train.engine_megatron import MegatronEngine

    OPEN.append(MegatronEngine(cfg, CPU))
    return OPEN[-1]


def close_all() -> None:
    if OPEN:
        while OPEN:
            OPEN.pop().close()
        gc.collect()  # a closed engine is garbage in reference cycles: free its groups now (~0.7 s here)


def compare(cfg: RunConfig, _dir: Path | None) -> dict:
    data = batches(cfg, cfg.train.steps, seed=0)
    out = {}
    for name, make in (("deepspeed", deepspeed_engine), ("megatron", megatron_engine)):
        start = time.perf_counter()
        engine = make(cfg)
        out[f"{name}_init_s"] = time.perf_counter() - start
        start = time.perf_counter()
        out[name] = train(engine, cfg, data, 0)
        out[f"{name}_step_s"] = (time.perf_counter() - start) / len(data)
        out[f"{name}_val"] = engine.evaluate(data[0]).loss
        del engine
    return out


def resume(cfg: RunConfig, ckpt: Path) -> dict:
    data = batches(cfg, BEFORE + AFTER, seed=1)
    engine = deepspeed_engine(cfg)
    train(engine, cfg, data[:BEFORE], 0)
    engine.save(ckpt)
    uninterrupted = train(engine, cfg, data[BEFORE:], BEFORE)
    engine.close()
    resumed = deepspeed_engine(cfg)
    resumed.load(ckpt)
    return {"uninterrupted": uninterrupted, "resumed": train(resumed, cfg, data[BEFORE:], BEFORE)}


def save(cfg: RunConfig, ckpt: Path) -> dict:
    data = batches(cfg, BEFORE + AFTER, seed=2)
    engine = deepspeed_engine(cfg)
    train(engine, cfg, data[:BEFORE], 0)
    engine.save(ckpt)
    val = engine.evaluate(batches(cfg, 1, seed=3)[0]).loss
    return {"val": val, "after": train(engine, cfg, data[BEFORE:], BEFORE)}


def load(cfg: RunConfig, ckpt: Path) -> dict:
    data = batches(cfg, BEFORE + AFTER, seed=2)
    engine = deepspeed_engine(cfg)
    engine.load(ckpt)
    val = engine.evaluate(batches(cfg, 1, seed=3)[0]).loss
    return {"val": val, "after": train(engine, cfg, data[BEFORE:], BEFORE)}


MODES = {"compare": compare, "resume": resume, "save": save, "load": load}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("out", type=Path)
    parser.add_argument("--dir", type=Path)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args()
    cfg = config(args.overrides)
    with distributed(cfg.parallel):
        result = MODES[args.mode](cfg, args.dir)
    if int(os.environ.get("RANK", "0")) == 0:
        args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()

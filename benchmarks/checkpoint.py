"""Sharded-checkpoint save/load speed of the megatron engine (dist_checkpointing, model + fully
reshardable optimizer state) against a raw sequential write (fsynced, as the save's files are) and
read of the same number of bytes, and the cost of a background save (checkpoint.async_save) to the
training steps it overlaps, next to the cost of a raw write of as many bytes, measured side by side
in one run. Also a loop of tiny torch ops (holding the interpreter lock, as a loop issuing GPU
kernels does) while a background save is written by each writer (`host_loop_*_over_plain`: the
CPU's stand-in for a GPU step, where the thread writer cost 1.48x). Prints one JSON line. Goals:
save and load >= 0.5 of raw; a step during a background save <= 1.1 x a step without one.

    python benchmarks/checkpoint.py [--hidden 256 --layers 4 --repeats 5 --rounds 8]
    python benchmarks/checkpoint.py --hidden 768 --layers 12 --rounds 0   # 124M's width and depth, save/load only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from statistics import mean, median


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def raw_write(path: Path, nbytes: int, chunk: int = 64 << 20) -> tuple[float, float]:
    """Seconds to write `nbytes` into the page cache, and to that plus an fsync (a checkpoint save
    fsyncs every file it writes: megatron's writer does, so a preempted node's checkpoint is on
    disk)."""
    block = os.urandom(min(chunk, nbytes))
    start = time.perf_counter()
    with open(path, "wb") as f:
        written = 0
        while written < nbytes:
            n = min(len(block), nbytes - written)
            f.write(block[:n])
            written += n
        f.flush()
        cached_s = time.perf_counter() - start
        os.fsync(f.fileno())
    return cached_s, time.perf_counter() - start


def raw_read(path: Path, into: bytearray) -> float:
    """Seconds to read the file at `path` into memory that already exists, as a load reads into
    the model's and optimizer's own tensors (a read into new memory also pays for its page faults,
    which glibc's allocator takes anew for every large buffer and tcmalloc's does not)."""
    view = memoryview(into)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        done = 0
        while n := f.readinto(view[done:]):
            done += n
    return time.perf_counter() - start


def save_load_and_raw(engine, target: Path, scratch: bytearray) -> dict:
    """Seconds to save into and load from `target`, then to write and read as many bytes raw (and
    the bytes; all removed after): side by side, so both see the same state of the disk and the
    page cache (the raw write's speed moves by 3x between runs on this machine with what is still
    being written back). The raw read goes into `scratch`, grown (and so touched) here first."""
    target.mkdir()
    start = time.perf_counter()
    engine.save(target)
    save_s = time.perf_counter() - start
    start = time.perf_counter()
    engine.load(target)
    load_s = time.perf_counter() - start
    nbytes = directory_bytes(target)
    raw = target.with_suffix(".raw")
    cached_s, write_s = raw_write(raw, nbytes)
    scratch.extend(b"\1" * max(0, nbytes - len(scratch)))
    read_s = raw_read(raw, scratch)
    shutil.rmtree(target)
    raw.unlink()
    return {"bytes": nbytes, "save": save_s, "load": load_s,
            "raw_cached_write": cached_s, "raw_write": write_s, "raw_read": read_s}  # fmt: skip


def timed(step: Callable[[], object]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def background_save_round(engine, step: Callable[[], object], target: Path, normal_steps: int) -> tuple[list[float], list[float], float]:
    """`normal_steps` plain steps, then a background save and the steps that overlap its write,
    each with the poll the train loop makes after it (the last poll finalizes the save).
    Returns (plain step times, overlapped step times, seconds the save's start blocked training)."""
    plain = [timed(step) for _ in range(normal_steps)]
    blocked = timed(lambda: engine.save(target, background=True))
    overlapped, written = [], False
    while not written:
        start = time.perf_counter()
        step()
        written = engine.save_written(blocking=False)
        overlapped.append(time.perf_counter() - start)
    return plain, overlapped, blocked


def overlapped_raw_write_round(step: Callable[[], object], path: Path, nbytes: int) -> tuple[float, list[float]]:
    """One plain step, then the steps that overlap a raw fsynced write of `nbytes` by a thread at the
    lowest CPU priority, as the engine's thread writer runs: what any writer of that many bytes
    costs the steps on this machine, the floor under a background save's."""
    from nlq_scale.train.writers import at_lowest_priority

    plain = timed(step)
    writer = threading.Thread(target=at_lowest_priority, args=(lambda: raw_write(path, nbytes),))
    writer.start()
    overlapped = [timed(step)]
    while writer.is_alive():
        overlapped.append(timed(step))
    writer.join()
    path.unlink()
    return plain, overlapped


def raw_write_over_plain(step: Callable[[], object], path: Path, nbytes: int, rounds: int) -> float:
    """A step overlapping a raw write ÷ a plain step, over `rounds` raw-write rounds."""
    plain, overlapped = [], []
    for _ in range(rounds):
        p_s, o_s = overlapped_raw_write_round(step, path, nbytes)
        plain, overlapped = plain + [p_s], overlapped + o_s
    return round(mean(overlapped) / mean(plain), 3)


def background_save_figures(engine, tokens, work: Path, rounds: int, save_s: float, nbytes: int) -> dict:
    """Rounds of plain steps and a background save, each round with as many plain steps as the
    previous one overlapped. The cost of a background save to training — its start plus what the
    steps it overlapped took beyond plain ones — is also set against a synchronous save (`save_s`),
    and the overlapped steps against steps overlapping a raw write of the checkpoint's bytes."""
    def step() -> None:
        engine.train_step(tokens)

    step()  # warm-up: the first step creates the optimizer state
    plain, overlapped, blocked, normal_steps = [], [], [], 2
    for i in range(rounds):
        target = work / f"background{i}"
        target.mkdir()
        p_s, o_s, b_s = background_save_round(engine, step, target, normal_steps)
        shutil.rmtree(target)
        plain, overlapped, blocked, normal_steps = plain + p_s, overlapped + o_s, blocked + [b_s], len(o_s)
    raw_ratio = raw_write_over_plain(step, work / "raw-overlapped", nbytes, rounds)
    step = mean(plain)
    cost = mean(blocked) + (sum(overlapped) - len(overlapped) * step) / rounds
    return {
        "step_s": round(step, 3),
        "async_overlapped_steps_per_save": round(len(overlapped) / rounds, 2),
        "async_step_over_step": round(mean(overlapped) / step, 3),
        "raw_write_step_over_step": raw_ratio,
        "async_start_over_save": round(mean(blocked) / save_s, 3),
        "async_cost_over_save": round(cost / save_s, 3),
    }


HOST_LOOP_OPS = 20000  # ~35 ms on this machine, the GPU benchmark run's step (session 23)


def host_loop_figures(engine, work: Path, rounds: int, nbytes: int) -> dict:
    """A loop of tiny in-place torch ops holds the interpreter lock and waits on nothing, as a
    training loop that only issues GPU kernels does: its time while a background save is written,
    by each writer (checkpoint.async_writer), and while a raw write is, over its time alone."""
    import torch

    x = torch.zeros(16)

    def loop() -> None:
        for _ in range(HOST_LOOP_OPS):
            x.add_(1.0)

    figures, setting = {}, engine.cfg.checkpoint.async_writer
    for writer in ("thread", "process"):
        engine.cfg.checkpoint.async_writer = writer
        plain, overlapped = [], []
        for i in range(rounds):
            target = work / f"host-loop-{writer}{i}"
            target.mkdir()
            p_s, o_s, _ = background_save_round(engine, loop, target, normal_steps=4)
            shutil.rmtree(target)
            plain, overlapped = plain + p_s, overlapped + o_s
        figures[f"host_loop_{writer}_writer_over_plain"] = round(mean(overlapped) / mean(plain), 3)
    engine.cfg.checkpoint.async_writer = setting
    figures["host_loop_raw_write_over_plain"] = raw_write_over_plain(loop, work / "raw-overlapped", nbytes, rounds)
    return figures


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5, help="save/load/raw pairs after a warm-up one")
    p.add_argument("--rounds", type=int, default=8, help="background saves, each after as many plain steps as it overlapped (0: none)")
    a = p.parse_args()

    import torch

    from nlq_scale.config import load_run_config
    from nlq_scale.runtime.dist import distributed
    from nlq_scale.train.engine_megatron import MegatronEngine

    cfg = load_run_config(
        "cpu-xs",
        "nonlinear",
        overrides=[f"model.hidden_size={a.hidden}", f"model.num_layers={a.layers}", f"model.num_attention_heads={a.hidden // 32}"],
    )
    work = Path(tempfile.mkdtemp(prefix="nlq-ckpt-bench-"))
    try:
        with distributed(cfg.parallel) as layout:
            device = layout.device  # CUDA where one is visible (runtime.device=auto)
            engine = MegatronEngine(cfg, device)
            scratch = bytearray()
            pairs = [save_load_and_raw(engine, work / f"ckpt{i}", scratch) for i in range(a.repeats + 1)][1:]  # 1st: warm-up
            shape = (cfg.train.global_batch_size, cfg.model.seq_length + 1)
            tokens = torch.randint(cfg.model.vocab_size, shape, device=device.torch_device)
            save_s = median(p["save"] for p in pairs)
            background = {}
            if a.rounds:
                background = background_save_figures(engine, tokens, work, a.rounds, save_s, pairs[0]["bytes"])
                background |= host_loop_figures(engine, work, a.rounds, pairs[0]["bytes"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mb = pairs[0]["bytes"] / 1e6

    def mb_s(key: str) -> float:
        return round(mb / median(p[key] for p in pairs), 1)

    def over(raw: str, ours: str) -> float:  # the median of the pairs' ratios
        return round(median(p[raw] / p[ours] for p in pairs), 3)

    print(
        json.dumps(
            {
                "benchmark": "checkpoint",
                "device": device.torch_device.type,
                "checkpoint_mb": round(mb, 1),
                "pairs": len(pairs),
                **{f"{key}_mb_s": mb_s(key) for key in ("save", "load", "raw_write", "raw_cached_write", "raw_read")},
                "save_over_raw": over("raw_write", "save"),
                "save_over_cached_raw": over("raw_cached_write", "save"),
                "load_over_raw": over("raw_read", "load"),
                **background,
                "goals": {"save_over_raw": 0.5, "load_over_raw": 0.5, "async_step_over_step": 1.1},
            }
        )
    )


if __name__ == "__main__":
    main()

"""GPU efficiency of the query arms, ready to measure: training tokens/s, MFU and peak memory of the
linear and nonlinear arms at 124M and 1.3B on one GPU, with the defaults and with each lever
(megatron-core's CUDA graphs, local and full_iteration; Transformer Engine's layer spec; deterministic
kernels off; larger micro-batches), the ratios beside them and the goals. Prints one JSON line.

    python benchmarks/gpu.py            # one GPU: at most 8 minutes on an H100
    python benchmarks/gpu.py --smoke    # the same cells through the same code on the CPU at cpu-xs (< 2 minutes)

A cell is one (scale, arm, lever). Each trains in a process of its own, forked from this one after the
imports (which leave CUDA uninitialised): the megatron engine of `nlq-scale train` (DDP, distributed
optimizer, megatron's schedule) on random tokens, the same for every cell, `warmup` steps (full_iteration
graphs run three eagerly and capture the fourth), then `timed` steps, each timed to its loss on the host as
the train loop times a step; tokens/s is the median timed step's. A cell that fails (out of memory, a lever
that does not run) keeps its error in one line and the others go on. A lever the config refuses (CUDA graphs
on the CPU) or that cannot run here (Transformer Engine without a GPU, or not installed) is skipped with the
reason, and so is every cell not started before the time budget is spent: the line always comes.

Every cell of a scale trains 4 micro-batches of the scale's size per step (48 sequences at 124M, 16 at
1.3B; the scales' own global batches of 480 and 512 would spend a cell's time in a few steps); a
micro-batch lever keeps that global batch in fewer, larger micro-batches. MFU: the accounting's training
FLOPs per token (what `mfu` logs in training) times tokens/s, over the GPU's dense bf16 peak (`nlq-scale
doctor`'s table); on the CPU over its fp32 matmul peak, measured in the cell as benchmarks/throughput.py
measures it. Peak memory: the most the GPU allocated; on the CPU the process's peak resident memory.
`loss`: the last step's, to compare levers that compute the same function.

Ratios, of tokens/s: `nonlinear_over_linear` per lever, `<lever>_over_default` per arm. Goals (issue 61):
linear MFU >= 0.40 at 124M and >= 0.50 at 1.3B, nonlinear/linear >= 0.95 at 124M; `goal_check` gives each
goal's value with the defaults, the best setting's, and whether any setting met it.

Without a GPU and without --smoke it says so in one line (stderr) and exits 0: `make bench` runs every
benchmark. Not yet run on a GPU (docs/performance.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import resource
import signal
import statistics
import sys
import time
from dataclasses import dataclass

ARMS = ("linear", "nonlinear")
MICRO_BATCHES_PER_STEP = 4
LEVERS = {
    "cuda_graphs_local": ("parallel.cuda_graph_impl=local",),
    "cuda_graphs_full_iteration": ("parallel.cuda_graph_impl=full_iteration",),
    "transformer_engine": ("model.transformer_impl=transformer_engine",),
    "deterministic_off": ("runtime.deterministic=false",),
}
GOALS = {"124m": {"mfu_linear": 0.40, "nonlinear_over_linear": 0.95}, "1.3b": {"mfu_linear": 0.50}}


@dataclass(frozen=True)
class Mode:
    device: str  # runtime.device of every cell
    scales: dict[str, tuple[int, ...]]  # scale -> multiples of its micro-batch size measured as levers
    warmup: int  # untimed steps: full_iteration graphs run 3 eagerly, capture the 4th, then replay
    timed: int
    budget_s: float  # all cells together: with this process's start, within 8 minutes on an H100
    cell_s: float  # one cell at most
    overrides: tuple[str, ...] = ()  # of every cell's config


GPU = Mode("cuda", {"124m": (2, 4), "1.3b": (2,)}, warmup=5, timed=5, budget_s=440.0, cell_s=90.0)
# A small vocabulary: at cpu-xs's width GPT-2's 50k logits would be nearly all of a CPU step.
SMOKE = Mode("cpu", {"cpu-xs": (2, 4)}, warmup=1, timed=2, budget_s=75.0, cell_s=40.0, overrides=("model.vocab_size=512",))


@dataclass(frozen=True)
class Cell:
    scale: str
    arm: str
    lever: str
    overrides: tuple[str, ...]


def cells(mode: Mode) -> list[Cell]:
    """The defaults of every scale first, then each scale's levers, both arms of a lever in turn: what
    is measured first when the budget runs out."""
    from nlq_scale.config import load_run_config

    defaults, levers = [], []
    for scale, multiples in mode.scales.items():
        micro = load_run_config(scale, ARMS[0]).train.micro_batch_size
        common = (f"train.global_batch_size={MICRO_BATCHES_PER_STEP * micro}", f"runtime.device={mode.device}",
                  *mode.overrides)  # fmt: skip
        batches = {f"micro_batch_{k * micro}": (f"train.micro_batch_size={k * micro}",) for k in multiples}
        defaults += [Cell(scale, arm, "default", common) for arm in ARMS]
        levers += [Cell(scale, arm, lever, (*common, *extra))
                   for lever, extra in {**LEVERS, **batches}.items() for arm in ARMS]  # fmt: skip
    return defaults + levers


def runnable(cell: Cell, mode: Mode):
    """The cell's run config, or why it cannot run here: what the config refuses, or what this host lacks."""
    from nlq_scale.config import load_run_config
    from nlq_scale.errors import UsageError
    from nlq_scale.runtime.kernels import probe

    try:
        cfg = load_run_config(cell.scale, cell.arm, overrides=cell.overrides)
    except UsageError as e:
        return str(e)
    if cfg.model.transformer_impl == "transformer_engine" and not (mode.device == "cuda" and probe().transformer_engine):
        return "model.transformer_impl=transformer_engine: needs a GPU with Transformer Engine installed"
    return cfg


def device_peak_flops(device) -> float | None:
    """The GPU's dense bf16 peak (doctor's table; None for a GPU not in it); the CPU's fp32 matmul peak."""
    if device.is_cuda:
        from nlq_scale.doctor.trial import peak_flops

        return peak_flops(None)
    from throughput import matmul_peak  # benchmarks/throughput.py, beside this file

    return matmul_peak(512, seconds=0.5)


def timed_step(engine, tokens) -> tuple[float, float]:
    """One training step's seconds, to its loss on the host, and the loss."""
    start = time.perf_counter()
    loss = engine.train_step(tokens).loss
    return time.perf_counter() - start, loss


def measure(cfg, mode: Mode) -> dict:
    """Train `cfg` for mode.warmup + mode.timed steps through the train loop's engine: speed, MFU, memory."""
    import torch

    from nlq_scale.model.accounting import flops_per_token
    from nlq_scale.runtime.device import deterministic_kernels
    from nlq_scale.runtime.dist import distributed
    from nlq_scale.train.loop import make_engine

    shape = (cfg.train.global_batch_size, cfg.model.seq_length + 1)
    with (
        distributed(cfg.parallel, device=cfg.runtime.device) as world,
        deterministic_kernels(world.device, cfg.runtime.deterministic),
    ):
        peak = device_peak_flops(world.device)
        engine = make_engine(cfg, world.device)
        tokens = world.device.put(torch.randint(0, cfg.model.vocab_size, shape, generator=torch.Generator().manual_seed(0)))
        try:
            steps = [timed_step(engine, tokens) for _ in range(mode.warmup + mode.timed)]
        finally:
            engine.close()
        if not world.device.is_cuda:  # the better of two, as throughput.py measures it: a busy moment reads low
            peak = max(peak, device_peak_flops(world.device))
        memory = world.device.peak_memory_bytes() or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        name = torch.cuda.get_device_name(world.device.torch_device) if world.device.is_cuda else "cpu"
    seconds = statistics.median(s for s, _ in steps[mode.warmup :])
    tokens_per_s = shape[0] * cfg.model.seq_length / seconds
    return {
        "tokens_per_s": round(tokens_per_s, 1),
        "mfu": round(flops_per_token(cfg.model) * tokens_per_s / peak, 4) if peak else None,
        "peak_memory_gb": round(memory / 2**30, 3),
        "step_s": round(seconds, 4),
        "loss": round(steps[-1][1], 6),
        "device": name,
        "peak_tflops": round(peak / 1e12, 3) if peak else None,
    }


def one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


def cell_process(cfg, mode: Mode, results) -> None:
    """A cell's own process: its own process group (a timed-out cell goes with all it started), its stdout
    onto stderr (stdout carries the one JSON line), and its result or its error sent back."""
    os.setpgrp()
    os.dup2(2, 1)
    try:
        result = measure(cfg, mode)
    except BaseException as e:  # the cell's failure is its result: out of memory, a lever that does not run
        result = {"error": one_line(e)}
    results.send(result)


def run_isolated(cfg, mode: Mode, timeout: float) -> dict:
    """One cell in a process forked from this one: its result, or its failure in one line."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=cell_process, args=(cfg, mode, send))
    process.start()
    send.close()
    try:
        result = receive.recv() if receive.poll(timeout) else {"error": f"unfinished after {timeout:.0f} s (killed)"}
    except EOFError:  # it died without a word: killed by the system, or a crash below Python
        result = {"error": "its process ended without a result"}
    finally:
        end(process)
    if "error" in result and process.exitcode:
        result["error"] += f" (exit code {process.exitcode})"
    return result


def end(process) -> None:
    """Give the cell's process a moment to exit, then end it with all it started (its process group)."""
    process.join(10)
    if process.is_alive():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.join()


def run_cells(mode: Mode) -> tuple[dict[Cell, dict], dict]:
    """Every cell's result within mode's time budget, and the device the measured cells ran on."""
    deadline = time.monotonic() + mode.budget_s
    results, device = {}, {}
    for cell in cells(mode):
        start, left = time.monotonic(), deadline - time.monotonic()
        cfg = runnable(cell, mode)
        if isinstance(cfg, str):
            result = {"skipped": cfg}
        elif left < mode.cell_s / 3:
            result = {"skipped": f"the time budget for all cells ({mode.budget_s:.0f} s) was spent"}
        else:
            result = run_isolated(cfg, mode, min(left, mode.cell_s))
            about = {key: result.pop(key) for key in ("device", "peak_tflops") if key in result}
            device = device or about
        results[cell] = result
        said = result.get("skipped") or result.get("error") or f"{result['tokens_per_s']:,.0f} tokens/s, MFU {result['mfu']}"
        print(f"[gpu.py] {cell.scale} {cell.arm} {cell.lever}: {said} ({time.monotonic() - start:.0f} s)", file=sys.stderr, flush=True)
    return results, device


def ratio(a: dict, b: dict) -> float | None:
    """a's tokens/s over b's, where both were measured."""
    if "tokens_per_s" in a and "tokens_per_s" in b:
        return round(a["tokens_per_s"] / b["tokens_per_s"], 4)
    return None


def scale_ratios(by_arm: dict[str, dict[str, dict]]) -> dict:
    linear, nonlinear = (by_arm[arm] for arm in ARMS)
    out = {"nonlinear_over_linear": {lever: ratio(nonlinear[lever], linear[lever]) for lever in linear}}
    for arm, by_lever in by_arm.items():
        out[arm] = {f"{lever}_over_default": ratio(result, by_lever["default"])
                    for lever, result in by_lever.items() if lever != "default"}  # fmt: skip
    return out


def goal(by_setting: dict[str, float | None], target: float) -> dict:
    """A goal's value with the defaults, the best measured setting's, and whether any met it (None: none measured)."""
    measured = {setting: v for setting, v in by_setting.items() if v is not None}
    best = max(measured, key=measured.get, default=None)
    return {
        "goal": target,
        "default": by_setting.get("default"),
        "best": None if best is None else [best, measured[best]],
        "met": None if best is None else measured[best] >= target,
    }


def summary(results: dict[Cell, dict]) -> dict:
    """The cells as scale -> arm -> lever, their ratios, the goals and how each measured scale stands."""
    table: dict[str, dict[str, dict[str, dict]]] = {}
    for cell, result in results.items():
        table.setdefault(cell.scale, {}).setdefault(cell.arm, {})[cell.lever] = result
    ratios = {scale: scale_ratios(by_arm) for scale, by_arm in table.items()}
    values = {scale: {"mfu_linear": {lever: r.get("mfu") for lever, r in table[scale]["linear"].items()},
                      "nonlinear_over_linear": ratios[scale]["nonlinear_over_linear"]}
              for scale in table}  # fmt: skip
    checked = {scale: {name: goal(values[scale][name], target) for name, target in goals.items()}
               for scale, goals in GOALS.items() if scale in table}  # fmt: skip
    return {"cells": table, "ratios": ratios, "goals": GOALS, "goal_check": checked}


def preload() -> None:
    """The engine's imports, once, before the cells fork; CUDA must stay uninitialised for them to use it."""
    import torch

    import nlq_scale.train.engine_megatron  # noqa: F401
    import nlq_scale.train.loop  # noqa: F401

    if torch.cuda.is_initialized():
        raise RuntimeError("benchmarks/gpu.py: CUDA was initialised before the cells fork (an import did it)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="the same cells on the CPU at cpu-xs, a few steps each")
    a = p.parse_args()
    # Before torch: is_available() then asks NVML, leaving CUDA uninitialised for the forked cells.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    import torch

    from nlq_scale.runtime.quiet import quiet_libraries

    quiet_libraries()
    if not a.smoke and not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device here, nothing measured (--smoke runs the same cells on the CPU)",
              file=sys.stderr)  # fmt: skip
        return
    mode = SMOKE if a.smoke else GPU
    start = time.monotonic()
    preload()
    results, device = run_cells(mode)
    print(json.dumps({
        "benchmark": "gpu",
        "smoke": a.smoke,
        "device": device.get("device"),
        "peak_tflops": device.get("peak_tflops"),
        "steps": {"warmup": mode.warmup, "timed": mode.timed},
        "micro_batches_per_step": MICRO_BATCHES_PER_STEP,
        **summary(results),
        "elapsed_s": round(time.monotonic() - start, 1),
    }))


if __name__ == "__main__":
    main()

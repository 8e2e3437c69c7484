"""`nlq-scale doctor --train`: each arm trains briefly on this node through the real `nlq-scale train`
(bf16 on a GPU), once straight through and once SIGKILLed after a checkpoint and relaunched; the
relaunch must reproduce the straight run's losses bit for bit. Tokens/s and MFU come from the straight
run's metrics. Everything runs offline: the data is the bundled sample corpus."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# A small shape that still has every part of a real layer (GPT-2 vocabulary, 4 heads, a 2-layer
# stack); seq 128 keeps the sample corpus preparation to seconds.
SEQ_LENGTH = 128
SHAPE = [
    "model.num_layers=2", "model.hidden_size=256", "model.num_attention_heads=4", "model.kv_channels=64",
    f"model.seq_length={SEQ_LENGTH}", "train.global_batch_size=8", "train.micro_batch_size=4",
    "train.warmup_steps=2", "train.eval_every=1000000", "logging.wandb=false", "data.val_sequences=8",
]  # fmt: skip
# Known dense bf16 peaks (TFLOP/s) by device name, for MFU when --peak-tflops is not given.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}


@dataclass(frozen=True)
class Trial:
    name: str
    arm: str
    overrides: tuple[str, ...]


def peak_flops(peak_tflops: float | None) -> float | None:
    """The device's dense bf16 FLOP/s: `peak_tflops` when given, else from PEAK_TFLOPS by the GPU's
    name (None without CUDA or for a GPU not listed). benchmarks/gpu.py's MFU uses it too."""
    import torch

    if peak_tflops is not None:
        return peak_tflops * 1e12
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(0)
    return next((tflops * 1e12 for key, tflops in PEAK_TFLOPS.items() if key in name), None)


def _train_cmd(trial: Trial, run_dir: Path, data: Path, steps: int, device: str, peak: float | None) -> list[str]:
    bf16 = "true" if device != "cpu" else "false"
    args = [
        sys.executable, "-m", "nlq_scale.cli", "train", "--scale", "cpu-xs", "--arm", trial.arm,
        "--run-dir", str(run_dir), f"data.path={data}", *SHAPE, f"train.steps={steps}",
        f"checkpoint.every={steps // 2}", f"model.bf16={bf16}", f"runtime.device={device}", *trial.overrides,
    ]  # fmt: skip
    return args + ([f"train.device_peak_flops={peak}"] if peak else [])


def _run(cmd: list[str]) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"`{' '.join(cmd[3:6])}` exited {out.returncode}: {out.stderr.strip()[-2000:]}")


def _kill_after_checkpoint(cmd: list[str], marker: Path, timeout_s: float = 1800) -> None:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + timeout_s
    while not marker.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"run ended before its checkpoint: {proc.stderr.read()[-2000:]}")
        if time.time() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(f"no checkpoint {marker} after {timeout_s:.0f} s")
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _losses_after(records: list[dict], step: int) -> dict[int, float]:
    return {r["step"]: r["train/loss"] for r in records if "train/loss" in r and r["step"] > step}


def run_trial(trial: Trial, work: Path, data: Path, steps: int, device: str, peak: float | None) -> dict:
    from nlq_scale.train.checkpoint import COMPLETE
    from nlq_scale.train.rundir import CHECKPOINTS_DIR, read_metrics

    straight, killed = work / f"{trial.name}-straight", work / f"{trial.name}-killed"
    _run(_train_cmd(trial, straight, data, steps, device, peak))
    cmd = _train_cmd(trial, killed, data, steps, device, peak)
    _kill_after_checkpoint(cmd, killed / CHECKPOINTS_DIR / f"step_{steps // 2}" / COMPLETE)
    _run(cmd)
    want, got = read_metrics(straight), read_metrics(killed)
    half = steps // 2
    train = [r for r in want if "tokens_per_s" in r and r["step"] > 2]  # past compile/warm-up steps
    mfu = [r["mfu"] for r in train if r.get("mfu") is not None]
    losses = _losses_after(want, 0)
    return {
        "arm": trial.arm,
        "final_loss": losses[max(losses)],
        "resume_bit_exact": _losses_after(got, half) == _losses_after(want, half),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in train),
        "mfu": statistics.median(mfu) if mfu else None,
        "peak_memory_gb": max((r.get("memory/peak_gb") or 0.0 for r in train), default=None) or None,
    }


def summary(t: dict) -> str:
    """One trial's result in words."""
    if "error" in t:
        return f"FAILED {t['error']}"
    mfu = f"{t['mfu']:.3f}" if t["mfu"] is not None else "n/a"
    return (f"resume bit-exact {t['resume_bit_exact']}, {t['tokens_per_s']:,.0f} tok/s, MFU {mfu}, "
            f"final loss {t['final_loss']:.4f}")


def trials(arms: list[str], deepspeed_arm: str | None, zero_stage: int) -> list[Trial]:
    out = [Trial(f"megatron-{arm}", arm, ("train.engine=megatron",)) for arm in arms]
    if deepspeed_arm is not None:
        out.append(Trial(f"deepspeed-zero{zero_stage}-{deepspeed_arm}", deepspeed_arm,
                         ("train.engine=deepspeed", f"train.zero_stage={zero_stage}")))
    return out


def prepare_sample(work: Path) -> Path:
    from nlq_scale.cli import main

    data = work / f"sample-{SEQ_LENGTH}"
    code = main(["prepare-data", "--sample", "--out", str(data), "--seq-len", str(SEQ_LENGTH), "--no-progress"])
    if code:
        raise RuntimeError(f"preparing the sample corpus exited {code}")
    return data


def train_check(work: Path, arms: list[str], deepspeed_arm: str | None, zero_stage: int, steps: int, device: str,
                peak_tflops: float | None) -> dict:
    data = prepare_sample(work)
    peak = peak_flops(peak_tflops)
    results = {}
    for trial in trials(arms, deepspeed_arm, zero_stage):
        print(f"[nlq-scale doctor] {trial.name}: {steps} steps, kill after {steps // 2}, resume", file=sys.stderr)
        try:
            results[trial.name] = run_trial(trial, work, data, steps, device, peak)
        except RuntimeError as e:
            results[trial.name] = {"arm": trial.arm, "error": str(e)}
        # as each trial ends: a doctor stopped by a time limit still reports the trials it finished
        print(f"[nlq-scale doctor] {trial.name}: {summary(results[trial.name])}", file=sys.stderr, flush=True)
    return results

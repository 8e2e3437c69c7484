"""`nlq-scale doctor`: what this node offers (CUDA, driver, NCCL, bf16, fused kernels) and, with
`--train`, every arm trained briefly, killed and resumed bit-exactly, with tokens/s and MFU."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from nlq_scale.errors import RunFailure, check_creatable


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "doctor",
        help="check this node (CUDA, NCCL, bf16, kernels); --train: each arm trains, is killed and resumes",
        description="Run on a fresh GPU node before submitting a ladder. Example: nlq-scale doctor --train",
    )
    p.add_argument("--train", action="store_true", help="also train each arm briefly, kill, resume (minutes)")
    p.add_argument("--arms", help="comma-separated arms to train (default: every shipped arm config)")
    p.add_argument("--steps", type=int, default=30, help="steps per trial run (default 30; killed at half)")
    p.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2, 3),
                   help="the DeepSpeed ZeRO stage of the DeepSpeed trial (default 1)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="runtime.device of the trials (default auto; bf16 except on the CPU)")
    p.add_argument("--peak-tflops", type=float, help="device peak for MFU (default: known GPUs by name)")
    p.add_argument("--work-dir", type=Path, help="keep the trial runs here (default: a temporary dir)")
    p.add_argument("--json", action="store_true", help="print one JSON line on stdout")
    p.set_defaults(func=run)


def _arms(arg: str | None) -> list[str]:
    from nlq_scale.config.load import available, named_config

    if arg is None:
        return available("arms")
    arms = [a for a in arg.split(",") if a]
    for arm in arms:
        named_config("arms", arm)  # UsageError listing the known arms
    return arms


def _doctor(args: argparse.Namespace, work: Path) -> dict:
    from nlq_scale.doctor.node import node_report
    from nlq_scale.doctor.trial import train_check

    report = {"node": node_report()}
    if args.train:
        arms = _arms(args.arms)
        report["trials"] = train_check(work, arms, arms[0], args.zero_stage, args.steps, args.device, args.peak_tflops)
    return report


def _failures(report: dict) -> list[str]:
    return [
        f"{name}: {t.get('error') or 'resume was not bit-exact'}"
        for name, t in report.get("trials", {}).items()
        if t.get("error") or not t.get("resume_bit_exact")
    ]


def run(args: argparse.Namespace) -> int:
    from nlq_scale.errors import UsageError
    from nlq_scale.runtime.device import resolve_device

    if args.steps < 4:
        raise UsageError(f"--steps must be >= 4, got {args.steps}")
    if args.train:
        resolve_device(args.device, 0)  # CUDA asked for and missing: one line before any work
    if args.work_dir is not None:
        check_creatable(args.work_dir, "--work-dir")
        args.work_dir.mkdir(parents=True, exist_ok=True)
        report = _doctor(args, args.work_dir)
    else:
        with tempfile.TemporaryDirectory(prefix="nlq-doctor-") as tmp:
            report = _doctor(args, Path(tmp))
    if args.json:
        print(json.dumps(report, default=str))
    else:
        _print(report)
    failures = _failures(report)
    if failures:
        raise RunFailure("; ".join(failures))
    return 0


def _print(report: dict) -> None:
    from nlq_scale.doctor.trial import summary

    for key, value in report["node"].items():
        print(f"{key:>16}: {value}")
    for name, t in report.get("trials", {}).items():
        print(f"{name:>32}: {summary(t)}")

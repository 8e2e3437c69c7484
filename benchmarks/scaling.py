"""Data-parallel scaling on CPU: training tokens/s at DP=2 (2 gloo ranks, 1 thread each) over DP=1
(1 rank, 1 thread), same model and global batch, measured side by side in one run through
`nlq-scale train`. Prints one JSON line. Goal: >= 1.7.

    python benchmarks/scaling.py [--scale cpu-s --steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def nlq(*args: str, env: dict | None = None) -> None:
    subprocess.run([sys.executable, "-m", "nlq_scale.cli", *args], check=True, env=os.environ | (env or {}))


def median_tokens_per_s(run_dir: Path, skip: int) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r and r["step"] > skip]
    return statistics.median(rates)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", default="cpu-s")
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="nlq-scaling-bench-"))
    try:
        rates = measure(work, a)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        json.dumps(
            {
                "benchmark": "scaling",
                "scale": a.scale,
                "steps": a.steps,
                "tokens_per_s_dp1": round(rates[1], 1),
                "tokens_per_s_dp2": round(rates[2], 1),
                "dp2_over_dp1": round(rates[2] / rates[1], 3),
                "goal": 1.7,
            }
        )
    )


def measure(work: Path, a: argparse.Namespace) -> dict[int, float]:
    data = work / "data"
    nlq("prepare-data", "--sample", "--out", str(data), "--seq-len", "64", "--no-progress")
    common = [
        "train", "--scale", a.scale, "--arm", "nonlinear", f"data.path={data}", f"train.steps={a.steps}",
        "train.global_batch_size=16", "train.micro_batch_size=8", f"train.eval_every={a.steps}",
        "logging.wandb=false", "checkpoint.keep=1",
    ]  # fmt: skip
    rates = {}
    for nproc in (1, 2):
        run_dir = work / f"dp{nproc}"
        nlq(*common, "--run-dir", str(run_dir), "--nproc", str(nproc), env={"OMP_NUM_THREADS": "1"})
        rates[nproc] = median_tokens_per_s(run_dir, skip=3)
    return rates


if __name__ == "__main__":
    main()

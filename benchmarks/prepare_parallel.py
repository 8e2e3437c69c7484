"""Parallel data preparation: one process against N parts at once plus their merge. Prints ONE JSON line:

- tokens_per_s_1_process: `prepare-data` on the whole input, one tokenizer thread (--workers 1);
- tokens_per_s_N_processes: `--parts N --executor local --workers N` on the same input: parts
  1/N ... N/N as N processes with one tokenizer thread each, then the merge (its shard writing in
  N processes), timed from start to end;
- ratio (the goal with 2 parts on a 2-core machine: >= 1.8), the seconds and the CPU seconds (user +
  system of the process and its children: what the work costs whatever else runs on the machine)
  of both, the load average around the run, and identical: whether the merged dataset is
  byte-identical to the single-process one (it must be).

The two are timed --repeats times, alternating, and the medians are reported (with every ratio):
on this shared VM one process's CPU seconds for the same work vary by up to ~30% between runs, so a
single pair can land anywhere from 1.6 to 2.3.

Each is a real `nlq-scale` CLI process (start-up included). The input is the sample corpus written
--copies times under different names (Pile-format .jsonl.zst).

Usage: python benchmarks/prepare_parallel.py [--copies 96] [--parts 2] [--repeats 3] [--work DIR]
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
import time
from pathlib import Path

SEQ = 1024


def cli(log: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "nlq_scale.cli", "prepare-data", "--no-progress", *args],
                                stdout=subprocess.DEVNULL, stderr=err)
    return proc, log


def wait_ok(*started: tuple[subprocess.Popen, Path]) -> list[float]:
    """Waits for every process; returns each one's CPU seconds (user + system, all its threads)."""
    cpu = []
    for proc, log in started:
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode:
            raise SystemExit(f"prepare-data failed (exit {proc.returncode}): {log.read_text().strip()[-2000:]}")
        cpu.append(round(usage.ru_utime + usage.ru_stime, 2))
    return cpu


def corpus(work: Path, copies: int) -> Path:
    from nlq_scale.data.sample import sample_corpus

    files = sample_corpus(work / "sample")
    inputs = work / "inputs"
    inputs.mkdir()
    for c in range(copies):
        for f in files:
            shutil.copyfile(f, inputs / f"{c:02d}-{f.name}")
    return inputs


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def timed(work: Path, name: str, *args: str) -> tuple[float, float]:
    """Seconds and CPU seconds of one `prepare-data` into work/name (replaced)."""
    shutil.rmtree(work / name, ignore_errors=True)
    start = time.perf_counter()
    (cpu,) = wait_ok(cli(work / f"{name}.log", *args, "--out", str(work / name)))
    return time.perf_counter() - start, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=96, help="copies of the sample corpus (~1.6 M tokens each)")
    parser.add_argument("--parts", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="alternating timings of each; medians reported")
    parser.add_argument("--work", type=Path, default=None, help="scratch dir (default: a temp dir, removed)")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="nlq-prepare-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        inputs = corpus(work, args.copies)
        common = ["--source", "pile", "--input", str(inputs), "--seq-len", str(SEQ)]
        load_before = os.getloadavg()[0]
        serial, parallel = [], []
        for _ in range(args.repeats):
            serial.append(timed(work, "one", *common, "--workers", "1"))
            parallel.append(timed(work, "par", *common, "--workers", str(args.parts),
                                  "--parts", str(args.parts), "--executor", "local"))
        serial_s, serial_cpu = (statistics.median(v) for v in zip(*serial))
        parallel_s, parallel_cpu = (statistics.median(v) for v in zip(*parallel))
        splits = json.loads((work / "one" / "manifest.json").read_text())["splits"]
        tokens = splits["train"]["tokens"] + splits["val"]["tokens"]
        print(json.dumps({
            "benchmark": "prepare_parallel",
            "cores": os.cpu_count(),
            "parts": args.parts,
            "repeats": args.repeats,
            "tokens": tokens,
            "tokens_per_s_1_process": round(tokens / serial_s),
            f"tokens_per_s_{args.parts}_processes": round(tokens / parallel_s),
            "ratio": round(serial_s / parallel_s, 3),
            "ratios": [round(s / p, 3) for (s, _), (p, _) in zip(serial, parallel)],
            "seconds_1_process": round(serial_s, 2),
            f"seconds_{args.parts}_processes": round(parallel_s, 2),
            "cpu_seconds_1_process": round(serial_cpu, 2),
            f"cpu_seconds_{args.parts}_processes": round(parallel_cpu, 2),
            "load_average_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "identical": tree(work / "one") == tree(work / "par"),
        }), flush=True)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Sharded-checkpoint save/load speed of the megatron engine (dist_checkpointing, model + fully
reshardable optimizer state) against a raw sequential write/read of the same number of bytes,
measured side by side in one run. Prints one JSON line. Goal: save and load >= 0.5 of raw.

    python benchmarks/checkpoint.py [--hidden 256 --layers 4 --repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def raw_write_read(path: Path, nbytes: int, chunk: int = 64 << 20) -> tuple[float, float]:
    block = os.urandom(min(chunk, nbytes))
    start = time.perf_counter()
    with open(path, "wb") as f:
        written = 0
        while written < nbytes:
            n = min(len(block), nbytes - written)
            f.write(block[:n])
            written += n
    write_s = time.perf_counter() - start
    start = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(chunk):
            pass
    return write_s, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args()

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
            engine = MegatronEngine(cfg, layout.device)
            save_s, load_s = [], []
            for i in range(a.repeats):
                target = work / f"ckpt{i}"
                target.mkdir()
                start = time.perf_counter()
                engine.save(target)
                save_s.append(time.perf_counter() - start)
                start = time.perf_counter()
                engine.load(target)
                load_s.append(time.perf_counter() - start)
            nbytes = directory_bytes(work / "ckpt0")
        raw = [raw_write_read(work / f"raw{i}.bin", nbytes) for i in range(a.repeats)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mb = nbytes / 1e6
    best = {"save": min(save_s), "load": min(load_s), "raw_write": min(w for w, _ in raw), "raw_read": min(r for _, r in raw)}
    print(
        json.dumps(
            {
                "benchmark": "checkpoint",
                "checkpoint_mb": round(mb, 1),
                "save_mb_s": round(mb / best["save"], 1),
                "load_mb_s": round(mb / best["load"], 1),
                "raw_write_mb_s": round(mb / best["raw_write"], 1),
                "raw_read_mb_s": round(mb / best["raw_read"], 1),
                "save_over_raw": round(best["raw_write"] / best["save"], 3),
                "load_over_raw": round(best["raw_read"] / best["load"], 3),
                "goals": {"save_over_raw": 0.5, "load_over_raw": 0.5},
            }
        )
    )


if __name__ == "__main__":
    main()

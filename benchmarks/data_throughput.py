"""Data pipeline throughput on the sample corpus. Prints ONE JSON line:

- tokenizer_tokens_per_s_1_worker / _all_workers: GPT-2 BPE (prepare-data's tokenizing step) with
  one thread and with every core;
- loader_tokens_per_s: the training loader (mosaicml-streaming MDS, py1e shuffle) at seq 1024,
  rank batch 16, with data.num_workers = 0 and with all cores as workers;
- memmap_tokens_per_s: nanoGPT's reader (np.memmap of all tokens, random offsets), same shapes,
  measured in the same run on the same tokens;
- training_tokens_per_s: what training consumes, measured in the same run: `nlq-scale train` at the
  quickstart's largest scale (cpu-m, linear arm, --train-steps steps on the sample corpus prepared
  at its context of 64), the median `tokens_per_s` of its metrics.jsonl (the whole run's
  consumption, so conservative for data-parallel runs, where each rank has its own loader);
  --train-run RUN_DIR reads an existing run instead;
- loader_over_training: loader_tokens_per_s / training_tokens_per_s (goal >= 20).

Usage: python benchmarks/data_throughput.py [--seconds 5] [--train-steps 30] [--work DIR] [--train-run RUN_DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

SEQ = 1024
BATCH = 16
QUICKSTART_SCALE = "cpu-m"


def _texts(corpus_files: list[Path]) -> list[str]:
    import io

    import zstandard

    texts = []
    for path in corpus_files:
        with path.open("rb") as f:
            reader = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True)
            for line in io.TextIOWrapper(reader, encoding="utf-8"):
                texts.append(json.loads(line)["text"])
    return texts


def tokenizer_rate(texts: list[str], workers: int, seconds: float) -> float:
    """prepare-data's tokenizing step (hash + BPE + EOT, in order), whole passes over the corpus."""
    from nlq_scale.data.prepare import tokenized
    from nlq_scale.data.tokenizer import gpt2_tokenizer

    tok = gpt2_tokenizer()
    tokens, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        tokens += sum(len(ids) for _, ids in tokenized(texts, tok, workers))
    return tokens / (time.perf_counter() - start)


def _timed_batches(batches, seconds: float) -> float:
    next(batches)  # warm-up: workers started, first shard touched
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        count += next(batches).numel()
    return count / (time.perf_counter() - start)


def loader_rate(dataset: Path, tmp: Path, workers: int, seconds: float) -> float:
    from nlq_scale.config.schema import DataConfig
    from nlq_scale.data.loader import make_train_loader

    loader = make_train_loader(DataConfig(path=str(dataset), num_workers=workers), seq_length=SEQ,
                               rank_batch_size=BATCH, dp_rank=0, dp_size=1, tmp_dir=tmp)
    try:
        return _timed_batches(iter(loader), seconds)
    finally:
        loader.close()


def memmap_rate(dataset: Path, work: Path, seconds: float) -> float:
    """All train tokens in one flat uint16 file, read nanoGPT's way (random offsets into a memmap)."""
    from nlq_scale.compat.streaming import LocalDataset

    local = LocalDataset(local=str(dataset), split="train")
    flat = work / "train.bin"
    np.concatenate([local[i]["tokens"] for i in range(len(local))]).tofile(flat)
    data = np.memmap(flat, dtype=np.uint16, mode="r")
    rng = np.random.default_rng(0)

    def batches():
        while True:
            offsets = rng.integers(0, len(data) - SEQ - 1, BATCH)
            yield torch.from_numpy(np.stack([data[i : i + SEQ + 1].astype(np.int64) for i in offsets]))

    return _timed_batches(batches(), seconds)


def training_tokens_per_s(run_dir: Path) -> float:
    from nlq_scale.train.rundir import read_metrics

    rates = [float(r["tokens_per_s"]) for r in read_metrics(run_dir) if r.get("tokens_per_s")]
    if not rates:
        raise SystemExit(f"{run_dir}: no tokens_per_s records in its metrics")
    return float(np.median(rates))


def train_quickstart_scale(corpus: list[Path], work: Path, steps: int) -> Path:
    """A short real training run at the quickstart's largest scale; returns its run directory."""
    from nlq_scale.config import load_run_config
    from nlq_scale.data.prepare import PrepareOptions, prepare

    seq = load_run_config(QUICKSTART_SCALE, "linear").model.seq_length
    data = work / f"ds-{seq}"
    prepare(PrepareOptions(source="pile", inputs=corpus, out=data, seq_len=seq, val_fraction=0.1, force=True),
            progress=False)
    run_dir = work / "train"
    cmd = [sys.executable, "-m", "nlq_scale.cli", "train", "--scale", QUICKSTART_SCALE, "--arm", "linear",
           "--run-dir", str(run_dir), f"data.path={data}", f"train.steps={steps}", "train.eval_every=1000000",
           "logging.wandb=false", f"checkpoint.every={steps}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"training run failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    return run_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--work", type=Path, default=None, help="scratch dir (default: a temp dir, removed)")
    parser.add_argument("--train-steps", type=int, default=30, help="steps of the training run measured here")
    parser.add_argument("--train-run", type=Path, default=None, help="read this finished run instead of training one")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="nlq-data-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    try:
        from nlq_scale.data.prepare import PrepareOptions, prepare
        from nlq_scale.data.sample import sample_corpus

        corpus = sample_corpus(work / "corpus")
        texts = _texts(corpus)
        one = tokenizer_rate(texts, 1, args.seconds)
        every = tokenizer_rate(texts, cores, args.seconds)
        dataset = work / "ds"
        prepare(PrepareOptions(source="pile", inputs=corpus, out=dataset, seq_len=SEQ, val_fraction=0.1, force=True),
                progress=False)
        result = {
            "benchmark": "data_throughput",
            "cores": cores,
            "tokenizer_tokens_per_s_1_worker": round(one),
            "tokenizer_tokens_per_s_all_workers": round(every),
            "seq_length": SEQ,
            "rank_batch_size": BATCH,
            "loader_tokens_per_s": round(loader_rate(dataset, work / "tmp", 0, args.seconds)),
            "loader_tokens_per_s_all_workers": round(loader_rate(dataset, work / "tmp", cores, args.seconds)),
            "memmap_tokens_per_s": round(memmap_rate(dataset, work, args.seconds)),
        }
        run_dir = args.train_run or train_quickstart_scale(corpus, work, args.train_steps)
        training = training_tokens_per_s(run_dir)
        result["training_scale"] = QUICKSTART_SCALE if args.train_run is None else str(run_dir)
        result["training_tokens_per_s"] = round(training)
        result["loader_over_training"] = round(result["loader_tokens_per_s"] / training, 1)
        result["goal"] = {"loader_over_training": 20}
        print(json.dumps(result), flush=True)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

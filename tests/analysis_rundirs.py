"""Builds run directories that follow the train contract (docs/training.md, "The run directory as
written"; config.yaml from the real RunConfig, manifest accounting from nlq_scale.model.accounting,
status.json, metrics.jsonl) from synthetic loss curves with a known ground truth, for the analysis
tests."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Callable

import numpy as np

from nlq_scale.config.load import build_run_config, dump_run_config
from nlq_scale.config.schema import RunConfig
from nlq_scale.model.accounting import count_parameters, flops_per_token

# tiny shapes, roughly 4x apart in non-embedding parameters
SCALES = {
    "t1": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4},
    "t2": {"num_layers": 3, "hidden_size": 128, "num_attention_heads": 4},
    "t3": {"num_layers": 4, "hidden_size": 256, "num_attention_heads": 4},
    "t4": {"num_layers": 6, "hidden_size": 384, "num_attention_heads": 6},
    "t5": {"num_layers": 8, "hidden_size": 512, "num_attention_heads": 8},
}
MODEL_ARM = {"linear": "linear", "nonlinear": "nonlinear", "identity": "identity", "linear-mlp4.75": "linear"}
STEPS, EVAL_EVERY, LOG_EVERY = 200, 20, 10


def make_config(arm: str, scale: str, seed: int, lr: float, steps: int = STEPS) -> RunConfig:
    model = {**SCALES[scale], "arm": MODEL_ARM[arm], "seq_length": 128, "vocab_size": 512}
    if arm == "linear-mlp4.75":
        model["mlp_ratio"] = 4.75
    return build_run_config(
        {
            "name": f"{arm}-{scale}-s{seed}-lr{lr:g}",
            "sweep": "synth",
            "scale": scale,
            "variant": arm,
            "seed": seed,
            "model": model,
            "train": {"lr": lr, "steps": steps, "global_batch_size": 8, "micro_batch_size": 8,
                      "eval_every": EVAL_EVERY, "log_every": LOG_EVERY},
        }
    )


def tokens_per_step(cfg: RunConfig) -> int:
    return cfg.train.global_batch_size * cfg.model.seq_length


def training_compute(cfg: RunConfig, steps: int | None = None) -> float:
    return float(flops_per_token(cfg.model) * tokens_per_step(cfg) * (steps or cfg.train.steps))


def curve(final: float, steps: np.ndarray, total: int, start: float = 8.0) -> np.ndarray:
    """A smooth decreasing val-loss curve that reaches `final` at step `total`."""
    k = (start - final) / ((EVAL_EVERY / total) ** -0.5 - 1)
    return final + k * ((steps / total) ** -0.5 - 1)


def write_run_dir(
    root: Path,
    cfg: RunConfig,
    val_steps: np.ndarray,
    val_loss: np.ndarray,
    state: str = "completed",
    events: dict[int, str] | None = None,
) -> Path:
    run_dir = root / (cfg.sweep or "synth") / (cfg.name or "run")
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_run_config(cfg))
    counts = count_parameters(cfg.model)
    manifest = {
        "package": {"name": "nlq-scale", "version": "0.1.0"},
        "git_sha": None,
        "versions": {},
        "data": {"manifest_sha256": None},
        "layout": {"world_size": 1, "nodes": 1, "tp": 1, "pp": 1, "dp": 1, "ep": 1, "engine": "megatron", "zero_stage": 0},
        "accounting": {"params": counts.total, "non_embedding_params": counts.non_embedding,
                       "flops_per_token": flops_per_token(cfg.model)},
    }
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    tps = tokens_per_step(cfg)
    last = int(val_steps[-1]) if len(val_steps) else 0
    now = time.time()
    (run_dir / "status.json").write_text(json.dumps({
        "state": state, "step": last, "tokens": last * tps, "last_checkpoint": None, "error": None,
        "total_steps": cfg.train.steps, "slurm_job_id": None, "num_nodes": 1,
        "started_at": now - 60, "updated_at": now, "elapsed_s": 60.0,
    }))
    val = dict(zip(map(int, val_steps), map(float, val_loss)))
    finite = np.isfinite(val_loss)
    events = {0: "start", **(events or {})}
    if state == "completed":
        events[last] = "end"
    lines = []
    for step in range(0, last + 1):
        rec: dict = {"step": step, "tokens": step * tps, "time": now - 60 + step * 0.1}
        if step in val:
            rec["val/loss"] = val[step]
        if step % LOG_EVERY == 0 and step > 0:
            rec["train/loss"] = val.get(step, float(np.interp(step, val_steps[finite], val_loss[finite]))) + 0.01
            rec["lr"] = cfg.train.lr
        if step in events:
            rec["event"] = events[step]
        if len(rec) > 3:
            lines.append(json.dumps(rec))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run_dir


Truth = Callable[[str, RunConfig], float]


def power_law_truth(E: float, A: float, alpha: float, multipliers: dict[str, float] | None = None,
                    best_lr: float = 1e-3, lr_penalty: float = 0.02) -> Truth:
    """Final loss = E + A (m_arm C)^-alpha + lr_penalty log10(lr/best_lr)^2: arm X is worth
    m_arm times its compute to the reference (m = 1)."""
    multipliers = multipliers or {}

    def truth(arm: str, cfg: RunConfig) -> float:
        c = multipliers.get(arm, 1.0) * training_compute(cfg)
        return E + A * c ** -alpha + lr_penalty * math.log10(cfg.train.lr / best_lr) ** 2

    return truth


def make_sweep(
    root: Path,
    truth: Truth,
    arms: list[str],
    scales: list[str],
    seeds: list[int],
    lrs: list[float] = (1e-3,),
    noise: float = 0.003,
    rng_seed: int = 0,
) -> list[Path]:
    rng = np.random.default_rng(rng_seed)
    steps = np.arange(EVAL_EVERY, STEPS + 1, EVAL_EVERY)
    paths = []
    for arm in arms:
        for scale in scales:
            for lr in lrs:
                for seed in seeds:
                    cfg = make_config(arm, scale, seed, lr)
                    final = truth(arm, cfg) + rng.normal(0, noise)
                    paths.append(write_run_dir(root, cfg, steps, curve(final, steps, STEPS)))
    return paths


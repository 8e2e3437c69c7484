"""Training throughput of the query arms through the megatron-core model, and of the plain-PyTorch
reference (linear) at the same shape, measured side by side in one run (interleaved rounds so
machine noise hits every variant alike). Prints one JSON line.

    python benchmarks/throughput.py [--hidden 512 --layers 8 --heads 8 --seq 512 --batch 8 --rounds 3]
    python benchmarks/throughput.py --processes 3 --rounds 4   # medians over fresh processes
    python benchmarks/throughput.py --scale cpu-m [--batch 8 --rounds 10]   # a shipped scale's shape

A CPU "MFU" per variant: achieved model FLOP/s (training FLOPs per token from the accounting, the
same count the GPU MFU uses, times tokens/s) over this machine's fp32 matmul peak at the same
thread count, measured in the same run (the best of a few seconds of square matmuls, before and
after the training steps).

`nonlinear_fuse_up` is the nonlinear arm with model.nlq.fuse_up (its RMSNorm folded into W1's GEMM);
`fuse_up_over_nonlinear` is what that gains. `nonlinear_recompute_query` is the nonlinear arm with
parallel.recompute_query (its query MLP run again in backward, for activation memory);
`recompute_query_over_nonlinear` is what that costs (its MFU counts the model's FLOPs, not the
recomputation, as MFU does). `nonlinear_compile_query` is the nonlinear arm with
parallel.compile_query (its norms and mix compiled by torch.compile, in the warm-up step);
`compile_query_over_nonlinear` is what that gains. Every arm runs its core attention through torch's
scaled_dot_product_attention (model.core_attention=auto); `linear_stock`, `nonlinear_stock` and
`identity_stock` run megatron's unfused one instead (model.core_attention=stock): `sdpa_over_stock` is
what SDPA gains the linear arm, and `nonlinear_stock_over_linear_stock` (`identity_stock_over_linear_stock`)
the arms' ratio without it.

The measuring processes run on tcmalloc where it is installed (`--cpu-allocator auto`, as the
`--nproc` ranks do: runtime.cpu_allocator); `--cpu-allocator system` keeps glibc's malloc, which
faults a step's freed activations in again at every step. `allocator` says which one ran.

Goals: nonlinear_over_linear >= 0.97, harness_over_reference >= 1.0, mfu >= 0.75 for every arm.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="timed steps per variant (after one warm-up)")
    p.add_argument("--scale", default=None, help="a shipped scale whose model shape to use (overrides --hidden ... --seq)")
    p.add_argument("--matmul-size", type=int, default=2048, help="square fp32 matmul for the peak")
    p.add_argument("--processes", type=int, default=1, help="fresh processes to run it in, one after another (medians)")
    p.add_argument("--cpu-allocator", choices=("auto", "system"), default="auto",
                   help="host allocator of the measuring processes (runtime.cpu_allocator)")
    return p.parse_args()


# Variant name -> (arm, config overrides).
VARIANTS = {
    "linear": ("linear", ()),
    "nonlinear": ("nonlinear", ()),
    "identity": ("identity", ()),
    "nonlinear_recompute_query": ("nonlinear", ("parallel.recompute_query=true",)),
    "nonlinear_fuse_up": ("nonlinear", ("model.nlq.fuse_up=true",)),
    "nonlinear_compile_query": ("nonlinear", ("parallel.compile_query=true",)),
    "linear_stock": ("linear", ("model.core_attention=stock",)),
    "nonlinear_stock": ("nonlinear", ("model.core_attention=stock",)),
    "identity_stock": ("identity", ("model.core_attention=stock",)),
}


def model_config(variant: str, a: argparse.Namespace):
    from nlq_scale.config import load_run_config

    arm, extra = VARIANTS[variant]
    fp32 = ["model.bf16=false", *extra]  # the CPU measures fp32 (the GPU rungs default to bf16)
    if a.scale:
        return load_run_config(a.scale, arm, overrides=fp32)
    overrides = [*fp32,
        f"model.num_layers={a.layers}",
        f"model.hidden_size={a.hidden}",
        f"model.num_attention_heads={a.heads}",
        f"model.kv_channels={a.hidden // a.heads}",
        f"model.seq_length={a.seq}",
    ]
    return load_run_config("124m", arm, overrides=overrides)


def megatron_step(variant: str, a: argparse.Namespace):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nlq_scale.model.gpt import build_gpt

    cfg = model_config(variant, a)
    model_parallel_cuda_manual_seed(0)
    model = build_gpt(cfg.model, cfg.parallel)
    positions = torch.arange(cfg.model.seq_length).unsqueeze(0).expand(a.batch, -1)
    return _stepper(model, lambda tokens: model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean())


def reference_step(a: argparse.Namespace):
    from nlq_scale.model.reference import ReferenceGPT

    model = ReferenceGPT(model_config("linear", a).model)
    return _stepper(model, lambda tokens: model(tokens[:, :-1], tokens[:, 1:]).mean())


def matmul_peak(n: int, seconds: float = 2.0) -> float:
    """fp32 FLOP/s of the best n x n x n matmul in `seconds` (the machine's attainable peak)."""
    x, y = torch.randn(n, n), torch.randn(n, n)
    x @ y
    best, deadline = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.perf_counter()
        x @ y
        best = max(best, 2 * n**3 / (time.perf_counter() - start))
    return best


def _stepper(model: torch.nn.Module, loss_fn):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)

    def step(tokens: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(tokens).backward()
        optimizer.step()

    return step


def across_processes(n: int) -> dict:
    """This benchmark run `n` times, each in a fresh process, one after another. Within a process the
    rounds agree, but between processes whole arms move by 10% and more with where their memory
    lands (docs/performance.md), so one process cannot judge a 3% goal. Every figure is the median
    over the processes; each ratio is also kept per process."""
    runs = []
    for _ in range(n):
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--processes", "1"],
                             check=True, capture_output=True, text=True).stdout  # fmt: skip
        runs.append(json.loads([line for line in out.splitlines() if line.startswith("{")][-1]))
    numeric = {k for k, v in runs[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    merged = {k: statistics.median(r[k] for r in runs) if k in numeric else v for k, v in runs[0].items()}
    return {**merged, "processes": n, "per_process": {k: [r[k] for r in runs] for k in numeric if "_over_" in k}}


def main() -> None:
    from nlq_scale.config.schema import ParallelConfig
    from nlq_scale.runtime.dist import distributed

    from nlq_scale.model.accounting import flops_per_token
    from nlq_scale.runtime.allocator import loaded_allocator, restart_with

    a = parse()
    restart_with(a.cpu_allocator)
    if a.processes > 1:
        print(json.dumps(across_processes(a.processes)))
        return
    models = {variant: model_config(variant, a).model for variant in VARIANTS}
    seq = models["linear"].seq_length
    torch.manual_seed(0)
    tokens = torch.randint(0, 50257, (a.batch, seq + 1))
    peak = matmul_peak(a.matmul_size)
    with distributed(ParallelConfig()):
        steps = {variant: megatron_step(variant, a) for variant in VARIANTS}
        steps["reference_linear"] = reference_step(a)
        for step in steps.values():
            step(tokens)  # warm-up: allocator, autograd graph caches
        seconds: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(a.rounds):
            for name, step in steps.items():
                start = time.perf_counter()
                step(tokens)
                seconds[name].append(time.perf_counter() - start)
    peak = max(peak, matmul_peak(a.matmul_size))
    tokens_per_step = a.batch * seq
    tps = {name: tokens_per_step / statistics.median(s) for name, s in seconds.items()}
    flops = {name: flops_per_token(models[name.removeprefix("reference_")]) for name in tps}
    mfu = {name: flops[name] * tps[name] / peak for name in tps}
    m = models["linear"]
    print(
        json.dumps(
            {
                "benchmark": "throughput",
                "scale": a.scale,
                "shape": {"hidden": m.hidden_size, "layers": m.num_layers, "heads": m.num_attention_heads, "seq": seq,
                          "batch": a.batch, "vocab": m.padded_vocab_size},
                "threads": torch.get_num_threads(),
                "allocator": loaded_allocator(),
                "rounds": a.rounds,
                **{f"tokens_per_s_{name}": round(v, 1) for name, v in tps.items()},
                "nonlinear_over_linear": round(tps["nonlinear"] / tps["linear"], 4),
                "nonlinear_fuse_up_over_linear": round(tps["nonlinear_fuse_up"] / tps["linear"], 4),
                "fuse_up_over_nonlinear": round(tps["nonlinear_fuse_up"] / tps["nonlinear"], 4),
                "identity_over_linear": round(tps["identity"] / tps["linear"], 4),
                "harness_over_reference": round(tps["linear"] / tps["reference_linear"], 4),
                "recompute_query_over_nonlinear": round(tps["nonlinear_recompute_query"] / tps["nonlinear"], 4),
                "nonlinear_compile_query_over_linear": round(tps["nonlinear_compile_query"] / tps["linear"], 4),
                "compile_query_over_nonlinear": round(tps["nonlinear_compile_query"] / tps["nonlinear"], 4),
                "sdpa_over_stock": round(tps["linear"] / tps["linear_stock"], 4),
                "nonlinear_stock_over_linear_stock": round(tps["nonlinear_stock"] / tps["linear_stock"], 4),
                "identity_stock_over_linear_stock": round(tps["identity_stock"] / tps["linear_stock"], 4),
                "matmul_peak_gflops": round(peak / 1e9, 1),
                **{f"model_gflops_{name}": round(flops[name] * tps[name] / 1e9, 1) for name in tps},
                **{f"mfu_{name}": round(v, 3) for name, v in mfu.items()},
                "goals": {"nonlinear_over_linear": 0.97, "harness_over_reference": 1.0, "mfu": 0.75},
            }
        )
    )


if __name__ == "__main__":
    main()

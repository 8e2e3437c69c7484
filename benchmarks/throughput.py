"""Training throughput of the query arms through the megatron-core model, and of the plain-PyTorch
reference (linear) at the same shape, measured side by side in one run (interleaved rounds so
machine noise hits every variant alike). Prints one JSON line.

    python benchmarks/throughput.py [--hidden 512 --layers 8 --heads 8 --seq 512 --batch 8 --rounds 3]

Goals: nonlinear_over_linear >= 0.97, harness_over_reference >= 1.0.
"""

from __future__ import annotations

import argparse
import json
import statistics
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
    return p.parse_args()


def model_config(arm: str, a: argparse.Namespace):
    from nlq_scale.config import load_run_config

    overrides = [
        f"model.num_layers={a.layers}",
        f"model.hidden_size={a.hidden}",
        f"model.num_attention_heads={a.heads}",
        f"model.kv_channels={a.hidden // a.heads}",
        f"model.seq_length={a.seq}",
    ]
    return load_run_config("124m", arm, overrides=overrides)


def megatron_step(arm: str, a: argparse.Namespace):
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nlq_scale.model.gpt import build_gpt

    cfg = model_config(arm, a)
    model_parallel_cuda_manual_seed(0)
    model = build_gpt(cfg.model, cfg.parallel)
    positions = torch.arange(a.seq).unsqueeze(0).expand(a.batch, -1)
    return _stepper(model, lambda tokens: model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).mean())


def reference_step(a: argparse.Namespace):
    from nlq_scale.model.reference import ReferenceGPT

    model = ReferenceGPT(model_config("linear", a).model)
    return _stepper(model, lambda tokens: model(tokens[:, :-1], tokens[:, 1:]).mean())


def _stepper(model: torch.nn.Module, loss_fn):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1)

    def step(tokens: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(tokens).backward()
        optimizer.step()

    return step


def main() -> None:
    from nlq_scale.config.schema import ParallelConfig
    from nlq_scale.runtime.dist import distributed

    a = parse()
    torch.manual_seed(0)
    tokens = torch.randint(0, 50257, (a.batch, a.seq + 1))
    with distributed(ParallelConfig()):
        steps = {arm: megatron_step(arm, a) for arm in ("linear", "nonlinear", "identity")}
        steps["reference_linear"] = reference_step(a)
        for step in steps.values():
            step(tokens)  # warm-up: allocator, autograd graph caches
        seconds: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(a.rounds):
            for name, step in steps.items():
                start = time.perf_counter()
                step(tokens)
                seconds[name].append(time.perf_counter() - start)
    tokens_per_step = a.batch * a.seq
    tps = {name: tokens_per_step / statistics.median(s) for name, s in seconds.items()}
    print(
        json.dumps(
            {
                "benchmark": "throughput",
                "shape": {"hidden": a.hidden, "layers": a.layers, "heads": a.heads, "seq": a.seq, "batch": a.batch},
                "threads": torch.get_num_threads(),
                "rounds": a.rounds,
                **{f"tokens_per_s_{name}": round(v, 1) for name, v in tps.items()},
                "nonlinear_over_linear": round(tps["nonlinear"] / tps["linear"], 4),
                "identity_over_linear": round(tps["identity"] / tps["linear"], 4),
                "harness_over_reference": round(tps["linear"] / tps["reference_linear"], 4),
                "goals": {"nonlinear_over_linear": 0.97, "harness_over_reference": 1.0},
            }
        )
    )


if __name__ == "__main__":
    main()

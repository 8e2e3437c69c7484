"""KV-cache greedy decoding speed of every arm side by side at one shape: each arm's megatron GPT is
exported to transformers (nlq_scale.export) and decodes with transformers' generate and its cache.
Every arm runs the exported modeling code (the baseline too, not GPT-2's class), so the ratio
measures the query path, not two implementations.
Prints one JSON line: decode tokens/s per arm and each arm's speed over the baseline's (the
nonlinear query adds work on the critical path of every token). Goal: nonlinear_over_linear >= 0.95.

    python benchmarks/decode.py [--scale 124m --prompt 16 --new-tokens 16 --batch 1 --repeats 8 --device cpu]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def decode_seconds(model, prompt, new_tokens: int) -> float:
    import torch

    with torch.no_grad():
        if prompt.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(
            prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )  # fmt: skip
        if prompt.is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start


def paired_ratio(base: list[float], arm: list[float]) -> float:
    """Median over rounds of the arm's speed over the baseline's in the same round: on a shared
    machine the load drifts between rounds far more than within one."""
    return round(statistics.median(b / t for b, t in zip(base, arm, strict=True)), 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", default="124m")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=8, help="rounds; medians reported")
    p.add_argument("--device", default="cpu")
    a = p.parse_args()

    import torch
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from nlq_scale import arms
    from nlq_scale.config import load_run_config
    from nlq_scale.config.schema import ParallelConfig
    from nlq_scale.export.hf import hf_model
    from nlq_scale.model.gpt import build_gpt
    from nlq_scale.runtime.dist import distributed

    seq = load_run_config(a.scale, overrides=["model.bf16=false"]).model.seq_length
    if a.prompt + a.new_tokens > seq:
        p.error(f"--prompt {a.prompt} + --new-tokens {a.new_tokens} exceed the {a.scale} context of {seq}")
    models = {}
    with distributed(ParallelConfig(), device="cpu"):
        for arm in arms.names():
            cfg = load_run_config(a.scale, overrides=[f"model.arm={arm}", "model.bf16=false"])
            model_parallel_cuda_manual_seed(cfg.seed)
            state = build_gpt(cfg.model, cfg.parallel, device=torch.device("cpu")).state_dict()
            models[arm] = hf_model(state, cfg.model, stock=False).to(a.device)
    prompt = torch.randint(0, cfg.model.vocab_size, (a.batch, a.prompt), device=a.device)
    for model in models.values():  # warm-up: first-call allocations and kernel selection
        decode_seconds(model, prompt, 2)
    times = {arm: [] for arm in models}
    order = list(models)
    for r in range(a.repeats):  # arms interleaved, the order rotated each round: load changes hit them alike
        for arm in order[r % len(order) :] + order[: r % len(order)]:
            times[arm].append(decode_seconds(models[arm], prompt, a.new_tokens))
    speed = {arm: a.batch * a.new_tokens / statistics.median(t) for arm, t in times.items()}
    classes = {arm: type(model).__name__ for arm, model in models.items()}
    base = arms.baseline().name
    print(
        json.dumps(
            {
                "benchmark": "decode",
                "scale": a.scale,
                "device": a.device,
                "batch": a.batch,
                "prompt_tokens": a.prompt,
                "new_tokens": a.new_tokens,
                "decode_tokens_per_s": {arm: round(s, 1) for arm, s in speed.items()},
                "class": classes,
                **{f"{arm}_over_{base}": paired_ratio(times[base], times[arm]) for arm in times if arm != base},
                f"nonlinear_over_{base}_per_round": sorted(round(b / t, 3) for b, t in zip(times[base], times["nonlinear"])),
                "goals": {f"nonlinear_over_{base}": 0.95},
            }
        )
    )


if __name__ == "__main__":
    main()

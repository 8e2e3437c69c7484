"""KV-cache greedy decoding speed of every arm side by side at one shape: each arm's megatron GPT is
exported to transformers (nlq_scale.export) and decodes with transformers' generate and its cache.
Every arm runs the exported modeling code (the baseline too, not GPT-2's class), so the ratio
measures the query path, not two implementations.
Prints one JSON line: decode tokens/s per arm and each arm's speed over the baseline's (the
nonlinear query adds work on the critical path of every token). Goal: nonlinear_over_linear >= 0.95.

    python benchmarks/decode.py [--scale cpu-s --prompt 16 --new-tokens 48 --batch 1 --repeats 3 --device cpu]
"""

from __future__ import annotations

import argparse
import json
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", default="cpu-s")
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
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
    best = dict.fromkeys(models, float("inf"))
    for _ in range(a.repeats):  # arms interleaved, so a change in machine load hits them alike
        for arm, model in models.items():
            best[arm] = min(best[arm], decode_seconds(model, prompt, a.new_tokens))
    speed = {arm: a.batch * a.new_tokens / s for arm, s in best.items()}
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
                **{f"{arm}_over_{base}": round(s / speed[base], 3) for arm, s in speed.items() if arm != base},
                "goals": {f"nonlinear_over_{base}": 0.95},
            }
        )
    )


if __name__ == "__main__":
    main()

"""Peak training activation memory of every query arm at one shape, measured side by side in one run,
with and without recomputing the query MLP in backward, next to the planner's estimate. Prints one
JSON line.

    python benchmarks/memory.py [--hidden 256 --layers 4 --heads 8 --seq 256 --batch 4 --vocab 256]

Measured as nlq_scale/model/memory.py does (the plain-PyTorch reference model, fp32 AdamW, torch
fused attention; the CPU allocator's own events over one forward + backward): `activation_mb_<arm>`
is the pass's peak above the model state, `planner_over_measured_<arm>` the planner's activation
estimate (selective recompute, the formula that matches fused attention) over it, and
`<arm>_over_linear` the arm's peak over the baseline's. The same with `_recompute_query` for the arms
whose query MLP `parallel.recompute_query` recomputes (only its input and output kept). The default
vocabulary is small so that the layers, where the arms differ, dominate the logits (with GPT-2's 50k
rows at this size the logits would hide them); `planner_<arm>_over_linear` gives the planner's ratio
at the shipped GPU rungs (their own vocabulary, micro-batch and selective recompute), with and
without the query recompute. Goal (issue #16): the nonlinear query within 5% of linear with
recompute_query.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scale", default="cpu-xs", help="a shipped scale: norms, positions")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--rungs", default="124m,1.3b,13b", help="shipped scales for the planner's ratios")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    a = p.parse_args()

    from nlq_scale import arms
    from nlq_scale.cluster.plan import memory_per_device, one_device_layout
    from nlq_scale.config import load_run_config
    from nlq_scale.model.memory import measure

    shape = [f"model.num_layers={a.layers}", f"model.hidden_size={a.hidden}", f"model.num_attention_heads={a.heads}",
             f"model.kv_channels={a.hidden // a.heads}", f"model.seq_length={a.seq}", f"model.vocab_size={a.vocab}", "model.bf16=false",
             f"train.micro_batch_size={a.batch}", f"train.global_batch_size={a.batch}", "parallel.recompute=selective"]
    variants = {"": "parallel.recompute_query=false", "_recompute_query": "parallel.recompute_query=true"}

    def recomputes(arm: str) -> bool:
        return arms.get(arm).recomputes_query(load_run_config(a.scale, overrides=[f"model.arm={arm}"]).model, True)

    cases = [(arm, suffix) for arm in arms.names() for suffix in variants if not suffix or recomputes(arm)]
    measured, estimated = {}, {}
    for arm, suffix in cases:
        cfg = load_run_config(a.scale, overrides=[f"model.arm={arm}", *shape, variants[suffix]])
        _, measured[arm + suffix] = measure(cfg)
        estimated[arm + suffix] = memory_per_device(cfg, one_device_layout(cfg)).activations
    base = arms.baseline().name
    planned = {}
    for rung in a.rungs.split(","):
        per_case = {}
        for arm, suffix in cases:
            cfg = load_run_config(rung, overrides=[f"model.arm={arm}", "parallel.recompute=selective", variants[suffix]])
            per_case[arm + suffix] = memory_per_device(cfg, one_device_layout(cfg)).activations
        planned[rung] = {case: round(v / per_case[base], 3) for case, v in per_case.items() if case != base}
    print(json.dumps({
        "benchmark": "memory",
        "scale": a.scale,
        "shape": {"hidden": a.hidden, "layers": a.layers, "heads": a.heads, "seq": a.seq, "batch": a.batch,
                  "vocab": a.vocab},
        **{f"activation_mb_{case}": round(v / 1e6, 1) for case, v in measured.items()},
        **{f"{case}_over_{base}": round(v / measured[base], 3) for case, v in measured.items() if case != base},
        **{f"planner_over_measured_{case}": round(estimated[case] / measured[case], 3) for case in measured},
        **{f"planner_{case}_over_{base}": {rung: ratios[case] for rung, ratios in planned.items()}
           for case in measured if case != base},
        "goals": {f"nonlinear_recompute_query_over_{base}": 1.05},
    }))


if __name__ == "__main__":
    main()

"""`nlq-scale params`: parameter counts and training FLOPs per token for a scale and arm."""

from __future__ import annotations

import argparse


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("params", help="parameter and FLOP accounting for a scale and arm")
    p.add_argument("--scale", required=True)
    p.add_argument("--arm", required=True)
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=run)


def summary(scale: str, arm: str, overrides: list[str]) -> dict:
    from nlq_scale.config.load import load_run_config
    from nlq_scale.model.accounting import count_parameters, flops_per_token, resolve_model

    cfg = load_run_config(scale=scale, arm=arm, overrides=overrides)
    m = resolve_model(cfg.model)
    counts = count_parameters(m)
    return {
        "scale": scale,
        "arm": arm,
        "model_arm": m.arm,
        "mlp_ratio": m.mlp_ratio,
        "layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "params": counts.as_dict(),
        "flops_per_token": flops_per_token(m),
    }


def run(args: argparse.Namespace) -> int:
    from nlq_scale.cli import emit_json

    info = summary(args.scale, args.arm, args.overrides)
    if args.json:
        emit_json(info)
        return 0
    p = info["params"]
    print(f"{info['scale']} / {info['arm']} (model.arm={info['model_arm']}, mlp_ratio={info['mlp_ratio']:.4g})")
    print(f"  total params          {p['total']:>16,}  ({p['total'] / 1e6:.2f}M)")
    print(f"  non-embedding params  {p['non_embedding']:>16,}  ({p['non_embedding'] / 1e6:.2f}M)")
    print(f"  embedding params      {p['embedding']:>16,}")
    if p["active_non_embedding"] != p["non_embedding"]:
        print(f"  active non-embedding  {p['active_non_embedding']:>16,}  (MoE: top-k experts)")
    print(f"  training FLOPs/token  {info['flops_per_token']:>16,}  ({info['flops_per_token'] / 1e9:.3f} GFLOP)")
    print("  per layer:")
    for name, n in p["per_layer"].items():
        print(f"    {name:<20} {n:>14,}")
    return 0

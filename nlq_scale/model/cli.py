"""`nlq-scale params`: parameter counts and training FLOPs per token for a scale and arm;
`nlq-scale coord-check`: muP's coordinate check for an arm."""

from __future__ import annotations

import argparse
from pathlib import Path

from nlq_scale.errors import check_creatable
from nlq_scale.model.coord import (
    HEAD_DIM,
    MUP_DECAY,
    MUP_GROWTH,
    MUP_INIT,
    READOUT,
    READOUT_INIT,
    STANDARD_STEEP,
    CoordCheckSpec,
)

PARAMETRIZATIONS = ("standard", "mup")


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("params", help="parameter and FLOP accounting for a scale and arm")
    p.add_argument("--scale", required=True)
    p.add_argument("--arm", required=True)
    p.add_argument("--json", action="store_true", help="one JSON document on stdout")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.set_defaults(func=run)

    c = sub.add_parser(
        "coord-check",
        help="muP coordinate check: per module, the slope of log mean |activation| (and of its update) "
        "against log width after a few training steps",
    )
    c.add_argument("--arm", required=True)
    d = CoordCheckSpec(arm="")
    c.add_argument("--parametrization", default=d.parametrizations, type=_choices(PARAMETRIZATIONS),
                   help="standard, mup, or both comma-separated (default both)")
    c.add_argument("--widths", default=d.widths, type=_widths,
                   help=f"hidden sizes, multiples of the head dim {HEAD_DIM}; the first is muP's base "
                        f"(default {_csv(d.widths)})")
    c.add_argument("--steps", type=_positive, default=d.steps, help="Adam steps before measuring")
    c.add_argument("--lr", type=float, default=d.lr, help="constant learning rate (the base width's)")
    c.add_argument("--seeds", default=d.seeds, type=_ints, help=f"seeds averaged per width (default {_csv(d.seeds)})")
    c.add_argument("--png", default=None, metavar="PATH",
                   help="plot of the curves (default coord-check-<arm>.png in the current directory)")
    c.add_argument("--check", action="store_true",
                   help=f"exit 1 unless muP is flat at init but the readout (slope {READOUT_INIT}) and, after "
                        f"training, no slope is over {MUP_GROWTH} or under {MUP_DECAY}, and standard has one "
                        f"|slope| over {STANDARD_STEEP}")
    c.add_argument("--json", action="store_true", help="one JSON document on stdout")
    c.set_defaults(func=run_coord_check)


def summary(scale: str, arm: str, overrides: list[str]) -> dict:
    from nlq_scale.config.load import load_run_config
    from nlq_scale.model.accounting import count_parameters, ffn_hidden_size, flops_per_token

    cfg = load_run_config(scale=scale, arm=arm, overrides=overrides)
    m = cfg.model
    counts = count_parameters(m)
    return {
        "scale": scale,
        "arm": arm,
        "model_arm": m.arm,
        "ffn_hidden_size": ffn_hidden_size(m),
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
    print(f"{info['scale']} / {info['arm']} (model.arm={info['model_arm']}, ffn_hidden_size={info['ffn_hidden_size']})")
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


def _csv(values) -> str:
    return ",".join(map(str, values))


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None


def _positive(text: str) -> int:
    (n,) = _ints(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be >= 1")
    return n


def _widths(text: str) -> tuple[int, ...]:
    widths = _ints(text)
    if len(widths) < 2 or sorted(set(widths)) != list(widths) or any(w % HEAD_DIM for w in widths):
        raise argparse.ArgumentTypeError(f"{text!r}: two or more increasing multiples of {HEAD_DIM}")
    return widths


def _choices(allowed: tuple[str, ...]):
    def parse(text: str) -> tuple[str, ...]:
        picked = tuple(text.split(","))
        if not picked or any(p not in allowed for p in picked):
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(allowed)}")
        return picked

    return parse


def run_coord_check(args: argparse.Namespace) -> int:
    from nlq_scale.cli import emit_json
    from nlq_scale.config.load import load_run_config
    from nlq_scale.config.schema import ParallelConfig
    from nlq_scale.model import coord
    from nlq_scale.runtime.dist import distributed

    load_run_config("cpu-xs", args.arm)  # an unknown arm fails here, in one line
    png = args.png or f"coord-check-{args.arm}.png"
    check_creatable(Path(png), "--png", directory=False)
    spec = coord.CoordCheckSpec(arm=args.arm, parametrizations=args.parametrization, widths=args.widths,
                                steps=args.steps, lr=args.lr, seeds=args.seeds)  # fmt: skip
    with distributed(ParallelConfig()):
        result = coord.check(spec)
    coord.plot(result, png)
    result["png"] = str(png)
    if args.json:
        emit_json(result)
    else:
        _print_slopes(result)
    return 1 if args.check and not all(result["verdict"].values()) else 0


def _print_slopes(result: dict) -> None:
    names = list(result["parametrizations"])
    print(f"coord check: {result['arm']}, widths {result['widths']}, {result['steps']} steps at lr {result['lr']}, "
          f"seeds {_csv(result['seeds'])}")
    columns = [(n, key, f"{n} {label}") for n in names for key, label in
               (("init_slope", "init"), ("slope", "act"), ("update_slope", "upd"))]  # fmt: skip
    print(f"  {'module':<44}" + "".join(f"{title:>15}" for *_, title in columns))
    for role in result["parametrizations"][names[0]]["modules"]:
        cells = "".join(f"{result['parametrizations'][n]['modules'][role][key]:>+15.3f}" for n, key, _ in columns)
        print(f"  {role:<44}{cells}")
    for n in names:
        p = result["parametrizations"][n]
        print(f"  {n}: max |slope| {p['max_abs_slope']:.3f} ({_where(p['steepest'])})")
        if n == "mup":
            print(f"  mup: largest growth {p['growth']['value']:+.3f} ({_where(p['growth'])}), "
                  f"steepest fall {p['decay']['value']:+.3f} ({_where(p['decay'])})")
            print(f"  mup at init: max |slope| {abs(p['init']['value']):.3f} ({p['init']['module']}), "
                  f"{READOUT} {p['readout_init_slope']:+.3f}")
    goals = {
        "mup_init_flat": f"muP at init: every |slope| < {MUP_INIT}, {READOUT} within {MUP_INIT} of {READOUT_INIT}",
        "mup_no_growth": f"muP: every slope < {MUP_GROWTH}",
        "mup_decay_bounded": f"muP: every slope > {MUP_DECAY}",
        "standard_drifts": f"standard: some |slope| > {STANDARD_STEEP}",
    }
    for key, ok in result["verdict"].items():
        print(f"  {goals[key]}: {'yes' if ok else 'NO'}")
    print(f"  plot: {result['png']}")


def _where(pick: dict) -> str:
    where, interval = f"{pick['module']} {pick['slope']}", pick["interval"]
    if interval is not None:
        where += f"; 95% seed-bootstrap interval {interval[0]:+.3f} to {interval[1]:+.3f}"
    return where

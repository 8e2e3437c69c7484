"""`nlq-scale quickstart`: prepare the bundled sample corpus, run the smoke sweep (three tiny CPU
scales x {linear, nonlinear}) through the local executor (or SLURM), then compare. Every step is
the real one a cluster run takes; re-running skips what is done."""

from __future__ import annotations

import argparse
from pathlib import Path

SEQ_LENGTH = 64  # the cpu-* scales' context


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quickstart", help="sample corpus -> smoke sweep -> comparison report",
                       epilog="example:\n  nlq-scale quickstart --root runs/quickstart")
    p.add_argument("--root", type=Path, default=Path("runs/quickstart"), help="where data, runs and report go")
    p.add_argument("--executor", choices=("local", "slurm"), default="local",
                   help="local: run here, one run after the other; slurm: queue job arrays")
    p.add_argument("--cluster", help="cluster file (or a name in configs/clusters) for --executor slurm; "
                                     "default: the sweep's (local: the cluster's default partition)")
    p.add_argument("--sweep", default="smoke", help="sweep file or name in configs/sweeps")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for every run")
    p.set_defaults(func=run)


def _step(title: str) -> None:
    print(f"\n== {title}", flush=True)


def _call(argv: list[str]) -> None:
    from nlq_scale.cli import main
    from nlq_scale.errors import RunFailure

    code = main(argv)
    if code:
        raise RunFailure(f"`nlq-scale {' '.join(argv)}` exited {code}")


def run(args: argparse.Namespace) -> int:
    from nlq_scale.cluster.sweep import load_sweep, sweep_path
    from nlq_scale.errors import check_creatable

    check_creatable(args.root, "--root")
    root = args.root.resolve()
    data = root / "data" / f"sample-{SEQ_LENGTH}"
    _step(f"1/3 sample corpus -> {data}")
    if (data / "manifest.json").is_file():
        print("already prepared")
    else:
        _call(["prepare-data", "--sample", "--out", str(data), "--seq-len", str(SEQ_LENGTH)])
    _step(f"2/3 sweep {args.sweep} ({args.executor} executor) -> {root}")
    cluster = ["--cluster", args.cluster] if args.cluster else []
    _call(["submit", args.sweep, "--root", str(root), "--executor", args.executor, *cluster, f"data.path={data}",
           *args.overrides])
    sweep_dir = root / load_sweep(sweep_path(args.sweep)).name
    report = sweep_dir / "report"
    _step(f"3/3 compare -> {report}")
    _call(["compare", str(sweep_dir), "--out", str(report)])
    print(f"\nreport: {report / 'report.md'}\nplots:  {report}/*.png")
    return 0

"""Sub-commands `import-csv`, `compare`, `fit` and `design`. Kept light: numpy, scipy, matplotlib and wandb
are imported inside the handlers."""

from __future__ import annotations

import argparse
import math
import textwrap
from pathlib import Path

from nlq_scale.errors import RunFailure, UsageError, check_creatable


def add_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("import-csv", help="turn a CSV training log into a run directory",
                       epilog="example:\n  nlq-scale import-csv log.csv --arm nonlinear --scale 124m --seed 1 --out runs/imported")
    p.add_argument("file", type=Path, help="CSV with columns step, val_loss [, train_loss, tokens]")
    p.add_argument("--arm", required=True, help="arm label, e.g. linear, nonlinear, linear-mlp4.75")
    p.add_argument("--scale", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--lr", type=float, help="learning rate (for picking each arm's best lr)")
    p.add_argument("--params", type=int, help="non-embedding parameters N (compute = 6 N tokens)")
    p.add_argument("--tokens-per-step", type=int, help="tokens = step x this, when the CSV has no tokens column")
    p.add_argument("--out", type=Path, required=True, help="root; the run goes to OUT/imported/<run_id>/")
    p.set_defaults(func=_import_csv)

    p = sub.add_parser("compare", help="compare arms across scales: statistics, fits, report",
                       epilog="example:\n  nlq-scale compare runs/quickstart/smoke --reference linear --out report")
    p.add_argument("roots", nargs="+", help="run-directory roots, W&B run dirs/.wandb files, or wandb:ENTITY/PROJECT")
    p.add_argument("--reference", help="reference arm (default: linear if present)")
    p.add_argument("--out", type=Path, help="report directory (default: ROOT/report)")
    p.add_argument("--json", action="store_true", help="print summary.json on stdout")
    p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples over seeds (default 2000)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap random seed (default 0)")
    p.add_argument("--include-incomplete", action="store_true", help="also use runs that are not completed")
    p.add_argument("--divergence-margin", type=float, default=0.5,
                   help="val loss this far above its running best (nats) is a spike or a blow-up (default 0.5)")
    p.add_argument("--trend-axis", choices=("compute", "params"), default="compute",
                   help="regress the improvement on log compute or log params (default compute)")
    p.add_argument("--strict", action="store_true", help="exit 1 (after writing the report) when a scaling fit is "
                   "not identifiable from its points")
    p.add_argument("--group", metavar="SWEEP", help="only the runs of this sweep (their W&B group), e.g. one sweep "
                   "of a W&B project that holds several")
    p.add_argument("--exclude", action="append", default=[], metavar="ID|PATH",
                   help="leave out this run, by its id or its directory (repeatable)")
    p.add_argument("--wandb", action="store_true", help="also log the tables and plots to a W&B run")
    p.add_argument("--wandb-project", default="nlq-scale")
    p.set_defaults(func=_compare)

    p = sub.add_parser("fit", help="Chinchilla approach-3 fit L(N, D) = E + A/N^a + B/D^b from a CSV",
                       epilog="example:\n  nlq-scale fit --csv runs.csv --params-col N --tokens-col D --loss-col loss")
    p.add_argument("--csv", type=Path, required=True)
    p.add_argument("--params-col", required=True)
    cols = p.add_mutually_exclusive_group(required=True)
    cols.add_argument("--tokens-col")
    cols.add_argument("--flops-col", help="training FLOPs; tokens = FLOPs / (6 N)")
    p.add_argument("--loss-col", required=True)
    p.add_argument("--drop-highest", type=int, default=0, help="drop the K highest-loss points")
    p.add_argument("--bootstrap", type=int, default=0,
                   help="resample points B times for CIs, each refit from the whole start grid (default 0 = none)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap random seed")
    p.add_argument("--huber-delta", type=float, default=1e-3, help="Huber loss delta (default 1e-3, Hoffmann et al.)")
    p.add_argument("--loss-space", choices=("log", "linear"), default="log",
                   help="residual log L - log prediction, or L - prediction (default log)")
    p.add_argument("--start-grid", default="default",
                   help="starts: default (36), hoffmann (4500), or 'a=0,10;b=0,10;e=0;alpha=0.5;beta=0.5' "
                        "(a, b, e = ln A, ln B, ln E)")
    p.add_argument("--ftol", type=float, default=1e-15, help="L-BFGS-B ftol (default 1e-15)")
    p.add_argument("--gtol", type=float, default=1e-12, help="L-BFGS-B gtol (default 1e-12)")
    p.add_argument("--maxiter", type=int, default=10000, help="L-BFGS-B iterations per start (default 10000)")
    p.add_argument("--strict", action="store_true", help="exit 1 when the points do not determine the fit")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_fit)

    p = sub.add_parser("design", help="seeds per arm that resolve a loss gap at a given power",
                       description="Seeds per arm for a two-sided two-sample t-test of a gap between two arms' "
                                   "mean final losses, whose seeds scatter with standard deviation SD: the fewest "
                                   "that reject a zero gap with probability POWER when the true gap is GAP "
                                   "(exact, from the noncentral t distribution). With a SWEEP and --pilot ROOT: the "
                                   "SD measured per scale on the pilot runs, its trend with N carried to the "
                                   "sweep's rungs, and per rung the seeds the gap needs, the smallest gap the "
                                   "sweep's own seeds resolve and the GPU-hours (plan's cost model).",
                       epilog="example:\n  nlq-scale design --sd 0.02 --gap 0.02 --power 0.8\n"
                              "  nlq-scale design ladder --pilot runs/quickstart/smoke --gap 0.01",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", nargs="?", metavar="SWEEP", help="sweep file or name, to design from --pilot runs")
    p.add_argument("--pilot", metavar="ROOT", help="runs whose seed spread the design uses (with SWEEP)")
    p.add_argument("--cluster", help="cluster for the GPU-hours (default: the sweep's)")
    p.add_argument("--sd", type=float, help="seed-to-seed standard deviation of the final loss (nats)")
    p.add_argument("--gap", type=float, help="the true gap to resolve (nats)")
    p.add_argument("--power", type=float, default=0.8, help="probability of resolving it (default 0.8)")
    p.add_argument("--level", type=float, default=0.95, help="confidence level of the test (default 0.95)")
    p.add_argument("--json", action="store_true", help="print the answer as JSON (key seeds_per_arm)")
    p.set_defaults(func=_design)


def _positive(value: int | float | None, flag: str) -> None:
    if value is not None and not value > 0:
        raise UsageError(f"{flag}: must be positive, got {value}")


def _fraction(value: float, flag: str) -> None:
    if not 0 < value < 1:
        raise UsageError(f"{flag}: must lie strictly between 0 and 1, got {value}")


# ---------------------------------------------------------------------------------------------


def _import_csv(args: argparse.Namespace) -> int:
    from nlq_scale.analysis.csvio import ImportSpec, import_csv

    for value, flag in ((args.lr, "--lr"), (args.params, "--params"), (args.tokens_per_step, "--tokens-per-step")):
        _positive(value, flag)
    check_creatable(args.out, "--out")
    spec = ImportSpec(args.file, args.arm, args.scale, args.seed, args.out, args.lr, args.params, args.tokens_per_step)
    print(import_csv(spec))
    return 0


def _compare(args: argparse.Namespace) -> int:
    from nlq_scale.analysis.compare import Options, compare
    from nlq_scale.analysis.report import findings, limits, summary, write_report
    from nlq_scale.analysis.runs import load_runs
    from nlq_scale.cli import emit_json

    _positive(args.bootstrap, "--bootstrap")
    _positive(args.divergence_margin, "--divergence-margin")
    options = Options(
        reference=args.reference,
        resamples=args.bootstrap,
        seed=args.seed,
        include_incomplete=args.include_incomplete,
        divergence_margin=args.divergence_margin,
        trend_axis=args.trend_axis,
    )
    out = args.out or _default_out(args.roots[0])
    check_creatable(out, "--out")
    comp = compare(load_runs(args.roots, args.group, args.exclude), options)
    paths = write_report(comp, out)
    if args.wandb:
        from nlq_scale.analysis.report import log_to_wandb

        log_to_wandb(comp, paths, args.wandb_project)
    if args.json:
        emit_json(summary(comp, {stem: str(p) for stem, p in paths.plots.items()}))
    else:
        print(textwrap.fill(" ".join(findings(comp) or limits(comp)), width=100), end="\n\n")
        print(f"report:  {paths.report}")
        print(f"summary: {paths.summary}")
        for path in paths.plots.values():
            print(f"plot:    {path}")
    flagged = [f"{f.arm} on {f.axis} ({'; '.join(f.flags)})" for f in comp.fits if f.flags]
    if args.strict and flagged:
        raise RunFailure(f"--strict: {len(flagged)} fit(s) not identifiable from their points: {', '.join(flagged)}")
    return 0


def _default_out(root: str) -> Path:
    path = Path(root)
    return path / "report" if path.is_dir() else Path("nlq-scale-report")


def _fit(args: argparse.Namespace) -> int:
    import numpy as np

    from nlq_scale.analysis import fits
    from nlq_scale.analysis.csvio import complete_column, read_csv_columns
    from nlq_scale.cli import emit_json

    if args.drop_highest < 0 or args.bootstrap < 0:
        raise UsageError("--drop-highest and --bootstrap must be >= 0")
    settings = _fit_settings(args)
    x_col = args.tokens_col or args.flops_col
    cols = read_csv_columns(args.csv, [args.params_col, x_col, args.loss_col])
    N, X, L = (np.array(complete_column(cols[c], args.csv, c)) for c in (args.params_col, x_col, args.loss_col))
    for name, values in ((args.params_col, N), (x_col, X), (args.loss_col, L)):
        if not np.all(np.isfinite(values)) or np.any(values <= 0):
            raise UsageError(f"{args.csv}: column {name} must be positive and finite on every row")
    if args.drop_highest >= len(L):
        raise UsageError(f"--drop-highest {args.drop_highest}: the CSV has only {len(L)} rows")
    keep = np.sort(np.argsort(L, kind="stable")[: len(L) - args.drop_highest])
    D = X if args.tokens_col else X / (6 * N)
    try:
        fitted = fits.fit_chinchilla(N[keep], D[keep], L[keep], settings)
    except fits.NotIdentifiable as e:
        raise UsageError(f"{args.csv}: {e}") from None
    result = {
        "csv": str(args.csv),
        "model": "L(N, D) = E + A / N^alpha + B / D^beta",
        "tokens": "column " + args.tokens_col if args.tokens_col else f"{args.flops_col} / (6 N)",
        "n_points": int(keep.size),
        "dropped_highest": args.drop_highest,
        "settings": settings.as_dict(),
        "fit": fitted.fit.as_dict(),
        "diagnostics": fitted.diagnostics.as_dict(),
        "bootstrap": _chinchilla_cis(fitted, N[keep], D[keep], L[keep], args.bootstrap, args.seed),
    }
    if args.json:
        emit_json(_finite_or_null(result))
    else:
        _print_fit(result)
    if args.strict and fitted.diagnostics.flags:
        raise RunFailure(f"--strict: {fitted.diagnostics.statement}")
    return 0


def _fit_settings(args: argparse.Namespace):
    from nlq_scale.analysis import fits

    for value, flag in ((args.huber_delta, "--huber-delta"), (args.ftol, "--ftol"), (args.gtol, "--gtol"),
                        (args.maxiter, "--maxiter")):
        _positive(value, flag)
    try:
        return fits.FitSettings(args.huber_delta, args.loss_space, args.start_grid, args.ftol, args.gtol, args.maxiter)
    except fits.BadSetting as e:
        raise UsageError(f"--start-grid: {e}") from None


def _finite_or_null(value):
    """JSON has no inf or NaN (a term the data never see runs its coefficient off to inf): null, as in
    summary.json; the diagnostics' flags say why."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_null(v) for v in value]
    return value


PARAMS = ("E", "A", "B", "alpha", "beta")
MIN_KEPT = 2  # resamples an interval needs


def _chinchilla_cis(fitted, N, D, L, resamples: int, seed: int) -> dict | None:
    import numpy as np

    from nlq_scale.analysis import fits

    if resamples == 0:
        return None
    boot = fits.bootstrap_chinchilla(N, D, L, fitted, resamples, seed)
    out = {"resamples": resamples, "seed": seed, "starts_per_resample": boot.starts, "kept": len(boot.fits),
           "failed": boot.failed, "collapsed": boot.collapsed, "ci95": None, "std": None}
    if len(boot.fits) < MIN_KEPT:
        return out
    table = np.array([[getattr(b, k) for k in PARAMS] for b in boot.fits])
    lo, hi = np.percentile(table, [2.5, 97.5], axis=0)
    out["ci95"] = {k: [float(lo[i]), float(hi[i])] for i, k in enumerate(PARAMS)}
    out["std"] = {k: float(table[:, i].std(ddof=1)) for i, k in enumerate(PARAMS)}
    return out


def _print_fit(result: dict) -> None:
    fit, boot, diag, s = result["fit"], result["bootstrap"], result["diagnostics"], result["settings"]
    print(f"{result['model']}  ({result['n_points']} points, {result['dropped_highest']} highest dropped, "
          f"tokens = {result['tokens']})")
    for k in PARAMS:
        ci = (boot or {}).get("ci95")
        print(f"  {k:<6}{fit[k]:.4g}" + (f"  95% CI [{ci[k][0]:.4g}, {ci[k][1]:.4g}]" if ci else ""))
    print(f"  objective {fit['objective']:.10g}: Huber delta {s['huber_delta']:g} on the {s['loss_space']} loss; "
          f"{diag['inside_delta']} of {result['n_points']} points inside delta")
    state = "converged" if diag["converged"] else "did NOT converge"
    print(f"  L-BFGS-B from {s['starts']} starts (grid {s['start_grid']}), ftol {s['ftol']:g}, gtol {s['gtol']:g}: "
          f"the chosen start {state} ({diag['message']}); {diag['starts_converged']} converged, "
          f"{diag['starts_at_optimum']} reached the optimum")
    if diag["starts_at_optimum"] == 1 < diag["starts"]:
        print("  (one start alone reached it: another optimum may lie lower, or the tolerances stop short)")
    if boot is not None:
        print(f"  bootstrap: {boot['resamples']} resamples of the points (seed {boot['seed']}), each refit from "
              f"{boot['starts_per_resample']} starts; {boot['failed']} failed to converge and {boot['collapsed']} "
              f"collapsed onto a bound, dropped; the intervals rest on {boot['kept']}"
              + ("" if boot["ci95"] is not None else f" (fewer than {MIN_KEPT}: no interval)"))
        if boot["collapsed"]:
            print(f"  ({boot['collapsed']} of {boot['resamples']} resamples collapsed: the intervals hold only for "
                  "resamples that keep E and the exponents off their bounds)")
    print("  " + (diag["statement"] or "identifiable: no parameter on a bound, no flat direction"))


def _design(args: argparse.Namespace) -> int:
    for value, flag in ((args.sd, "--sd"), (args.gap, "--gap")):
        _positive(value, flag)
        if value is not None and math.isinf(value):
            raise UsageError(f"{flag}: must be finite, got {value}")
    _fraction(args.power, "--power")
    _fraction(args.level, "--level")
    if args.sweep is not None:
        return _design_sweep(args)
    for value, flag in ((args.pilot, "--pilot"), (args.cluster, "--cluster")):
        if value is not None:
            raise UsageError(f"{flag}: only with a SWEEP")
    for value, flag in ((args.sd, "--sd"), (args.gap, "--gap")):
        if value is None:
            raise UsageError(f"{flag}: required (or a SWEEP with --pilot ROOT)")
    return _design_one(args)


def _design_one(args: argparse.Namespace) -> int:
    from nlq_scale.analysis import power
    from nlq_scale.cli import emit_json

    try:
        n = power.seeds_per_arm(args.gap, args.sd, args.power, args.level)
    except ValueError as e:
        raise UsageError(f"--gap {args.gap:g} against --sd {args.sd:g}: {e}") from None
    achieved = power.power(args.gap, args.sd, n, n, args.level)
    if args.json:
        emit_json({"seeds_per_arm": n, "power": achieved, "sd": args.sd, "gap": args.gap,
                   "target_power": args.power, "level": args.level, "test": "two-sided two-sample t, pooled variance"})
    else:
        print(f"{n} seeds per arm resolve a {args.gap:g}-nat gap between arms whose seeds scatter by {args.sd:g} nats "
              f"with power {achieved:.3f} (target {args.power:g}; two-sided two-sample t-test at {args.level:.0%}).")
    return 0


def _design_sweep(args: argparse.Namespace) -> int:
    from nlq_scale.analysis import design
    from nlq_scale.analysis.runs import load_runs
    from nlq_scale.cli import emit_json
    from nlq_scale.cluster.cli import load_sweep_and_cluster
    from nlq_scale.cluster.plan import plan_sweep

    if args.pilot is None:
        raise UsageError(f"design {args.sweep}: --pilot ROOT: required (the runs whose seed spread to use)")
    if args.sd is not None:
        raise UsageError("--sd: not with a SWEEP (the pilot runs give the spread)")
    sweep, cluster = load_sweep_and_cluster(args.sweep, args.cluster)
    law = design.spread_law(design.pilot_spreads(load_runs([args.pilot])))
    rungs = design.rungs(plan_sweep(sweep, cluster), law, args.gap, args.power, args.level)
    doc = design.as_dict(sweep.name, cluster.name, law, rungs, args)
    if args.json:
        emit_json(doc)
    else:
        print(design.table(doc))
    return 0

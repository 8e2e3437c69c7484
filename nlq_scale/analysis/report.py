"""report.md + PNGs + summary.json from a Comparison. Each file is written to a temporary name and
renamed into place, so an interrupted report never leaves a half-written file."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nlq_scale.analysis.compare import (
    DETECT_POWER, ArmFit, Cell, Comparison, Estimate, Gap, Multiplier, Trend, join_notes,
)
from nlq_scale.analysis.lr import LrOptimum, LrScaling
from nlq_scale.files import atomic_write, replacing

SUMMARY_VERSION = 2  # 2: trends' ci_bootstrap became ci_seeds (a Welch interval, no bootstrap)


@dataclass(frozen=True)
class ReportPaths:
    report: Path
    summary: Path
    plots: dict[str, Path]


# ---------------------------------------------------------------------------------------------
# summary.json


def _num(value: Any) -> Any:
    """JSON has no NaN/inf: those become null (the accompanying note says why)."""
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _ci(ci: tuple[float, float] | None) -> list | None:
    return None if ci is None else [_num(ci[0]), _num(ci[1])]


def _estimate(e: Estimate | None) -> dict | None:
    return None if e is None else {"value": _num(e.value), "ci": _ci(e.ci), "note": e.note, "resamples": e.resamples}


def summary(comp: Comparison, plots: dict[str, str] | None = None) -> dict[str, Any]:
    o = comp.options
    return {
        "version": SUMMARY_VERSION,
        "reference": comp.reference,
        "arms": comp.arms,
        "scales": comp.scales,
        "bootstrap": {"resamples": o.resamples, "seed": o.seed, "level": o.level, "over": "seeds within arm x scale"},
        "options": {"include_incomplete": o.include_incomplete, "divergence_margin": o.divergence_margin,
                    "trend_axis": o.trend_axis},
        "runs": [_run_row(v) for v in comp.verdicts],
        "cells": [_cell_row(comp.cells[(a, s)]) for s in comp.scales for a in comp.arms if (a, s) in comp.cells],
        "gaps": [_gap_row(g) for g in comp.gaps],
        "fits": [_fit_row(f) for f in comp.fits],
        "multipliers": [_multiplier_row(m) for m in comp.multipliers],
        "trends": [_trend_row(t) for t in comp.trends],
        "lr_optima": [_optimum_row(o) for o in comp.lr_optima],
        "lr_scaling": [_lr_law_row(law) for law in comp.lr_laws],
        "downstream": [_downstream_row(d) for d in comp.downstream],
        "findings": findings(comp),
        "limits": limits(comp),
        "plots": plots or {},
    }


def _run_row(v) -> dict:
    r = v.run
    return {
        "run_id": r.run_id, "source": r.source, "arm": r.arm, "scale": r.scale, "seed": r.seed, "lr": r.lr,
        "state": r.state, "final_step": r.final_step if r.has_val else None,
        "final_val_loss": _num(r.final_loss) if r.has_val else None,
        "params": r.params, "compute": _num(r.compute), "included": v.included, "excluded_reason": v.reason,
        "divergence": None if v.divergence is None else {"kind": v.divergence.kind, "step": v.divergence.step},
        "spikes": v.spikes,
    }


def _cell_row(c) -> dict:
    return {
        "arm": c.arm, "scale": c.scale, "best_lr": c.best_lr, "n_seeds": c.n, "seeds": [r.seed for r in c.runs],
        "mean": _num(c.mean), "std": _num(c.std), "min": _num(c.losses.min()), "max": _num(c.losses.max()),
        "compute": _num(c.compute), "params": c.params,
        "lr_grid": [{"lr": p.lr, "mean": _num(p.mean), "n_seeds": p.n} for p in c.lr_grid],
    }


def _downstream_row(d) -> dict:
    return {"arm": d.arm, "scale": d.scale, "metric": d.metric, "n_seeds": d.n_seeds,
            "accuracy": _estimate(d.accuracy), "loss": _num(d.loss), "compute": _num(d.compute)}  # fmt: skip


def _gap_row(g: Gap) -> dict:
    return {"arm": g.arm, "scale": g.scale, "improvement": _estimate(g.improvement),
            "improvement_pct": _estimate(g.improvement_pct), "n_arm": g.n_arm, "n_ref": g.n_ref,
            "detectable_gap": _num(g.detectable), "detectable_power": DETECT_POWER}


def _fit_row(f: ArmFit) -> dict:
    law = None if f.law is None else {k: _num(v) for k, v in f.law.as_dict().items()}
    return {"arm": f.arm, "axis": f.axis, "identifiable": f.law is not None and not f.flags, "law": law,
            "objective": _num(f.objective), "flags": list(f.flags), "statement": f.statement, "note": f.note,
            "alpha": _estimate(f.alpha), "E": _estimate(f.E)}


def _multiplier_row(m: Multiplier) -> dict:
    return {"arm": m.arm, "scale": m.scale, **_estimate(m.estimate), "extrapolated": m.extrapolated,
            "separated": m.separated}


def _trend_row(t: Trend) -> dict:
    return {"arm": t.arm, "axis": t.axis, "n_scales": t.n_scales, "slope_pct_points_per_decade": _num(t.slope),
            "ci_seeds": _ci(t.ci_seeds), "ci_residual": _ci(t.ci_residual),
            "distinguishable_from_zero": t.distinguishable, "steady_bound": _num(t.steady_bound),
            "narrow": t.narrow, "note": t.note}


def _optimum_row(o: LrOptimum) -> dict:
    return {"arm": o.arm, "scale": o.scale, "params": o.params, "lr_opt": _num(o.lr), "ci": _ci(o.ci),
            "loss_at_opt": _num(o.loss), "on_grid_edge": o.edge, "note": o.note}


def _lr_law_row(law: LrScaling) -> dict:
    return {"arm": law.arm, "exponent": _num(law.exponent), "coefficient": _num(law.coefficient),
            "n_scales": law.n_scales, "note": law.note}


# ---------------------------------------------------------------------------------------------
# plain statements


def _fmt_ci(ci: tuple[float, float] | None, fmt: str) -> str:
    if ci is None:
        return "n/a"
    return "[" + ", ".join("∞" if math.isinf(v) else format(v, fmt) for v in ci) + "]"


def gap_statement(g: Gap, reference: str, level: float) -> str:
    pct = g.improvement_pct
    head = (f"{g.scale}: {g.arm} vs {reference}: {g.improvement.value:+.4f} nats ({pct.value:+.2f}%), "
            f"{_fmt_ci(pct.ci, '+.2f')}% at {level:.0%}, {g.n_arm} vs {g.n_ref} seeds")
    if pct.ci is None:
        return f"{head}: no interval ({pct.note})."
    if pct.ci[0] > 0:
        return f"{head}: {g.arm} is better."
    if pct.ci[1] < 0:
        return f"{head}: {g.arm} is worse."
    return f"{head}: not distinguishable from zero; {_resolvable(g)}."


def _resolvable(g: Gap) -> str:
    seeds = f"{g.n_arm} seeds" if g.n_arm == g.n_ref else f"{g.n_arm} and {g.n_ref} seeds"
    return (f"with {seeds} at {g.scale} this sweep could only resolve gaps above {g.detectable:.4f} nats "
            f"({DETECT_POWER:.0%} power at the seeds' measured spread)")


def multiplier_statement(m: Multiplier, reference: str, level: float) -> str:
    e = m.estimate
    if e.value is None:
        return f"{m.scale}: compute multiplier of {m.arm} over {reference}: not available ({e.note})."
    where = " (extrapolated beyond the reference's fitted range)" if m.extrapolated else ""
    head = f"{m.scale}: {reference} needs {e.value:.3g}x the compute of {m.arm} to reach {m.arm}'s loss"
    if e.ci is None:
        return f"{head}, no interval: {e.note}{where}; whether the arms differ cannot be told."
    head += (f", {_fmt_ci(e.ci, '.3g')} at {level:.0%} over {e.resamples} resamples of seeds and refits "
             f"(a bootstrap through the fitted law, not calibrated){where}")
    if not m.separated:
        return f"{head}: the data cannot separate {m.arm} from {reference} (the interval includes 1)."
    return f"{head}: {m.arm} is {'more' if e.ci[0] > 1 else 'less'} compute-efficient than {reference}."


def trend_statement(t: Trend, reference: str, level: float) -> str:
    if t.slope is None:
        return f"Trend of {t.arm}'s improvement over {reference} with {t.axis}: cannot tell ({t.note})."
    cis = []
    if t.ci_seeds is not None:
        cis.append(f"seeds {_fmt_ci(t.ci_seeds, '+.3f')}")
    if t.ci_residual is not None:
        cis.append(f"residual t-interval over {t.n_scales} scales {_fmt_ci(t.ci_residual, '+.3f')}")
    head = (f"Trend of {t.arm}'s improvement over {reference}: {t.slope:+.3f} percentage points per 10x {t.axis} "
            f"({'; '.join(cis)}; {level:.0%})")
    if t.distinguishable:
        direction = "grows" if t.slope > 0 else "shrinks"
        return f"{head}: distinguishable from zero — the improvement {direction} with scale."
    note = f" ({t.note})" if t.note else ""
    if t.narrow:
        return (f"{head}: not distinguishable from zero at {level:.0%}, and narrow enough to say the data are "
                f"consistent with a steady gap (no slope beyond ±{t.steady_bound:.3f}, which would move the gap by "
                f"its own size across these scales).{note}")
    return (f"{head}: not distinguishable from zero at {level:.0%}, but too wide to call the gap steady: it admits "
            f"slopes beyond ±{_g(t.steady_bound, '.3f')}, which would move the gap by its own size across these "
            f"scales.{note}")


def findings(comp: Comparison) -> list[str]:
    lvl, ref = comp.options.level, comp.reference
    out = [gap_statement(g, ref, lvl) for g in comp.gaps]
    out += [multiplier_statement(m, ref, lvl) for m in comp.multipliers]
    out += [f"Fit of {f.arm}'s loss on {f.axis}: {f.statement}" for f in comp.fits if f.flags]
    out += [trend_statement(t, ref, lvl) for t in comp.trends]
    diverged = [v for v in comp.verdicts if v.divergence is not None]
    if diverged:
        out.append(f"{len(diverged)} run(s) diverged and were left out of the statistics (listed below).")
    return out


SMALL_N = 10_000_000  # non-embedding parameters: below this, a "model" is a pipeline check, not evidence at scale
FEW_SEEDS = 5  # a bootstrap over fewer seeds cannot be wider than their spread: a rough interval
SEEDS_AGREE = 1e-9  # nats: a spread of final losses this small is rounding, not seed noise


def limits(comp: Comparison) -> list[str]:
    """In plain words, what these runs can and cannot conclude: seeds per cell, the parameter range,
    how many scales a trend rests on, and what the intervals exclude."""
    cells = list(comp.cells.values())
    if not cells:
        return ["No arm x scale cell has a finished run: nothing can be concluded yet."]
    out = []
    n_min, n_max = min(c.n for c in cells), max(c.n for c in cells)
    seeds = f"{n_min}" if n_min == n_max else f"{n_min} to {n_max}"
    if n_min < 2:
        out.append(f"{seeds} seed(s) per arm and scale: a cell with one seed has no interval, and any difference "
                   "there may be seed noise alone. Run at least 2 seeds (better 3-5) per arm and scale.")
    elif n_min < FEW_SEEDS:
        out.append(f"{seeds} seeds per arm and scale: the gap intervals are calibrated but wide (few degrees of "
                   "freedom), and the fits' and multipliers' bootstrap intervals are rough (a bootstrap over so few "
                   "seeds is not calibrated); a gap whose interval only just excludes zero is a hint, not a result.")
    else:
        out.append(f"{seeds} seeds per arm and scale: the intervals account for seed-to-seed variation.")
    agree = [f"{c.arm}@{c.scale}" for c in _ordered_cells(comp)
             if c.n > 1 and c.losses.max() - c.losses.min() <= SEEDS_AGREE]
    if agree:
        out.append(f"Every seed ended at the same final loss (within {SEEDS_AGREE:g} nats) in {', '.join(agree)}: "
                   "the seed did not change those runs (a seed that did not reach the initialisation, a rerun, "
                   "copied logs), so their intervals have no width and say nothing about seed noise.")
    params = sorted({r.params for c in cells for r in c.runs if r.params})
    if params:
        span = f"{_g(params[0], '.3g')} to {_g(params[-1], '.3g')} non-embedding parameters"
        if params[-1] < SMALL_N:
            out.append(f"The models span {span}: tiny models that check the pipeline end to end and show the sign "
                       "of the gap at this size only. They cannot say whether the gap holds, grows or vanishes at "
                       "124M parameters and beyond; that needs the GPU ladder.")
        else:
            out.append(f"The models span {span}; nothing here extrapolates beyond the largest.")
    n_scales = len(comp.scales)
    if n_scales < 3:
        out.append(f"{n_scales} scale(s): too few for a trend with scale (a line through two points has no error).")
    else:
        out.append(f"{n_scales} scales: a trend with scale rests on {n_scales} points, so only a clear slope "
                   "is distinguishable from zero.")
    out += [_seen(g) for g in comp.gaps if g.detectable is not None]
    out += [_trend_limit(t) for t in comp.trends if t.slope is not None and not t.distinguishable]
    excluded = [g for g in comp.gaps if g.improvement_pct.ci is not None and (g.improvement_pct.ci[0] > 0
                                                                              or g.improvement_pct.ci[1] < 0)]
    with_ci = [g for g in comp.gaps if g.improvement_pct.ci is not None]
    if with_ci:
        out.append(f"{len(excluded)} of {len(with_ci)} arm-vs-{comp.reference} gaps with an interval exclude zero "
                   f"at {comp.options.level:.0%}; the others cannot tell the arms apart.")
    edges = [f"{o.arm} at {o.scale}" for o in comp.lr_optima if o.edge]
    if edges:
        out.append(f"The best learning rate is on the grid's edge for {', '.join(edges)}: that arm may do better "
                   "beyond the grid, so its loss there (and any gap it enters) is an upper bound. Extend the grid.")
    return out


def _seen(g: Gap) -> str:
    """What the seeds could have seen at one scale, next to what they saw."""
    head = f"{_resolvable(g)[0].upper()}{_resolvable(g)[1:]}; {g.arm}'s measured gap is {g.improvement.value:+.4f}"
    if abs(g.improvement.value) < g.detectable:
        return f"{head}, below that: a true gap of this size would go unresolved more often than not."
    return f"{head}."


def _trend_limit(t: Trend) -> str:
    if t.narrow:
        return (f"The trend of {t.arm}'s gap is not distinguishable from zero, and its interval is narrow enough "
                "to say the gap is steady across these scales.")
    return (f"The trend of {t.arm}'s gap is not distinguishable from zero, but its interval is too wide to say the "
            "gap is steady: it could still grow or vanish across these scales. More seeds per scale, or more "
            "scales, narrow it.")


# ---------------------------------------------------------------------------------------------
# report.md


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join("" if v is None else str(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _g(value: Any, fmt: str = ".4g") -> str:
    return "n/a" if value is None else format(value, fmt)


def markdown(comp: Comparison, plots: dict[str, str]) -> str:
    o = comp.options
    n_in = sum(v.included for v in comp.verdicts)
    parts = [
        "# nlq-scale comparison",
        f"Reference arm: **{comp.reference}**. Runs found: {len(comp.verdicts)}; compared: {n_in}; "
        f"left out: {len(comp.verdicts) - n_in}. Each arm is compared at its own best learning rate per scale.",
        f"Intervals ({o.level:.0%}): gaps and the trend's seed interval are Welch-Satterthwaite t intervals "
        f"over the seeds of the cells they combine, calibrated at every seed count. Fits and compute "
        f"multipliers go through a fitted law: a percentile bootstrap, {o.resamples} resamples of the seeds "
        f"within each arm x scale cell (numpy default_rng seed {o.seed}), not calibrated. Divergence margin: "
        f"{o.divergence_margin} nats above the running best. Positive improvement = lower loss than "
        f"{comp.reference}. See docs/analysis.md.",
        "## Findings",
        "\n".join(f"- {line}" for line in findings(comp)),
        "## What these runs can and cannot conclude",
        "\n".join(f"- {line}" for line in limits(comp)),
        "## Final validation loss per arm x scale",
        _cells_table(comp),
    ]
    if comp.downstream:
        parts += ["## Downstream accuracy per arm x scale",
                  "`nlq-scale eval` results at each run's newest evaluated checkpoint (docs/evaluation.md): "
                  "seed mean with its bootstrap interval, beside the cell's final validation loss.",
                  _downstream_table(comp)]  # fmt: skip
    if any(len(c.lr_grid) > 1 for c in comp.cells.values()):
        parts += ["## Learning-rate grid", _lr_table(comp), "## Learning-rate optimum per arm x scale",
                  "η*: vertex of a parabola in log LR through the grid's minimum and up to two neighbours each "
                  "side; an optimum on the grid's edge is flagged (the true one may lie beyond the grid). "
                  "η*(N) = c·N^b per arm over the scales with an interior optimum.",
                  _optima_table(comp), _lr_laws_table(comp)]
    parts += [
        f"## Improvement over {comp.reference}",
        _gaps_table(comp),
        "## Scaling fits L(x) = E + A·x^-α",
        _fits_table(comp),
        f"## Compute multiplier over {comp.reference}",
        f"C_ref / C_arm: the compute {comp.reference}'s fitted L(C) needs to reach the arm's mean loss, divided "
        "by the compute the arm used. Above 1: the arm is worth that many times its compute.",
        _multipliers_table(comp),
        "## Trend of the improvement with scale",
        "\n".join(f"- {trend_statement(t, comp.reference, o.level)}" for t in comp.trends) or "- only one arm.",
        "## Runs left out, divergences and spikes",
        _runs_table(comp),
        "## Plots",
        "\n\n".join(f"![{stem}]({name})" for stem, name in plots.items()),
    ]
    return "\n\n".join(parts) + "\n"


def _ordered_cells(comp: Comparison) -> list[Cell]:
    return [comp.cells[(a, s)] for s in comp.scales for a in comp.arms if (a, s) in comp.cells]


def _ci_label(comp: Comparison) -> str:
    return f"{comp.options.level:.0%} CI"


def _cells_table(comp: Comparison) -> str:
    return _table(
        ["scale", "arm", "best lr", "seeds", "mean", "std", "min", "max", "compute C (FLOPs)", "params N"],
        [[c.scale, c.arm, _g(c.best_lr), c.n, _g(c.mean, ".4f"), _g(c.std, ".4f"), _g(c.losses.min(), ".4f"),
          _g(c.losses.max(), ".4f"), _g(c.compute, ".3e"), _g(c.params, ",")] for c in _ordered_cells(comp)],
    )


def _downstream_table(comp: Comparison) -> str:
    return _table(
        ["scale", "arm", "task/metric", "seeds", "accuracy", _ci_label(comp), "val loss", "compute C (FLOPs)"],
        [[d.scale, d.arm, d.metric, d.n_seeds, _g(d.accuracy.value, ".4f"), _fmt_ci(d.accuracy.ci, ".4f"),
          _g(d.loss, ".4f"), _g(d.compute, ".3e")] for d in comp.downstream],
    )


def _lr_table(comp: Comparison) -> str:
    return _table(
        ["scale", "arm", "lr", "seeds", "mean final loss", ""],
        [[c.scale, c.arm, _g(p.lr), p.n, _g(p.mean, ".4f"), "best" if p.lr == c.best_lr else ""]
         for c in _ordered_cells(comp) for p in c.lr_grid],
    )


def _optima_table(comp: Comparison) -> str:
    return _table(
        ["scale", "arm", "η*", _ci_label(comp), "loss at η*", "note"],
        [[o.scale, o.arm, _g(o.lr), _fmt_ci(o.ci, ".3g"), _g(o.loss, ".4f"), o.note] for o in comp.lr_optima],
    )


def _lr_laws_table(comp: Comparison) -> str:
    return _table(
        ["arm", "exponent b", "coefficient c", "scales", "note"],
        [[law.arm, _g(law.exponent, ".3f"), _g(law.coefficient, ".3g"), law.n_scales, law.note] for law in comp.lr_laws],
    )


def _gaps_table(comp: Comparison) -> str:
    ci = _ci_label(comp)
    return _table(
        ["scale", "arm", "Δ loss (nats)", ci, "Δ %", ci, "seeds arm/ref",
         f"resolvable above (nats, {DETECT_POWER:.0%} power)", "note"],
        [[g.scale, g.arm, _g(g.improvement.value, "+.4f"), _fmt_ci(g.improvement.ci, "+.4f"),
          _g(g.improvement_pct.value, "+.2f"), _fmt_ci(g.improvement_pct.ci, "+.2f"), f"{g.n_arm}/{g.n_ref}",
          _g(g.detectable, ".4f"), g.improvement.note] for g in comp.gaps],
    )


def _fits_table(comp: Comparison) -> str:
    ci = _ci_label(comp)
    rows = []
    for f in comp.fits:
        law = f.law
        rows.append([
            f.arm, f.axis, _g(law and law.E, ".4f"), _fmt_ci(f.E and f.E.ci, ".4f"), _g(law and law.A, ".4g"),
            _g(law and law.alpha, ".4f"), _fmt_ci(f.alpha and f.alpha.ci, ".4f"), law.n_points if law else "",
            _g(f.objective, ".3g"), _g(f.alpha and f.alpha.resamples, "d"),
            join_notes(f.statement, f.note, f.alpha.note if f.alpha else ""),
        ])
    return _table(["arm", "x", "E", f"E {ci}", "A", "α", f"α {ci}", "points", "SSE", "resamples", "note"], rows)


def _multipliers_table(comp: Comparison) -> str:
    return _table(
        ["scale", "arm", "multiplier", _ci_label(comp), "resamples", "separates the arms", "extrapolated", "note"],
        [[m.scale, m.arm, _g(m.estimate.value, ".3f"), _fmt_ci(m.estimate.ci, ".3f"), _g(m.estimate.resamples, "d"),
          {True: "yes", False: "no", None: "n/a"}[m.separated], "yes" if m.extrapolated else "no", m.estimate.note]
         for m in comp.multipliers],
    )


def _runs_table(comp: Comparison) -> str:
    rows = [[v.run.run_id, v.run.arm, v.run.scale, v.run.seed, _g(v.run.lr), v.run.state,
             v.reason or "included", ", ".join(map(str, v.spikes)) or ""]
            for v in comp.verdicts if not v.included or v.spikes]
    if not rows:
        return "Every run was compared; no divergences or spikes."
    return _table(["run", "arm", "scale", "seed", "lr", "state", "status in this report", "spike steps"], rows)


# ---------------------------------------------------------------------------------------------
# writing


def write_report(comp: Comparison, out_dir: Path) -> ReportPaths:
    from nlq_scale.analysis import plots as plotting

    out_dir.mkdir(parents=True, exist_ok=True)
    saved: dict[str, Path] = {}
    for stem, fig in plotting.figures(comp).items():
        path = out_dir / f"{stem}.png"
        with replacing(path) as tmp:
            fig.savefig(tmp, dpi=120, format="png")
        plotting.close(fig)
        saved[stem] = path
    names = {stem: p.name for stem, p in saved.items()}
    report, summary_path = out_dir / "report.md", out_dir / "summary.json"
    atomic_write(summary_path, json.dumps(summary(comp, names), indent=2) + "\n")
    atomic_write(report, markdown(comp, names))
    return ReportPaths(report, summary_path, saved)


def log_to_wandb(comp: Comparison, paths: ReportPaths, project: str) -> str:
    """The report's tables, plots and findings as one W&B run (job_type "analysis"); mode from
    WANDB_MODE, offline when unset. Returns the run's directory."""
    import wandb

    data = summary(comp, {stem: p.name for stem, p in paths.plots.items()})
    run = wandb.init(project=project, job_type="analysis", mode=os.environ.get("WANDB_MODE", "offline"),
                     config={"reference": comp.reference, "bootstrap": data["bootstrap"], **data["options"]})
    try:
        for name in ("cells", "gaps", "multipliers", "trends", "lr_optima", "lr_scaling"):
            rows = [_flatten(r) for r in data[name]]
            if rows:
                columns = sorted({k for r in rows for k in r})
                run.log({f"analysis/{name}": wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])})
        run.log({f"analysis/{stem}": wandb.Image(str(p)) for stem, p in paths.plots.items()})
        run.summary["findings"] = "\n".join(data["findings"])
        return run.dir
    finally:
        run.finish()


def _flatten(row: dict, prefix: str = "") -> dict:
    """Nested summary rows as flat W&B table columns (a.b); lists become strings."""
    out: dict = {}
    for key, value in row.items():
        if isinstance(value, dict):
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, list) else value
    return out

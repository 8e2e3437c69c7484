"""The report's figures (matplotlib, Agg backend; imported only when a report is written).

- loss vs step, one panel per scale: every seed thin, the seed mean bold, each arm at its best lr;
- final loss vs compute (or params) per arm with the fitted E + A x^-alpha;
- relative improvement over the reference vs step, one line per scale (the nonlinear-query
  paper's Figure 1);
- with an LR grid: final loss vs learning rate per arm, a line per scale, the fitted optimum marked.
"""

from __future__ import annotations

import math

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.ticker import NullFormatter  # noqa: E402

from nlq_scale.analysis.compare import Cell, Comparison, improvement_pct  # noqa: E402
from nlq_scale.analysis.runs import Run  # noqa: E402

PANEL = (4.6, 3.4)
MIN_WIDTH = 6.4  # room for the figure title when there is a single panel
EARLY_FRACTION = 0.3  # early evaluations sit far above the rest: let them run off the top so arms separate


def arm_colors(comp: Comparison) -> dict[str, str]:
    palette = plt.get_cmap("tab10").colors
    return {arm: palette[i % len(palette)] for i, arm in enumerate(comp.arms)}


def mean_curve(runs: list[Run]) -> tuple[np.ndarray, np.ndarray]:
    """Seed-mean val loss on the steps of the shortest run (others interpolated onto them)."""
    base = min(runs, key=lambda r: (r.final_step, len(r.val.step)))
    steps = base.val.step
    stacked = np.stack([np.interp(steps, r.val.step, r.val.loss) for r in runs])
    return steps, stacked.mean(axis=0)


def _grid(n: int, title: str) -> tuple[Figure, list]:
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    width = max(PANEL[0] * cols, MIN_WIDTH)
    fig, axes = plt.subplots(rows, cols, figsize=(width, PANEL[1] * rows), squeeze=False)
    flat = list(axes.ravel())
    for ax in flat[n:]:
        ax.set_visible(False)
    fig.suptitle(title)
    return fig, flat[:n]


def loss_vs_step(comp: Comparison) -> Figure:
    colors = arm_colors(comp)
    fig, axes = _grid(len(comp.scales), "Validation loss vs step (each arm at its best lr; thin = seeds)")
    for ax, scale in zip(axes, comp.scales):
        tails = []
        for arm in comp.arms:
            cell = comp.cells.get((arm, scale))
            if cell is None:
                continue
            for run in cell.runs:
                ax.plot(run.val.step, run.val.loss, color=colors[arm], lw=0.6, alpha=0.35)
            steps, mean = mean_curve(cell.runs)
            ax.plot(steps, mean, color=colors[arm], lw=1.8,
                    label=f"{arm} (lr {_lr(cell)}, {cell.n} seed{'s' if cell.n > 1 else ''})")
            tails.append(mean[int(len(mean) * EARLY_FRACTION):])
        _tight_ylim(ax, np.concatenate(tails))
        ax.set_title(scale)
        ax.set_xlabel("step")
        ax.set_ylabel("val loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _tight_ylim(ax, values: np.ndarray) -> None:
    lo, hi = float(np.min(values)), float(np.max(values))
    pad = 0.05 * (hi - lo) or 0.01
    ax.set_ylim(lo - pad, hi + pad)


def _lr(cell: Cell) -> str:
    return "?" if cell.best_lr is None else f"{cell.best_lr:g}"


def loss_vs_axis(comp: Comparison, axis: str) -> Figure:
    colors = arm_colors(comp)
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    label = "training compute C (FLOPs)" if axis == "compute" else "non-embedding parameters N"
    symbol = "C" if axis == "compute" else "N"
    xs, fitted, seeds = [], False, 0
    for arm in comp.arms:
        cells = [comp.cells[(arm, s)] for s in comp.scales if (arm, s) in comp.cells]
        cells = [c for c in cells if c.axis_value(axis) is not None]
        if not cells:
            continue
        x = np.array([c.axis_value(axis) for c in cells])
        xs.extend(x)
        seeds = max(seeds, *(c.n for c in cells))
        y = np.array([c.mean for c in cells])
        err = np.array([[c.mean - c.losses.min() for c in cells], [c.losses.max() - c.mean for c in cells]])
        fit = next(f for f in comp.fits if f.arm == arm and f.axis == axis)
        name = arm if fit.law is None else f"{arm}: {fit.law.E:.3f} + {fit.law.A:.3g}·{symbol}^-{fit.law.alpha:.3f}"
        ax.errorbar(x, y, yerr=err, fmt="o", color=colors[arm], capsize=3, label=name)
        if fit.law is not None:
            grid = np.geomspace(x.min() / 1.5, x.max() * 1.5, 200)
            ax.plot(grid, fit.law(grid), color=colors[arm], lw=1.2)
            fitted = True
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels collide when x spans < 2 decades
    _at_least_a_decade(ax, np.array(xs))
    ax.set_xlabel(label)
    ax.set_ylabel("final val loss (seed mean; bars = min..max)" if seeds > 1 else "final val loss (one seed: no bars)")
    ax.set_title(f"Final loss vs {axis} " + (f"with fitted L = E + A·{symbol}^-α" if fitted else "(no curve fitted)"))
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _at_least_a_decade(ax, x: np.ndarray) -> None:
    """Values less than a decade apart (one scale: arms whose compute differs by a hair) get the decade
    around their geometric middle, which holds a labelled tick, instead of being pushed to the edges."""
    if x.size == 0 or x.max() >= 10 * x.min():
        return
    middle = math.sqrt(x.min() * x.max())
    ax.set_xlim(middle / math.sqrt(10), middle * math.sqrt(10))


def relative_improvement(comp: Comparison) -> Figure | None:
    """100 (L_ref - L_arm) / L_ref along training, per scale; None when there is nothing to compare."""
    arms = [a for a in comp.arms if a != comp.reference]
    if not arms:
        return None
    shades = plt.get_cmap("viridis")
    fig, axes = _grid(len(arms), f"Relative improvement over {comp.reference} (%, positive = better)")
    for ax, arm in zip(axes, arms):
        for i, scale in enumerate(comp.scales):
            mine, ref = comp.cells.get((arm, scale)), comp.cells.get((comp.reference, scale))
            if mine is None or ref is None:
                continue
            steps, ref_loss = mean_curve(ref.runs)
            arm_steps, arm_loss = mean_curve(mine.runs)
            keep = steps <= arm_steps[-1]
            pct = improvement_pct(ref_loss[keep], np.interp(steps[keep], arm_steps, arm_loss))
            ax.plot(steps[keep], pct, color=shades(i / max(len(comp.scales) - 1, 1)), lw=1.6, label=scale)
        ax.axhline(0, color="black", lw=0.8)
        ax.set_title(arm)
        ax.set_xlabel("step")
        ax.set_ylabel("improvement (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, title="scale")
    fig.tight_layout()
    return fig


def loss_vs_lr(comp: Comparison) -> Figure:
    """One panel per arm: final loss (seed mean) against learning rate, a line per scale, the fitted
    optimum eta* marked (hollow when it sits on the grid's edge)."""
    fig, axes = _grid(len(comp.arms), "Final loss vs learning rate (★ = fitted optimum η*)")
    palette = plt.get_cmap("viridis")
    for ax, arm in zip(axes, comp.arms, strict=True):
        for i, scale in enumerate(comp.scales):
            cell = comp.cells.get((arm, scale))
            if cell is None:
                continue
            color = palette(i / max(1, len(comp.scales) - 1))
            points = [p for p in cell.lr_grid if p.lr is not None]
            ax.plot([p.lr for p in points], [p.mean for p in points], "o-", color=color, lw=1.2, label=scale)
            opt = next(o for o in comp.lr_optima if o.arm == arm and o.scale == scale)
            if opt.lr is not None and opt.loss is not None:
                ax.plot([opt.lr], [opt.loss], "*", ms=13, color=color, mfc="none" if opt.edge else color)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels collide on a grid spanning < 2 decades
        ax.set_xlabel("learning rate")
        ax.set_ylabel("final val loss")
        ax.set_title(arm)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, title="scale")
    fig.tight_layout()
    return fig


def accuracy_vs_compute(comp: Comparison) -> Figure | None:
    """One panel per eval task metric: seed-mean accuracy against training compute per arm, bars =
    the bootstrap interval (none with one seed)."""
    metrics = sorted({d.metric for d in comp.downstream if d.compute is not None})
    if not metrics:
        return None
    colors = arm_colors(comp)
    fig, axes = _grid(len(metrics), "Downstream accuracy vs training compute")
    for ax, metric in zip(axes, metrics):
        for arm in comp.arms:
            rows = [d for d in comp.downstream if d.arm == arm and d.metric == metric and d.compute is not None]
            if not rows:
                continue
            x = np.array([d.compute for d in rows])
            y = np.array([d.accuracy.value for d in rows])
            ci = [d.accuracy.ci or (d.accuracy.value, d.accuracy.value) for d in rows]
            err = np.array([[v - lo for v, (lo, _) in zip(y, ci)], [hi - v for v, (_, hi) in zip(y, ci)]])
            ax.errorbar(x, y, yerr=err, fmt="o-", color=colors[arm], capsize=3, label=arm)
        ax.set_xscale("log")
        ax.set_xlabel("training compute C (FLOPs)")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def figures(comp: Comparison) -> dict[str, Figure]:
    """File stem -> figure, for the report."""
    out = {"loss_vs_step": loss_vs_step(comp)}
    if any(len(c.lr_grid) > 1 for c in comp.cells.values()):
        out["loss_vs_lr"] = loss_vs_lr(comp)
    has_compute = any(c.compute is not None for c in comp.cells.values())
    out["loss_vs_compute" if has_compute else "loss_vs_params"] = loss_vs_axis(
        comp, "compute" if has_compute else "params"
    )
    rel = relative_improvement(comp)
    if rel is not None:
        out["relative_improvement"] = rel
    accuracy = accuracy_vs_compute(comp)
    if accuracy is not None:
        out["accuracy_vs_compute"] = accuracy
    return out


def close(fig: Figure) -> None:
    plt.close(fig)

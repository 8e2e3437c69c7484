"""The learning-rate optimum of each arm x scale from its LR grid, and how it moves with scale.

eta*: the vertex of a parabola in log LR fitted to the grid's mean final losses around the grid's
minimum (the minimum and up to two neighbours on each side). Its interval resamples the seeds
within every grid point (the same percentile bootstrap as the rest of the report); with one seed
per point there is none. An optimum at the grid's first or last LR is flagged: the true one may
lie beyond it, so the grid should be extended there. Per arm, eta*(N) = c * N^b over the scales with
an interior optimum (a line in log-log), which centres the next rung's grid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from nlq_scale.analysis.stats import percentile_ci

WINDOW = 2  # grid points each side of the minimum that the parabola is fitted to


@dataclass(frozen=True)
class LrOptimum:
    arm: str
    scale: str
    params: int | None
    lr: float | None  # eta*; None when the grid has no learning rates
    ci: tuple[float, float] | None
    loss: float | None  # the parabola's value at eta* (the grid's minimum mean when not fitted)
    edge: bool  # the grid's minimum is its first or last LR
    note: str


@dataclass(frozen=True)
class LrScaling:
    """eta*(N) = coefficient * N^exponent for one arm."""

    arm: str
    exponent: float | None
    coefficient: float | None
    n_scales: int
    note: str


def parabola_vertex(log_lrs: np.ndarray, losses: np.ndarray) -> tuple[float, float] | None:
    """(log LR, loss) at the vertex of the least-squares parabola through the points around the
    minimum; None when they do not curve upwards or the vertex falls outside them (noise, not an optimum)."""
    i = int(np.argmin(losses))
    lo, hi = max(0, i - WINDOW), min(len(losses), i + WINDOW + 1)
    x, y = log_lrs[lo:hi], losses[lo:hi]
    if len(x) < 3:
        return None
    a, b, c = np.polyfit(x, y, 2)
    vertex = -b / (2 * a) if a > 0 else math.inf
    if not x.min() <= vertex <= x.max():
        return None
    return float(vertex), float(np.polyval((a, b, c), vertex))


def lr_optimum(cell, resamples: int, rng: np.random.Generator, level: float) -> LrOptimum:
    """`cell`: an analysis Cell (its lr_grid holds every LR's per-seed final losses)."""
    return grid_optimum(cell.arm, cell.scale, cell.params, cell.lr_grid, resamples, rng, level)


def grid_optimum(arm: str, scale: str, params: int | None, grid: list, resamples: int, rng: np.random.Generator,
                 level: float) -> LrOptimum:
    """eta* of one arm at one scale from `grid`: points with .lr, .mean, .losses, .n (analysis LrPoint)."""
    points = [p for p in grid if p.lr is not None]
    if len(points) < 3:
        best = min(grid, key=lambda p: p.mean)
        return LrOptimum(arm, scale, params, best.lr, None, None, False,
                         f"{len(points)} learning rate(s): no optimum fitted")  # fmt: skip
    x = np.log([p.lr for p in points])
    means = np.array([p.mean for p in points])
    edge = int(np.argmin(means)) in (0, len(points) - 1)
    fitted = None if edge else parabola_vertex(x, means)
    if fitted is None:
        best = points[int(np.argmin(means))]
        note = ("optimum on the grid's edge: extend the grid" if edge else
                "no parabola with its vertex among the points around the minimum: the grid's minimum")  # fmt: skip
        return LrOptimum(arm, scale, params, best.lr, None, best.mean, edge, note)
    vertex, loss = fitted
    ci, note = _vertex_ci(points, x, resamples, rng, level)
    return LrOptimum(arm, scale, params, math.exp(vertex), ci, loss, False, note)


def _vertex_ci(points, x: np.ndarray, resamples: int, rng, level: float):
    if all(p.n < 2 for p in points):
        return None, "one seed per learning rate: no interval"
    draws = []
    for _ in range(resamples):
        means = np.array([rng.choice(p.losses, size=p.n, replace=True).mean() for p in points])
        fitted = parabola_vertex(x, means)
        if fitted is not None and int(np.argmin(means)) not in (0, len(points) - 1):
            draws.append(math.exp(fitted[0]))
    if len(draws) < resamples / 2:
        return None, f"only {len(draws)} of {resamples} resamples had an interior, curved optimum"
    return percentile_ci(np.array(draws), level), ""


def lr_scaling(optima: list[LrOptimum], arm: str) -> LrScaling:
    usable = [o for o in optima if o.arm == arm and o.params and o.lr and not o.edge and o.loss is not None]
    if len({o.params for o in usable}) < 2:
        return LrScaling(arm, None, None, len(usable), "fewer than two scales with an interior optimum")
    b, log_c = np.polyfit(np.log([o.params for o in usable]), np.log([o.lr for o in usable]), 1)
    return LrScaling(arm, float(b), float(math.exp(log_c)), len(usable), "")

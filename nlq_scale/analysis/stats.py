"""Small statistical helpers shared by the comparison: bootstrap resampling of seed means,
percentile intervals, the Welch-Satterthwaite interval of a weighted sum of seed means and the
slope of a line with its interval. docs/analysis.md states the
assumptions behind each."""

from __future__ import annotations

import numpy as np
from scipy import stats


def resample_means(values: np.ndarray, resamples: int, rng: np.random.Generator, level: float) -> np.ndarray:
    """Bootstrap means of `values` (one per seed), shape (resamples,), spread out around the sample
    mean by sqrt(n/(n-1)) * t(n-1)/z: the plain bootstrap's spread is the biased (1/n) standard
    error and its tails are normal, so with 2-5 seeds its intervals would be far too narrow. After
    the correction a single cell's percentile interval is about the Student-t interval."""
    n = len(values)
    idx = rng.integers(0, n, size=(resamples, n))
    means = values[idx].mean(axis=1)
    if n < 2:
        return means
    q = 0.5 + level / 2
    widen = np.sqrt(n / (n - 1)) * stats.t.ppf(q, n - 1) / stats.norm.ppf(q)
    center = values.mean()
    return center + widen * (means - center)


def percentile_ci(samples: np.ndarray, level: float) -> tuple[float, float] | None:
    """Percentile interval over the finite-or-infinite samples (NaN = failed resample, dropped).
    Order statistics, not interpolation, so an infinite tail stays infinite instead of NaN."""
    kept = samples[~np.isnan(samples)]
    if kept.size == 0:
        return None
    tail = (1 - level) / 2
    lo, hi = np.quantile(kept, [tail, 1 - tail], method="inverted_cdf")
    return float(lo), float(hi)


def welch_ci(value: float, weights: np.ndarray, variances: np.ndarray, counts: np.ndarray,
             level: float) -> tuple[float, float]:
    """Student-t interval for value = sum_i weights_i * mean_i over independent cells (sample
    variances, seed counts >= 2), with Welch-Satterthwaite degrees of freedom. Widening each cell
    to its own t and adding the widenings is far too wide with 2-3 seeds (two cells of 2 seeds give
    the difference about 2 degrees of freedom, not 1 + 1); this is calibrated for normal seed noise
    and unequal spreads. Cells whose seeds agree add no variance; when none vary the interval is
    the point."""
    terms = weights**2 * variances / counts
    var = float(terms.sum())
    if var == 0:
        return value, value
    dof = var**2 / float((terms**2 / (counts - 1)).sum())
    half = float(stats.t.ppf(0.5 + level / 2, dof)) * np.sqrt(var)
    return value - half, value + half


def ols_slope(x: np.ndarray, Y: np.ndarray) -> np.ndarray:
    """Least-squares slope of each row of Y (B x k) on x (k,)."""
    xc = x - x.mean()
    return (Y - Y.mean(axis=-1, keepdims=True)) @ xc / (xc @ xc)


def ols_slope_ci(x: np.ndarray, y: np.ndarray, level: float) -> tuple[float, float] | None:
    """Student-t interval for the slope from the residual scatter; needs 3+ points (1+ dof)."""
    k = len(x)
    if k < 3:
        return None
    xc = x - x.mean()
    slope = float(ols_slope(x, y[None, :])[0])
    resid = y - y.mean() - slope * xc
    se = np.sqrt((resid @ resid) / (k - 2) / (xc @ xc))
    t = stats.t.ppf(0.5 + level / 2, k - 2)
    return float(slope - t * se), float(slope + t * se)


def excludes_zero(ci: tuple[float, float] | None) -> bool | None:
    if ci is None:
        return None
    return ci[0] > 0 or ci[1] < 0

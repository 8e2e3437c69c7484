"""Small statistical helpers shared by the comparison: bootstrap resampling of seed means,
percentile intervals and the slope of a line with its interval. docs/analysis.md states the
assumptions behind each."""

from __future__ import annotations

import numpy as np
from scipy import stats


def resample_means(values: np.ndarray, resamples: int, rng: np.random.Generator) -> np.ndarray:
    """Means of `resamples` draws with replacement from `values` (one per seed), shape (resamples,)."""
    idx = rng.integers(0, len(values), size=(resamples, len(values)))
    return values[idx].mean(axis=1)


def percentile_ci(samples: np.ndarray, level: float) -> tuple[float, float] | None:
    """Percentile interval over the finite-or-infinite samples (NaN = failed resample, dropped).
    Order statistics, not interpolation, so an infinite tail stays infinite instead of NaN."""
    kept = samples[~np.isnan(samples)]
    if kept.size == 0:
        return None
    tail = (1 - level) / 2
    lo, hi = np.quantile(kept, [tail, 1 - tail], method="inverted_cdf")
    return float(lo), float(hi)


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
    return slope - t * se, slope + t * se


def excludes_zero(ci: tuple[float, float] | None) -> bool | None:
    if ci is None:
        return None
    return ci[0] > 0 or ci[1] < 0

"""How many seeds a comparison needs: the power of a two-sided two-sample t-test, computed exactly
from the noncentral t distribution (the normal approximation asks for a seed too few at small
counts, where every seed is most of the cost), the seeds per arm that reach a power, and the
smallest gap a given number of seeds resolves."""

from __future__ import annotations

import math

from scipy import optimize, stats

MAX_SEEDS = 1_000_000  # beyond this the question is not a question of seeds


def power(gap: float, sd: float, n_arm: int, n_ref: int, level: float = 0.95) -> float:
    """Probability that a two-sided two-sample t-test at `level` rejects a zero gap when the true
    gap is `gap` and both arms' seeds scatter with `sd` (pooled variance, n_arm + n_ref - 2 dof)."""
    dof = n_arm + n_ref - 2
    ncp = abs(gap) / (sd * math.sqrt(1 / n_arm + 1 / n_ref))
    crit = stats.t.ppf(0.5 + level / 2, dof)
    p = float(stats.nct.sf(crit, dof, ncp) + stats.nct.cdf(-crit, dof, ncp))
    # scipy's nct gives NaN far out in the tail (ncp in the hundreds), where the power is 1 to double precision
    return p if math.isfinite(p) else 1.0


def seeds_per_arm(gap: float, sd: float, target: float = 0.8, level: float = 0.95) -> int:
    """The fewest seeds per arm (2 or more: one seed has no spread) whose test reaches `target` power."""
    lo, hi = 1, 2  # power(lo) < target <= power(hi) once the doubling stops
    while power(gap, sd, hi, hi, level) < target:
        if hi > MAX_SEEDS:
            raise ValueError(f"more than {MAX_SEEDS} seeds per arm")
        lo, hi = hi, 2 * hi
    while hi - lo > 1:  # power grows with n: bisect
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if power(gap, sd, mid, mid, level) < target else (lo, mid)
    return hi


def detectable_gap(sd: float, n_arm: int, n_ref: int, target: float = 0.8, level: float = 0.95) -> float:
    """The smallest true gap that `n_arm` and `n_ref` seeds with spread `sd` resolve with `target` power."""
    if sd == 0:
        return 0.0
    hi = sd
    while power(hi, sd, n_arm, n_ref, level) < target:
        hi *= 2
    return float(optimize.brentq(lambda g: power(g, sd, n_arm, n_ref, level) - target, 0.0, hi, xtol=1e-12 * sd))

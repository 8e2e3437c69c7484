"""The calibrated intervals cover the truth about 95% of the time at every seed count, on the
project's simulation (tests/analysis_sim.py: truth known, unequal seed spreads between the arms).
docs/analysis.md ("Coverage") shows the table, before and after the Welch intervals."""

from __future__ import annotations

import numpy as np
import pytest
from tests import analysis_sim as sim

from nlq_scale.analysis import stats

# four gaps and one slope each: the slope's coverage rests on 1000 draws (binomial SE 0.7 points). Welch-
# Satterthwaite is slightly conservative at 2 seeds (96.5% for this slope in 200000 draws), so fewer
# draws would leave the band's upper edge within noise.
SWEEPS = 1000


@pytest.mark.parametrize("seeds", [2, 3, 4, 8])
def test_gap_and_slope_intervals_cover_the_truth_95_percent_of_the_time(seeds):
    cov = sim.coverage(seeds, SWEEPS)
    for name in ("gap", "gap_pct", "slope_seeds"):
        assert 0.93 <= cov[name] <= 0.97, (name, cov)


def test_two_seeds_give_an_interval_as_wide_as_two_seeds_can_say():
    """Two cells of 2 seeds with equal spread: the difference has about 2 degrees of freedom, so its
    interval is about t(2) * sqrt(2 s^2 / 2) wide on either side, not the sum of two t(1) widenings
    (12.7 each) that the per-cell bootstrap gave."""
    ref, arm = np.array([3.00, 3.02]), np.array([2.98, 3.00])
    s2 = ref.var(ddof=1)
    lo, hi = stats.welch_ci(0.02, np.array([1.0, -1.0]), np.array([s2, s2]), np.array([2.0, 2.0]), 0.95)
    assert hi - 0.02 == pytest.approx(4.303 * np.sqrt(s2), rel=1e-3)  # t(0.975, 2) = 4.303
    assert lo == pytest.approx(0.04 - hi)


def test_cells_whose_seeds_agree_give_an_interval_of_no_width():
    assert stats.welch_ci(0.5, np.array([1.0, -1.0]), np.zeros(2), np.array([3.0, 3.0]), 0.95) == (0.5, 0.5)

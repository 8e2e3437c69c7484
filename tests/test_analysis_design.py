"""`nlq-scale design`: seeds per arm from the exact noncentral-t power of a two-sample t-test, the
same answer as statsmodels' TTestIndPower, and the seeds it recommends resolve the gap in about
`power` of simulated comparisons (through compare's own gap interval)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from statsmodels.stats.power import TTestIndPower
from tests import analysis_sim as sim
from tests.conftest import nlq, refused

from nlq_scale.analysis import power
from nlq_scale.analysis.compare import Options, arm_gaps, build_cells

QUESTIONS = [  # sd, gap, power, level
    (0.02, 0.02, 0.8, 0.95),
    (0.003, 0.006, 0.8, 0.95),
    (0.01, 0.04, 0.9, 0.99),
    (0.005, 0.001, 0.8, 0.95),
    (0.004, 0.0096, 0.8, 0.9),
]


@pytest.mark.parametrize("sd, gap, target, level", QUESTIONS)
def test_seeds_per_arm_is_statsmodels_solution_rounded_up(sd, gap, target, level):
    solved = TTestIndPower().solve_power(effect_size=gap / sd, power=target, alpha=1 - level, ratio=1.0,
                                         alternative="two-sided")
    assert power.seeds_per_arm(gap, sd, target, level) == math.ceil(solved)
    n = power.seeds_per_arm(gap, sd, target, level)
    assert power.power(gap, sd, n, n, level) == pytest.approx(TTestIndPower().power(gap / sd, n, 1 - level), abs=1e-9)


def test_exact_power_asks_for_more_seeds_than_the_normal_approximation_at_small_counts():
    # the normal approximation: n = 2 ((z_a + z_b) sd / gap)^2 = 3.14 at gap = 2.24 sd: 4 seeds, power 0.77 in fact
    assert power.seeds_per_arm(2.24, 1.0) == 5
    assert power.power(2.24, 1.0, 4, 4) < 0.8 <= power.power(2.24, 1.0, 5, 5)


def test_detectable_gap_is_the_gap_whose_power_is_the_target():
    gap = power.detectable_gap(0.01, 2, 3)
    assert power.power(gap, 0.01, 2, 3) == pytest.approx(0.8, abs=1e-9)
    assert power.detectable_gap(0.01, 2, 2) > gap > power.detectable_gap(0.01, 8, 8)


def _resolved(rng: np.random.Generator, sd: float, gap: float, n: int) -> bool:
    """One simulated comparison at one scale: does the report's gap interval exclude zero?"""
    ref = [sim.run(sim.REFERENCE, 0, s, 3.0 + rng.normal(0, sd)) for s in range(n)]
    arm = [sim.run(sim.ARM, 0, s, 3.0 - gap + rng.normal(0, sd)) for s in range(n)]
    (g,) = arm_gaps(build_cells(ref + arm), sim.REFERENCE, sim.ARM, sim.SCALES[:1], Options())
    return g.improvement.ci[0] > 0 or g.improvement.ci[1] < 0


@pytest.mark.parametrize("sd, gap", [(0.02, 0.02), (0.004, 0.0096)])
def test_recommended_seeds_resolve_the_gap_in_about_power_of_simulated_comparisons(sd, gap):
    n = power.seeds_per_arm(gap, sd, 0.8)
    rng = np.random.default_rng(0)
    resolved = np.mean([_resolved(rng, sd, gap, n) for _ in range(1000)])  # binomial SE 1.3 points
    assert 0.75 <= resolved <= 0.85, (n, resolved)


def test_design_cli_json():
    r = nlq("design", "--sd", "0.02", "--gap", "0.02", "--power", "0.8", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["seeds_per_arm"] == 17 and 0.8 <= doc["power"] < 0.81


@pytest.mark.parametrize("args, words", [
    (["--sd", "0", "--gap", "0.02"], "--sd: must be positive"),
    (["--sd", "0.02", "--gap", "-0.01"], "--gap: must be positive"),
    (["--sd", "0.02", "--gap", "0.02", "--power", "1"], "--power: must lie strictly between 0 and 1"),
    (["--sd", "0.02", "--gap", "0.02", "--level", "95"], "--level: must lie strictly between 0 and 1"),
    (["--sd", "x", "--gap", "0.02"], "--sd: invalid float value"),
    (["--sd", "1", "--gap", "1e-9"], "more than 1000000 seeds per arm"),
])
def test_design_refuses_bad_input_in_one_line(args, words):
    assert words in refused("design", *args)

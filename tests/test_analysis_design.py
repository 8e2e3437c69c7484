"""`nlq-scale design`: seeds per arm from the exact noncentral-t power of a two-sample t-test, the
same answer as statsmodels' TTestIndPower, and the seeds it recommends resolve the gap in about
`power` of simulated comparisons (through compare's own gap interval); from pilot runs, a sweep's
seed spread per rung, the seeds its gap needs and their GPU-hours."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from statsmodels.stats.power import TTestIndPower
from tests import analysis_sim as sim
from tests.analysis_rundirs import make_sweep, power_law_truth
from tests.conftest import nlq, refused

from nlq_scale.analysis import design, power
from nlq_scale.analysis.compare import Options, arm_gaps, build_cells
from nlq_scale.analysis.runs import load_runs
from nlq_scale.cli import main
from nlq_scale.cluster.plan import load_cluster, plan_sweep, totals
from nlq_scale.cluster.sweep import load_sweep, sweep_path

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


def test_spread_law_carries_the_pilot_sd_to_larger_n():
    points = [design.PilotSpread(f"s{i}", n, 0.01 * (n / 1e6) ** -0.2, 2) for i, n in enumerate((1e6, 4e6, 1.6e7))]
    law = design.spread_law(points)
    assert law.b == pytest.approx(-0.2)
    sd, ci = law.at(1e9, 0.95)
    assert sd == pytest.approx(0.01 * 1000**-0.2) and ci == pytest.approx((sd, sd))  # on the line: no scatter
    one = design.spread_law(points[:1])
    assert one.b == 0 and one.at(1e9, 0.95) == (pytest.approx(0.01), None) and "constant in N" in one.note


def test_design_a_sweep_from_pilot_runs(tmp_path, capsys):
    make_sweep(tmp_path, power_law_truth(E=2.0, A=30.0, alpha=0.12), ["linear", "nonlinear"], ["t1", "t2", "t3"],
               seeds=[0, 1, 2], noise=0.003)
    assert main(["design", "ladder", "--pilot", str(tmp_path), "--gap", "0.004", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    runs = load_runs([str(tmp_path)])
    for p in doc["pilot_spread"]:
        residuals = [r.final_loss - np.mean([q.final_loss for q in runs if (q.arm, q.scale) == (r.arm, r.scale)])
                     for r in runs if r.scale == p["scale"]]
        assert p["sd"] == pytest.approx(np.sqrt(np.sum(np.square(residuals)) / p["dof"])) and p["dof"] == 4
    planned = totals([r.plan for r in plan_sweep(load_sweep(sweep_path("ladder")), load_cluster("example-8x80gb"))])
    assert [r["scale"] for r in doc["rungs"]] == ["124m", "350m", "760m", "1.3b"]
    for r in doc["rungs"]:
        assert r["seeds"] == 3 and r["sd_ci"][0] <= r["sd"] <= r["sd_ci"][1]
        assert r["seeds_per_arm"] == power.seeds_per_arm(0.004, r["sd"])
        assert r["detectable_gap"] == pytest.approx(power.detectable_gap(r["sd"], 3, 3))
        assert r["gpu_hours_sweep"] == pytest.approx(planned["per_scale"][r["scale"]]["gpu_hours"], abs=1e-3)
        assert r["gpu_hours_needed"] == pytest.approx(r["seeds_per_arm"] * r["gpu_hours_sweep"] / 3, rel=1e-3)


@pytest.mark.parametrize("args, words", [
    (["ladder", "--gap", "0.01"], "--pilot ROOT: required"),
    (["--pilot", "runs", "--sd", "0.01", "--gap", "0.01"], "--pilot: only with a SWEEP"),
    (["--gap", "0.01"], "--sd: required"),
])
def test_design_sweep_refuses_bad_input_in_one_line(args, words):
    assert words in refused("design", *args)


def test_a_pilot_without_two_seeds_anywhere_is_refused(tmp_path):
    make_sweep(tmp_path, power_law_truth(E=2.0, A=30.0, alpha=0.12), ["linear"], ["t1"], seeds=[0])
    assert "no completed arm x scale cell with 2 or more seeds" in refused("design", "ladder", "--pilot", str(tmp_path))

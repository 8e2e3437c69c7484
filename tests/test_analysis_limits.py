"""The report says in plain words what its runs can and cannot conclude, from the runs themselves."""

from __future__ import annotations

import numpy as np
import pytest

from nlq_scale.analysis import power
from nlq_scale.analysis.compare import Options, compare
from nlq_scale.analysis.report import findings, limits, summary
from nlq_scale.analysis.runs import load_runs
from tests import analysis_sim as sim
from tests.analysis_rundirs import make_sweep, power_law_truth

TRUTH = power_law_truth(E=2.0, A=30.0, alpha=0.12, multipliers={"nonlinear": 1.5})


def _limits(root, seeds, scales=("t1", "t2", "t3")) -> str:
    make_sweep(root, TRUTH, ["linear", "nonlinear"], list(scales), seeds=seeds)
    return "\n".join(limits(compare(load_runs([str(root)]), Options(resamples=200))))


def test_one_seed_has_no_interval_and_says_so(tmp_path):
    text = _limits(tmp_path, seeds=[0])
    assert "1 seed(s) per arm and scale: a cell with one seed has no interval" in text
    assert "gaps with an interval" not in text


@pytest.mark.parametrize("seeds, words", [([0, 1], "2 seeds per arm and scale: the gap intervals are calibrated but wide"),
                                          ([0, 1, 2, 3, 4], "5 seeds per arm and scale: the intervals account")])
def test_seeds_tiny_models_and_scales_are_named(tmp_path, seeds, words):
    text = _limits(tmp_path, seeds=seeds)
    assert words in text
    assert "tiny models that check the pipeline" in text and "124M parameters and beyond" in text
    assert "3 scales: a trend with scale rests on 3 points" in text
    assert "of 3 arm-vs-linear gaps with an interval exclude zero at 95%" in text


def test_two_scales_are_too_few_for_a_trend(tmp_path):
    assert "2 scale(s): too few for a trend" in _limits(tmp_path, seeds=[0, 1], scales=("t1", "t2"))


def test_each_scale_says_the_smallest_gap_its_seeds_could_resolve():
    rng = np.random.default_rng(0)
    comp = compare(sim.sweep(rng, 2), Options(resamples=200))
    text, doc = "\n".join(limits(comp)), summary(comp)
    for gap, row in zip(comp.gaps, doc["gaps"]):
        x, r = comp.cells[(sim.ARM, gap.scale)], comp.cells[(sim.REFERENCE, gap.scale)]
        pooled = np.sqrt((x.losses.var(ddof=1) + r.losses.var(ddof=1)) / 2)
        smallest = power.detectable_gap(pooled, 2, 2, 0.8, 0.95)
        assert f"With 2 seeds at {gap.scale} this sweep could only resolve gaps above {smallest:.4f} nats" in text
        assert row["detectable_gap"] == pytest.approx(smallest) and row["detectable_power"] == 0.8
    more = compare(sim.sweep(rng, 8), Options(resamples=200))
    assert max(g.detectable for g in more.gaps) < min(g.detectable for g in comp.gaps)


def _steady_gap_runs(seeds: int, sd: float) -> list:
    """The arm 1% below the reference at every scale: a steady relative gap."""
    rng = np.random.default_rng(1)
    ref = sim.true_loss(sim.REFERENCE, sim.FLOPS_PER_TOKEN * sim.TOKENS)
    return [sim.run(arm, i, s, float(loss * (1 - 0.01 * (arm == sim.ARM)) + rng.normal(0, sd)))
            for arm in (sim.REFERENCE, sim.ARM) for i, loss in enumerate(ref) for s in range(seeds)]


@pytest.mark.parametrize("seeds, sd, steady", [(16, 0.0005, True), (2, 0.01, False)])
def test_a_steady_gap_is_claimed_only_where_the_trend_interval_is_narrow(seeds, sd, steady):
    comp = compare(_steady_gap_runs(seeds, sd), Options(resamples=200))
    (trend,) = comp.trends
    assert not trend.distinguishable and trend.narrow is steady
    assert summary(comp)["trends"][0]["narrow"] is steady
    text = "\n".join(findings(comp) + limits(comp))
    assert ("consistent with a steady gap" in text) is steady
    assert ("too wide to call the gap steady" in text) is not steady

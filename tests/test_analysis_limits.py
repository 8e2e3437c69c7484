"""The report says in plain words what its runs can and cannot conclude, from the runs themselves."""

from __future__ import annotations

import pytest

from nlq_scale.analysis.compare import Options, compare
from nlq_scale.analysis.report import limits
from nlq_scale.analysis.runs import load_runs
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

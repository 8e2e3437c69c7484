"""The learning-rate optimum per arm x scale (a parabola in log LR around the grid's minimum), its
bootstrap interval, the grid-edge flag, eta*(N) across scales, and `compare --group`."""

from __future__ import annotations

import math

import numpy as np
import pytest

from nlq_scale.analysis.compare import Cell, LrPoint, Options, compare
from nlq_scale.analysis.lr import lr_optimum, lr_scaling
from nlq_scale.analysis.runs import load_runs
from nlq_scale.cli import main
from nlq_scale.model.accounting import count_parameters
from tests.analysis_rundirs import EVAL_EVERY, STEPS, curve, make_config, write_run_dir

GRID = [1e-3 * 2**k for k in range(6)]


def bowl(lr: float, best: float, depth: float = 0.08) -> float:
    """A loss that is a parabola in log LR with its minimum at `best`."""
    return 3.0 + depth * math.log(lr / best) ** 2


def cell(best: float, seeds: int = 3, noise: float = 0.002, rng_seed: int = 0) -> Cell:
    rng = np.random.default_rng(rng_seed)
    grid = [LrPoint(lr, bowl(lr, best) + rng.normal(0, noise, seeds)) for lr in GRID]
    chosen = min(grid, key=lambda p: p.mean)
    return Cell("nonlinear", "t1", chosen.lr, grid, [], chosen.losses)


def test_vertex_of_the_grid_is_the_optimum_with_an_interval_around_it():
    opt = lr_optimum(cell(best=5.5e-3), resamples=400, rng=np.random.default_rng(0), level=0.95)
    assert opt.lr == pytest.approx(5.5e-3, rel=0.1) and not opt.edge
    assert opt.ci[0] < opt.lr < opt.ci[1] and opt.ci[1] / opt.ci[0] < 2
    assert opt.loss == pytest.approx(3.0, abs=0.01)


def test_optimum_on_the_grid_edge_is_flagged_not_fitted():
    opt = lr_optimum(cell(best=1e-4), resamples=100, rng=np.random.default_rng(0), level=0.95)
    assert opt.edge and opt.lr == GRID[0] and opt.ci is None and "edge" in opt.note


def test_one_seed_per_lr_gives_an_optimum_without_interval():
    opt = lr_optimum(cell(best=8e-3, seeds=1), resamples=100, rng=np.random.default_rng(0), level=0.95)
    assert opt.lr == pytest.approx(8e-3, rel=0.15) and opt.ci is None and "one seed" in opt.note


def test_eta_star_power_law_across_scales(tmp_path):
    """Runs whose best LR falls as N^-0.25: compare's eta*(N) recovers the exponent, and the report
    shows the optimum section and the loss-vs-LR plot."""
    steps = np.arange(EVAL_EVERY, STEPS + 1, EVAL_EVERY)
    for scale in ("t1", "t2", "t3"):
        n = count_parameters(make_config("linear", scale, 0, 1e-3).model).non_embedding
        for lr in GRID:
            for seed in (0, 1):
                cfg = make_config("linear", scale, seed, lr)
                final = bowl(lr, 0.1 * n**-0.25) + 0.001 * seed
                write_run_dir(tmp_path / "runs", cfg, steps, curve(final, steps, STEPS))
    comp = compare(load_runs([str(tmp_path / "runs")]), Options(resamples=200))
    law = lr_scaling(comp.lr_optima, "linear")
    params = [o.params for o in comp.lr_optima]
    assert law.n_scales == 3 and all(params)
    assert law.exponent == pytest.approx(-0.25, abs=0.02)
    out = tmp_path / "report"
    assert main(["compare", str(tmp_path / "runs"), "--out", str(out), "--bootstrap", "100"]) == 0
    report = (out / "report.md").read_text()
    assert "## Learning-rate optimum per arm x scale" in report and "![loss_vs_lr](loss_vs_lr.png)" in report


def test_group_keeps_one_sweep(tmp_path, capsys):
    steps = np.arange(EVAL_EVERY, STEPS + 1, EVAL_EVERY)
    for sweep, final in (("first", 3.0), ("second", 3.5)):
        for arm in ("linear", "nonlinear"):
            cfg = make_config(arm, "t1", 0, 1e-3).model_copy(update={"sweep": sweep})
            cfg = cfg.model_copy(update={"name": f"{sweep}-{cfg.name}"})
            write_run_dir(tmp_path, cfg, steps, curve(final, steps, STEPS))
    runs = load_runs([str(tmp_path)], group="second")
    assert {r.sweep for r in runs} == {"second"} and len(runs) == 2
    assert main(["compare", str(tmp_path), "--group", "nope", "--out", str(tmp_path / "r")]) == 2
    assert "--group nope: none of the 4 runs found belong to it (sweeps: first, second)" in capsys.readouterr().err

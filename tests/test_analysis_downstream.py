"""`compare` with `nlq-scale eval` results in the run directories: per arm x scale seed-mean accuracy
with a bootstrap interval beside the loss, in summary.json, report.md and an accuracy-vs-compute plot;
the newest evaluated step counts."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tests.analysis_rundirs import make_sweep

from nlq_scale.analysis.compare import Options, compare
from nlq_scale.analysis.report import write_report
from nlq_scale.analysis.runs import load_runs
from nlq_scale.train.rundir import read_config, record_eval

FAST = Options(resamples=400)


def accuracy(arm: str, scale: str, seed: int) -> float:
    return 0.30 + 0.10 * (arm == "nonlinear") + 0.05 * (scale == "t2") + 0.01 * seed


def eval_entry(step: int, acc: float) -> dict:
    metrics = {"acc": {"value": acc, "stderr": 0.04}, "perplexity": {"value": 50.0, "stderr": 5.0}}
    return {"step": step, "tokens": step * 1024, "lm_eval": "test", "tasks": {"nlq_lastword": {"metrics": metrics, "n": 100}}}


def test_compare_reports_accuracy_per_arm_and_scale_with_intervals(tmp_path):
    paths = make_sweep(tmp_path, lambda arm, cfg: 3.0, ["linear", "nonlinear"], ["t1", "t2"], seeds=[0, 1, 2])
    for path in paths:
        cfg = read_config(path)
        record_eval(path, 100, eval_entry(100, 0.99))  # an older checkpoint: not the one compared
        record_eval(path, 200, eval_entry(200, accuracy(cfg.model.arm, cfg.scale, cfg.seed)))
    comp = compare(load_runs([str(tmp_path)]), FAST)
    assert {(d.arm, d.scale, d.metric) for d in comp.downstream} == {
        (arm, scale, "nlq_lastword/acc") for arm in ("linear", "nonlinear") for scale in ("t1", "t2")}
    for d in comp.downstream:
        expected = np.mean([accuracy(d.arm, d.scale, seed) for seed in (0, 1, 2)])
        assert d.n_seeds == 3 and d.accuracy.value == pytest.approx(expected)
        lo, hi = d.accuracy.ci
        assert lo < d.accuracy.value < hi and hi - lo < 0.1
        cell = comp.cells[(d.arm, d.scale)]
        assert (d.loss, d.compute) == (cell.mean, cell.compute)
    paths = write_report(comp, tmp_path / "report")
    rows = json.loads(paths.summary.read_text())["downstream"]
    assert len(rows) == 4 and rows[0]["accuracy"]["ci"] is not None
    assert "## Downstream accuracy per arm x scale" in paths.report.read_text()
    assert paths.plots["accuracy_vs_compute"].is_file()


def test_one_seed_gives_the_accuracy_without_an_interval(tmp_path):
    (path,) = make_sweep(tmp_path, lambda arm, cfg: 3.0, ["linear"], ["t1"], seeds=[0])
    record_eval(path, 200, eval_entry(200, 0.25))
    (d,) = compare(load_runs([str(tmp_path)]), FAST).downstream
    assert d.accuracy.value == 0.25 and d.accuracy.ci is None and "no interval" in d.accuracy.note
